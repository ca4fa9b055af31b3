#include "common/transport/ucx/net_device.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <net/if.h>

#include "common/config.h"
#include "common/logging.h"
#include "common/transport/ucx/endpoint_info.h"
#include "common/transport/ucx/options.h"

namespace tandem::transport::ucx {
namespace {

namespace fs = std::filesystem;

// A numeric address: family and bytes (an IPv4-mapped IPv6 address as IPv4).
struct Ip {
  int family = AF_UNSPEC;
  unsigned char bytes[16] = {};
};

bool ParseIp(std::string text, Ip* ip) {
  if (const size_t zone = text.find('%'); zone != std::string::npos) text.resize(zone);
  if (inet_pton(AF_INET, text.c_str(), ip->bytes) == 1) {
    ip->family = AF_INET;
    return true;
  }
  if (inet_pton(AF_INET6, text.c_str(), ip->bytes) != 1) return false;
  static const unsigned char kMapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  if (std::memcmp(ip->bytes, kMapped, sizeof(kMapped)) == 0) {
    std::memmove(ip->bytes, ip->bytes + 12, 4);
    std::memset(ip->bytes + 4, 0, 12);
    ip->family = AF_INET;
  } else {
    ip->family = AF_INET6;
  }
  return true;
}

size_t Length(const Ip& ip) {
  return ip.family == AF_INET ? 4 : 16;
}

bool IsWildcard(const Ip& ip) {
  const size_t n = Length(ip);
  return std::all_of(ip.bytes, ip.bytes + n, [](unsigned char b) { return b == 0; });
}

std::string ReadTrimmed(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream buf;
  buf << in.rdbuf();
  return Trim(buf.str());
}

// Which kinds of network device the transports `tls` (UCX_TLS syntax) can
// use: interfaces (tcp) and RDMA ports (verbs).
struct Kinds {
  bool tcp = true;
  bool rdma = true;
};

Kinds KindsOf(const std::string& tls) {
  const std::string t = Trim(tls);
  if (t.empty() || t == "all") return {};
  const bool exclude = t[0] == '^';
  bool tcp = false;
  bool rdma = false;
  for (const auto& name : SplitList(exclude ? t.substr(1) : t)) {
    if (name == "tcp") tcp = true;
    if (name == "ib" || IsVerbs(name)) rdma = true;
  }
  if (exclude) return {!tcp, !rdma};  // "^ib" leaves tcp; "^rc" alone still leaves ud
  return {tcp, rdma};
}

}  // namespace

std::string InterfaceCarrying(const std::string& text) {
  Ip want;
  if (!ParseIp(text, &want)) return "";
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return "";
  std::string found;
  std::string loopback;
  for (const ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || i->ifa_name == nullptr) continue;
    if ((i->ifa_flags & IFF_LOOPBACK) != 0 && loopback.empty()) loopback = i->ifa_name;
    const int family = i->ifa_addr->sa_family;
    if (family != want.family) continue;
    const void* bytes = family == AF_INET
                            ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(i->ifa_addr)->sin_addr)
                            : static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(i->ifa_addr)->sin6_addr);
    if (std::memcmp(bytes, want.bytes, Length(want)) == 0) {
      found = i->ifa_name;
      break;
    }
  }
  freeifaddrs(list);
  if (found.empty() && want.family == AF_INET && want.bytes[0] == 127) found = loopback;
  // An IPv4 alias is listed under its label ("eth0:1"); UCX knows the device.
  return found.substr(0, found.find(':'));
}

std::vector<std::string> RdmaPortsOf(const std::string& ifname, const std::string& sysfs) {
  std::set<std::string> ports;
  std::error_code ec;
  const fs::path ib = fs::path(sysfs) / "class" / "infiniband";
  // IPoIB: the interface's device is an HCA, and dev_port says which port (from 0).
  const fs::path net = fs::path(sysfs) / "class" / "net" / ifname;
  std::string ipoib_port;
  if (ReadTrimmed(net / "type") == "32") {  // ARPHRD_INFINIBAND
    int dev_port = 0;
    std::istringstream(ReadTrimmed(net / "dev_port")) >> dev_port;
    ipoib_port = std::to_string(dev_port + 1);
  }
  try {
    for (const auto& dev : fs::directory_iterator(ib, ec)) {
      const std::string name = dev.path().filename().string();
      for (const auto& port : fs::directory_iterator(dev.path() / "ports", ec)) {
        if (ReadTrimmed(port.path() / "state").find("ACTIVE") == std::string::npos) continue;
        const std::string p = port.path().filename().string();
        bool bound = !ipoib_port.empty() && p == ipoib_port && fs::exists(net / "device" / "infiniband" / name, ec);
        for (const auto& ndev : fs::directory_iterator(port.path() / "gid_attrs" / "ndevs", ec)) {
          if (bound) break;
          bound = ReadTrimmed(ndev.path()) == ifname;  // RoCE: a GID on this interface
        }
        if (bound) ports.insert(name + ":" + p);
      }
    }
  } catch (const fs::filesystem_error&) {
    // A device went away while listed: what was found so far.
  }
  return {ports.begin(), ports.end()};
}

NetDeviceChoice ChooseNetDevices(const std::string& setting, const std::string& listen_host, const std::string& tls,
                                 const std::string& sysfs) {
  NetDeviceChoice choice;
  const std::string s = Trim(setting);
  if (!s.empty() && s != "auto") {
    choice.devices = s;
    choice.why =
        s == "all" ? "all network devices, as configured" : fmt::format("network devices {}, as configured", s);
    return choice;
  }
  auto fall_back = [&](std::string why, bool warn) {
    choice.devices = "all";
    choice.why = fmt::format("all network devices: {}", why);
    choice.fallback = true;
    choice.warn = warn;
    return choice;
  };
  std::vector<std::string> addresses;
  if (Ip ip; ParseIp(listen_host, &ip)) {
    if (IsWildcard(ip)) {
      return fall_back(fmt::format("the listen address {} is a wildcard, which no one interface carries "
                                   "(listen on this host's address, or name the devices, to keep UCX off the rest)",
                                   listen_host),
                       false);
    }
    addresses.push_back(listen_host);
  } else {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    if (getaddrinfo(listen_host.c_str(), nullptr, &hints, &res) == 0) {
      for (const addrinfo* a = res; a != nullptr; a = a->ai_next) {
        char text[INET6_ADDRSTRLEN] = {};
        const void* bytes =
            a->ai_family == AF_INET
                ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(a->ai_addr)->sin_addr)
                : static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(a->ai_addr)->sin6_addr);
        if ((a->ai_family == AF_INET || a->ai_family == AF_INET6) &&
            inet_ntop(a->ai_family, bytes, text, sizeof(text)) != nullptr) {
          addresses.emplace_back(text);
        }
      }
      freeaddrinfo(res);
    }
  }
  std::string ifname;
  std::string address;
  for (const auto& a : addresses) {
    ifname = InterfaceCarrying(a);
    address = a;
    if (!ifname.empty()) break;
  }
  if (ifname.empty()) {
    return fall_back(
        addresses.empty()
            ? fmt::format("the listen address {} does not resolve to an address", listen_host)
            : fmt::format("no interface of this host carries the listen address {}", Join(addresses, ", ")),
        true);
  }
  const Kinds kinds = KindsOf(tls);
  std::vector<std::string> devices;
  if (kinds.tcp) devices.push_back(ifname);
  if (kinds.rdma) {
    for (auto& port : RdmaPortsOf(ifname, sysfs)) devices.push_back(std::move(port));
  }
  const std::string carries = address == listen_host ? fmt::format("the listen address {}", listen_host)
                                                     : fmt::format("the listen address {} ({})", listen_host, address);
  if (devices.empty()) {
    return fall_back(fmt::format("{} is on {}, which the transports '{}' cannot use", carries, ifname, tls), true);
  }
  choice.devices = Join(devices);
  choice.why = fmt::format("network devices {}: {} carries {}", choice.devices, ifname, carries);
  return choice;
}

std::string ResolveNetDevices(const std::string& setting, const std::string& listen_address, const std::string& tls,
                              const std::string& option) {
  auto hp = ParseHostPort(listen_address);
  const NetDeviceChoice choice = ChooseNetDevices(setting, hp.ok() ? hp->host : listen_address, tls);
  if (choice.warn) {
    spdlog::warn("ucx: {} ({}: {})", choice.why, option, Trim(setting).empty() ? "auto" : Trim(setting));
  } else {
    spdlog::info("ucx: {} ({}: {})", choice.why, option, Trim(setting).empty() ? "auto" : Trim(setting));
  }
  return choice.devices;
}

}  // namespace tandem::transport::ucx
