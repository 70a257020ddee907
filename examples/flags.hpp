#pragma once
// The examples' command-line flags: `--name value`, or the fallback.

#include <string>

namespace example {

inline std::string flag(int argc, char** argv, const std::string& name, const std::string& fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (argv[i] == "--" + name) return argv[i + 1];
  return fallback;
}

}  // namespace example
