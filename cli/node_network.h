// The network of the simulated nodes of `tandem run` (docs/local-cluster.md).
//
// `tandem run` simulates K nodes on one machine. With network namespaces
// (root, and `ip` from iproute2 works), node k is its own Linux network
// namespace joined to the others by a bridge in the root namespace:
//
//   root namespace:  bridge tnd<pid>br 10.213.0.1/16  (the coordinator listens here)
//                      |-- veth tnd<pid>v0 <-> eth0 in namespace tnd<pid>n0: 10.213.1.2/16
//                      |-- veth tnd<pid>v1 <-> eth0 in namespace tnd<pid>n1: 10.213.2.2/16
//                      ...
//
// so traffic between nodes really crosses network interfaces (veth + bridge),
// and a node's 127.0.0.1 is its own. The /16 is the first of 10.213.0.0/16,
// 10.214.0.0/16, ... 10.254.0.0/16 that overlaps no address or route of the
// machine. Without namespaces every node is 127.0.0.1 and the daemons run
// as they always did.
//
// Processes of node k are started as exec_prefix(k) + argv (`ip netns exec
// NAME` execs the program: the PID is the daemon's own) and bind node_address(k).
//
// Lifetime: the destructor removes exactly what Create made (veths,
// namespaces, bridge); stop the processes started in the namespaces first.
// A `tandem` killed with SIGKILL leaves them behind; the next run with the
// same PID removes them, or `ip netns del tnd<pid>n<k>; ip link del tnd<pid>br`.
// One NodeNetwork with namespaces may exist per process at a time (the names
// derive from the PID).
//
// Thread safety: not thread-safe; the const accessors may be called from any
// thread once Create has returned.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace tandem::cli {

class NodeNetwork {
 public:
  // The most nodes with namespaces: node k is 10.X.(k+1).2.
  static constexpr int kMaxNamespaceNodes = 253;

  // mode: "auto" (namespaces when root and they work, else loopback, with a
  // warning saying why when namespaces were possible but failed), "netns"
  // (namespaces, or an error saying why not), "loopback".
  // Errors name the failing `ip` command and quote its output.
  static Result<std::unique_ptr<NodeNetwork>> Create(int nodes, const std::string& mode);
  ~NodeNetwork();  // tears down what Create made; never throws, logs failures
  NodeNetwork(const NodeNetwork&) = delete;
  NodeNetwork& operator=(const NodeNetwork&) = delete;

  int nodes() const { return nodes_; }
  bool namespaces() const { return namespaces_; }
  // Where a process in the root namespace (the coordinator) listens so that
  // every node reaches it: the bridge's IP, or 127.0.0.1.
  std::string host_address() const;
  // The IP processes of node k bind: its veth's IP in its namespace, or 127.0.0.1.
  // REQUIRES: 0 <= node < nodes()
  std::string node_address(int node) const;
  // What to put in front of a program's argv to run it on node k:
  // {"/usr/sbin/ip", "netns", "exec", "tnd1234n0"} (an absolute path, for
  // execve), or {} without namespaces. REQUIRES: 0 <= node < nodes()
  std::vector<std::string> exec_prefix(int node) const;
  // The namespace of node k ("tnd1234n0"), or "" without namespaces.
  std::string namespace_name(int node) const;
  // The bridge ("tnd1234br"), or "" without namespaces.
  std::string bridge_name() const;
  // One line for the user: "3 network namespaces tnd1234n0..2 on bridge
  // tnd1234br (10.213.0.0/16: host 10.213.0.1, node k 10.213.<k+1>.2)", or
  // "loopback: every node on 127.0.0.1 (not running as root)".
  std::string Describe() const;

  // Cuts node `node` off the others and the host (its veth's root end set
  // down), or joins it again (up): a network partition, as `tandem run
  // --inject partition:node-K@STEP/DURATION` makes one. Namespaces only.
  Status SetNodeLink(int node, bool up);

 private:
  NodeNetwork(int nodes, std::string loopback_reason);
  Status SetUp();
  Status CheckConnectivity() const;
  void TearDown();
  // Runs `ip ARGS`; on failure, says which command failed and what it printed.
  Result<std::string> Ip(const std::vector<std::string>& args) const;

  struct Created {
    bool is_namespace;  // else a link (bridge or veth) in the root namespace
    std::string name;
  };

  int nodes_;
  bool namespaces_ = false;
  std::string loopback_reason_;   // why not namespaces
  std::string ip_;                // path of the `ip` program
  std::string prefix_;            // "tnd1234"
  int subnet_ = 0;                // X of 10.X.0.0/16
  std::vector<Created> created_;  // in creation order; removed in reverse
};

}  // namespace tandem::cli
