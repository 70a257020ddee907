#pragma once
// The examples' command-line flags: `--name value`, or the fallback.

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>

namespace example {

inline std::string flag(int argc, char** argv, const std::string& name, const std::string& fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (argv[i] == "--" + name) return argv[i + 1];
  return fallback;
}

/// An integer flag; a value that is not one ends the program with a message.
inline std::int64_t flag(int argc, char** argv, const std::string& name, std::int64_t fallback) {
  const std::string text = flag(argc, argv, name, std::to_string(fallback));
  try {
    std::size_t used = 0;
    const std::int64_t value = std::stoll(text, &used);
    if (used == text.size()) return value;
  } catch (const std::exception&) {
  }
  std::fprintf(stderr, "--%s %s is not an integer\n", name.c_str(), text.c_str());
  std::exit(2);
}

}  // namespace example
