// The contract every fuzz target enforces: whatever the bytes of a file, the engine either accepts
// them or refuses them with the error the command line turns into one clear line - an
// std::runtime_error (ConfigError, BadInputError, CheckpointModelMismatch and the I/O errors derive
// from it) or the std::invalid_argument the Hugging Face config reader documents - whose message is
// non-empty, names the file where the reader has one, and carries no C++ or JSON-library text.
// Anything else - another exception type, a message that breaks those rules, an abort, a sanitizer
// report - is a crash: the target prints what it saw and aborts, and libFuzzer keeps the input.
#pragma once
#include <cxxabi.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <typeinfo>

namespace mt::fuzz {

// A private folder for the files a target writes (tmpfs when there is one), removed at exit.
inline const std::string& work_dir() {
  // Never destroyed: the atexit handler runs after static destructors.
  static const std::string* dir = [] {
    const char* base = std::filesystem::is_directory("/dev/shm") ? "/dev/shm" : "/tmp";
    auto* d = new std::string(std::string(base) + "/meshtrain-fuzz-" + std::to_string(::getpid()));
    std::filesystem::create_directories(*d);
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(work_dir(), ec);
    });
    return d;
  }();
  return *dir;
}

// Writes the fuzzer's bytes to work_dir()/name and returns the path.
inline std::string write_file(const std::string& name, const uint8_t* data, size_t size) {
  const std::string path = work_dir() + "/" + name;
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  f.close();
  if (!f) {
    std::fprintf(stderr, "fuzz: cannot write %s\n", path.c_str());
    std::abort();
  }
  return path;
}

inline std::string type_name(const std::type_info& t) {
  int status = 0;
  char* n = abi::__cxa_demangle(t.name(), nullptr, nullptr, &status);
  std::string s = status == 0 && n ? n : t.name();
  std::free(n);
  return s;
}

[[noreturn]] inline void crash(const char* target, const std::string& why, const std::string& type, const std::string& msg) {
  std::fprintf(stderr, "\n%s: CONTRACT BROKEN: %s\n  exception: %s\n  message: %s\n", target, why.c_str(), type.c_str(),
               msg.c_str());
  std::abort();
}

// Whether `needle` occurs in `hay`. A plain loop outside the coverage instrumentation: through
// std::string::find (memcmp) libFuzzer would learn the needles and write them into its inputs,
// where the engine's messages echo them back.
__attribute__((no_sanitize("coverage"))) inline bool contains(const std::string& hay, const char* needle) {
  const size_t n = std::char_traits<char>::length(needle);
  for (size_t i = 0; i + n <= hay.size(); ++i) {
    size_t k = 0;
    while (k < n && hay[i + k] == needle[k]) ++k;
    if (k == n) return true;
  }
  return false;
}

// Text a user must never see in an error: what the C++ library and nlohmann::json put in their
// exceptions (std::stoi's "stoi", vector::at's "_M_range_check", json's "[json.exception.*]").
__attribute__((no_sanitize("coverage"))) inline const char* library_text(const std::string& msg) {
  for (const char* bad : {"[json.exception.", "_M_range_check", "basic_string::_M_", "(which is", "std::bad_",
                          "std::exception", "std::logic_error", "std::out_of_range"})
    if (contains(msg, bad)) return bad;
  for (const char* whole : {"stoi", "stol", "stoll", "stoul", "stoull", "stof", "stod", "stold", "map::at",
                            "unordered_map::at", "vector", "basic_string::substr"})
    if (msg.size() == std::char_traits<char>::length(whole) && contains(msg, whole)) return whole;
  return nullptr;
}

// Checks one refusal against the contract. `file`: what the message must name ("" = nothing).
// Messages may hold several lines only where they echo the file's own text.
__attribute__((no_sanitize("coverage"))) inline void check_message(const char* target, const std::exception& e, const std::string& file) {
  const std::string msg = e.what(), type = type_name(typeid(e));
  if (msg.empty()) crash(target, "empty message", type, msg);
  if (const char* bad = library_text(msg)) crash(target, std::string("library text '") + bad + "' in the message", type, msg);
  if (!file.empty() && !contains(msg, file.c_str()))
    crash(target, "message does not name the file " + file, type, msg);
}

// Runs `body`; returns whether it completed (false: refused within the contract). Aborts on
// anything else.
template <class Body>
bool expect_clear(const char* target, const std::string& file, Body&& body) {
  try {
    body();
    return true;
  } catch (const std::invalid_argument& e) {
    check_message(target, e, file);
  } catch (const std::runtime_error& e) {
    check_message(target, e, file);
  } catch (const std::exception& e) {
    crash(target, "an exception the command line does not report as a clear error", type_name(typeid(e)), e.what());
  } catch (...) {
    crash(target, "a non-standard exception", "?", "");
  }
  return false;
}

}  // namespace mt::fuzz
