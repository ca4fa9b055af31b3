// AsyncCommunicator: operations run in submission order on the progress
// thread; small allreduces are fused into buckets whose boundaries depend only
// on the sequence of calls; errors and aborts complete every affected handle
// promptly; destruction with queued work does not hang. Ranks are threads of
// this process, over a small in-process communicator defined here.
#include "worker/comm/async_communicator.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace tandem::comm {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------
// A test-only communicator: every collective is an exchange of each rank's
// contribution through a table shared by the group's threads, then computed
// locally. Honours timeouts and Abort() (OnAbort wakes the waiters).
// ---------------------------------------------------------------------------

struct Group {
  explicit Group(int n) : size(n) {}
  const int size;
  std::mutex mu;
  std::condition_variable cv;
  struct Slot {
    std::vector<std::optional<std::string>> blobs;
    int taken = 0;
  };
  std::map<uint64_t, Slot> slots;
  std::map<std::pair<int, int>, std::deque<std::string>> mail;  // (from, to) -> messages
};

class TestComm : public Communicator {
 public:
  TestComm(CommInfo info, std::shared_ptr<Group> group) : Communicator(std::move(info)), group_(std::move(group)) {}
  std::string backend() const override { return "test"; }

  // Every DoAllReduce with this sequence number fails (0: none).
  std::atomic<uint64_t> fail_at{0};
  // The element counts the allreduces ran with, in order.
  std::vector<size_t> allreduce_counts() const {
    std::lock_guard lock(mu_);
    return counts_;
  }

 protected:
  Status DoAllReduce(uint64_t seq, const void* in, void* out, size_t count, DType dtype, ReduceOp op) override {
    {
      std::lock_guard lock(mu_);
      counts_.push_back(count);
    }
    if (seq == fail_at.load()) return Unavailable("injected failure: rank {} lost its peers", rank());
    TANDEM_ASSIGN_OR_RETURN(auto blobs, Exchange(seq, Bytes(in, count, dtype)));
    Combine(blobs, out, 0, count, dtype, op);
    return Status::Ok();
  }
  Status DoReduceScatter(uint64_t seq, const void* in, void* out, size_t count, DType dtype, ReduceOp op) override {
    TANDEM_ASSIGN_OR_RETURN(auto blobs, Exchange(seq, Bytes(in, count * static_cast<size_t>(size()), dtype)));
    Combine(blobs, out, count * static_cast<size_t>(rank()), count, dtype, op);
    return Status::Ok();
  }
  Status DoAllGather(uint64_t seq, const void* in, void* out, size_t count, DType dtype) override {
    TANDEM_ASSIGN_OR_RETURN(auto blobs, Exchange(seq, Bytes(in, count, dtype)));
    auto* o = static_cast<char*>(out);
    for (const auto& b : blobs) o = std::copy(b.begin(), b.end(), o);
    return Status::Ok();
  }
  Status DoBroadcast(uint64_t seq, void* data, size_t count, DType dtype, int root) override {
    TANDEM_ASSIGN_OR_RETURN(auto blobs, Exchange(seq, rank() == root ? Bytes(data, count, dtype) : ""));
    std::copy(blobs[static_cast<size_t>(root)].begin(), blobs[static_cast<size_t>(root)].end(),
              static_cast<char*>(data));
    return Status::Ok();
  }
  Status DoReduce(uint64_t seq, const void* in, void* out, size_t count, DType dtype, ReduceOp op, int root) override {
    TANDEM_ASSIGN_OR_RETURN(auto blobs, Exchange(seq, Bytes(in, count, dtype)));
    if (rank() == root) Combine(blobs, out, 0, count, dtype, op);
    return Status::Ok();
  }
  Status DoBarrier(uint64_t seq) override { return Exchange(seq, "").status(); }
  Status DoSend(int peer, const void* data, size_t bytes) override {
    std::lock_guard lock(group_->mu);
    group_->mail[{rank(), peer}].emplace_back(static_cast<const char*>(data), bytes);
    group_->cv.notify_all();
    return Status::Ok();
  }
  Status DoRecv(int peer, void* data, size_t bytes) override {
    std::unique_lock lock(group_->mu);
    auto& box = group_->mail[{peer, rank()}];
    if (!group_->cv.wait_for(lock, timeout(), [&] { return aborted() || !box.empty(); })) {
      return DeadlineExceeded("rank {} sent nothing to rank {}", peer, rank());
    }
    if (aborted()) return health();
    if (box.front().size() != bytes)
      return InvalidArgument("message of {} bytes, expected {}", box.front().size(), bytes);
    std::memcpy(data, box.front().data(), bytes);
    box.pop_front();
    return Status::Ok();
  }
  void OnAbort() override {
    std::lock_guard lock(group_->mu);
    group_->cv.notify_all();
  }

 private:
  static std::string Bytes(const void* p, size_t count, DType dtype) {
    return std::string(static_cast<const char*>(p), count * collectives::SizeOf(dtype));
  }

  // out[0..count) = op over every blob's elements [offset, offset + count).
  void Combine(const std::vector<std::string>& blobs, void* out, size_t offset, size_t count, DType dtype,
               ReduceOp op) const {
    const size_t elem = collectives::SizeOf(dtype);
    std::string acc = blobs[0].substr(offset * elem, count * elem);
    for (size_t r = 1; r < blobs.size(); ++r)
      collectives::Reduce(acc.data(), blobs[r].data() + offset * elem, count, dtype, op);
    if (op == ReduceOp::kAvg) collectives::Divide(acc.data(), count, dtype, size());
    std::memcpy(out, acc.data(), acc.size());
  }

  Result<std::vector<std::string>> Exchange(uint64_t seq, std::string blob) {
    std::unique_lock lock(group_->mu);
    auto& slot = group_->slots[seq];
    if (slot.blobs.empty()) slot.blobs.resize(static_cast<size_t>(size()));
    slot.blobs[static_cast<size_t>(rank())] = std::move(blob);
    group_->cv.notify_all();
    const auto deadline = Clock::now() + timeout();
    while (true) {
      if (aborted()) return health();
      if (std::all_of(slot.blobs.begin(), slot.blobs.end(), [](const auto& b) { return b.has_value(); })) break;
      if (group_->cv.wait_until(lock, deadline) == std::cv_status::timeout && Clock::now() >= deadline) {
        std::string missing;
        for (size_t r = 0; r < slot.blobs.size(); ++r) {
          if (!slot.blobs[r]) missing += (missing.empty() ? "" : ",") + std::to_string(r);
        }
        return DeadlineExceeded("collective {} of {}: ranks {} never entered", seq, name(), missing);
      }
    }
    std::vector<std::string> out;
    for (const auto& b : slot.blobs) out.push_back(*b);
    if (++slot.taken == size()) group_->slots.erase(seq);
    return out;
  }

  std::shared_ptr<Group> group_;
  mutable std::mutex mu_;
  std::vector<size_t> counts_;
};

// The communicators of one group of `n` ranks.
std::vector<std::shared_ptr<TestComm>> MakeGroup(int n, milliseconds timeout = milliseconds(10000)) {
  auto group = std::make_shared<Group>(n);
  std::vector<std::shared_ptr<TestComm>> out;
  for (int r = 0; r < n; ++r) {
    CommInfo info;
    info.name = "world";
    info.epoch = 1;
    info.rank = r;
    info.size = n;
    info.timeout = timeout;
    out.push_back(std::make_shared<TestComm>(info, group));
  }
  return out;
}

// Runs fn(rank) on one thread per rank.
template <typename Fn>
void RunRanks(int n, Fn fn) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back([&fn, r] { fn(r); });
  for (auto& t : threads) t.join();
}

constexpr milliseconds kWait{10000};

// The bucket sizes (in tensors) the fusion rule gives for tensors of these
// byte sizes, all of one dtype and op.
std::vector<size_t> ExpectedBuckets(const std::vector<size_t>& bytes, size_t fusion) {
  std::vector<size_t> out;
  size_t open = 0, used = 0;
  for (size_t b : bytes) {
    if (open > 0 && used + b > fusion) {
      out.push_back(open);
      open = used = 0;
    }
    ++open;
    used += b;
  }
  if (open > 0) out.push_back(open);
  return out;
}

// ---------------------------------------------------------------------------

TEST(AsyncCommunicatorTest, ManySmallAllReducesAreFusedIntoBuckets) {
  constexpr int kRanks = 4;
  constexpr size_t kFusion = 1024;
  constexpr int kTensors = 120;
  std::vector<size_t> counts;
  for (int i = 0; i < kTensors; ++i) counts.push_back(static_cast<size_t>(1 + (i * 7) % 23));  // 1..23 floats
  std::vector<size_t> bytes;
  for (size_t c : counts) bytes.push_back(c * 4);
  const auto buckets = ExpectedBuckets(bytes, kFusion);
  ASSERT_GT(buckets.size(), 3u);
  ASSERT_LT(buckets.size(), static_cast<size_t>(kTensors) / 4);

  auto comms = MakeGroup(kRanks);
  RunRanks(kRanks, [&](int rank) {
    AsyncCommunicator async(comms[static_cast<size_t>(rank)], AsyncOptions{kFusion});
    std::vector<std::vector<float>> in(kTensors), out(kTensors);
    std::vector<AsyncCommunicator::Handle> handles;
    for (int i = 0; i < kTensors; ++i) {
      const size_t n = counts[static_cast<size_t>(i)];
      in[static_cast<size_t>(i)].resize(n);
      out[static_cast<size_t>(i)].assign(n, -1.0f);
      for (size_t k = 0; k < n; ++k)
        in[static_cast<size_t>(i)][k] = static_cast<float>(rank * 1000 + i * 10 + static_cast<int>(k));
      handles.push_back(async.AllReduceAsync(in[static_cast<size_t>(i)].data(), out[static_cast<size_t>(i)].data(), n,
                                             DType::kFloat32, ReduceOp::kSum));
    }
    for (auto& h : handles) ASSERT_TRUE(h.Wait(kWait).ok());
    for (int i = 0; i < kTensors; ++i) {
      for (size_t k = 0; k < counts[static_cast<size_t>(i)]; ++k) {
        // sum over ranks of rank*1000 + i*10 + k
        const float want = static_cast<float>(1000 * (0 + 1 + 2 + 3) + kRanks * (i * 10 + static_cast<int>(k)));
        ASSERT_EQ(out[static_cast<size_t>(i)][k], want) << "rank " << rank << " tensor " << i << " element " << k;
      }
    }
    EXPECT_EQ(async.ops(), static_cast<uint64_t>(kTensors));
    EXPECT_EQ(async.fused_tensors(), static_cast<uint64_t>(kTensors));
    EXPECT_EQ(async.bucket_flushes(), buckets.size());
    size_t total = 0;
    for (size_t b : bytes) total += b;
    EXPECT_EQ(async.bytes(), total);
  });
  // The communicator saw one allreduce per bucket, of the bucket's elements.
  for (const auto& comm : comms) {
    const auto ran = comm->allreduce_counts();
    ASSERT_EQ(ran.size(), buckets.size());
    size_t next = 0;
    for (size_t b = 0; b < buckets.size(); ++b) {
      size_t elements = 0;
      for (size_t j = 0; j < buckets[b]; ++j) elements += counts[next++];
      EXPECT_EQ(ran[b], elements) << "bucket " << b;
    }
  }
}

TEST(AsyncCommunicatorTest, AnotherDtypeOrOpClosesTheBucket) {
  constexpr int kRanks = 3;
  auto comms = MakeGroup(kRanks);
  RunRanks(kRanks, [&](int rank) {
    AsyncCommunicator async(comms[static_cast<size_t>(rank)], AsyncOptions{4096});
    std::vector<float> f1(5, static_cast<float>(rank + 1)), f2(7, 2.0f), f3(3, 1.0f), f4(4, static_cast<float>(rank));
    std::vector<int32_t> i1(6, rank + 1), i2(2, 10);
    std::vector<int64_t> l1(3, int64_t{1} << 40);
    std::vector<AsyncCommunicator::Handle> h;
    h.push_back(async.AllReduceAsync(f1.data(), f1.data(), f1.size(), DType::kFloat32, ReduceOp::kSum));
    h.push_back(async.AllReduceAsync(f2.data(), f2.data(), f2.size(), DType::kFloat32, ReduceOp::kSum));
    h.push_back(async.AllReduceAsync(i1.data(), i1.data(), i1.size(), DType::kInt32, ReduceOp::kSum));
    h.push_back(async.AllReduceAsync(i2.data(), i2.data(), i2.size(), DType::kInt32, ReduceOp::kSum));
    h.push_back(async.AllReduceAsync(l1.data(), l1.data(), l1.size(), DType::kInt64, ReduceOp::kSum));
    h.push_back(async.AllReduceAsync(f3.data(), f3.data(), f3.size(), DType::kFloat32, ReduceOp::kSum));
    h.push_back(async.AllReduceAsync(f4.data(), f4.data(), f4.size(), DType::kFloat32, ReduceOp::kMax));
    for (auto& x : h) ASSERT_TRUE(x.Wait(kWait).ok());
    // Buckets: [f1 f2] [i1 i2] [l1] [f3] [f4 max].
    EXPECT_EQ(async.bucket_flushes(), 5u);
    EXPECT_EQ(async.fused_tensors(), 7u);
    for (float v : f1) EXPECT_EQ(v, 6.0f);
    for (float v : f2) EXPECT_EQ(v, 6.0f);
    for (int32_t v : i1) EXPECT_EQ(v, 6);
    for (int32_t v : i2) EXPECT_EQ(v, 30);
    for (int64_t v : l1) EXPECT_EQ(v, 3 * (int64_t{1} << 40));
    for (float v : f3) EXPECT_EQ(v, 3.0f);
    for (float v : f4) EXPECT_EQ(v, 2.0f);
  });
  const std::vector<size_t> want = {12, 8, 3, 3, 4};
  for (const auto& comm : comms) EXPECT_EQ(comm->allreduce_counts(), want);
}

TEST(AsyncCommunicatorTest, TensorLargerThanTheBucketRunsAloneInPlace) {
  constexpr int kRanks = 2;
  auto comms = MakeGroup(kRanks);
  RunRanks(kRanks, [&](int rank) {
    AsyncCommunicator async(comms[static_cast<size_t>(rank)], AsyncOptions{1024});
    std::vector<float> a(10, 1.0f), b(10, 2.0f), big(512, static_cast<float>(rank + 1)), c(10, 3.0f);
    auto ha = async.AllReduceAsync(a.data(), a.data(), a.size(), DType::kFloat32, ReduceOp::kSum);
    auto hb = async.AllReduceAsync(b.data(), b.data(), b.size(), DType::kFloat32, ReduceOp::kSum);
    auto hbig = async.AllReduceAsync(big.data(), big.data(), big.size(), DType::kFloat32, ReduceOp::kAvg);
    auto hc = async.AllReduceAsync(c.data(), c.data(), c.size(), DType::kFloat32, ReduceOp::kSum);
    ASSERT_TRUE(hbig.Wait(kWait).ok());
    // The big tensor closed the bucket before it, so a and b are done too.
    EXPECT_TRUE(ha.Done());
    EXPECT_TRUE(hb.Done());
    ASSERT_TRUE(hc.Wait(kWait).ok());
    for (float v : a) EXPECT_EQ(v, 2.0f);
    for (float v : b) EXPECT_EQ(v, 4.0f);
    for (float v : big) EXPECT_EQ(v, 1.5f);
    for (float v : c) EXPECT_EQ(v, 6.0f);
    EXPECT_EQ(async.bucket_flushes(), 2u);
    EXPECT_EQ(async.fused_tensors(), 3u);
    EXPECT_EQ(async.ops(), 4u);
  });
  const std::vector<size_t> want = {20, 512, 10};
  for (const auto& comm : comms) EXPECT_EQ(comm->allreduce_counts(), want);
}

TEST(AsyncCommunicatorTest, BucketStaysOpenUntilWaitOrDoneOrFlush) {
  constexpr int kRanks = 2;
  auto comms = MakeGroup(kRanks);
  RunRanks(kRanks, [&](int rank) {
    AsyncCommunicator async(comms[static_cast<size_t>(rank)], AsyncOptions{1 << 20});
    std::vector<float> x(8, 1.0f), y(8, 1.0f), z(8, 1.0f);
    auto hx = async.AllReduceAsync(x.data(), x.data(), x.size(), DType::kFloat32, ReduceOp::kSum);
    auto hy = async.AllReduceAsync(y.data(), y.data(), y.size(), DType::kFloat32, ReduceOp::kSum);
    // Nothing closes the bucket by itself: boundaries never depend on time.
    std::this_thread::sleep_for(milliseconds(50));
    EXPECT_TRUE(comms[static_cast<size_t>(rank)]->allreduce_counts().empty());
    EXPECT_EQ(hy.status().code(), StatusCode::kFailedPrecondition);  // still running
    // Waiting on a handle of the open bucket closes it: both complete.
    ASSERT_TRUE(hy.Wait(kWait).ok());
    EXPECT_TRUE(hx.Done());
    EXPECT_TRUE(hx.status().ok());
    EXPECT_EQ(async.bucket_flushes(), 1u);
    // Polling Done() closes the bucket as well.
    auto hz = async.AllReduceAsync(z.data(), z.data(), z.size(), DType::kFloat32, ReduceOp::kSum);
    const auto deadline = Clock::now() + kWait;
    while (!hz.Done() && Clock::now() < deadline) std::this_thread::yield();
    EXPECT_TRUE(hz.status().ok());
    EXPECT_EQ(async.bucket_flushes(), 2u);
    // And Flush() / Synchronize() close it explicitly.
    auto hx2 = async.AllReduceAsync(x.data(), x.data(), x.size(), DType::kFloat32, ReduceOp::kSum);
    async.Flush();
    ASSERT_TRUE(async.Synchronize(kWait).ok());
    EXPECT_TRUE(hx2.Done());
    EXPECT_EQ(async.bucket_flushes(), 3u);
    for (float v : x) EXPECT_EQ(v, 4.0f);
    for (float v : y) EXPECT_EQ(v, 2.0f);
    for (float v : z) EXPECT_EQ(v, 2.0f);
  });
  const std::vector<size_t> want = {16, 8, 8};
  for (const auto& comm : comms) EXPECT_EQ(comm->allreduce_counts(), want);
}

TEST(AsyncCommunicatorTest, FusionDisabledRunsEachAllReduce) {
  constexpr int kRanks = 2;
  auto comms = MakeGroup(kRanks);
  RunRanks(kRanks, [&](int rank) {
    AsyncCommunicator async(comms[static_cast<size_t>(rank)], AsyncOptions{0});
    std::vector<std::vector<int32_t>> t(5, std::vector<int32_t>(3, rank));
    std::vector<AsyncCommunicator::Handle> h;
    for (auto& v : t) h.push_back(async.AllReduceAsync(v.data(), v.data(), v.size(), DType::kInt32, ReduceOp::kSum));
    ASSERT_TRUE(async.Synchronize(kWait).ok());
    for (auto& x : h) EXPECT_TRUE(x.status().ok());
    for (auto& v : t) EXPECT_EQ(v, std::vector<int32_t>(3, 1));
    EXPECT_EQ(async.bucket_flushes(), 0u);
    EXPECT_EQ(async.fused_tensors(), 0u);
  });
  for (const auto& comm : comms) EXPECT_EQ(comm->allreduce_counts().size(), 5u);
}

TEST(AsyncCommunicatorTest, EveryKindRunsInSubmissionOrder) {
  constexpr int kRanks = 3;
  auto comms = MakeGroup(kRanks);
  RunRanks(kRanks, [&](int rank) {
    AsyncCommunicator async(comms[static_cast<size_t>(rank)]);
    std::vector<int32_t> rs_in(6), rs_out(2), ag_out(6), bc(4, rank == 1 ? 7 : 0), red(2, rank + 1), red_out(2, 0);
    for (int i = 0; i < 6; ++i) rs_in[static_cast<size_t>(i)] = rank * 100 + i;
    int32_t mine = rank * 10;
    std::vector<int32_t> ring(1, -1);
    const int right = (rank + 1) % kRanks, left = (rank + kRanks - 1) % kRanks;
    std::vector<AsyncCommunicator::Handle> h;
    h.push_back(async.ReduceScatterAsync(rs_in.data(), rs_out.data(), 2, DType::kInt32, ReduceOp::kSum));
    h.push_back(async.AllGatherAsync(&mine, ag_out.data(), 1, DType::kInt32));
    h.push_back(async.BroadcastAsync(bc.data(), bc.size(), DType::kInt32, 1));
    h.push_back(async.ReduceAsync(red.data(), red_out.data(), red.size(), DType::kInt32, ReduceOp::kMax, 2));
    h.push_back(async.BarrierAsync());
    h.push_back(async.SendAsync(right, &mine, 1, DType::kInt32));
    h.push_back(async.RecvAsync(left, ring.data(), 1, DType::kInt32));
    for (auto& x : h) ASSERT_TRUE(x.Wait(kWait).ok()) << x.status().ToString();
    // Block `rank` of every rank's input, summed: 300 + 3 * (2 * rank + k).
    EXPECT_EQ(rs_out, (std::vector<int32_t>{300 + 6 * rank, 300 + 6 * rank + 3}));
    EXPECT_EQ(std::vector<int32_t>(ag_out.begin(), ag_out.begin() + 3), (std::vector<int32_t>{0, 10, 20}));
    EXPECT_EQ(bc, std::vector<int32_t>(4, 7));
    if (rank == 2) {
      EXPECT_EQ(red_out, std::vector<int32_t>(2, 3));
    }
    EXPECT_EQ(ring[0], left * 10);
    EXPECT_EQ(async.ops(), 7u);
    EXPECT_EQ(async.progress().last_completed, 5u);  // five numbered collectives
  });
}

// A float32 sum allreduce of each tensor, in place.
std::vector<AsyncCommunicator::Handle> AllReduceEach(AsyncCommunicator& async, std::vector<std::vector<float>>& t) {
  std::vector<AsyncCommunicator::Handle> h;
  for (auto& v : t) h.push_back(async.AllReduceAsync(v.data(), v.data(), v.size(), DType::kFloat32, ReduceOp::kSum));
  return h;
}

// The error is published while a bucket is still open: the bucket's
// handles fail with it, before anything submitted after them.
TEST(AsyncCommunicatorTest, AnOpenBucketFailsWithTheErrorBeforeLaterOperations) {
  constexpr int kRanks = 2;
  auto comms = MakeGroup(kRanks);
  for (auto& c : comms) c->fail_at = 1;  // the first allreduce fails on every rank
  RunRanks(kRanks, [&](int rank) {
    AsyncCommunicator async(comms[static_cast<size_t>(rank)], AsyncOptions{256});
    std::vector<std::vector<float>> t(5, std::vector<float>(16, 1.0f));  // 64 bytes: 4 per bucket
    auto h = AllReduceEach(async, t);
    // The first bucket runs and fails; the fifth tensor's bucket stays open.
    ASSERT_EQ(h[0].Wait(kWait).code(), StatusCode::kUnavailable);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // let the error be published
    auto barrier = async.BarrierAsync();
    EXPECT_EQ(barrier.Wait(kWait).code(), StatusCode::kUnavailable) << barrier.status().ToString();
    ASSERT_TRUE(h[4].Done()) << "the open bucket was left behind";
    EXPECT_EQ(h[4].status(), h[0].status());
  });
}

TEST(AsyncCommunicatorTest, AnErrorFailsEveryHandleOfTheBucketAndEverythingAfter) {
  constexpr int kRanks = 2;
  auto comms = MakeGroup(kRanks);
  for (auto& c : comms) c->fail_at = 2;  // the second allreduce fails on every rank
  RunRanks(kRanks, [&](int rank) {
    AsyncCommunicator async(comms[static_cast<size_t>(rank)], AsyncOptions{256});
    std::vector<std::vector<float>> t(12, std::vector<float>(16, 1.0f));  // 64 bytes: 4 per bucket
    auto h = AllReduceEach(async, t);
    auto barrier = async.BarrierAsync();
    ASSERT_TRUE(barrier.Wait(kWait).code() == StatusCode::kUnavailable) << barrier.status().ToString();
    for (size_t i = 0; i < 4; ++i) EXPECT_TRUE(h[i].status().ok()) << i;
    for (size_t i = 4; i < 12; ++i) {
      ASSERT_TRUE(h[i].Done());
      EXPECT_EQ(h[i].status().code(), StatusCode::kUnavailable) << i;
      EXPECT_NE(h[i].status().message().find("injected failure"), std::string::npos) << h[i].status().ToString();
    }
    EXPECT_EQ(barrier.status(), h[4].status());
    // Later operations fail at once with the same error, without running.
    std::vector<float> more(4, 1.0f);
    auto late = async.AllReduceAsync(more.data(), more.data(), more.size(), DType::kFloat32, ReduceOp::kSum);
    EXPECT_TRUE(late.Done());
    EXPECT_EQ(late.status(), h[4].status());
    EXPECT_EQ(async.health(), h[4].status());
    EXPECT_EQ(async.Synchronize(kWait), h[4].status());
    for (float v : t[0]) EXPECT_EQ(v, 2.0f);
  });
  // Buckets 1 and 2 reached the communicator; bucket 3 failed fast.
  for (const auto& comm : comms) EXPECT_EQ(comm->allreduce_counts().size(), 2u);
}

TEST(AsyncCommunicatorTest, AbortFailsTheOperationInFlightAndTheQueuePromptly) {
  // Rank 1 never takes part: rank 0's barrier stays in flight.
  auto comms = MakeGroup(2, milliseconds(30000));
  AsyncCommunicator async(comms[0]);
  std::vector<float> a(4, 1.0f);
  std::vector<AsyncCommunicator::Handle> h;
  h.push_back(async.BarrierAsync());
  h.push_back(async.BroadcastAsync(a.data(), a.size(), DType::kFloat32, 0));
  h.push_back(async.AllReduceAsync(a.data(), a.data(), a.size(), DType::kFloat32, ReduceOp::kSum));  // open bucket
  std::this_thread::sleep_for(milliseconds(50));
  EXPECT_FALSE(h[0].Done());
  const auto start = Clock::now();
  async.Abort("epoch 1 was superseded by epoch 2");
  for (auto& x : h) {
    const Status s = x.Wait(milliseconds(2000));
    EXPECT_EQ(s.code(), StatusCode::kAborted) << s.ToString();
    EXPECT_NE(s.message().find("epoch 1 was superseded by epoch 2"), std::string::npos) << s.ToString();
  }
  EXPECT_LT(Clock::now() - start, milliseconds(2000));
  auto late = async.BarrierAsync();
  EXPECT_TRUE(late.Done());
  EXPECT_EQ(late.status().code(), StatusCode::kAborted);
}

TEST(AsyncCommunicatorTest, DestructorWithQueuedWorkDoesNotHang) {
  auto comms = MakeGroup(2, milliseconds(30000));
  std::vector<float> a(4, 1.0f), b(4, 1.0f);
  std::vector<AsyncCommunicator::Handle> h;
  const auto start = Clock::now();
  {
    AsyncCommunicator async(comms[0]);
    h.push_back(async.BarrierAsync());  // in flight: rank 1 never comes
    h.push_back(async.AllGatherAsync(a.data(), b.data(), 2, DType::kFloat32));
    h.push_back(async.AllReduceAsync(a.data(), a.data(), a.size(), DType::kFloat32, ReduceOp::kSum));  // open bucket
    std::this_thread::sleep_for(milliseconds(20));
  }
  EXPECT_LT(Clock::now() - start, milliseconds(3000));
  for (auto& x : h) {
    ASSERT_TRUE(x.Done());
    EXPECT_EQ(x.status().code(), StatusCode::kAborted);
    EXPECT_NE(x.status().message().find("communicator closed"), std::string::npos) << x.status().ToString();
  }
  // Handles outlive the communicator.
  EXPECT_EQ(h[2].Wait(milliseconds(0)).code(), StatusCode::kAborted);
}

TEST(AsyncCommunicatorTest, WaitTimeoutMeansNotDoneYet) {
  auto comms = MakeGroup(2, milliseconds(30000));
  AsyncCommunicator async(comms[0]);
  auto h = async.BarrierAsync();
  EXPECT_EQ(h.Wait(milliseconds(20)).code(), StatusCode::kDeadlineExceeded);
  EXPECT_FALSE(h.Done());
  AsyncCommunicator::Handle empty;
  EXPECT_TRUE(empty.Done());
  EXPECT_EQ(empty.Wait(milliseconds(0)).code(), StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace tandem::comm
