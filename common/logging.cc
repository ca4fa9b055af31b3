#include "common/logging.h"

#include <spdlog/sinks/stdout_sinks.h>

namespace tandem {

Status SetupLogging(const std::string& component, const std::string& level) {
  const spdlog::level::level_enum parsed = spdlog::level::from_str(level);
  if (parsed == spdlog::level::off && level != "off") {
    return InvalidArgument("log.level: expected one of trace, debug, info, warn, error; got '{}'", level);
  }
  auto logger = std::make_shared<spdlog::logger>(component, std::make_shared<spdlog::sinks::stderr_sink_mt>());
  // Time in UTC with milliseconds, a one-letter level, the component, the message.
  logger->set_pattern(fmt::format("%Y-%m-%d %H:%M:%S.%e %L {:<12} %v", component), spdlog::pattern_time_type::utc);
  logger->set_level(parsed);
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(std::move(logger));
  return Status::Ok();
}

}  // namespace tandem
