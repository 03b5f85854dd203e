// Subcommand dispatch for the meshtrain binary.
#pragma once

namespace mt::cli {
int dispatch(int argc, char** argv);
}
