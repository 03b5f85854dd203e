#include "train/data_commands.h"

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/arg_parser.h"
#include "train/data_loader.h"
#include "train/token_shards.h"
#include "train/tokenizer.h"

namespace mt {

namespace {

const char kPrepareHelp[] =
    "usage: meshtrain prepare --input TEXT_FILE --out DIR --tokenizer byte|gpt2 [--gpt2-dir DIR]\n"
    "                         [--val-fraction F]\n"
    "\n"
    "Tokenizes text into two token shards in llm.c's layout: DIR/train.bin and DIR/val.bin\n"
    "(val.bin holds the last fraction F of the tokens, train.bin the rest). Point the [data] train\n"
    "and val keys of a training config at them.\n"
    "\n"
    "options:\n"
    "  --input FILE|GLOB   text file to tokenize. Give --input several times, or a quoted glob such\n"
    "                      as 'books/*.txt' (matches sorted by name), to concatenate several files;\n"
    "                      bare arguments are taken as further input files, so an unquoted shell\n"
    "                      glob works too. Files are joined by the end-of-text token <|endoftext|>\n"
    "                      (gpt2) or by a newline (byte). Required.\n"
    "  --out DIR           output directory, created when missing. Required.\n"
    "  --tokenizer NAME    byte: ids 0..255 are the bytes of the text (vocabulary 256).\n"
    "                      gpt2: OpenAI GPT-2 byte-level BPE (vocabulary 50257, <|endoftext|> = 50256).\n"
    "                      Required.\n"
    "  --gpt2-dir DIR      directory holding the GPT-2 files encoder.json and vocab.bpe\n"
    "                      (default: $MESHTRAIN_GPT2_DIR). Needed for --tokenizer gpt2.\n"
    "  --val-fraction F    fraction of the tokens, taken from the end, written to val.bin\n"
    "                      (default 0.1; 0 <= F < 1; 0 writes an empty val.bin).\n"
    "  -h, --help          print this help and exit.\n"
    "\n"
    "Shard layout: a header of 256 little-endian int32 (20240520, 1, token count, zeros), then the\n"
    "tokens as uint16. The model's vocab_size must be at least the tokenizer's vocabulary (256 for\n"
    "byte; 50257 for gpt2, usually padded to 50304).\n"
    "\n"
    "example:\n"
    "  meshtrain prepare --input input.txt --out data/shakespeare --tokenizer gpt2 --gpt2-dir gpt2/\n";

const char kTokenizeHelp[] =
    "usage: meshtrain tokenize --tokenizer gpt2 --gpt2-dir DIR [--text STRING | --input FILE]\n"
    "\n"
    "Prints the token ids of a text, space-separated, on one line.\n"
    "\n"
    "options:\n"
    "  --tokenizer NAME    gpt2 (default): OpenAI GPT-2 byte-level BPE; byte: ids are the bytes.\n"
    "  --gpt2-dir DIR      directory holding encoder.json and vocab.bpe (default: $MESHTRAIN_GPT2_DIR).\n"
    "  --text STRING       the text to tokenize.\n"
    "  --input FILE        tokenize the contents of FILE instead.\n"
    "                      With neither --text nor --input the text is read from stdin.\n"
    "  -h, --help          print this help and exit.\n"
    "\n"
    "\"<|endoftext|>\" inside the text is ordinary text, not the end-of-text token.\n"
    "\n"
    "example:\n"
    "  meshtrain tokenize --tokenizer gpt2 --gpt2-dir gpt2/ --text \"Hello world\"   # 15496 995\n";

// Reported as "meshtrain <cmd>: error: <message>", exit code 2.
struct CommandError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

int fail(const char* cmd, const std::string& msg) {
  std::fprintf(stderr, "meshtrain %s: error: %s\n(run 'meshtrain %s --help' for usage)\n", cmd, msg.c_str(), cmd);
  return 2;
}

bool wants_help(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--")) break;
    if (!std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h")) return true;
  }
  return false;
}

std::string read_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) throw CommandError("input " + path + " is a directory, not a text file");
  std::ifstream f(path, std::ios::binary);
  if (!f) throw CommandError("cannot open input file " + path + ": " + std::strerror(errno));
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (f.bad()) throw CommandError("cannot read input file " + path);
  return s;
}

// Pulls every occurrence of --`name` (as "--name V" or "--name=V") out of argv, leaving the rest for
// ArgParser, which keeps only the last value of a repeated flag. `value_flags` lists the other flags
// that take a value so their values are never mistaken for flags.
std::vector<std::string> take_repeated(int argc, char** argv, const std::string& name,
                                       const std::vector<std::string>& value_flags, std::vector<char*>& rest) {
  std::vector<std::string> values;
  const std::string flag = "--" + name, flag_eq = flag + "=";
  std::vector<char*> out{argv[0]};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--") {
      out.insert(out.end(), argv + i, argv + argc);
      break;
    }
    if (a == flag) {
      if (i + 1 >= argc) throw ArgError("option " + flag + " needs a value");
      values.emplace_back(argv[++i]);
      continue;
    }
    if (a.rfind(flag_eq, 0) == 0) {
      values.push_back(a.substr(flag_eq.size()));
      continue;
    }
    out.push_back(argv[i]);
    if (a.size() > 2 && a.compare(0, 2, "--") == 0 && a.find('=') == std::string::npos) {
      for (const auto& v : value_flags)
        if (a.substr(2) == v && i + 1 < argc) {
          out.push_back(argv[++i]);
          break;
        }
    }
  }
  rest = std::move(out);
  return values;
}

std::string count_str(long long n) {
  std::string s = std::to_string(n), out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i && (s.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(s[i]);
  }
  return out;
}

int prepare(int argc, char** argv) {
  const std::vector<std::string> value_flags = {"out", "tokenizer", "gpt2-dir", "val-fraction"};
  std::vector<char*> rest;
  std::vector<std::string> patterns = take_repeated(argc, argv, "input", value_flags, rest);
  ArgParser args(value_flags, {"help"});
  args.parse(static_cast<int>(rest.size()), rest.data());
  if (!args.rest().empty()) throw ArgError("unexpected arguments after '--'");
  for (const auto& p : args.positional()) {
    if (!p.empty() && p[0] == '-') throw ArgError("unknown option " + p);
    patterns.push_back(p);
  }
  if (patterns.empty()) throw ArgError("missing --input TEXT_FILE");
  if (!args.has("out")) throw ArgError("missing --out DIR");
  if (!args.has("tokenizer")) throw ArgError("missing --tokenizer byte|gpt2");
  const double val_fraction = args.get_double("val-fraction", 0.1);
  if (!(val_fraction >= 0.0 && val_fraction < 1.0))
    throw ArgError("--val-fraction must be in [0, 1), got " + args.get("val-fraction"));

  std::vector<std::string> files;
  for (const auto& p : patterns) {
    std::vector<std::string> matched;
    try {
      matched = expand_file_pattern(p);
    } catch (const std::runtime_error& e) {
      throw CommandError(std::string("--input: ") + e.what());
    }
    files.insert(files.end(), matched.begin(), matched.end());
  }

  std::unique_ptr<Tokenizer> tok;
  try {
    tok = make_tokenizer(args.get("tokenizer"), args.get("gpt2-dir"));
  } catch (const std::runtime_error& e) {
    throw CommandError(e.what());
  }
  const int32_t sep = tok->eot_token() >= 0 ? tok->eot_token() : int32_t{'\n'};

  std::vector<int32_t> tokens;
  long long bytes = 0;
  for (size_t i = 0; i < files.size(); ++i) {
    const std::string text = read_file(files[i]);
    bytes += static_cast<long long>(text.size());
    if (i > 0) tokens.push_back(sep);
    const std::vector<int32_t> ids = tok->encode(text);
    tokens.insert(tokens.end(), ids.begin(), ids.end());
  }
  const auto n = static_cast<int64_t>(tokens.size());
  const auto n_val = static_cast<int64_t>(static_cast<double>(n) * val_fraction);
  const int64_t n_train = n - n_val;
  if (n_train <= 0)
    throw CommandError("the input holds " + std::to_string(n) + " tokens, leaving none for train.bin");

  const std::string out = args.get("out");
  std::error_code ec;
  std::filesystem::create_directories(out, ec);
  if (ec || !std::filesystem::is_directory(out))
    throw CommandError("cannot create output directory " + out + (ec ? ": " + ec.message() : ""));
  const std::string train_path = (std::filesystem::path(out) / "train.bin").string();
  const std::string val_path = (std::filesystem::path(out) / "val.bin").string();
  const std::span<const int32_t> all(tokens);
  write_token_shard(train_path, all.subspan(0, static_cast<size_t>(n_train)));
  write_token_shard(val_path, all.subspan(static_cast<size_t>(n_train)));

  std::printf("tokenizer %s (vocab %d): %zu input file%s, %s bytes -> %s tokens\n", tok->name().c_str(),
              tok->vocab_size(), files.size(), files.size() == 1 ? "" : "s", count_str(bytes).c_str(),
              count_str(n).c_str());
  std::printf("wrote %s: %s tokens\n", train_path.c_str(), count_str(n_train).c_str());
  std::printf("wrote %s: %s tokens\n", val_path.c_str(), count_str(n_val).c_str());
  if (n_val == 0 && val_fraction > 0)
    std::fprintf(stderr, "meshtrain prepare: warning: val.bin is empty (too little text for --val-fraction %g)\n",
                 val_fraction);
  return 0;
}

int tokenize(int argc, char** argv) {
  ArgParser args({"tokenizer", "gpt2-dir", "text", "input"}, {"help"});
  args.parse(argc, argv);
  if (!args.positional().empty()) throw ArgError("unexpected argument '" + args.positional()[0] + "'");
  if (!args.rest().empty()) throw ArgError("unexpected arguments after '--'");
  if (args.has("text") && args.has("input")) throw ArgError("give either --text or --input, not both");

  std::unique_ptr<Tokenizer> tok;
  try {
    tok = make_tokenizer(args.get("tokenizer", "gpt2"), args.get("gpt2-dir"));
  } catch (const std::runtime_error& e) {
    throw CommandError(e.what());
  }
  std::string text;
  if (args.has("text"))
    text = args.get("text");
  else if (args.has("input"))
    text = read_file(args.get("input"));
  else
    text.assign(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());

  const std::vector<int32_t> ids = tok->encode(text);
  std::string line;
  line.reserve(ids.size() * 6 + 1);
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) line.push_back(' ');
    line += std::to_string(ids[i]);
  }
  line.push_back('\n');
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fflush(stdout);
  return 0;
}

int run(const char* cmd, const char* help, int (*body)(int, char**), int argc, char** argv) {
  if (wants_help(argc, argv)) {
    std::fputs(help, stdout);
    return 0;
  }
  try {
    return body(argc, argv);
  } catch (const ArgError& e) {
    return fail(cmd, e.what());
  } catch (const std::exception& e) {
    return fail(cmd, e.what());
  }
}

}  // namespace

int run_prepare_command(int argc, char** argv) { return run("prepare", kPrepareHelp, prepare, argc, argv); }

int run_tokenize_command(int argc, char** argv) { return run("tokenize", kTokenizeHelp, tokenize, argc, argv); }

}  // namespace mt
