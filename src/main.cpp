// meshtrain: one binary, one subcommand per job (see `meshtrain --help`).
#include <cstdio>
#include <cstring>
#include <string>

#include "cli/commands.h"

int main(int argc, char** argv) { return mt::cli::dispatch(argc, argv); }
