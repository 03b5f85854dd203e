// `meshtrain tokenize`: print the token ids of a text, or of each document of a file.
#include <cstdio>
#include <iostream>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "cli/cli_support.h"
#include "cli/data_commands.h"
#include "data/corpus.h"
#include "data/tokenizer.h"

namespace mt {

namespace {

using namespace cli_support;

const char kTokenizeHelp[] =
    "usage: meshtrain tokenize [--tokenizer gpt2|byte|hf] [--tokenizer-file tokenizer.json] [--gpt2-dir DIR]\n"
    "                          [--text STRING | --input FILE] [--jsonl-field F] [--special] [--decode]\n"
    "\n"
    "Prints the token ids of a text, space-separated, on one line; for a JSON-lines input (.jsonl,\n"
    ".ndjson, .json, or --jsonl-field given) one line per document.\n"
    "\n"
    "options:\n"
    "  --tokenizer NAME    gpt2 (default): OpenAI GPT-2 byte-level BPE; byte: ids are the bytes;\n"
    "                      hf: a Hugging Face tokenizer.json (--tokenizer-file).\n"
    "  --tokenizer-file F  the tokenizer.json for --tokenizer hf.\n"
    "  --gpt2-dir DIR      directory holding encoder.json and vocab.bpe (default: $MESHTRAIN_GPT2_DIR,\n"
    "                      else the repository's assets/gpt2).\n"
    "  --text STRING       the text to tokenize.\n"
    "  --input FILE        tokenize the contents of FILE instead (a JSON-lines file: each document).\n"
    "                      With neither --text nor --input the text is read from stdin.\n"
    "  --jsonl-field F     the field of each JSON line holding the document (default text; implies\n"
    "                      JSON lines).\n"
    "  --special           add what the tokenizer adds around a sequence (Llama 3's <|begin_of_text|>;\n"
    "                      Hugging Face's add_special_tokens=True).\n"
    "  --decode            the input is token ids (space-separated, one sequence a line): print the\n"
    "                      text they decode to (--json: as one JSON string a line).\n"
    "  -h, --help          print this help and exit.\n"
    "\n"
    "With gpt2 and byte, \"<|endoftext|>\" inside the text is ordinary text (tiktoken's\n"
    "encode_ordinary); hf splits added and special tokens out of the text as Hugging Face does.\n"
    "\n"
    "example:\n"
    "  meshtrain tokenize --text \"Hello world\"   # 15496 995\n";

void print_ids(const std::vector<int32_t>& ids) {
  std::string line;
  line.reserve(ids.size() * 6 + 1);
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) line.push_back(' ');
    line += std::to_string(ids[i]);
  }
  line.push_back('\n');
  std::fwrite(line.data(), 1, line.size(), stdout);
}

int tokenize(int argc, char** argv) {
  ArgParser args({"tokenizer", "gpt2-dir", "tokenizer-file", "text", "input", "jsonl-field"},
                 {"help", "special", "decode", "json"});
  args.parse(argc, argv);
  if (!args.positional().empty()) throw ArgError("unexpected argument '" + args.positional()[0] + "'");
  if (!args.rest().empty()) throw ArgError("unexpected arguments after '--'");
  if (args.has("text") && args.has("input")) throw ArgError("give either --text or --input, not both");

  const std::unique_ptr<Tokenizer> tok =
      make_tokenizer(args.get("tokenizer", "gpt2"), args.get("gpt2-dir"), args.get("tokenizer-file"));
  const bool special = args.flag("special");
  auto encode = [&](std::string_view text) {
    std::vector<int32_t> ids;
    if (special)
      tok->encode_document(text, ids);
    else
      ids = tok->encode(text);
    return ids;
  };
  std::string text;
  if (args.has("input")) {
    const std::string path = args.get("input");
    const InputFormat fmt = args.has("jsonl-field") ? InputFormat::Jsonl : InputFormat::Auto;
    if (!args.flag("decode")) {
      try {
        for_each_document(path, fmt, args.get("jsonl-field", "text"), false,
                          [&](std::string_view doc, int64_t) { print_ids(encode(doc)); });
      } catch (const BadInputError& e) {
        throw CommandError(e.what());
      }
      std::fflush(stdout);
      return 0;
    }
    for_each_document(path, InputFormat::Text, "", false, [&](std::string_view doc, int64_t) { text = doc; });
  } else if (args.has("text")) {
    text = args.get("text");
  } else {
    text.assign(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
  }
  if (args.flag("decode")) {
    size_t pos = 0;
    while (pos < text.size()) {
      size_t eol = text.find('\n', pos);
      if (eol == std::string::npos) eol = text.size();
      std::vector<int32_t> ids;
      const std::string line = text.substr(pos, eol - pos);
      size_t i = 0;
      while (i < line.size()) {
        while (i < line.size() && (line[i] == ' ' || line[i] == '\t' || line[i] == '\r')) ++i;
        if (i >= line.size()) break;
        size_t used = 0;
        try {
          ids.push_back(static_cast<int32_t>(std::stol(line.substr(i), &used)));
        } catch (const std::exception&) {
          throw CommandError("--decode: '" + line.substr(i, 20) + "' is not a token id");
        }
        i += used;
      }
      const std::string decoded = tok->decode(ids);
      // --json: one JSON string a line, so texts holding newlines stay one line each.
      const std::string out = (args.flag("json") ? nlohmann::json(decoded).dump(-1, ' ', false,
                                                                                 nlohmann::json::error_handler_t::replace)
                                                  : decoded) + "\n";
      std::fwrite(out.data(), 1, out.size(), stdout);
      pos = eol + 1;
    }
    std::fflush(stdout);
    return 0;
  }
  print_ids(encode(text));
  std::fflush(stdout);
  return 0;
}

}  // namespace

int run_tokenize_command(int argc, char** argv) {
  return cli_support::run("tokenize", kTokenizeHelp, tokenize, argc, argv);
}

}  // namespace mt
