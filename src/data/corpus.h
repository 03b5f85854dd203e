// Corpus preparation: text and JSON-lines files -> token shards, streamed.
//
// Inputs are files, directories (every regular file below, recursively) and globs, each expanded
// in byte order of the path. A plain-text file is one document; a JSON-lines file (.jsonl, .ndjson,
// .json, or any file when the format is forced) holds one document per line in a string field.
// Documents are read in batches, tokenized in parallel (OpenMP, one document per task) and written
// in input order, so the output does not depend on the thread count; memory holds one batch and
// the largest plain-text file, never the corpus. Tokens go to a temporary file first; at the end
// the last val_fraction of them become the validation shard(s) and the rest the training shard(s),
// each cut into shards of at most shard_tokens tokens.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "data/tokenizer.h"

namespace mt {

// Thrown for bad input (names file and line); prepare_corpus turns it into a counted warning when
// skip_bad is set.
struct BadInputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The files `patterns` name: a file as is, a directory's regular files (recursively), a glob's
// matches; each pattern's files sorted. Throws std::runtime_error naming a pattern that matches
// nothing or a path that does not exist.
std::vector<std::string> expand_inputs(const std::vector<std::string>& patterns);

// Chat: every file is JSON lines of instruction or chat records (see ChatTemplate below).
enum class InputFormat { Auto, Text, Jsonl, Chat };

// ---- instruction and chat data ----
//
// A chat record is one JSON line holding either "messages": [{"role": R, "content": C}, ...]
// (strings; at least one message) or "prompt": P and "completion": C (strings), which stands for
// the two messages [{"role": "user", "content": P}, {"role": "assistant", "content": C}].
struct ChatMessage {
  std::string role, content;
};
// Throws BadInputError naming `path`, `lineno` and what is wrong with the record.
std::vector<ChatMessage> parse_chat_record(const std::string& line, const std::string& path, int64_t lineno);

// A named chat template applied as Hugging Face's apply_chat_template renders it and the tokenizer
// then encodes the text (special tokens split out first):
//   chatml  for each message: <|im_start|>ROLE\nCONTENT<|im_end|>\n
//   llama3  <|begin_of_text|>, then for each message:
//           <|start_header_id|>ROLE<|end_header_id|>\n\nCONTENT<|eot_id|> (CONTENT trimmed of
//           surrounding whitespace, as the template's `trim` does)
// The loss mask trains an assistant message's content and the token that closes it (<|im_end|>,
// <|eot_id|>); everything else (system and user messages, roles, headers) is context only. With
// train_all every token is trained.
class ChatTemplate {
 public:
  // `name` is chatml or llama3. The special tokens come from the tokenizer (a Hugging Face
  // tokenizer.json); throws std::invalid_argument naming the template and the missing token.
  ChatTemplate(const std::string& name, const Tokenizer& tok);
  // Appends the record's ids and one mask byte per id (1 = trained).
  void apply(const std::vector<ChatMessage>& messages, bool train_all, std::vector<int32_t>& ids,
             std::vector<uint8_t>& mask) const;
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  const Tokenizer& tok_;
  int32_t bos_ = -1, open_ = -1, close_ = -1, header_end_ = -1;
};

struct PrepareOptions {
  std::vector<std::string> inputs;   // expanded files
  std::string out_dir;
  InputFormat format = InputFormat::Auto;
  std::string jsonl_field = "text";
  double val_fraction = 0.1;
  int64_t shard_tokens = 0;          // 0 = one train and one val shard
  bool skip_bad = false;             // bad documents become warnings (counted) instead of errors
  std::string chat_template = "chatml";  // InputFormat::Chat: the template (ChatTemplate)
  bool train_on_all = false;         // InputFormat::Chat: train every token, not only the assistant's
  int threads = 0;                   // 0 = every core
  size_t batch_bytes = size_t{8} << 20;
};

struct PrepareProgress {
  int64_t bytes_done = 0, bytes_total = 0, tokens = 0, documents = 0;
  double seconds = 0;
};

struct PrepareResult {
  int64_t bytes = 0, tokens = 0, documents = 0, bad = 0, train_tokens = 0, val_tokens = 0;
  std::vector<std::string> train_files, val_files;
  std::vector<std::string> warnings;  // the first bad documents skipped (file:line: why)
  double seconds = 0;
  int token_bytes = 2;                // 2: llm.c uint16 shards; 4: uint32 (vocabularies above 65536)
  int64_t trained_tokens = 0;         // InputFormat::Chat: tokens the loss masks train
};

// Runs the preparation. `progress` (may be empty) is called after every batch. Throws
// BadInputError (file and line) for bad input unless skip_bad, std::runtime_error for I/O errors
// and for a corpus that leaves no training token.
PrepareResult prepare_corpus(const PrepareOptions& opts, const Tokenizer& tok,
                             const std::function<void(const PrepareProgress&)>& progress = {});

// Documents of one input file, in order, for callers that tokenize themselves (`tokenize`).
// `fn(text, line)` gets each document (line 0 for a plain-text file). Throws BadInputError unless
// skip_bad; returns the number of bad documents skipped.
int64_t for_each_document(const std::string& path, InputFormat format, const std::string& jsonl_field, bool skip_bad,
                          const std::function<void(std::string_view, int64_t)>& fn,
                          std::vector<std::string>* warnings = nullptr);

}  // namespace mt
