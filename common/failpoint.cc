#include "common/failpoint.h"

#include <signal.h>

#include <chrono>
#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>

#include <spdlog/spdlog.h>

namespace tandem {
namespace {

const std::map<std::string, std::string, std::less<>>& Table() {
  static const auto* table = [] {
    auto* t = new std::map<std::string, std::string, std::less<>>();
    const char* env = std::getenv("TANDEM_FAILPOINTS");
    if (env == nullptr) return t;
    std::string_view rest(env);
    while (!rest.empty()) {
      const size_t comma = rest.find(',');
      const std::string_view item = rest.substr(0, comma);
      rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
      if (item.empty()) continue;
      const size_t eq = item.find('=');
      const std::string name(item.substr(0, eq));
      const std::string value(eq == std::string_view::npos ? "" : item.substr(eq + 1));
      (*t)[name] = value;
      spdlog::warn("failpoint {}={} is set (TANDEM_FAILPOINTS): this process will fail on purpose", name, value);
    }
    return t;
  }();
  return *table;
}

}  // namespace

std::optional<std::string> FailpointValue(std::string_view name) {
  const auto& t = Table();
  if (t.empty()) return std::nullopt;
  auto it = t.find(name);
  if (it == t.end()) return std::nullopt;
  return it->second;
}

std::optional<uint64_t> FailpointNumber(std::string_view name) {
  auto v = FailpointValue(name);
  if (!v) return std::nullopt;
  char* end = nullptr;
  const unsigned long long n = std::strtoull(v->c_str(), &end, 10);
  if (v->empty() || end == nullptr || *end != '\0') {
    static std::once_flag warned;
    std::call_once(warned, [&] { spdlog::error("failpoint {}: '{}' is not a number; ignored", name, *v); });
    return std::nullopt;
  }
  return static_cast<uint64_t>(n);
}

void FailpointCrashSoon(const std::string& why, int delay_ms) {
  spdlog::error("failpoint: {}; dying with SIGKILL in {} ms", why, delay_ms);
  spdlog::default_logger()->flush();
  std::thread([delay_ms] {
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    ::raise(SIGKILL);
  }).detach();
}

}  // namespace tandem
