// An in-process transport: the ranks of a group are threads of one process
// that exchange messages through shared mailboxes. It keeps every rule of
// transport.h, so collective algorithms are tested with it fast and without
// a network; Kill() makes a rank die as a process would.
//
// Thread safety: thread-safe.
#pragma once

#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "common/thread_annotations.h"
#include "common/transport/transport.h"

namespace tandem::transport {

class LocalFabric : public std::enable_shared_from_this<LocalFabric> {
 public:
  static std::shared_ptr<LocalFabric> Create(int size);
  // The transport of one rank. The fabric outlives it (shared ownership).
  std::unique_ptr<Transport> Connect(int rank);
  // Marks `rank` dead: its peers' operations with it fail.
  void Kill(int rank);

 private:
  friend class LocalTransport;
  friend class LocalRecv;
  explicit LocalFabric(int size) : size_(size), dead_(static_cast<size_t>(size), false) {}
  using Key = std::tuple<int, int, uint64_t>;  // sender, receiver, tag

  const int size_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<Key, std::deque<std::string>> mailboxes_ TANDEM_GUARDED_BY(mu_);
  std::vector<bool> dead_ TANDEM_GUARDED_BY(mu_);
};

}  // namespace tandem::transport
