// meshtrain: one binary, one subcommand per job (see `meshtrain --help`).
#include <cstdio>
#include <cstring>
#include <string>

#include "cli/commands.h"
#include "train/preflight.h"

int main(int argc, char** argv) {
  mt::set_dry_run_binary("/proc/self/exe");  // this binary runs `train --dry-run` for the memory preflight
  return mt::cli::dispatch(argc, argv);
}
