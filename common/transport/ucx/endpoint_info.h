// What UCX says about an endpoint or a context (ucp_ep_print_info,
// ucp_context_print_info), parsed for Connect's start-up self-check: which
// transports and devices carry eager messages and rendezvous (see
// ucx_transport.h).
//
// Thread safety: plain values and functions; the UCX calls need the holder
// of the progress role (see core.h).
#pragma once

#include <cstdint>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include <ucp/api/ucp.h>

namespace tandem::transport::ucx {

std::string EndpointInfoText(ucp_ep_h ep);
std::string ContextInfoText(ucp_context_h context);

// rc*, ud*, dc*: the InfiniBand/RoCE transports.
bool IsVerbs(const std::string& tl);

struct Lane {
  std::string transport;  // "sysv"
  std::string device;     // "memory"
  std::set<std::string> roles;
  std::string Name() const;  // "sysv/memory (shared memory)"
};

struct EndpointPaths {
  std::vector<Lane> lanes;
  bool rendezvous = false;
  uint64_t rendezvous_from = 0;  // bytes

  bool Any(const std::function<bool(const Lane&)>& f) const;
  bool OnlyTcp() const;
  bool HasNetworkLane() const;
  // The lanes with either role, " + "-separated ("no lane" when none).
  std::string Lanes(const char* role1, const char* role2 = nullptr) const;
  // "eager via ... up to N B, rendezvous above via ...".
  std::string Describe() const;
};

// Parses ucp_ep_print_info's text.
EndpointPaths ParseEndpointInfo(const std::string& text);

}  // namespace tandem::transport::ucx
