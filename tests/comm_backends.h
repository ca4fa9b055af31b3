// The communicator backends the shared communicator suite
// (communicator_test.cc) runs over. Each backend builds a group of
// communicators whose ranks run as threads of the test process, and says
// whether it can make a rank die mid-run.
//
// Adding a backend: write a function returning its Backend (next to
// LocalBackend below, or in a header of its own included here) and add one
// line in the marked place in AllBackends(). The suite then runs every
// collective, every failure test and every world size over it.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/rendezvous.h"
#include "common/status.h"
#include "common/transport/local_transport.h"
#include "worker/comm/communicator.h"
#include "worker/comm/factory.h"
#include "worker/comm/shm_communicator.h"
#include "worker/comm/transport_communicator.h"

namespace tandem::comm_test {

// The communicators of one group, comms[r] being rank r.
struct Group {
  std::vector<std::unique_ptr<comm::Communicator>> comms;
  // Makes `rank` die as a process would: its peers' operations with it fail.
  // Null when the backend cannot (supports_kill is false).
  std::function<void(int rank)> kill;
  // Whatever the group needs kept alive besides the communicators (a fabric,
  // a rendezvous, a directory); released after the communicators.
  std::shared_ptr<void> keep;

  Group() = default;
  Group(Group&&) = default;
  Group& operator=(Group&&) = default;
  ~Group() { comms.clear(); }  // before `keep`
};

struct Backend {
  // Used in test names: letters, digits and '_' only.
  std::string name;
  // Builds a group of `world` communicators from `base` (the factory sets
  // rank and size). The suite gives every group a distinct base.name within
  // the process, so a backend may derive segment or rendezvous keys from
  // (base.name, base.epoch). A backend whose construction waits for the
  // peers (a rendezvous) constructs the ranks on threads.
  std::function<Result<Group>(int world, const comm::CommInfo& base)> make_group;
  // Whether Group::kill works.
  bool supports_kill = false;
};

// TransportCommunicator over an in-process LocalFabric; kill is
// LocalFabric::Kill.
inline Backend LocalBackend(std::string name = "local", comm::TransportCommunicatorOptions options = {}) {
  Backend backend;
  backend.name = std::move(name);
  backend.supports_kill = true;
  backend.make_group = [options](int world, const comm::CommInfo& base) -> Result<Group> {
    auto fabric = transport::LocalFabric::Create(world);
    Group group;
    for (int r = 0; r < world; ++r) {
      comm::CommInfo info = base;
      info.rank = r;
      info.size = world;
      TANDEM_ASSIGN_OR_RETURN(auto communicator,
                              comm::TransportCommunicator::Create(info, fabric->Connect(r), options));
      group.comms.push_back(std::move(communicator));
    }
    group.kill = [fabric](int rank) { fabric->Kill(rank); };
    group.keep = fabric;
    return group;
  };
  return backend;
}

// Constructs rank r of a group of `world` with make(info of rank r) on a
// thread of its own (constructors that wait for their peers need this).
template <typename T>
Result<std::vector<std::unique_ptr<T>>> ConstructOnThreads(
    int world, const comm::CommInfo& base,
    const std::function<Result<std::unique_ptr<T>>(const comm::CommInfo&)>& make) {
  std::vector<Result<std::unique_ptr<T>>> made;
  for (int r = 0; r < world; ++r) made.emplace_back(Internal("rank {} not constructed", r));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      comm::CommInfo info = base;
      info.rank = r;
      info.size = world;
      made[static_cast<size_t>(r)] = make(info);
    });
  }
  for (auto& t : threads) t.join();
  std::vector<std::unique_ptr<T>> out;
  for (auto& m : made) {
    TANDEM_RETURN_IF_ERROR(m.status());
    out.push_back(std::move(m).value());
  }
  return out;
}

// ShmCommunicator with its ranks as threads; small rounds, so that the
// suite's element counts run the multi-round, streaming and single-step paths
// alike. kill is KillForTesting (the rank looks dead to its peers).
inline Backend ShmBackend() {
  Backend backend;
  backend.name = "shm";
  backend.supports_kill = true;
  backend.make_group = [](int world, const comm::CommInfo& base) -> Result<Group> {
    comm::ShmOptions options;
    options.round_bytes = 4096;
    options.small_bytes = 256;
    options.stream_bytes = 16 << 10;
    options.p2p_slot_bytes = 1024;
    auto rendezvous = std::make_shared<comm::MemoryRendezvous>();
    TANDEM_ASSIGN_OR_RETURN(auto made,
                            ConstructOnThreads<comm::ShmCommunicator>(world, base, [&](const comm::CommInfo& info) {
                              return comm::ShmCommunicator::Create(info, *rendezvous, options);
                            }));
    Group group;
    std::vector<comm::ShmCommunicator*> raw;
    for (auto& m : made) {
      raw.push_back(m.get());
      group.comms.push_back(std::move(m));
    }
    group.kill = [raw](int rank) { raw[static_cast<size_t>(rank)]->KillForTesting(); };
    group.keep = rendezvous;
    return group;
  };
  return backend;
}

// The "ucx" backend of the factory with its ranks as threads, each with its
// own UCX transport, addresses exchanged in memory, TCP confined to lo. A
// thread cannot die as a process does, so kill is not supported here
// (ucx_transport_test kills a real peer process).
inline Backend UcxBackend() {
  Backend backend;
  backend.name = "ucx";
  backend.supports_kill = false;
  backend.make_group = [](int world, const comm::CommInfo& base) -> Result<Group> {
    comm::BackendOptions options;
    options.ucx.net_devices = "lo";
    auto rendezvous = std::make_shared<comm::MemoryRendezvous>();
    TANDEM_ASSIGN_OR_RETURN(auto made,
                            ConstructOnThreads<comm::Communicator>(world, base, [&](const comm::CommInfo& info) {
                              return comm::CreateCommunicator("ucx", info, *rendezvous, options);
                            }));
    Group group;
    for (auto& m : made) group.comms.push_back(std::move(m));
    group.keep = rendezvous;
    return group;
  };
  return backend;
}

inline const std::vector<Backend>& AllBackends() {
  static const std::vector<Backend> backends = [] {
    std::vector<Backend> all;
    all.push_back(LocalBackend());
    // ---- Other backends register here, one line each (with their include
    // above, guarded by their build option where they need one):
    all.push_back(ShmBackend());
    all.push_back(UcxBackend());
    // ---- End of registrations.
    return all;
  }();
  return backends;
}

}  // namespace tandem::comm_test
