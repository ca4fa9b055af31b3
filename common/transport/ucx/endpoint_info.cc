#include "common/transport/ucx/endpoint_info.h"

#include <stdio.h>
#include <stdlib.h>

#include <algorithm>
#include <cstdlib>
#include <sstream>

#include "common/logging.h"
#include "common/transport/ucx/options.h"

namespace tandem::transport::ucx {
namespace {

// What `print` writes to a FILE, as a string.
std::string PrintToString(const std::function<void(FILE*)>& print) {
  char* buf = nullptr;
  size_t len = 0;
  FILE* f = open_memstream(&buf, &len);
  if (f == nullptr) return "";
  print(f);
  const bool closed = fclose(f) == 0;
  std::string out(closed && buf != nullptr ? buf : "", closed ? len : 0);
  free(buf);
  return out;
}

// "posix/memory" -> "shared memory".
std::string TransportKind(const std::string& tl) {
  if (tl == "posix" || tl == "sysv" || tl == "xpmem") return "shared memory";
  if (tl == "cma" || tl == "knem") return "single-copy shared memory";
  if (tl == "tcp") return "TCP";
  if (IsVerbs(tl)) return "verbs";
  if (tl == "self") return "loopback";
  if (tl.rfind("cuda", 0) == 0 || tl.rfind("rocm", 0) == 0 || tl == "gdr_copy") return "GPU";
  return tl;
}

}  // namespace

std::string EndpointInfoText(ucp_ep_h ep) {
  return PrintToString([ep](FILE* f) { ucp_ep_print_info(ep, f); });
}

std::string ContextInfoText(ucp_context_h context) {
  return PrintToString([context](FILE* f) { ucp_context_print_info(context, f); });
}

bool IsVerbs(const std::string& tl) {
  return tl.rfind("rc", 0) == 0 || tl.rfind("ud", 0) == 0 || tl.rfind("dc", 0) == 0;
}

std::string Lane::Name() const {
  return fmt::format("{}/{} ({})", transport, device, TransportKind(transport));
}

bool EndpointPaths::Any(const std::function<bool(const Lane&)>& f) const {
  return std::any_of(lanes.begin(), lanes.end(), f);
}

bool EndpointPaths::OnlyTcp() const {
  return !lanes.empty() && std::all_of(lanes.begin(), lanes.end(), [](const Lane& l) { return l.transport == "tcp"; });
}

bool EndpointPaths::HasNetworkLane() const {
  return Any([](const Lane& l) { return l.transport == "tcp" || IsVerbs(l.transport); });
}

std::string EndpointPaths::Lanes(const char* role1, const char* role2) const {
  std::vector<std::string> names;
  for (const auto& l : lanes) {
    if (l.roles.count(role1) > 0 || (role2 != nullptr && l.roles.count(role2) > 0)) {
      if (std::find(names.begin(), names.end(), l.Name()) == names.end()) names.push_back(l.Name());
    }
  }
  return names.empty() ? "no lane" : Join(names, " + ");
}

std::string EndpointPaths::Describe() const {
  if (lanes.empty()) return "UCX did not describe the endpoint";
  const std::string eager = Lanes("am", "am_bw");
  if (!rendezvous) return fmt::format("eager via {} at every size", eager);
  const bool zero_copy = Any([](const Lane& l) { return l.roles.count("rma_bw") > 0; });
  return fmt::format("eager via {} up to {} B, rendezvous above via {}{}", eager, rendezvous_from,
                     zero_copy ? Lanes("rma_bw") : Lanes("am_bw", "am"),
                     zero_copy ? " (zero-copy)" : " (copied through active messages)");
}

// Parses lines like
//   lane[0]:  2:sysv/memory.0 md[2]  -> md[2]/sysv/sysdev[255] am am_bw#0
//   tag_send: 0..<egr/short>..8185..<egr/zcopy>..20553..<rndv>..(inf)
EndpointPaths ParseEndpointInfo(const std::string& text) {
  EndpointPaths out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (const size_t lane = line.find("lane["); lane != std::string::npos) {
      const size_t colon = line.find("]:", lane);
      if (colon == std::string::npos) continue;
      std::istringstream words(line.substr(colon + 2));
      std::string first;
      words >> first;  // "2:sysv/memory.0"
      if (const size_t c = first.find(':'); c != std::string::npos) first = first.substr(c + 1);
      if (const size_t dot = first.rfind('.'); dot != std::string::npos) first = first.substr(0, dot);
      Lane l;
      const size_t slash = first.find('/');
      l.transport = first.substr(0, slash);
      l.device = slash == std::string::npos ? "" : first.substr(slash + 1);
      bool after_arrow = false;
      bool skipped_remote = false;
      for (std::string w; words >> w;) {
        if (w == "->") {
          after_arrow = true;
        } else if (after_arrow && !skipped_remote) {
          skipped_remote = true;  // "md[2]/sysv/sysdev[255]"
        } else if (after_arrow) {
          l.roles.insert(w.substr(0, w.find('#')));
        }
      }
      out.lanes.push_back(std::move(l));
    } else if (const size_t tag = line.find("tag_send:"); tag != std::string::npos) {
      const size_t rndv = line.find("..<rndv>", tag);
      if (rndv == std::string::npos) continue;
      const size_t start = line.rfind("..", rndv - 1);
      if (start == std::string::npos || start < tag) continue;
      out.rendezvous = true;
      out.rendezvous_from = std::strtoull(line.substr(start + 2, rndv - start - 2).c_str(), nullptr, 10);
    }
  }
  return out;
}

}  // namespace tandem::transport::ucx
