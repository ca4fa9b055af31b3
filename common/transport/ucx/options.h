// UcxOptions checked and turned into what each UCX context is opened with:
// which transports go to the shared-memory worker and which to the network
// worker (see ucx_transport.h), plus the string helpers they share.
//
// Thread safety: pure functions (CheckNetDevices reads the host's devices).
#pragma once

#include <string>
#include <vector>

#include "common/status.h"
#include "common/transport/ucx_transport.h"

namespace tandem::transport::ucx {

std::string Trim(std::string s);
// "a, b,c" -> {"a", "b", "c"}.
std::vector<std::string> SplitList(const std::string& s);
std::string Join(const std::vector<std::string>& v, const char* sep = ",");

// What each worker is opened with. Empty: no such worker.
struct TlsPlan {
  std::string shm;
  std::string net;
  bool shm_eager_only = false;  // no single-copy transport: copy through segments, eagerly
  bool explicit_shm = false;    // the caller named shared-memory transports
  bool explicit_net = false;    // the caller named network transports
};

// Splits UcxOptions::tls between the two workers; INVALID_ARGUMENT names an
// unknown transport.
Result<TlsPlan> PlanTls(const std::string& tls, bool prefer_copy_shm);
// INVALID_ARGUMENT names a device this host lacks.
Status CheckNetDevices(const std::string& devices);
// The ranges of UcxOptions.
Status ValidateOptions(const UcxOptions& o);

}  // namespace tandem::transport::ucx
