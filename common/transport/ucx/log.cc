#include "common/transport/ucx/log.h"

#include <stdio.h>

#include <cstdarg>
#include <cstring>
#include <mutex>

#include <ucp/api/ucp.h>
#include <ucs/debug/log_def.h>

#include "common/logging.h"

namespace tandem::transport::ucx {

thread_local constinit bool t_quiet_ucx_warnings = false;

namespace {

__attribute__((format(printf, 6, 0))) ucs_log_func_rc_t LogToSpdlog(const char* file, unsigned line,
                                                                    const char* /*function*/, ucs_log_level_t level,
                                                                    const ucs_log_component_config_t* component,
                                                                    const char* format, va_list ap) {
  if (component != nullptr && level > component->log_level) return UCS_LOG_FUNC_RC_CONTINUE;
  if (level > UCS_LOG_LEVEL_TRACE_POLL) return UCS_LOG_FUNC_RC_CONTINUE;  // explicit prints (ucs_print) stay UCX's
  char text[1024];
  va_list copy;
  va_copy(copy, ap);
  if (vsnprintf(text, sizeof(text), format, copy) < 0) {
    text[0] = '\0';
  }
  va_end(copy);
  spdlog::level::level_enum out = spdlog::level::trace;
  switch (level) {
    case UCS_LOG_LEVEL_FATAL:
      out = spdlog::level::err;
      break;
    case UCS_LOG_LEVEL_ERROR:  // Tandem reports failures to its callers; UCX's
                               // view of them is a warning
      out = spdlog::level::warn;
      break;
    case UCS_LOG_LEVEL_WARN:
      out = t_quiet_ucx_warnings ? spdlog::level::debug : spdlog::level::warn;
      break;
    case UCS_LOG_LEVEL_DIAG:
    case UCS_LOG_LEVEL_INFO:
      out = spdlog::level::debug;
      break;
    default:
      break;
  }
  const char* base = std::strrchr(file, '/');
  spdlog::log(out, "ucx: {} ({}:{})", text, base != nullptr ? base + 1 : file, line);
  return UCS_LOG_FUNC_RC_STOP;
}

}  // namespace

void InstallLogHandler() {
  static std::once_flag once;
  std::call_once(once, [] { ucs_log_push_handler(&LogToSpdlog); });
}

}  // namespace tandem::transport::ucx
