// `meshtrain prepare`: arguments -> PrepareOptions, a progress bar, a summary.
#include <unistd.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cli/cli_support.h"
#include "cli/data_commands.h"
#include "data/corpus.h"
#include "data/tokenizer.h"

namespace mt {

namespace {

using namespace cli_support;

const char kPrepareHelp[] =
    "usage: meshtrain prepare --input FILE|DIR|GLOB [--input ...] --out DIR --tokenizer byte|gpt2|hf\n"
    "                         [--vocab-size N] [--tokenizer-file tokenizer.json] [--gpt2-dir DIR] [--jsonl-field F]\n"
    "                         [--format auto|text|jsonl|chat] [--template chatml|llama3]\n"
    "                         [--train-on assistant|all] [--val-fraction F] [--shard-tokens N]\n"
    "                         [--skip-bad] [--threads N]\n"
    "\n"
    "Tokenizes a corpus into token shards in llm.c's layout: DIR/train.bin and DIR/val.bin (val.bin\n"
    "holds the last fraction F of the tokens, train.bin the rest), or DIR/train_000000.bin, ... when\n"
    "a split holds more than --shard-tokens tokens. Point the [data] train and val keys of a training\n"
    "config at them (a glob such as \"DIR/train_*.bin\" for several shards).\n"
    "\n"
    "Input is streamed: documents are read in batches, tokenized in parallel on every core and\n"
    "written in input order (the output does not depend on the thread count); memory holds one batch,\n"
    "never the corpus. On a terminal a progress line shows MB/s and tokens.\n"
    "\n"
    "options:\n"
    "  --input PATH        a text or JSON-lines file, a directory (every file below it), or a quoted\n"
    "                      glob such as 'books/*.txt'; give --input several times; bare arguments are\n"
    "                      further inputs (an unquoted shell glob works too). Each pattern's files are\n"
    "                      taken sorted by name. Required.\n"
    "  --format F          auto (default): files named .jsonl, .ndjson or .json are JSON lines, others\n"
    "                      plain text; text: every file is one plain-text document; jsonl: every\n"
    "                      file is JSON lines; chat: every file is JSON lines of instruction or chat\n"
    "                      records (see 'Chat data' below).\n"
    "  --template T        chat: chatml (<|im_start|>ROLE\\nCONTENT<|im_end|>\\n per message; default)\n"
    "                      or llama3 (<|begin_of_text|>, then <|start_header_id|>ROLE<|end_header_id|>\n"
    "                      \\n\\nCONTENT<|eot_id|> per message). The special tokens come from the\n"
    "                      tokenizer (--tokenizer hf); one it lacks is refused.\n"
    "  --train-on W        chat: assistant (default): the loss trains only the assistant messages'\n"
    "                      content and closing token; all: every token.\n"
    "  --jsonl-field F     the string field of each JSON line that holds the document (default text).\n"
    "                      A plain-text file is one document; a JSON-lines file one document per line.\n"
    "  --out DIR           output directory, created when missing; old train*/val* shards in it are\n"
    "                      removed. Required.\n"
    "  --tokenizer NAME    byte: ids 0..255 are the bytes of the text (vocabulary 256).\n"
    "                      gpt2: OpenAI GPT-2 byte-level BPE (vocabulary 50257, <|endoftext|> = 50256;\n"
    "                      its files ship in the repository's assets/gpt2). gpt2:N is the same cut to N\n"
    "                      tokens (as --vocab-size N).\n"
    "                      hf: a Hugging Face tokenizer.json of the byte-level BPE family (GPT-2,\n"
    "                      Llama 3, Qwen 2, Mistral Tekken, ...), given by --tokenizer-file. Required.\n"
    "  --tokenizer-file F  the tokenizer.json for --tokenizer hf.\n"
    "  --vocab-size N      gpt2 only: keep GPT-2's 256 byte tokens, its N - 257 most frequent merges and\n"
    "                      <|endoftext|> as id N - 1 (tokenizer gpt2:N; a small model trains faster on a\n"
    "                      small vocabulary). Set the training config's [data] tokenizer = \"gpt2:N\"\n"
    "                      and [model] vocab_size = N.\n"
    "  --gpt2-dir DIR      directory holding encoder.json and vocab.bpe (default: $MESHTRAIN_GPT2_DIR,\n"
    "                      else the repository's assets/gpt2).\n"
    "  --val-fraction F    fraction of the tokens, taken from the end, written to val (default 0.1;\n"
    "                      0 <= F < 1; 0 writes an empty val.bin).\n"
    "  --shard-tokens N    at most N tokens per shard (default 0: one train and one val shard).\n"
    "  --skip-bad          a bad JSON line (not JSON, invalid UTF-8, missing or non-string field) is\n"
    "                      skipped and counted instead of stopping with its file and line.\n"
    "  --threads N         tokenizer threads (default: every core).\n"
    "  -h, --help          print this help and exit.\n"
    "\n"
    "Documents: the tokenizer's beginning-of-text tokens (Llama 3's <|begin_of_text|>) start each\n"
    "document, and its end-of-text token (<|endoftext|>, <|end_of_text|>, </s>, ...) separates them;\n"
    "the byte tokenizer joins documents with a newline.\n"
    "\n"
    "Chat data: one record per JSON line, {\"messages\": [{\"role\": ..., \"content\": ...}, ...]} or\n"
    "{\"prompt\": ..., \"completion\": ...} (a user and an assistant message); a bad record stops\n"
    "with its file and line (or is skipped with --skip-bad). Records are documents as above. Beside\n"
    "each shard a loss mask PATH.mask (one byte per token, 1 = trained) is written; training reads\n"
    "it and leaves the other tokens out of the loss.\n"
    "\n"
    "Shard layout: a header of 256 little-endian int32 (20240520, version, token count, the\n"
    "tokenizer's vocabulary, the bytes of text as two words, zeros), then the tokens: uint16 (version 1,\n"
    "llm.c's), or uint32 (version 2) when an id exceeds 65535. The model's vocab_size must be at least\n"
    "the tokenizer's vocabulary. Training reports validation in bits per byte from the bytes recorded.\n"
    "\n"
    "examples:\n"
    "  meshtrain prepare --input input.txt --out data/shakespeare --tokenizer gpt2\n"
    "  meshtrain prepare --input 'corpus/*.jsonl' --jsonl-field text --out data/web \\\n"
    "      --tokenizer hf --tokenizer-file tokenizer.json --shard-tokens 100000000\n"
    "  meshtrain prepare --format chat --template llama3 --input chats.jsonl --out data/sft \\\n"
    "      --tokenizer hf --tokenizer-file tokenizer.json\n";

int prepare(int argc, char** argv) {
  const std::vector<std::string> value_flags = {"out",          "tokenizer",   "gpt2-dir", "tokenizer-file", "val-fraction",
                                                "shard-tokens", "jsonl-field", "format",   "threads",        "vocab-size",
                                                "template",     "train-on"};
  std::vector<char*> rest;
  std::vector<std::string> patterns = take_repeated(argc, argv, "input", value_flags, rest);
  std::vector<std::string> known = value_flags;
  known.push_back("input");  // taken out above; named here so a misspelling finds it
  ArgParser args(known, {"help", "skip-bad"});
  args.parse(static_cast<int>(rest.size()), rest.data());
  if (!args.rest().empty()) throw ArgError("unexpected arguments after '--'");
  for (const auto& p : args.positional()) {
    if (!p.empty() && p[0] == '-') throw ArgError("unknown option " + p);
    patterns.push_back(p);
  }
  if (patterns.empty()) throw ArgError("missing --input FILE");
  if (!args.has("out")) throw ArgError("missing --out DIR");
  if (!args.has("tokenizer")) throw ArgError("missing --tokenizer byte|gpt2|hf");
  PrepareOptions o;
  o.val_fraction = args.get_double("val-fraction", 0.1);
  if (!(o.val_fraction >= 0.0 && o.val_fraction < 1.0))
    throw ArgError("--val-fraction must be in [0, 1), got " + args.get("val-fraction"));
  o.shard_tokens = args.get_int("shard-tokens", 0);
  if (o.shard_tokens < 0) throw ArgError("--shard-tokens must be >= 0");
  o.threads = static_cast<int>(args.get_int("threads", 0));
  o.jsonl_field = args.get("jsonl-field", "text");
  o.skip_bad = args.flag("skip-bad");
  const std::string fmt = args.get("format", "auto");
  if (fmt == "auto") o.format = InputFormat::Auto;
  else if (fmt == "text") o.format = InputFormat::Text;
  else if (fmt == "jsonl") o.format = InputFormat::Jsonl;
  else if (fmt == "chat") o.format = InputFormat::Chat;
  else throw ArgError("--format must be auto, text, jsonl or chat, got '" + fmt + "'");
  if (o.format != InputFormat::Chat && (args.has("template") || args.has("train-on")))
    throw ArgError("--template and --train-on are for --format chat");
  o.chat_template = args.get("template", "chatml");
  if (o.chat_template != "chatml" && o.chat_template != "llama3")
    throw ArgError("--template must be chatml or llama3, got '" + o.chat_template + "'");
  const std::string train_on = args.get("train-on", "assistant");
  if (train_on != "assistant" && train_on != "all")
    throw ArgError("--train-on must be assistant or all, got '" + train_on + "'");
  o.train_on_all = train_on == "all";
  try {
    o.inputs = expand_inputs(patterns);
  } catch (const std::runtime_error& e) {
    throw CommandError(std::string("--input: ") + e.what());
  }
  o.out_dir = args.get("out");
  std::string tok_name = args.get("tokenizer");
  if (args.has("vocab-size")) {
    if (tok_name != "gpt2")
      throw ArgError("--vocab-size cuts GPT-2's vocabulary: use it with --tokenizer gpt2, not " + tok_name);
    tok_name += ":" + std::to_string(args.get_int("vocab-size", 0));
  }
  const std::unique_ptr<Tokenizer> tok = make_tokenizer(tok_name, args.get("gpt2-dir"), args.get("tokenizer-file"));

  const bool tty = ::isatty(2);
  auto progress = [&](const PrepareProgress& p) {
    if (!tty) return;
    const double frac = p.bytes_total > 0 ? static_cast<double>(p.bytes_done) / static_cast<double>(p.bytes_total) : 1.0;
    const int width = 30, filled = static_cast<int>(frac * width + 0.5);
    std::string bar(static_cast<size_t>(std::min(filled, width)), '#');
    bar.resize(width, ' ');
    std::fprintf(stderr, "\r[%s] %5.1f%%  %.1f MB/s  %s tokens  %s documents", bar.c_str(), 100.0 * frac,
                 p.seconds > 0 ? static_cast<double>(p.bytes_done) / 1e6 / p.seconds : 0.0,
                 count_str(p.tokens).c_str(), count_str(p.documents).c_str());
    std::fflush(stderr);
  };
  const PrepareResult r = prepare_corpus(o, *tok, progress);
  if (tty) std::fprintf(stderr, "\n");
  for (const auto& w : r.warnings) std::fprintf(stderr, "meshtrain prepare: warning: skipped %s\n", w.c_str());
  if (r.bad > 0)
    std::fprintf(stderr, "meshtrain prepare: warning: %s bad document%s skipped (--skip-bad)%s\n",
                 count_str(r.bad).c_str(), r.bad == 1 ? "" : "s",
                 r.bad > static_cast<int64_t>(r.warnings.size()) ? "; the first ones are listed above" : "");
  std::printf("tokenizer %s (vocab %d): %zu input file%s, %s documents, %s bytes -> %s tokens (%.2f bytes/token) in "
              "%.1f s (%.1f MB/s)\n",
              tok->name().c_str(), tok->vocab_size(), o.inputs.size(), o.inputs.size() == 1 ? "" : "s",
              count_str(r.documents).c_str(), count_str(r.bytes).c_str(), count_str(r.tokens).c_str(),
              r.tokens > 0 ? static_cast<double>(r.bytes) / static_cast<double>(r.tokens) : 0.0, r.seconds,
              r.seconds > 0 ? static_cast<double>(r.bytes) / 1e6 / r.seconds : 0.0);
  auto report = [&](const std::vector<std::string>& files, int64_t n) {
    if (files.size() == 1)
      std::printf("wrote %s: %s tokens\n", files[0].c_str(), count_str(n).c_str());
    else
      std::printf("wrote %zu shards %s .. %s: %s tokens\n", files.size(), files.front().c_str(), files.back().c_str(),
                  count_str(n).c_str());
  };
  report(r.train_files, r.train_tokens);
  report(r.val_files, r.val_tokens);
  if (o.format == InputFormat::Chat)
    std::printf("loss masks (%s template, training on %s): %s of %s tokens trained\n", o.chat_template.c_str(),
                o.train_on_all ? "all tokens" : "assistant messages", count_str(r.trained_tokens).c_str(),
                count_str(r.tokens).c_str());
  if (r.token_bytes == 4)
    std::printf("token ids above 65535: the shards hold uint32 tokens (format version 2)\n");
  if (r.val_tokens == 0 && o.val_fraction > 0)
    std::fprintf(stderr, "meshtrain prepare: warning: val.bin is empty (too little text for --val-fraction %g)\n",
                 o.val_fraction);
  return 0;
}

}  // namespace

int run_prepare_command(int argc, char** argv) { return cli_support::run("prepare", kPrepareHelp, prepare, argc, argv); }

}  // namespace mt
