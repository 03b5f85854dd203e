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

enum class InputFormat { Auto, Text, Jsonl };

struct PrepareOptions {
  std::vector<std::string> inputs;   // expanded files
  std::string out_dir;
  InputFormat format = InputFormat::Auto;
  std::string jsonl_field = "text";
  double val_fraction = 0.1;
  int64_t shard_tokens = 0;          // 0 = one train and one val shard
  bool skip_bad = false;             // bad documents become warnings (counted) instead of errors
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
