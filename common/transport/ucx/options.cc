#include "common/transport/ucx/options.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <set>

#include <net/if.h>

namespace tandem::transport {
namespace ucx {
namespace {

using std::chrono::microseconds;
using std::chrono::milliseconds;

const std::set<std::string>& ShmTransports() {
  static const std::set<std::string> names = {"posix", "sysv", "mm", "cma", "knem", "xpmem", "sm", "shm"};
  return names;
}
const std::set<std::string>& NetTransports() {
  static const std::set<std::string> names = {"tcp",  "ib",      "rc", "rc_v", "rc_verbs",
                                              "rc_x", "rc_mlx5", "ud", "ud_v", "ud_verbs",
                                              "ud_x", "ud_mlx5", "dc", "dc_x", "dc_mlx5"};
  return names;
}
// GPU memory transports serve both workers.
const std::set<std::string>& GpuTransports() {
  static const std::set<std::string> names = {"cuda", "cuda_copy", "cuda_ipc", "gdr_copy",
                                              "rocm", "rocm_copy", "rocm_ipc", "rocm_gdr"};
  return names;
}
// Shared-memory transports that copy once, by rendezvous (the rest copy through
// segments).
bool SingleCopy(const std::string& name) {
  return name == "cma" || name == "knem" || name == "xpmem" || name == "sm" || name == "shm";
}

}  // namespace

std::string Trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  return s.substr(i);
}

std::vector<std::string> SplitList(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (c == ',') {
      out.push_back(Trim(cur));
      cur.clear();
    } else {
      cur.push_back(c);
    }
  }
  out.push_back(Trim(cur));
  return out;
}

std::string Join(const std::vector<std::string>& v, const char* sep) {
  std::string out;
  for (const auto& s : v) {
    if (!out.empty()) out += sep;
    out += s;
  }
  return out;
}

Result<TlsPlan> PlanTls(const std::string& tls, bool prefer_copy_shm) {
  // cma is built into Linux; knem and xpmem are kernel modules UCX uses only
  // where they are loaded.
  std::vector<std::string> default_shm = {"posix", "sysv"};
  if (!prefer_copy_shm) {
    default_shm.push_back("cma");
    if (access("/dev/knem", F_OK) == 0) default_shm.push_back("knem");
    if (access("/dev/xpmem", F_OK) == 0) default_shm.push_back("xpmem");
  }
  TlsPlan plan;
  const std::string trimmed = Trim(tls);
  const bool exclude = !trimmed.empty() && trimmed[0] == '^';
  std::vector<std::string> names;
  if (!trimmed.empty() && trimmed != "all") {
    names = SplitList(exclude ? trimmed.substr(1) : trimmed);
    for (const auto& n : names) {
      const bool known = ShmTransports().count(n) > 0 || NetTransports().count(n) > 0 || GpuTransports().count(n) > 0 ||
                         n == "self" || n == "all";
      if (!known) {
        std::vector<std::string> all(ShmTransports().begin(), ShmTransports().end());
        all.insert(all.end(), NetTransports().begin(), NetTransports().end());
        all.insert(all.end(), GpuTransports().begin(), GpuTransports().end());
        all.push_back("self");
        return InvalidArgument("tls: unknown UCX transport '{}' in '{}' (known: {})", n, tls, Join(all, ", "));
      }
    }
  }
  std::vector<std::string> shm, net;
  if (trimmed.empty() || trimmed == "all") {
    shm = default_shm;
    net = {"^sm", "self"};
  } else if (exclude) {
    std::set<std::string> excluded(names.begin(), names.end());
    const bool all_shm = excluded.count("sm") > 0 || excluded.count("shm") > 0;
    for (const auto& n : default_shm) {
      const bool mm = (n == "posix" || n == "sysv" || n == "xpmem") && excluded.count("mm") > 0;
      if (!all_shm && !mm && excluded.count(n) == 0) shm.push_back(n);
    }
    net = {"^sm", "self"};
    for (const auto& n : names) {
      if (NetTransports().count(n) > 0 || GpuTransports().count(n) > 0) net.push_back(n);
    }
  } else {
    std::vector<std::string> gpu;
    for (const auto& n : names) {
      if (n == "all") return InvalidArgument("tls: 'all' cannot be combined with other transports ('{}')", tls);
      if (ShmTransports().count(n) > 0) shm.push_back(n);
      if (NetTransports().count(n) > 0) net.push_back(n);
      if (GpuTransports().count(n) > 0) gpu.push_back(n);
    }
    plan.explicit_shm = !shm.empty();
    plan.explicit_net = !net.empty();
    if (!shm.empty()) shm.insert(shm.end(), gpu.begin(), gpu.end());
    if (!net.empty()) net.insert(net.end(), gpu.begin(), gpu.end());
  }
  plan.shm = Join(shm);
  plan.net = Join(net);
  plan.shm_eager_only = !shm.empty() && std::none_of(shm.begin(), shm.end(), SingleCopy);
  return plan;
}

Status CheckNetDevices(const std::string& devices) {
  if (devices.empty() || devices == "all") return Status::Ok();
  if (Trim(devices) == "auto") {
    return InvalidArgument(
        "net_devices: 'auto' is for the daemons to resolve from their listen address "
        "(ResolveNetDevices); a transport takes device names or 'all'");
  }
  std::vector<std::string> have;
  if (struct if_nameindex* list = if_nameindex(); list != nullptr) {
    for (auto* i = list; i->if_index != 0; ++i) have.emplace_back(i->if_name);
    if_freenameindex(list);
  }
  for (const auto& d : SplitList(devices)) {
    const bool charset_ok = !d.empty() && std::all_of(d.begin(), d.end(), [](char c) {
      return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.' || c == ':';
    });
    if (!charset_ok) return InvalidArgument("net_devices: '{}' is not a device name (in '{}')", d, devices);
    const std::string name = d.substr(0, d.find(':'));  // "mlx5_0:1" names port 1 of mlx5_0
    if (if_nametoindex(name.c_str()) != 0) continue;
    if (access(("/sys/class/infiniband/" + name).c_str(), F_OK) == 0) continue;
    return InvalidArgument("net_devices: this host has no network device '{}' (it has: {})", d, Join(have, ", "));
  }
  return Status::Ok();
}

Status ValidateOptions(const UcxOptions& o) {
  if (o.progress != UcxProgressMode::kAdaptive && o.progress != UcxProgressMode::kBusyPoll) {
    return InvalidArgument("progress: unknown mode {}", static_cast<int>(o.progress));
  }
  if (o.spin < microseconds(0) || o.spin > milliseconds(10)) {
    return InvalidArgument("spin: {} us is out of range (0 to 10000 us)", o.spin.count());
  }
  if (o.liveness_interval < milliseconds(1) || o.liveness_interval > milliseconds(10000)) {
    return InvalidArgument("liveness_interval: {} ms is out of range (1 to 10000 ms)", o.liveness_interval.count());
  }
  if (o.keepalive_interval < milliseconds(10) || o.keepalive_interval > std::chrono::hours(1)) {
    return InvalidArgument("keepalive_interval: {} ms is out of range (10 ms to 1 h)", o.keepalive_interval.count());
  }
  if (o.close_timeout < milliseconds(0) || o.close_timeout > milliseconds(60000)) {
    return InvalidArgument("close_timeout: {} ms is out of range (0 to 60000 ms)", o.close_timeout.count());
  }
  if (o.abandon_timeout < milliseconds(1) || o.abandon_timeout > std::chrono::hours(1)) {
    return InvalidArgument("abandon_timeout: {} ms is out of range (1 ms to 1 h)", o.abandon_timeout.count());
  }
  if (o.hostname.size() > 255 || std::any_of(o.hostname.begin(), o.hostname.end(), [](char c) {
        return std::isspace(static_cast<unsigned char>(c)) || std::iscntrl(static_cast<unsigned char>(c));
      })) {
    return InvalidArgument("hostname: '{}' is not a host name (at most 255 bytes, no spaces)", o.hostname);
  }
  return Status::Ok();
}

}  // namespace ucx

Status CheckUcxOptions(const UcxOptions& options) {
  TANDEM_RETURN_IF_ERROR(ucx::ValidateOptions(options));
  TANDEM_RETURN_IF_ERROR(ucx::PlanTls(options.tls, options.prefer_copy_shm).status());
  return ucx::CheckNetDevices(options.net_devices);
}

}  // namespace tandem::transport
