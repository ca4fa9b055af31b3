// The address a rank publishes (UcxTransport::address()): a small Tandem
// envelope around its packed UCX worker addresses, with what Connect needs to
// tell peers on this host apart before it creates any endpoint (see
// ucx_transport.h).
//
// Thread safety: plain values and pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace tandem::transport::ucx {

// What a rank publishes: who it is and its UCX worker addresses.
struct Identity {
  uint32_t pid = 0;
  uint64_t start_ticks = 0;
  uint64_t pid_namespace = 0;  // inode of /proc/self/ns/pid, 0 if unknown
  uint64_t net_namespace = 0;  // inode of the network namespace UCX's sockets are in, 0 if unknown
  std::string hostname;
  std::string boot_id;
  bool has_verbs = false;
  std::string shm_address;  // empty: no shared-memory worker
  std::string net_address;  // empty: no network worker
};

std::string EncodeIdentity(const Identity& id);
// Empty error on success.
std::string DecodeIdentity(std::string_view in, Identity* id);

}  // namespace tandem::transport::ucx
