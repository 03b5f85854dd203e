// Helpers shared by the subcommands: argument parsing with --help and usage errors, error
// reporting, repeated flags.
#pragma once
#include <cstdio>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "cli/arg_parser.h"

namespace mt::cli_support {

// Reported as "meshtrain <cmd>: error: <message>", exit code 2.
struct CommandError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline int fail(const char* cmd, const std::string& msg) {
  std::fprintf(stderr, "meshtrain %s: error: %s\n(run 'meshtrain %s --help' for usage)\n", cmd, msg.c_str(), cmd);
  return 2;
}

// A usage error: "meshtrain <cmd>: <msg> (see --help)", exit code 2.
inline int usage_error(const char* cmd, const std::string& msg) {
  std::fprintf(stderr, "meshtrain %s: %s (see --help)\n", cmd, msg.c_str());
  return 2;
}

// Parses the options after the command name into `ap`. Returns the exit code when the command is
// already done - 0 after `print_help()` for --help, 2 after a usage error - and nothing otherwise.
template <class PrintHelp>
std::optional<int> parse_args(const char* cmd, ArgParser& ap, int argc, char** argv, PrintHelp print_help) {
  try {
    ap.parse(argc, argv, 1);
  } catch (const ArgError& e) {
    return usage_error(cmd, e.what());
  }
  if (ap.flag("help")) {
    print_help();
    return 0;
  }
  return std::nullopt;
}

inline bool wants_help(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--")) break;
    if (!std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h")) return true;
  }
  return false;
}

// Pulls every occurrence of --`name` (as "--name V" or "--name=V") out of argv, leaving the rest for
// ArgParser, which keeps only the last value of a repeated flag. `value_flags` lists the other flags
// that take a value so their values are never mistaken for flags.
inline std::vector<std::string> take_repeated(int argc, char** argv, const std::string& name,
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

inline std::string count_str(long long n) {
  std::string s = std::to_string(n), out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i && (s.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(s[i]);
  }
  return out;
}

inline int run(const char* cmd, const char* help, int (*body)(int, char**), int argc, char** argv) {
  if (wants_help(argc, argv)) {
    std::fputs(help, stdout);
    return 0;
  }
  try {
    return body(argc, argv);
  } catch (const std::exception& e) {
    return fail(cmd, e.what());
  }
}

}  // namespace mt::cli_support
