// An in-process transport: the ranks of a group are threads of one process
// that exchange messages through shared mailboxes. It keeps every rule of
// transport.h, so collective algorithms are tested with it fast and without
// a network; Kill() makes a rank die as a process would. Completions of
// SendAsync/RecvAsync run on one delivery thread per fabric (started with the
// first of them), as UCX's run on its progress thread; a completion must not
// destroy the fabric (its last transport).
//
// Thread safety: thread-safe.
#pragma once

#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "common/mutex.h"
#include "common/thread_annotations.h"
#include "common/transport/transport.h"

namespace tandem::transport {

class LocalFabric : public std::enable_shared_from_this<LocalFabric> {
 public:
  ~LocalFabric();
  LocalFabric(const LocalFabric&) = delete;
  LocalFabric& operator=(const LocalFabric&) = delete;
  static std::shared_ptr<LocalFabric> Create(int size);
  // The transport of one rank. The fabric outlives it (shared ownership).
  std::unique_ptr<Transport> Connect(int rank);
  // Marks `rank` dead: its peers' operations with it fail.
  void Kill(int rank);

 private:
  friend class LocalTransport;
  friend class LocalRecv;
  friend class LocalAsync;
  explicit LocalFabric(int size) : size_(size), dead_(static_cast<size_t>(size), false) {}
  using Key = std::tuple<int, int, uint64_t>;  // sender, receiver, tag

  // An operation with a completion.
  struct Async {
    enum class State { kWaiting, kQueued, kRunning, kDone };
    Key key;
    void* data = nullptr;  // receives
    size_t bytes = 0;
    std::function<void(const Status&)> done;
    // Guarded by mu_.
    State state = State::kWaiting;
    Status status;
    CondVar cv;
  };
  // Hands `op` to the delivery thread with `status`.
  void QueueLocked(const std::shared_ptr<Async>& op, Status status) TANDEM_REQUIRES(mu_);
  // Matches waiting receives of `key` with its mailbox.
  void MatchLocked(const Key& key) TANDEM_REQUIRES(mu_);
  void Deliver();

  const int size_;
  Mutex mu_;
  CondVar cv_;
  std::map<Key, std::deque<std::string>> mailboxes_ TANDEM_GUARDED_BY(mu_);
  std::vector<bool> dead_ TANDEM_GUARDED_BY(mu_);
  std::map<Key, std::deque<std::shared_ptr<Async>>> waiting_ TANDEM_GUARDED_BY(mu_);
  std::deque<std::shared_ptr<Async>> ready_ TANDEM_GUARDED_BY(mu_);
  CondVar delivery_cv_;
  bool stopping_ TANDEM_GUARDED_BY(mu_) = false;
  std::thread delivery_;  // started under mu_
};

}  // namespace tandem::transport
