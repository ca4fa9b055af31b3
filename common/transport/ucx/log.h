// UCX's log messages go to spdlog ("ucx: ..."); see ucx_transport.h.
//
// Thread safety: InstallLogHandler may be called from any thread.
#pragma once

namespace tandem::transport::ucx {

// Set on the progress thread while it tears UCX down: UCX's warnings about
// requests still held for dead peers are expected then (logged at debug).
extern thread_local constinit bool t_quiet_ucx_warnings;

// Routes UCX's log messages to spdlog, once per process.
void InstallLogHandler();

}  // namespace tandem::transport::ucx
