#pragma once
// Child processes of the engine: the preflight's dry run of each rank and `meshtrain compare`'s two
// runs. One place spawns them, with stdout and stderr into a log file the caller reads back.

#include <string>
#include <vector>

namespace mt {

// Runs args[0] (a path; no PATH search) with args[1..] and stdout + stderr written to `log` (created or
// truncated), waits for it and returns its exit status, 128 + the signal number when a signal ended it,
// or -1 when it could not be started (then *error, when given, says why).
int run_logged(const std::vector<std::string>& args, const std::string& log, std::string* error = nullptr);

}  // namespace mt
