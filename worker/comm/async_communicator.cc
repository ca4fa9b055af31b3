#include "worker/comm/async_communicator.h"

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "common/thread_annotations.h"

namespace tandem::comm {
namespace internal {

// The shared state of one operation: what a Handle points to.
struct AsyncOp {
  std::weak_ptr<AsyncCore> core;
  // The id of the open fusion bucket holding the operation; 0 once the bucket
  // is closed (or when the operation is not fused).
  std::atomic<uint64_t> bucket{0};

  mutable std::mutex mu;
  std::condition_variable cv;
  bool done TANDEM_GUARDED_BY(mu) = false;
  Status status TANDEM_GUARDED_BY(mu);

  // Records the result; false if the operation was already complete.
  bool Complete(const Status& s) {
    {
      std::lock_guard lock(mu);
      if (done) return false;
      done = true;
      status = s;
    }
    cv.notify_all();
    return true;
  }
};

namespace {

bool ValidTypes(DType dtype, ReduceOp op) {
  return static_cast<int>(dtype) <= static_cast<int>(DType::kInt64) &&
         static_cast<int>(op) <= static_cast<int>(ReduceOp::kMax);
}

}  // namespace

// One queued unit of work: a single operation, or a closed fusion bucket.
struct AsyncTask {
  struct Entry {
    const void* in = nullptr;
    void* out = nullptr;
    size_t count = 0;
    std::shared_ptr<AsyncOp> op;
  };

  // A single operation (entries empty).
  std::function<Status(Communicator&)> run;
  std::shared_ptr<AsyncOp> op;
  uint64_t bytes = 0;

  // A fusion bucket (entries non-empty).
  std::vector<Entry> entries;
  DType dtype = DType::kFloat32;
  ReduceOp reduce = ReduceOp::kSum;
  size_t bucket_bytes = 0;
  uint64_t bucket_id = 0;
};

// Everything the progress thread and the handles share. Handles keep a weak
// reference (to close their bucket); the AsyncCommunicator owns it and joins
// the progress thread before letting go.
class AsyncCore : public std::enable_shared_from_this<AsyncCore> {
 public:
  AsyncCore(std::shared_ptr<Communicator> comm, AsyncOptions options)
      : comm_(std::move(comm)), fusion_bytes_(comm_->device_buffers() ? 0 : options.fusion_bytes) {}

  AsyncCommunicator::Handle Submit(std::function<Status(Communicator&)> run, uint64_t bytes) {
    auto op = NewOp();
    Status fail;
    {
      std::unique_lock lock(mu_);
      ++submitted_;
      if (!error_.ok()) {
        fail = error_;
        WaitDrainedLocked(lock);
      } else {
        if (open_) CloseLocked();
        AsyncTask task;
        task.run = std::move(run);
        task.op = op;
        task.bytes = bytes;
        queue_.push_back(std::move(task));
      }
    }
    if (fail.ok()) {
      work_cv_.notify_one();
    } else {
      Complete(op, fail);
    }
    return AsyncCommunicator::Handle(op);
  }

  AsyncCommunicator::Handle SubmitAllReduce(const void* in, void* out, size_t count, DType dtype, ReduceOp reduce) {
    const bool valid = ValidTypes(dtype, reduce);
    const size_t elem = valid ? collectives::SizeOf(dtype) : 1;
    // Fusable: a non-empty, well-formed host tensor below the bucket size.
    // Anything else runs alone (and the communicator reports what is wrong).
    const bool fusable = fusion_bytes_ > 0 && valid && count > 0 && count <= (fusion_bytes_ - 1) / elem &&
                         in != nullptr && out != nullptr;
    if (!fusable) {
      return Submit([=](Communicator& c) { return c.AllReduce(in, out, count, dtype, reduce); }, count * elem);
    }
    const size_t bytes = count * elem;
    auto op = NewOp();
    Status fail;
    bool closed = false;
    {
      std::unique_lock lock(mu_);
      ++submitted_;
      if (!error_.ok()) {
        fail = error_;
        WaitDrainedLocked(lock);
      } else {
        if (open_ &&
            (open_->dtype != dtype || open_->reduce != reduce || open_->bucket_bytes + bytes > fusion_bytes_)) {
          CloseLocked();
          closed = true;
        }
        if (!open_) {
          open_.emplace();
          open_->dtype = dtype;
          open_->reduce = reduce;
          open_->bucket_id = ++next_bucket_;
        }
        open_->entries.push_back({in, out, count, op});
        open_->bucket_bytes += bytes;
        op->bucket.store(open_->bucket_id);
      }
    }
    if (closed) work_cv_.notify_one();
    if (!fail.ok()) Complete(op, fail);
    return AsyncCommunicator::Handle(op);
  }

  // Closes the open bucket if it is bucket `id`.
  void CloseBucket(uint64_t id) {
    {
      std::lock_guard lock(mu_);
      if (!open_ || open_->bucket_id != id) return;
      CloseLocked();
    }
    work_cv_.notify_one();
  }

  void Flush() {
    {
      std::lock_guard lock(mu_);
      if (!open_) return;
      CloseLocked();
    }
    work_cv_.notify_one();
  }

  Status Synchronize(std::chrono::milliseconds timeout) {
    std::unique_lock lock(mu_);
    const bool closed = open_.has_value();
    if (closed) CloseLocked();
    const uint64_t target = submitted_;
    if (closed) {
      lock.unlock();
      work_cv_.notify_one();
      lock.lock();
    }
    if (!idle_cv_.wait_for(lock, timeout, [&] { return completed_ >= target; })) {
      return DeadlineExceeded("{} of {} operations on communicator \"{}\" still running after {} ms",
                              target - completed_, target, comm_->name(), timeout.count());
    }
    return error_;
  }

  void Abort(const std::string& reason, bool stop) {
    comm_->Abort(reason);
    Status aborted = comm_->health();  // ABORTED with the reason, or an earlier error
    if (aborted.ok()) aborted = Aborted("communicator \"{}\" was aborted: {}", comm_->name(), reason);
    FailAll(aborted, stop);
  }

  Status health() const {
    {
      std::lock_guard lock(mu_);
      if (!error_.ok()) return error_;
    }
    // Between a failed task and the publication of its error (Run), the
    // communicator itself already says it is broken.
    return comm_->health();
  }

  // The progress thread.
  void Run() {
    while (true) {
      AsyncTask task;
      Status error;
      {
        std::unique_lock lock(mu_);
        work_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
        error = error_;
      }
      const Status s = error.ok() ? Execute(task) : error;
      // The task's handles complete before its error is published: an
      // operation submitted once the error is visible fails at once, and it
      // must never finish before the handles of the task that failed.
      CompleteTask(task, s);
      if (!s.ok()) {
        // An error that broke the communicator fails everything after it.
        const Status broken = comm_->health();
        if (!broken.ok()) FailAll(broken, /*stop=*/false);
      }
    }
  }

  // Publishes `error` (unless there is one already) and fails what is
  // queued and the open bucket with it, in submission order. A submission
  // that fails at once waits until that is done (WaitDrainedLocked), so
  // nothing submitted later completes first, and no open bucket is left
  // waiting for a Wait or a Flush.
  void FailAll(const Status& error, bool stop) {
    std::deque<AsyncTask> drained;
    std::optional<AsyncTask> open;
    Status fail;
    {
      std::lock_guard lock(mu_);
      if (error_.ok()) error_ = error;
      fail = error_;
      drained.swap(queue_);
      open.swap(open_);
      if (stop) stop_ = true;
      ++draining_;
    }
    work_cv_.notify_all();
    for (auto& task : drained) CompleteTask(task, fail);
    if (open) CompleteTask(*open, fail);
    {
      std::lock_guard lock(mu_);
      --draining_;
    }
    drained_cv_.notify_all();
  }

  void WaitDrainedLocked(std::unique_lock<std::mutex>& lock) TANDEM_REQUIRES(mu_) {
    drained_cv_.wait(lock, [&]() TANDEM_REQUIRES(mu_) { return draining_ == 0; });
  }

  // The counters AsyncCommunicator exposes.
  std::atomic<uint64_t> ops_count{0};
  std::atomic<uint64_t> fused_count{0};
  std::atomic<uint64_t> bucket_count{0};
  std::atomic<uint64_t> byte_count{0};

 private:
  std::shared_ptr<AsyncOp> NewOp() {
    auto op = std::make_shared<AsyncOp>();
    op->core = weak_from_this();
    ops_count.fetch_add(1, std::memory_order_relaxed);
    return op;
  }

  // Queues the open bucket. The caller wakes the progress thread once it has
  // released mu_ (woken under it, the thread would only block on mu_).
  void CloseLocked() TANDEM_REQUIRES(mu_) {
    for (auto& e : open_->entries) e.op->bucket.store(0);
    queue_.push_back(std::move(*open_));
    open_.reset();
  }

  void Complete(const std::shared_ptr<AsyncOp>& op, const Status& s) {
    if (!op->Complete(s)) return;
    {
      std::lock_guard lock(mu_);
      ++completed_;
    }
    idle_cv_.notify_all();
  }

  void CompleteTask(AsyncTask& task, const Status& s) {
    if (task.entries.empty()) {
      if (s.ok()) byte_count.fetch_add(task.bytes, std::memory_order_relaxed);
      Complete(task.op, s);
      return;
    }
    if (s.ok()) byte_count.fetch_add(task.bucket_bytes, std::memory_order_relaxed);
    for (auto& e : task.entries) Complete(e.op, s);
  }

  // Runs one task on the progress thread.
  Status Execute(AsyncTask& task) {
    if (task.entries.empty()) return task.run(*comm_);
    bucket_count.fetch_add(1, std::memory_order_relaxed);
    fused_count.fetch_add(task.entries.size(), std::memory_order_relaxed);
    if (task.entries.size() == 1) {
      const auto& e = task.entries.front();
      return comm_->AllReduce(e.in, e.out, e.count, task.dtype, task.reduce);
    }
    if (buffer_.size() < task.bucket_bytes) buffer_.resize(task.bucket_bytes);
    const size_t elem = collectives::SizeOf(task.dtype);
    size_t offset = 0;
    for (const auto& e : task.entries) {
      std::memcpy(buffer_.data() + offset, e.in, e.count * elem);
      offset += e.count * elem;
    }
    TANDEM_RETURN_IF_ERROR(
        comm_->AllReduce(buffer_.data(), buffer_.data(), task.bucket_bytes / elem, task.dtype, task.reduce));
    offset = 0;
    for (const auto& e : task.entries) {
      std::memcpy(e.out, buffer_.data() + offset, e.count * elem);
      offset += e.count * elem;
    }
    return Status::Ok();
  }

  const std::shared_ptr<Communicator> comm_;
  const size_t fusion_bytes_;
  // The fusion buffer: used by the progress thread only, grown to the largest
  // bucket and reused.
  std::vector<std::byte> buffer_;

  mutable std::mutex mu_;
  std::condition_variable work_cv_;          // queue_ became non-empty, or stop_
  std::condition_variable idle_cv_;          // completed_ grew
  std::condition_variable drained_cv_;       // draining_ fell to 0
  int draining_ TANDEM_GUARDED_BY(mu_) = 0;  // FailAll calls completing what they took
  std::deque<AsyncTask> queue_ TANDEM_GUARDED_BY(mu_);
  std::optional<AsyncTask> open_ TANDEM_GUARDED_BY(mu_);  // the open fusion bucket
  Status error_ TANDEM_GUARDED_BY(mu_);                   // non-OK once broken or aborted
  bool stop_ TANDEM_GUARDED_BY(mu_) = false;
  uint64_t submitted_ TANDEM_GUARDED_BY(mu_) = 0;  // operations submitted
  uint64_t completed_ TANDEM_GUARDED_BY(mu_) = 0;  // operations completed (OK or not)
  uint64_t next_bucket_ TANDEM_GUARDED_BY(mu_) = 0;
};

}  // namespace internal

using internal::AsyncCore;

Status AsyncCommunicator::Handle::Wait(std::chrono::milliseconds timeout) const {
  if (op_ == nullptr) return FailedPrecondition("the handle refers to no operation");
  if (const uint64_t bucket = op_->bucket.load(); bucket != 0) {
    if (auto core = op_->core.lock()) core->CloseBucket(bucket);
  }
  std::unique_lock lock(op_->mu);
  if (!op_->cv.wait_for(lock, timeout, [this] { return op_->done; })) {
    return DeadlineExceeded("the operation is not complete after {} ms (it is still running)", timeout.count());
  }
  return op_->status;
}

bool AsyncCommunicator::Handle::Done() const {
  if (op_ == nullptr) return true;
  if (const uint64_t bucket = op_->bucket.load(); bucket != 0) {
    if (auto core = op_->core.lock()) core->CloseBucket(bucket);
  }
  std::lock_guard lock(op_->mu);
  return op_->done;
}

Status AsyncCommunicator::Handle::status() const {
  if (op_ == nullptr) return FailedPrecondition("the handle refers to no operation");
  std::lock_guard lock(op_->mu);
  if (!op_->done) return FailedPrecondition("the operation is still running");
  return op_->status;
}

AsyncCommunicator::AsyncCommunicator(std::shared_ptr<Communicator> comm, AsyncOptions options)
    : comm_(std::move(comm)), core_(std::make_shared<AsyncCore>(comm_, options)) {
  thread_ = std::thread([core = core_.get()] { core->Run(); });
}

AsyncCommunicator::~AsyncCommunicator() {
  core_->Abort("communicator closed", /*stop=*/true);
  thread_.join();
}

AsyncCommunicator::Handle AsyncCommunicator::AllReduceAsync(const void* in, void* out, size_t count, DType dtype,
                                                            ReduceOp op) {
  return core_->SubmitAllReduce(in, out, count, dtype, op);
}

namespace {

uint64_t Bytes(size_t count, DType dtype) {
  return static_cast<int>(dtype) <= static_cast<int>(DType::kInt64) ? count * collectives::SizeOf(dtype) : 0;
}

}  // namespace

AsyncCommunicator::Handle AsyncCommunicator::ReduceScatterAsync(const void* in, void* out, size_t count, DType dtype,
                                                                ReduceOp op) {
  return core_->Submit([=](Communicator& c) { return c.ReduceScatter(in, out, count, dtype, op); },
                       Bytes(count, dtype));
}

AsyncCommunicator::Handle AsyncCommunicator::AllGatherAsync(const void* in, void* out, size_t count, DType dtype) {
  return core_->Submit([=](Communicator& c) { return c.AllGather(in, out, count, dtype); }, Bytes(count, dtype));
}

AsyncCommunicator::Handle AsyncCommunicator::BroadcastAsync(void* data, size_t count, DType dtype, int root) {
  return core_->Submit([=](Communicator& c) { return c.Broadcast(data, count, dtype, root); }, Bytes(count, dtype));
}

AsyncCommunicator::Handle AsyncCommunicator::ReduceAsync(const void* in, void* out, size_t count, DType dtype,
                                                         ReduceOp op, int root) {
  return core_->Submit([=](Communicator& c) { return c.Reduce(in, out, count, dtype, op, root); }, Bytes(count, dtype));
}

AsyncCommunicator::Handle AsyncCommunicator::BarrierAsync() {
  return core_->Submit([](Communicator& c) { return c.Barrier(); }, 0);
}

AsyncCommunicator::Handle AsyncCommunicator::SendAsync(int peer, const void* data, size_t count, DType dtype) {
  return core_->Submit([=](Communicator& c) { return c.Send(peer, data, count, dtype); }, Bytes(count, dtype));
}

AsyncCommunicator::Handle AsyncCommunicator::RecvAsync(int peer, void* data, size_t count, DType dtype) {
  return core_->Submit([=](Communicator& c) { return c.Recv(peer, data, count, dtype); }, Bytes(count, dtype));
}

void AsyncCommunicator::Flush() {
  core_->Flush();
}

Status AsyncCommunicator::Synchronize(std::chrono::milliseconds timeout) {
  return core_->Synchronize(timeout);
}

void AsyncCommunicator::Abort(const std::string& reason) {
  core_->Abort(reason, /*stop=*/false);
}

Status AsyncCommunicator::health() const {
  return core_->health();
}

uint64_t AsyncCommunicator::ops() const {
  return core_->ops_count.load();
}
uint64_t AsyncCommunicator::fused_tensors() const {
  return core_->fused_count.load();
}
uint64_t AsyncCommunicator::bucket_flushes() const {
  return core_->bucket_count.load();
}
uint64_t AsyncCommunicator::bytes() const {
  return core_->byte_count.load();
}

}  // namespace tandem::comm
