// Logging: one readable line per event, to stderr.
//
//   2026-11-21 01:30:48.123 I coordinator  listening for gRPC on 127.0.0.1:7400
//
// Tandem logs through spdlog's default logger; SetupLogging() installs it with
// the format above, the component name and the level from the configuration
// (`log.level`: trace, debug, info, warn, error). Call it once at start-up.
//
// Thread safety: logging calls are thread-safe; SetupLogging is not.
#pragma once

#include <string>

#include <spdlog/spdlog.h>

#include "common/status.h"

namespace tandem {

inline const std::vector<std::string>& LogLevels() {
  static const std::vector<std::string> levels = {"trace", "debug", "info", "warn", "error"};
  return levels;
}

// `component` names the process in every line ("coordinator", "server-1").
Status SetupLogging(const std::string& component, const std::string& level);

}  // namespace tandem
