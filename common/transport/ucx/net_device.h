// Which network devices a daemon's UCX transports use by default: the
// interface that carries the address the daemon listens on, not every
// interface of the host. Other jobs on the same host create and delete veth
// pairs and bridges; UCX left to UCX_NET_DEVICES=all opens TCP lanes over
// them too, and a lane over an interface that goes away breaks the
// connection (the peer is taken for dead).
//
// The daemons' option (data_plane.ucx_net_devices, server.ucx_net_devices)
// takes:
//   auto (the default; empty means the same): the interface whose addresses
//       include the listen address's host, plus the active RDMA ports bound
//       to that interface (RoCE GIDs, IPoIB), so that verbs lanes stay on the
//       same rail. All devices when the host is a wildcard (0.0.0.0, ::),
//       when no interface carries it, or when the transports chosen
//       (ucx_tls) could use none of the devices found.
//   all: every device (UCX_NET_DEVICES=all).
//   a list ("eth0", "mlx5_0:1,mlx5_1:1"): as given.
// UcxOptions::net_devices itself takes no "auto": the daemon resolves it
// (ResolveNetDevices) before it opens a transport.
//
// Thread safety: pure functions over the host's interfaces (getifaddrs, sysfs).
#pragma once

#include <string>
#include <vector>

namespace tandem::transport::ucx {

// The name of the interface one of whose addresses is `ip`, a numeric IPv4
// or IPv6 address (an IPv4-mapped IPv6 address counts as its IPv4 address;
// an IPv6 zone, "fe80::1%eth0", is ignored). An address in 127.0.0.0/8 that
// no interface carries exactly goes to the loopback interface, which Linux
// routes the whole block to. Empty when no interface carries it or `ip` is
// not a numeric address.
std::string InterfaceCarrying(const std::string& ip);

// The active RDMA ports ("mlx5_0:1") bound to network interface `ifname`:
// RoCE ports with a GID on it, and the port behind an IPoIB interface.
// `sysfs` is the root of sysfs ("/sys"; tests pass a directory of their own).
std::vector<std::string> RdmaPortsOf(const std::string& ifname, const std::string& sysfs = "/sys");

struct NetDeviceChoice {
  std::string devices;    // for UcxOptions::net_devices: an interface (and its RDMA ports), "all", or the setting
  std::string why;        // one line for the log
  bool fallback = false;  // auto could not choose, so all devices
  bool warn = false;      // ... for a reason other than a wildcard listen address
};

// What `setting` (auto or empty, all, or a list) comes to for a process that
// listens on `listen_host` (the host part of its listen address: a numeric
// address or a name, which is resolved) and opens UCX with transports `tls`
// (UcxOptions::tls). Does not check a given list (CheckNetDevices does).
NetDeviceChoice ChooseNetDevices(const std::string& setting, const std::string& listen_host,
                                 const std::string& tls = "", const std::string& sysfs = "/sys");

// ChooseNetDevices for a daemon that listens on `listen_address` ("host:port"),
// with one log line: info, or a warning when auto found no interface carrying
// the address. `option` names the key in that line.
std::string ResolveNetDevices(const std::string& setting, const std::string& listen_address, const std::string& tls,
                              const std::string& option);

}  // namespace tandem::transport::ucx
