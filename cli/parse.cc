#include <fmt/format.h>

#include "cli/commands.h"

namespace tandem::cli {

int ParseOrExit(OptionSet& options, int argc, char** argv) {
  std::string output;
  auto parsed = options.Parse(argc, argv, &output);
  if (!parsed.ok()) {
    fmt::print(stderr, "{}: {}\n", options.program(), parsed.status().message());
    return 2;
  }
  if (*parsed == OptionSet::Outcome::kExit) {
    fmt::print("{}", output);
    return 0;
  }
  return -1;
}

}  // namespace tandem::cli
