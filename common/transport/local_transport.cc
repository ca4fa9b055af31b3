#include "common/transport/local_transport.h"

#include <cstring>

namespace tandem::transport {

class LocalRecv final : public Request {
 public:
  LocalRecv(std::shared_ptr<LocalFabric> fabric, int self, int peer, uint64_t tag, void* data, size_t bytes)
      : fabric_(std::move(fabric)), self_(self), peer_(peer), tag_(tag), data_(data), bytes_(bytes) {}

  Status Wait(std::chrono::milliseconds timeout) override {
    if (done_) return status_;
    std::unique_lock<std::mutex> lock(fabric_->mu_);
    auto& box = fabric_->mailboxes_[{peer_, self_, tag_}];
    const bool ready = fabric_->cv_.wait_for(lock, timeout, [&] {
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

class LocalTransport final : public Transport {
 public:
  LocalTransport(std::shared_ptr<LocalFabric> fabric, int rank) : fabric_(std::move(fabric)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return fabric_->size_; }

  std::unique_ptr<Request> Send(int peer, uint64_t tag, const void* data, size_t bytes) override {
    {
      std::lock_guard<std::mutex> lock(fabric_->mu_);
      if (fabric_->dead_[static_cast<size_t>(peer)]) {
        return Completed(
            Unavailable("rank {} is gone (send of {} bytes with tag {} by rank {})", peer, bytes, tag, rank_));
      }
      // Eager: the message is copied now, so the send is complete at once.
      fabric_->mailboxes_[{rank_, peer, tag}].emplace_back(static_cast<const char*>(data), bytes);
    }
    fabric_->cv_.notify_all();
    return Completed(Status::Ok());
  }

  std::unique_ptr<Request> Recv(int peer, uint64_t tag, void* data, size_t bytes) override {
    return std::make_unique<LocalRecv>(fabric_, rank_, peer, tag, data, bytes);
  }

 private:
  std::shared_ptr<LocalFabric> fabric_;
  const int rank_;
};

std::shared_ptr<LocalFabric> LocalFabric::Create(int size) {
  return std::shared_ptr<LocalFabric>(new LocalFabric(size));
}

std::unique_ptr<Transport> LocalFabric::Connect(int rank) {
  return std::make_unique<LocalTransport>(shared_from_this(), rank);
}

void LocalFabric::Kill(int rank) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    dead_[static_cast<size_t>(rank)] = true;
  }
  cv_.notify_all();
}

}  // namespace tandem::transport
