// `meshtrain prepare` (text and JSON-lines corpora -> token shards) and `meshtrain tokenize`
// (print token ids). Both parse their arguments here and call the library in data/corpus.h and
// data/tokenizer.h.
#pragma once

namespace mt {

int run_prepare_command(int argc, char** argv);
int run_tokenize_command(int argc, char** argv);

}  // namespace mt
