#include "common/transport/local_transport.h"

#include <algorithm>
#include <cstring>

namespace tandem::transport {

class LocalRecv final : public Request {
 public:
  LocalRecv(std::shared_ptr<LocalFabric> fabric, int self, int peer, uint64_t tag, void* data, size_t bytes)
      : fabric_(std::move(fabric)), self_(self), peer_(peer), tag_(tag), data_(data), bytes_(bytes) {}

  Status Wait(std::chrono::milliseconds timeout) override {
    if (done_) return status_;
    MutexLock lock(&fabric_->mu_);
    auto& box = fabric_->mailboxes_[{peer_, self_, tag_}];
    const bool ready = fabric_->cv_.WaitFor(lock, timeout, [&]() TANDEM_REQUIRES(fabric_->mu_) {
      return !box.empty() || fabric_->dead_[static_cast<size_t>(peer_)] || fabric_->dead_[static_cast<size_t>(self_)];
    });
    if (!box.empty()) {
      std::string message = std::move(box.front());
      box.pop_front();
      done_ = true;
      if (message.size() != bytes_) {
        status_ = InvalidArgument(
            "rank {} sent {} bytes with tag {}, rank {} expected {} (do the ranks agree on "
            "count and dtype?)",
            peer_, message.size(), tag_, self_, bytes_);
      } else if (bytes_ > 0) {
        std::memcpy(data_, message.data(), bytes_);
      }
      return status_;
    }
    if (ready) {
      done_ = true;
      status_ = Unavailable("rank {} is gone (receive of {} bytes with tag {} by rank {})", peer_, bytes_, tag_, self_);
      return status_;
    }
    return DeadlineExceeded("rank {} waited {} ms for rank {} (tag {}, {} bytes)", self_, timeout.count(), peer_, tag_,
                            bytes_);
  }

 private:
  std::shared_ptr<LocalFabric> fabric_;
  const int self_;
  const int peer_;
  const uint64_t tag_;
  void* const data_;
  const size_t bytes_;
  bool done_ = false;
  Status status_;
};

// The Request of an operation with a completion.
class LocalAsync final : public Request {
 public:
  LocalAsync(std::shared_ptr<LocalFabric> fabric, std::shared_ptr<LocalFabric::Async> op)
      : fabric_(std::move(fabric)), op_(std::move(op)) {}
  ~LocalAsync() override {
    using State = LocalFabric::Async::State;
    MutexLock lock(&fabric_->mu_);
    if (op_->state == State::kWaiting) {
      auto& waiting = fabric_->waiting_[op_->key];
      std::erase(waiting, op_);
      fabric_->QueueLocked(op_, Cancelled("the receive of {} bytes with tag {} from rank {} was dropped", op_->bytes,
                                          std::get<2>(op_->key), std::get<0>(op_->key)));
    }
    if (std::this_thread::get_id() == fabric_->delivery_.get_id()) return;
    op_->cv.Wait(lock, [&]() TANDEM_REQUIRES(fabric_->mu_) { return op_->state == State::kDone; });
  }
  Status Wait(std::chrono::milliseconds timeout) override {
    using State = LocalFabric::Async::State;
    MutexLock lock(&fabric_->mu_);
    if (!op_->cv.WaitFor(lock, timeout,
                         [&]() TANDEM_REQUIRES(fabric_->mu_) { return op_->state != State::kWaiting; })) {
      return DeadlineExceeded("rank {} waited {} ms for rank {} (tag {}, {} bytes)", std::get<1>(op_->key),
                              timeout.count(), std::get<0>(op_->key), std::get<2>(op_->key), op_->bytes);
    }
    return op_->status;
  }

 private:
  std::shared_ptr<LocalFabric> fabric_;
  std::shared_ptr<LocalFabric::Async> op_;
};

class LocalTransport final : public Transport {
 public:
  LocalTransport(std::shared_ptr<LocalFabric> fabric, int rank) : fabric_(std::move(fabric)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return fabric_->size_; }

  std::unique_ptr<Request> Send(int peer, uint64_t tag, const void* data, size_t bytes) override {
    {
      MutexLock lock(&fabric_->mu_);
      if (fabric_->dead_[static_cast<size_t>(peer)]) {
        return Completed(
            Unavailable("rank {} is gone (send of {} bytes with tag {} by rank {})", peer, bytes, tag, rank_));
      }
      // Eager: the message is copied now, so the send is complete at once.
      fabric_->mailboxes_[{rank_, peer, tag}].emplace_back(static_cast<const char*>(data), bytes);
      fabric_->MatchLocked({rank_, peer, tag});
    }
    fabric_->cv_.NotifyAll();
    return Completed(Status::Ok());
  }

  std::unique_ptr<Request> Recv(int peer, uint64_t tag, void* data, size_t bytes) override {
    return std::make_unique<LocalRecv>(fabric_, rank_, peer, tag, data, bytes);
  }

  std::unique_ptr<Request> SendAsync(int peer, uint64_t tag, const void* data, size_t bytes, Completion done) override {
    auto op = std::make_shared<LocalFabric::Async>();
    op->key = {rank_, peer, tag};
    op->bytes = bytes;
    op->done = std::move(done);
    {
      MutexLock lock(&fabric_->mu_);
      if (fabric_->dead_[static_cast<size_t>(peer)]) {
        fabric_->QueueLocked(
            op, Unavailable("rank {} is gone (send of {} bytes with tag {} by rank {})", peer, bytes, tag, rank_));
      } else {
        fabric_->mailboxes_[op->key].emplace_back(static_cast<const char*>(data), bytes);
        fabric_->MatchLocked(op->key);
        fabric_->QueueLocked(op, Status::Ok());
      }
    }
    fabric_->cv_.NotifyAll();
    return std::make_unique<LocalAsync>(fabric_, std::move(op));
  }

  std::unique_ptr<Request> RecvAsync(int peer, uint64_t tag, void* data, size_t bytes, Completion done) override {
    auto op = std::make_shared<LocalFabric::Async>();
    op->key = {peer, rank_, tag};
    op->data = data;
    op->bytes = bytes;
    op->done = std::move(done);
    {
      MutexLock lock(&fabric_->mu_);
      fabric_->waiting_[op->key].push_back(op);
      fabric_->MatchLocked(op->key);
      if (op->state == LocalFabric::Async::State::kWaiting &&
          (fabric_->dead_[static_cast<size_t>(peer)] || fabric_->dead_[static_cast<size_t>(rank_)])) {
        std::erase(fabric_->waiting_[op->key], op);
        fabric_->QueueLocked(
            op, Unavailable("rank {} is gone (receive of {} bytes with tag {} by rank {})", peer, bytes, tag, rank_));
      }
    }
    return std::make_unique<LocalAsync>(fabric_, std::move(op));
  }

 private:
  std::shared_ptr<LocalFabric> fabric_;
  const int rank_;
};

LocalFabric::~LocalFabric() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  delivery_cv_.NotifyAll();
  if (delivery_.joinable()) delivery_.join();
}

void LocalFabric::QueueLocked(const std::shared_ptr<Async>& op, Status status) {
  op->status = std::move(status);
  op->state = Async::State::kQueued;
  ready_.push_back(op);
  if (!delivery_.joinable()) delivery_ = std::thread([this] { Deliver(); });
  delivery_cv_.NotifyOne();
  op->cv.NotifyAll();  // Wait returns once the status is known
}

void LocalFabric::MatchLocked(const Key& key) {
  auto w = waiting_.find(key);
  if (w == waiting_.end()) return;
  auto& box = mailboxes_[key];
  while (!w->second.empty() && !box.empty()) {
    std::shared_ptr<Async> op = std::move(w->second.front());
    w->second.pop_front();
    std::string message = std::move(box.front());
    box.pop_front();
    Status status;
    if (message.size() != op->bytes) {
      status = InvalidArgument(
          "rank {} sent {} bytes with tag {}, rank {} expected {} (do the ranks agree on count and dtype?)",
          std::get<0>(key), message.size(), std::get<2>(key), std::get<1>(key), op->bytes);
    } else if (op->bytes > 0) {
      std::memcpy(op->data, message.data(), op->bytes);
    }
    QueueLocked(op, std::move(status));
  }
}

void LocalFabric::Deliver() {
  MutexLock lock(&mu_);
  for (;;) {
    delivery_cv_.Wait(lock, [&]() TANDEM_REQUIRES(mu_) { return stopping_ || !ready_.empty(); });
    if (ready_.empty()) return;
    std::shared_ptr<Async> op = std::move(ready_.front());
    ready_.pop_front();
    op->state = Async::State::kRunning;
    auto done = std::move(op->done);
    const Status status = op->status;
    lock.Unlock();
    if (done) done(status);
    lock.Lock();
    op->state = Async::State::kDone;
    op->cv.NotifyAll();
    // What the completion holds is released outside the lock (it may drop
    // Requests, which take it).
    lock.Unlock();
    done = nullptr;
    op.reset();
    lock.Lock();
  }
}

std::shared_ptr<LocalFabric> LocalFabric::Create(int size) {
  return std::shared_ptr<LocalFabric>(new LocalFabric(size));
}

std::unique_ptr<Transport> LocalFabric::Connect(int rank) {
  return std::make_unique<LocalTransport>(shared_from_this(), rank);
}

void LocalFabric::Kill(int rank) {
  {
    MutexLock lock(&mu_);
    dead_[static_cast<size_t>(rank)] = true;
    // Receives with a completion that nothing can answer now fail (messages
    // already sent were matched when they arrived).
    for (auto& [key, ops] : waiting_) {
      if (std::get<0>(key) != rank && std::get<1>(key) != rank) continue;
      for (auto& op : ops) {
        QueueLocked(op, Unavailable("rank {} is gone (receive of {} bytes with tag {} by rank {})", std::get<0>(key),
                                    op->bytes, std::get<2>(key), std::get<1>(key)));
      }
      ops.clear();
    }
  }
  cv_.NotifyAll();
}

}  // namespace tandem::transport
