#include <algorithm>
#include <cmath>

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

std::string JsonNumber(std::optional<double> v, int precision) {
  if (!v || !std::isfinite(*v)) return "null";
  return fmt::format("{:.{}g}", *v, precision);
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t m = v.size();
  return m % 2 ? v[m / 2] : 0.5 * (v[m / 2 - 1] + v[m / 2]);
}

std::vector<std::string> SplitList(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t comma = s.find(',', start);
    const std::string item = s.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (!item.empty()) out.push_back(item);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

}  // namespace tandem::cli
