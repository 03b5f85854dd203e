// `meshtrain prepare` and `meshtrain tokenize`. argv[0] is the subcommand name, flags follow.
// Both return 0 on success (and for --help, printed to stdout) and 2 on an error, reported on stderr.
#pragma once

namespace mt {

// meshtrain prepare --input TEXT_FILE --out DIR --tokenizer byte|gpt2 [--gpt2-dir DIR] [--val-fraction F]
int run_prepare_command(int argc, char** argv);
// meshtrain tokenize [--tokenizer gpt2|byte] [--gpt2-dir DIR] [--text STRING | --input FILE]
int run_tokenize_command(int argc, char** argv);

}  // namespace mt
