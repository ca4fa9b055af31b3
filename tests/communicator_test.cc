// The communicators, over every backend of comm_backends.h: one shared suite
// over backend x world size x element count x dtype x op that runs every
// collective and checks it against a double-precision reference; then
// disagreeing ranks, dead and absent peers, Abort, progress, concurrent
// groups and a new epoch after an abort. Last, what is particular to the
// transport communicator: both algorithm families at every world size, and
// the selection rule.
//
// Ranks run as threads of this process; every call is bounded by the
// communicator's timeout, so a bug fails a test rather than hanging it.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "comm_backends.h"
#include "reference.h"
#include "worker/collectives/dtype.h"

namespace tandem::comm_test {
namespace {

using collectives::DType;
using collectives::ReduceOp;
using collectives::SizeOf;
using comm::CommInfo;
using comm::Communicator;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

// ---- Groups and ranks.

const Backend* FindBackend(const std::string& name) {
  for (const auto& backend : AllBackends()) {
    if (backend.name == name) return &backend;
  }
  return nullptr;
}

// A CommInfo with a name no other group of this process has.
CommInfo Base(milliseconds timeout, uint64_t epoch = 1) {
  static std::atomic<int> next{0};
  CommInfo info;
  info.name = "group" + std::to_string(next.fetch_add(1));
  info.epoch = epoch;
  info.timeout = timeout;
  return info;
}

// Runs body(rank, communicator) on one thread per rank; returns each rank's status.
std::vector<Status> RunRanks(Group& group, const std::function<Status(int, Communicator&)>& body) {
  const size_t n = group.comms.size();
  std::vector<Status> results(n);
  std::vector<std::thread> threads;
  for (size_t r = 0; r < n; ++r) {
    threads.emplace_back([&, r] { results[r] = body(static_cast<int>(r), *group.comms[r]); });
  }
  for (auto& thread : threads) thread.join();
  return results;
}

std::string Describe(const std::vector<Status>& statuses) {
  std::string out;
  for (size_t r = 0; r < statuses.size(); ++r) out += "\n  rank " + std::to_string(r) + ": " + statuses[r].ToString();
  return out;
}

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// ---- Values and the reference: tests/reference.h.

using reference::Expected;
using reference::IsInt;
using reference::Load;
using reference::Store;
using reference::Tolerance;
using reference::Value;

// A buffer of `count` elements holding Value(rank, i, seed); one spare byte
// so that data() is not null when count is 0.
std::vector<char> Filled(DType dtype, size_t count, int rank, uint64_t seed) {
  std::vector<char> buffer(count * SizeOf(dtype) + 1);
  for (size_t i = 0; i < count; ++i) Store(dtype, buffer.data(), i, Value(rank, i, seed));
  return buffer;
}

std::vector<char> Garbage(DType dtype, size_t count) {
  return std::vector<char>(count * SizeOf(dtype) + 1, '\x5a');
}

// Checks got[0..count) against want(i) within the tolerance of (dtype, op);
// reports the first few differences.
void ExpectNear(const std::string& what, DType dtype, ReduceOp op, const void* got, size_t count,
                const std::function<double(size_t)>& want) {
  size_t wrong = 0;
  for (size_t i = 0; i < count; ++i) {
    const double g = Load(dtype, got, i);
    const double w = want(i);
    if (std::abs(g - w) > Tolerance(dtype, op) * std::max(1.0, std::abs(w))) {
      if (wrong++ < 3) ADD_FAILURE() << what << " element " << i << ": " << g << " != " << w;
    }
  }
  EXPECT_EQ(wrong, 0u) << what;
}

void ExpectSameBytes(const std::string& what, const void* got, const void* want, size_t bytes) {
  if (bytes > 0 && std::memcmp(got, want, bytes) != 0) ADD_FAILURE() << what << " differs";
}

// ---- The shared suite.

struct Case {
  std::string backend;
  int world;
  size_t count;
  DType dtype;
  ReduceOp op;
};

// Above this count the suite gathers and scatters count / world elements per
// rank and uses one root, to keep memory and time down.
constexpr size_t kLarge = 100000;

std::vector<int> Roots(int world, size_t count) {
  if (count > kLarge) return {world - 1};
  std::vector<int> roots = {0, world - 1, world / 2};
  std::sort(roots.begin(), roots.end());
  roots.erase(std::unique(roots.begin(), roots.end()), roots.end());
  return roots;
}

struct RankData {
  std::vector<char> in;        // allreduce, reduce, send
  std::vector<char> out;       // allreduce
  std::vector<char> in_place;  // allreduce with in == out
  std::vector<char> rs_in;     // reduce_scatter: `block` elements per rank
  std::vector<char> rs_out;
  std::vector<char> ag_out;                // all_gather of in[0..block)
  std::vector<std::vector<char>> bcast;    // one per root
  std::vector<std::vector<char>> reduced;  // one per root (on the root only)
  std::vector<char> received;              // send/recv ring
};

// Runs every collective on a group of `c.world` ranks of `backend` and checks
// each against the reference. The op-independent collectives run for op sum
// only.
void CheckEveryCollective(const Backend& backend, const Case& c) {
  const int n = c.world;
  const auto un = static_cast<size_t>(n);
  const size_t element = SizeOf(c.dtype);
  const size_t block = c.count > kLarge ? c.count / un : c.count;
  const bool op_free = c.op == ReduceOp::kSum;
  const std::vector<int> roots = Roots(n, c.count);
  const uint64_t seed = 0x5eed0000ULL + c.count * 131 + static_cast<uint64_t>(n) * 7 + static_cast<uint64_t>(c.op);
  const uint64_t rs_seed = seed + 1;
  const uint64_t bcast_seed = seed + 2;

  std::vector<RankData> data(un);
  for (int r = 0; r < n; ++r) {
    RankData& d = data[static_cast<size_t>(r)];
    d.in = Filled(c.dtype, c.count, r, seed);
    d.out = Garbage(c.dtype, c.count);
    d.in_place = d.in;
    d.rs_in = Filled(c.dtype, block * un, r, rs_seed);
    d.rs_out = Garbage(c.dtype, block);
    for (int root : roots) {
      d.reduced.push_back(r == root ? Garbage(c.dtype, c.count) : std::vector<char>());
      if (op_free) {
        d.bcast.push_back(r == root ? Filled(c.dtype, c.count, root, bcast_seed + static_cast<uint64_t>(root))
                                    : Garbage(c.dtype, c.count));
      }
    }
    if (op_free) {
      d.ag_out = Garbage(c.dtype, block * un);
      d.received = Garbage(c.dtype, c.count);
    }
  }

  auto made = backend.make_group(n, Base(milliseconds(30000)));
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  Group& group = *made;
  const auto results = RunRanks(group, [&](int r, Communicator& comm) -> Status {
    RankData& d = data[static_cast<size_t>(r)];
    TANDEM_RETURN_IF_ERROR(comm.AllReduce(d.in.data(), d.out.data(), c.count, c.dtype, c.op).WithContext("allreduce"));
    TANDEM_RETURN_IF_ERROR(
        comm.AllReduce(d.in_place.data(), d.in_place.data(), c.count, c.dtype, c.op).WithContext("allreduce in place"));
    TANDEM_RETURN_IF_ERROR(
        comm.ReduceScatter(d.rs_in.data(), d.rs_out.data(), block, c.dtype, c.op).WithContext("reduce_scatter"));
    for (size_t k = 0; k < roots.size(); ++k) {
      // Non-roots pass a null output: they must not touch it.
      void* out = r == roots[k] ? d.reduced[k].data() : nullptr;
      TANDEM_RETURN_IF_ERROR(comm.Reduce(d.in.data(), out, c.count, c.dtype, c.op, roots[k])
                                 .WithContext(fmt::format("reduce to root {}", roots[k])));
    }
    if (!op_free) return Status::Ok();
    TANDEM_RETURN_IF_ERROR(comm.AllGather(d.in.data(), d.ag_out.data(), block, c.dtype).WithContext("all_gather"));
    for (size_t k = 0; k < roots.size(); ++k) {
      TANDEM_RETURN_IF_ERROR(comm.Broadcast(d.bcast[k].data(), c.count, c.dtype, roots[k])
                                 .WithContext(fmt::format("broadcast from root {}", roots[k])));
    }
    TANDEM_RETURN_IF_ERROR(comm.Barrier().WithContext("barrier"));
    if (n > 1) {
      // A ring: each rank sends its input right and receives from the left;
      // even ranks send first, odd ranks receive first, so backends whose
      // sends wait for the receiver do not deadlock.
      const int right = (r + 1) % n;
      const int left = (r + n - 1) % n;
      auto send = [&] {
        return comm.Send(right, d.in.data(), c.count, c.dtype).WithContext(fmt::format("send to {}", right));
      };
      auto recv = [&] {
        return comm.Recv(left, d.received.data(), c.count, c.dtype).WithContext(fmt::format("recv from {}", left));
      };
      if (r % 2 == 0) {
        TANDEM_RETURN_IF_ERROR(send());
        TANDEM_RETURN_IF_ERROR(recv());
      } else {
        TANDEM_RETURN_IF_ERROR(recv());
        TANDEM_RETURN_IF_ERROR(send());
      }
    }
    return Status::Ok();
  });
  for (int r = 0; r < n; ++r) ASSERT_TRUE(results[static_cast<size_t>(r)].ok()) << Describe(results);

  const size_t numbered = 3 + roots.size() + (op_free ? 2 + roots.size() : 0);
  std::vector<double> expected(c.count);
  for (size_t i = 0; i < c.count; ++i) expected[i] = Expected(n, i, seed, c.op, c.dtype);
  const auto want = [&](size_t i) { return expected[i]; };
  for (int r = 0; r < n; ++r) {
    const auto ur = static_cast<size_t>(r);
    const RankData& d = data[ur];
    const std::string rank = "rank " + std::to_string(r) + " ";
    ExpectNear(rank + "allreduce", c.dtype, c.op, d.out.data(), c.count, want);
    // Every rank holds the same bits, in place or not.
    ExpectSameBytes(rank + "allreduce (against rank 0)", d.out.data(), data[0].out.data(), c.count * element);
    ExpectSameBytes(rank + "allreduce in place", d.in_place.data(), d.out.data(), c.count * element);
    ExpectNear(rank + "reduce_scatter", c.dtype, c.op, d.rs_out.data(), block,
               [&](size_t i) { return Expected(n, ur * block + i, rs_seed, c.op, c.dtype); });
    for (size_t k = 0; k < roots.size(); ++k) {
      if (r == roots[k]) {
        ExpectNear(rank + "reduce to root " + std::to_string(roots[k]), c.dtype, c.op, d.reduced[k].data(), c.count,
                   want);
      }
    }
    if (op_free) {
      for (int q = 0; q < n; ++q) {
        ExpectSameBytes(rank + "all_gather block " + std::to_string(q),
                        d.ag_out.data() + static_cast<size_t>(q) * block * element,
                        data[static_cast<size_t>(q)].in.data(), block * element);
      }
      for (size_t k = 0; k < roots.size(); ++k) {
        const auto sent = Filled(c.dtype, c.count, roots[k], bcast_seed + static_cast<uint64_t>(roots[k]));
        ExpectSameBytes(rank + "broadcast from root " + std::to_string(roots[k]), d.bcast[k].data(), sent.data(),
                        c.count * element);
      }
      if (n > 1) {
        ExpectSameBytes(rank + "recv", d.received.data(), data[static_cast<size_t>((r + n - 1) % n)].in.data(),
                        c.count * element);
      }
    }
    const auto progress = group.comms[ur]->progress();
    EXPECT_EQ(progress.last_entered, numbered) << rank;
    EXPECT_EQ(progress.last_completed, numbered) << rank;
  }
}

class CommunicatorSuite : public ::testing::TestWithParam<Case> {};

TEST_P(CommunicatorSuite, EveryCollectiveMatchesADoublePrecisionReference) {
  const Case& c = GetParam();
  const Backend* backend = FindBackend(c.backend);
  ASSERT_NE(backend, nullptr);
  CheckEveryCollective(*backend, c);
}

std::vector<Case> SuiteCases() {
  std::vector<Case> cases;
  const DType dtypes[] = {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kInt32, DType::kInt64};
  const ReduceOp ops[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax};
  for (const auto& backend : AllBackends()) {
    for (int world = 1; world <= 8; ++world) {
      // 1021 (prime, so never divisible by the world size) is below the
      // default small-message threshold in every dtype; 33331 (prime) is
      // above it in every dtype.
      for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{13}, size_t{1021}, size_t{33331}}) {
        for (DType dtype : dtypes) {
          for (ReduceOp op : ops) cases.push_back({backend.name, world, count, dtype, op});
        }
      }
    }
    // A few MiB, for the pipelined paths with several chunks per step.
    for (int world : {3, 5, 8})
      cases.push_back({backend.name, world, (size_t{1} << 20) + 3, DType::kFloat32, ReduceOp::kSum});
    cases.push_back({backend.name, 4, (size_t{1} << 20) + 1, DType::kBFloat16, ReduceOp::kAvg});
    cases.push_back({backend.name, 6, (size_t{1} << 19) + 7, DType::kInt64, ReduceOp::kMax});
  }
  return cases;
}

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return c.backend + "_w" + std::to_string(c.world) + "_n" + std::to_string(c.count) + "_" +
         std::string(collectives::Name(c.dtype)) + "_" + std::string(collectives::Name(c.op));
}

INSTANTIATE_TEST_SUITE_P(Backends, CommunicatorSuite, ::testing::ValuesIn(SuiteCases()), CaseName);

// ---- Failures, per backend.

class CommunicatorFailureTest : public ::testing::TestWithParam<std::string> {
 protected:
  const Backend& backend() const { return *FindBackend(GetParam()); }
  Group MakeGroup(int world, milliseconds timeout, uint64_t epoch = 1) {
    auto made = backend().make_group(world, Base(timeout, epoch));
    EXPECT_TRUE(made.ok()) << made.status().ToString();
    return made.ok() ? std::move(made).value() : Group();
  }
};

struct Disagreement {
  const char* what;
  // What rank r calls; rank 1 disagrees with the others.
  std::function<Status(int r, Communicator& comm, std::vector<float>& buffer)> call;
  // Both sides, as the error describes them.
  std::string odd;
  std::string others;
};

TEST_P(CommunicatorFailureTest, RanksThatDisagreeGetInvalidArgumentNamingBothSides) {
  const std::vector<Disagreement> disagreements = {
      {"count",
       [](int r, Communicator& comm, std::vector<float>& b) {
         return comm.AllReduce(b.data(), b.data(), r == 1 ? 99 : 100, DType::kFloat32, ReduceOp::kSum);
       },
       "rank 1 runs allreduce seq 1 of 99 float32 elements (op sum)", "allreduce seq 1 of 100 float32 elements"},
      {"dtype",
       [](int r, Communicator& comm, std::vector<float>& b) {
         return comm.AllReduce(b.data(), b.data(), 64, r == 1 ? DType::kBFloat16 : DType::kFloat16, ReduceOp::kSum);
       },
       "rank 1 runs allreduce seq 1 of 64 bfloat16 elements", "allreduce seq 1 of 64 float16 elements"},
      {"op",
       [](int r, Communicator& comm, std::vector<float>& b) {
         return comm.AllReduce(b.data(), b.data(), 64, DType::kFloat32, r == 1 ? ReduceOp::kMax : ReduceOp::kSum);
       },
       "rank 1 runs allreduce seq 1 of 64 float32 elements (op max)", "64 float32 elements (op sum)"},
      {"broadcast root",
       [](int r, Communicator& comm, std::vector<float>& b) {
         return comm.Broadcast(b.data(), 64, DType::kFloat32, r == 1 ? 2 : 3);
       },
       "rank 1 runs broadcast seq 1 of 64 float32 elements from root 2", "from root 3"},
      {"reduce root",
       [](int r, Communicator& comm, std::vector<float>& b) {
         return comm.Reduce(b.data(), b.data(), 64, DType::kFloat32, ReduceOp::kSum, r == 1 ? 0 : 3);
       },
       "rank 1 runs reduce seq 1 of 64 float32 elements (op sum) to root 0", "to root 3"},
      {"kind",
       [](int r, Communicator& comm, std::vector<float>& b) {
         if (r == 1) return comm.Barrier();
         return comm.AllReduce(b.data(), b.data(), 64, DType::kFloat32, ReduceOp::kSum);
       },
       "rank 1 runs barrier seq 1", "allreduce seq 1 of 64 float32 elements"},
      {"large count",  // above the small-message threshold: the ring
       [](int r, Communicator& comm, std::vector<float>& b) {
         return comm.AllReduce(b.data(), b.data(), r == 1 ? 99999 : 100000, DType::kFloat32, ReduceOp::kSum);
       },
       "rank 1 runs allreduce seq 1 of 99999 float32 elements", "allreduce seq 1 of 100000 float32 elements"},
  };
  const milliseconds timeout(10000);
  for (const auto& d : disagreements) {
    SCOPED_TRACE(d.what);
    Group group = MakeGroup(4, timeout);
    ASSERT_EQ(group.comms.size(), 4u);
    std::vector<std::vector<float>> buffers(4, std::vector<float>(100000, 1.f));
    const auto start = Clock::now();
    const auto results =
        RunRanks(group, [&](int r, Communicator& comm) { return d.call(r, comm, buffers[static_cast<size_t>(r)]); });
    // Promptly: the ranks that see the disagreement tell the others.
    EXPECT_LT(Clock::now() - start, timeout / 4) << Describe(results);
    std::string all;
    for (int r = 0; r < 4; ++r) {
      const Status& s = results[static_cast<size_t>(r)];
      all += s.message() + "\n";
      // The odd rank and its neighbours see it; rank 3 either hears of it
      // or, where its part finished first (the root of a broadcast), has
      // correct data and fails at the next call.
      if (r == 3 && s.ok()) continue;
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << "rank " << r << Describe(results);
      EXPECT_TRUE(Contains(s.message(), "rank 1")) << "rank " << r << Describe(results);
    }
    EXPECT_TRUE(Contains(all, d.odd)) << all;
    EXPECT_TRUE(Contains(all, d.others)) << all;
    // After an error the communicator stays broken, with the first error.
    const auto again = RunRanks(group, [&](int, Communicator& comm) { return comm.Barrier(); });
    for (int r = 0; r < 4; ++r) {
      const auto ur = static_cast<size_t>(r);
      EXPECT_EQ(again[ur].code(), StatusCode::kInvalidArgument) << "rank " << r << Describe(again);
      if (!results[ur].ok()) {
        EXPECT_EQ(again[ur], results[ur]) << "rank " << r;
      }
      EXPECT_EQ(group.comms[ur]->health(), again[ur]) << "rank " << r;
    }
  }
}

TEST_P(CommunicatorFailureTest, ARankKilledMidCollectiveIsNamedBySurvivorsWithinTheTimeout) {
  if (!backend().supports_kill) GTEST_SKIP() << "backend " << GetParam() << " cannot kill a rank";
  const milliseconds timeout(2000);
  for (size_t count : {size_t{1000}, size_t{1} << 16}) {  // both algorithm families
    SCOPED_TRACE("count " + std::to_string(count));
    Group group = MakeGroup(4, timeout);
    ASSERT_EQ(group.comms.size(), 4u);
    std::vector<std::vector<float>> buffers(4, std::vector<float>(count, 1.f));
    std::atomic<int64_t> killed_at{0};
    std::vector<Clock::time_point> failed_at(4);
    const auto results = RunRanks(group, [&](int r, Communicator& comm) -> Status {
      auto& b = buffers[static_cast<size_t>(r)];
      for (int i = 0; i < 3; ++i)
        TANDEM_RETURN_IF_ERROR(comm.AllReduce(b.data(), b.data(), count, DType::kFloat32, ReduceOp::kSum));
      if (r == 2) {
        // Rank 2 dies while the others wait in the fourth allreduce.
        std::this_thread::sleep_for(milliseconds(100));
        killed_at = Clock::now().time_since_epoch().count();
        group.kill(2);
        return Status::Ok();
      }
      Status s;
      for (int i = 0; i < 1000 && s.ok(); ++i)
        s = comm.AllReduce(b.data(), b.data(), count, DType::kFloat32, ReduceOp::kSum);
      failed_at[static_cast<size_t>(r)] = Clock::now();
      return s;
    });
    const Clock::time_point kill_time{Clock::duration(killed_at.load())};
    for (int r : {0, 1, 3}) {
      const auto ur = static_cast<size_t>(r);
      const Status& s = results[ur];
      EXPECT_TRUE(s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kDeadlineExceeded)
          << "rank " << r << Describe(results);
      EXPECT_TRUE(Contains(s.message(), "rank 2")) << "rank " << r << Describe(results);
      EXPECT_LT(failed_at[ur] - kill_time, timeout) << "rank " << r;
      const auto progress = group.comms[ur]->progress();
      EXPECT_EQ(progress.last_entered, 4u) << "rank " << r;
      EXPECT_EQ(progress.last_completed, 3u) << "rank " << r;
      EXPECT_EQ(progress.last_kind, "allreduce") << "rank " << r;
    }
  }
}

TEST_P(CommunicatorFailureTest, ARankKilledWhileEveryRankIsInsideNeverHangsTheOthers) {
  if (!backend().supports_kill) GTEST_SKIP() << "backend " << GetParam() << " cannot kill a rank";
  const milliseconds timeout(2000);
  Group group = MakeGroup(5, timeout);
  ASSERT_EQ(group.comms.size(), 5u);
  std::vector<std::vector<float>> buffers(5, std::vector<float>(size_t{1} << 18, 1.f));
  std::thread killer([&] {
    std::this_thread::sleep_for(milliseconds(30));
    group.kill(2);
  });
  const auto start = Clock::now();
  const auto results = RunRanks(group, [&](int r, Communicator& comm) -> Status {
    auto& b = buffers[static_cast<size_t>(r)];
    for (int i = 0; i < 100000; ++i) {
      TANDEM_RETURN_IF_ERROR(comm.AllReduce(b.data(), b.data(), b.size(), DType::kFloat32, ReduceOp::kMax));
    }
    return Status::Ok();
  });
  killer.join();
  // Never hangs: a generous bound (a sanitizer build on a loaded 2-core
  // machine once took 13.5 s); how fast survivors notice is measured by
  // ARankKilledMidCollectiveIsNamedBySurvivorsWithinTheTimeout.
  EXPECT_LT(Clock::now() - start, 15 * timeout) << Describe(results);
  for (int r : {0, 1, 3, 4}) {
    const Status& s = results[static_cast<size_t>(r)];
    EXPECT_TRUE(s.code() == StatusCode::kUnavailable || s.code() == StatusCode::kDeadlineExceeded)
        << "rank " << r << Describe(results);
    EXPECT_TRUE(Contains(s.message(), "rank 2")) << "rank " << r << Describe(results);
  }
}

TEST_P(CommunicatorFailureTest, ARankThatNeverEntersIsADeadlineNamingIt) {
  const milliseconds timeout(1000);
  for (size_t count : {size_t{100}, size_t{1} << 16}) {
    SCOPED_TRACE("count " + std::to_string(count));
    Group group = MakeGroup(4, timeout);
    ASSERT_EQ(group.comms.size(), 4u);
    std::vector<std::vector<float>> buffers(4, std::vector<float>(count, 1.f));
    const auto start = Clock::now();
    const auto results = RunRanks(group, [&](int r, Communicator& comm) -> Status {
      if (r == 2) return Status::Ok();  // busy elsewhere: never calls
      auto& b = buffers[static_cast<size_t>(r)];
      return comm.AllReduce(b.data(), b.data(), count, DType::kFloat32, ReduceOp::kSum);
    });
    const auto elapsed = Clock::now() - start;
    EXPECT_GE(elapsed, timeout);
    EXPECT_LT(elapsed, timeout + milliseconds(1500)) << Describe(results);
    std::string all;
    for (int r : {0, 1, 3}) {
      const Status& s = results[static_cast<size_t>(r)];
      all += s.message() + "\n";
      EXPECT_EQ(s.code(), StatusCode::kDeadlineExceeded) << "rank " << r << Describe(results);
      EXPECT_TRUE(Contains(s.message(), "rank 2 never entered this collective within 1000 ms"))
          << "rank " << r << Describe(results);
    }
  }
}

TEST_P(CommunicatorFailureTest, AbortWakesWaitingRanksPromptlyWithTheReason) {
  const milliseconds timeout(30000);
  Group group = MakeGroup(4, timeout);
  ASSERT_EQ(group.comms.size(), 4u);
  const std::string reason = "epoch 1 was superseded by epoch 2";
  std::vector<std::vector<float>> buffers(4, std::vector<float>(1 << 16, 1.f));
  std::atomic<bool> aborted{false};
  std::thread aborter([&] {
    std::this_thread::sleep_for(milliseconds(200));
    for (auto& comm : group.comms) comm->Abort(reason);
    aborted = true;
  });
  const auto start = Clock::now();
  std::vector<Clock::duration> took(4);
  const auto results = RunRanks(group, [&](int r, Communicator& comm) -> Status {
    auto& b = buffers[static_cast<size_t>(r)];
    if (r == 3) {  // never enters before the abort, then tries
      while (!aborted) std::this_thread::sleep_for(milliseconds(5));
      return comm.AllReduce(b.data(), b.data(), b.size(), DType::kFloat32, ReduceOp::kSum);
    }
    const Status s = comm.AllReduce(b.data(), b.data(), b.size(), DType::kFloat32, ReduceOp::kSum);
    took[static_cast<size_t>(r)] = Clock::now() - start;
    return s;
  });
  aborter.join();
  for (int r = 0; r < 4; ++r) {
    const auto ur = static_cast<size_t>(r);
    EXPECT_EQ(results[ur].code(), StatusCode::kAborted) << "rank " << r << Describe(results);
    EXPECT_TRUE(Contains(results[ur].message(), reason)) << "rank " << r << Describe(results);
    if (r != 3) {
      EXPECT_LT(took[ur], milliseconds(2000)) << "rank " << r;  // 200 ms + a slice or so
    }
    EXPECT_EQ(group.comms[ur]->health().code(), StatusCode::kAborted);
    float x = 0;
    EXPECT_EQ(group.comms[ur]->Send((r + 1) % 4, &x, 1, DType::kFloat32).code(), StatusCode::kAborted);
  }

  // The next epoch: a new group (a new fabric) works.
  Group next = MakeGroup(4, timeout, /*epoch=*/2);
  ASSERT_EQ(next.comms.size(), 4u);
  std::vector<std::vector<int32_t>> values(4);
  const auto ok = RunRanks(next, [&](int r, Communicator& comm) {
    values[static_cast<size_t>(r)].assign(1000, r + 1);
    EXPECT_EQ(comm.epoch(), 2u);
    return comm.AllReduce(values[static_cast<size_t>(r)].data(), values[static_cast<size_t>(r)].data(), 1000,
                          DType::kInt32, ReduceOp::kSum);
  });
  for (int r = 0; r < 4; ++r) {
    ASSERT_TRUE(ok[static_cast<size_t>(r)].ok()) << Describe(ok);
    EXPECT_EQ(values[static_cast<size_t>(r)][999], 10);
  }
}

TEST_P(CommunicatorFailureTest, ProgressCountsCollectivesNotPointToPoint) {
  Group group = MakeGroup(3, milliseconds(10000));
  ASSERT_EQ(group.comms.size(), 3u);
  for (const auto& comm : group.comms) {
    const auto p = comm->progress();
    EXPECT_EQ(p.communicator, comm->name());
    EXPECT_EQ(p.last_entered, 0u);
    EXPECT_EQ(p.last_completed, 0u);
    EXPECT_EQ(p.last_kind, "");
  }
  std::vector<std::vector<float>> buffers(3, std::vector<float>(64, 2.f));
  auto step = [&](const std::function<Status(int, Communicator&, std::vector<float>&)>& call) {
    const auto results =
        RunRanks(group, [&](int r, Communicator& comm) { return call(r, comm, buffers[static_cast<size_t>(r)]); });
    for (const auto& s : results) ASSERT_TRUE(s.ok()) << Describe(results);
  };
  auto expect = [&](uint64_t entered, uint64_t completed, const std::string& kind, int only_rank = -1) {
    for (int r = 0; r < 3; ++r) {
      if (only_rank >= 0 && r != only_rank) continue;
      const auto p = group.comms[static_cast<size_t>(r)]->progress();
      EXPECT_EQ(p.last_entered, entered) << "rank " << r;
      EXPECT_EQ(p.last_completed, completed) << "rank " << r;
      EXPECT_EQ(p.last_kind, kind) << "rank " << r;
    }
  };
  step([](int, Communicator& comm, std::vector<float>&) { return comm.Barrier(); });
  expect(1, 1, "barrier");
  step([](int, Communicator& comm, std::vector<float>& b) {
    return comm.AllReduce(b.data(), b.data(), b.size(), DType::kFloat32, ReduceOp::kSum);
  });
  expect(2, 2, "allreduce");
  step([](int, Communicator& comm, std::vector<float>& b) {
    return comm.Broadcast(b.data(), b.size(), DType::kFloat32, 1);
  });
  expect(3, 3, "broadcast");
  step([](int r, Communicator& comm, std::vector<float>& b) -> Status {
    if (r == 0) return comm.Send(1, b.data(), b.size(), DType::kFloat32);
    if (r == 1) return comm.Recv(0, b.data(), b.size(), DType::kFloat32);
    return Status::Ok();
  });
  expect(3, 3, "send", 0);
  expect(3, 3, "recv", 1);
  expect(3, 3, "broadcast", 2);
  EXPECT_FLOAT_EQ(buffers[1][0], 6.f);
}

// The observer (what the worker's collective metrics count) sees each
// operation that succeeded once, with its kind and bytes; a failed one is
// not observed.
TEST_P(CommunicatorFailureTest, TheObserverSeesEachSuccessfulOperationWithItsBytes) {
  Group group = MakeGroup(3, milliseconds(10000));
  ASSERT_EQ(group.comms.size(), 3u);
  struct Seen {
    comm::Kind kind;
    uint64_t bytes;
    double seconds;
  };
  std::vector<std::vector<Seen>> seen(3);  // one rank's observer runs on that rank's thread only
  for (size_t r = 0; r < 3; ++r) {
    group.comms[r]->SetObserver([&seen, r](comm::Kind kind, uint64_t bytes, double seconds) {
      seen[r].push_back({kind, bytes, seconds});
    });
  }
  std::vector<std::vector<float>> in(3, std::vector<float>(3 * 40, 1.f));
  std::vector<std::vector<float>> out(3, std::vector<float>(3 * 40, 0.f));
  const auto results = RunRanks(group, [&](int r, Communicator& comm) -> Status {
    auto& i = in[static_cast<size_t>(r)];
    auto& o = out[static_cast<size_t>(r)];
    TANDEM_RETURN_IF_ERROR(comm.Barrier());
    TANDEM_RETURN_IF_ERROR(comm.AllReduce(i.data(), o.data(), 100, DType::kFloat32, ReduceOp::kSum));
    TANDEM_RETURN_IF_ERROR(comm.ReduceScatter(i.data(), o.data(), 40, DType::kFloat32, ReduceOp::kSum));
    TANDEM_RETURN_IF_ERROR(comm.AllGather(i.data(), o.data(), 40, DType::kFloat32));
    TANDEM_RETURN_IF_ERROR(comm.Broadcast(o.data(), 20, DType::kFloat32, 0));
    if (r == 0) return comm.Send(1, i.data(), 7, DType::kFloat32);
    if (r == 1) return comm.Recv(0, o.data(), 7, DType::kFloat32);
    return Status::Ok();
  });
  for (const auto& s : results) ASSERT_TRUE(s.ok()) << Describe(results);
  for (size_t r = 0; r < 3; ++r) {
    const auto& s = seen[r];
    ASSERT_EQ(s.size(), r == 2 ? 5u : 6u) << "rank " << r;
    EXPECT_EQ(s[0].kind, comm::Kind::kBarrier);
    EXPECT_EQ(s[0].bytes, 0u);
    EXPECT_EQ(s[1].kind, comm::Kind::kAllReduce);
    EXPECT_EQ(s[1].bytes, 400u);
    EXPECT_EQ(s[2].kind, comm::Kind::kReduceScatter);
    EXPECT_EQ(s[2].bytes, 3u * 40 * 4);  // the whole input
    EXPECT_EQ(s[3].kind, comm::Kind::kAllGather);
    EXPECT_EQ(s[3].bytes, 3u * 40 * 4);  // the whole output
    EXPECT_EQ(s[4].kind, comm::Kind::kBroadcast);
    EXPECT_EQ(s[4].bytes, 80u);
    if (r < 2) {
      EXPECT_EQ(s[5].kind, r == 0 ? comm::Kind::kSend : comm::Kind::kRecv);
      EXPECT_EQ(s[5].bytes, 28u);
    }
    for (const auto& one : s) EXPECT_GE(one.seconds, 0.0);
  }
  // A failed operation (a size mismatch) is not observed.
  const auto failed = RunRanks(group, [&](int r, Communicator& comm) -> Status {
    if (r == 0) return comm.Send(1, in[0].data(), 10, DType::kFloat32);
    if (r == 1) return comm.Recv(0, out[1].data(), 11, DType::kFloat32);
    return Status::Ok();
  });
  EXPECT_FALSE(failed[1].ok()) << Describe(failed);
  EXPECT_EQ(seen[1].size(), 6u);
}

TEST_P(CommunicatorFailureTest, ASendRecvSizeMismatchIsInvalidArgumentNamingBothSizes) {
  Group group = MakeGroup(2, milliseconds(5000));
  ASSERT_EQ(group.comms.size(), 2u);
  std::vector<float> data(11, 1.f);
  const auto results = RunRanks(group, [&](int r, Communicator& comm) -> Status {
    if (r == 0) return comm.Send(1, data.data(), 10, DType::kFloat32);
    std::vector<float> into(11);
    return comm.Recv(0, into.data(), 11, DType::kFloat32);
  });
  EXPECT_EQ(results[1].code(), StatusCode::kInvalidArgument) << Describe(results);
  EXPECT_TRUE(Contains(results[1].message(), "40")) << results[1].message();
  EXPECT_TRUE(Contains(results[1].message(), "44")) << results[1].message();
  EXPECT_TRUE(Contains(results[1].message(), "rank 0")) << results[1].message();
  EXPECT_FALSE(group.comms[1]->health().ok());
}

TEST_P(CommunicatorFailureTest, SeparateGroupsRunConcurrently) {
  // Two groups of different sizes (as "dp" and "tp" groups would be), their
  // ranks all running at once.
  Group a = MakeGroup(3, milliseconds(20000));
  Group b = MakeGroup(5, milliseconds(20000));
  ASSERT_EQ(a.comms.size(), 3u);
  ASSERT_EQ(b.comms.size(), 5u);
  auto run = [](Group& group, int world, std::vector<Status>* results) {
    *results = RunRanks(group, [world](int r, Communicator& comm) -> Status {
      for (size_t count : {size_t{5}, size_t{3000}, size_t{40000}, size_t{1}, size_t{70001}}) {
        std::vector<int64_t> v(count, r + 1);
        TANDEM_RETURN_IF_ERROR(comm.AllReduce(v.data(), v.data(), count, DType::kInt64, ReduceOp::kSum));
        const int64_t want = static_cast<int64_t>(world) * (world + 1) / 2;
        for (size_t i = 0; i < count; ++i) {
          if (v[i] != want) return Internal("rank {} element {} of {}: {} != {}", r, i, count, v[i], want);
        }
        TANDEM_RETURN_IF_ERROR(comm.Barrier());
      }
      return Status::Ok();
    });
  };
  std::vector<Status> ra;
  std::vector<Status> rb;
  std::thread ta([&] { run(a, 3, &ra); });
  std::thread tb([&] { run(b, 5, &rb); });
  ta.join();
  tb.join();
  for (const auto& s : ra) EXPECT_TRUE(s.ok()) << Describe(ra);
  for (const auto& s : rb) EXPECT_TRUE(s.ok()) << Describe(rb);
}

std::vector<std::string> BackendNames() {
  std::vector<std::string> names;
  for (const auto& backend : AllBackends()) names.push_back(backend.name);
  return names;
}

INSTANTIATE_TEST_SUITE_P(Backends, CommunicatorFailureTest, ::testing::ValuesIn(BackendNames()),
                         [](const auto& p) { return p.param; });

// ---- The transport communicator's own algorithms.

// Forcing each family: "ring" runs the large-message algorithms (ring,
// chain, ring reduce + gather) at every size, with small chunks so steps
// pipeline; "doubling" runs the small-message ones (recursive doubling,
// Bruck, binomial trees) at every size.
TEST(TransportCommunicatorTest, BothAlgorithmFamiliesMatchTheReferenceAtEveryWorldSize) {
  comm::TransportCommunicatorOptions ring;
  ring.small_bytes = 0;
  ring.chunk_bytes = 1000;  // not a multiple of any element size's block
  comm::TransportCommunicatorOptions doubling;
  doubling.small_bytes = size_t{1} << 40;
  const Backend backends[] = {LocalBackend("local_ring", ring), LocalBackend("local_doubling", doubling)};
  for (const auto& backend : backends) {
    for (int world : {2, 3, 4, 5, 6, 7, 8}) {
      for (size_t count : {size_t{1}, size_t{13}, size_t{5003}}) {
        for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kInt64}) {
          for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin}) {
            SCOPED_TRACE(CaseName(::testing::TestParamInfo<Case>({backend.name, world, count, dtype, op}, 0)));
            CheckEveryCollective(backend, {backend.name, world, count, dtype, op});
            if (::testing::Test::HasFatalFailure()) return;
          }
        }
      }
    }
  }
}

TEST(TransportCommunicatorTest, AlgorithmSelection) {
  auto fabric = transport::LocalFabric::Create(5);
  CommInfo info = Base(milliseconds(1000));
  info.size = 5;
  info.rank = 0;
  auto comm = comm::TransportCommunicator::Create(info, fabric->Connect(0));
  ASSERT_TRUE(comm.ok()) << comm.status().ToString();
  EXPECT_EQ((*comm)->backend(), "local");
  EXPECT_STREQ((*comm)->AllReduceAlgorithmName(16384, DType::kFloat32), "recursive doubling");  // 64 KiB
  EXPECT_STREQ((*comm)->AllReduceAlgorithmName(16385, DType::kFloat32), "ring");
  EXPECT_STREQ((*comm)->AllReduceAlgorithmName(32768, DType::kBFloat16), "recursive doubling");
  EXPECT_STREQ((*comm)->AllReduceAlgorithmName(4, DType::kFloat32), "recursive doubling");
  EXPECT_STREQ((*comm)->AllReduceAlgorithmName(0, DType::kFloat32), "trivial");

  comm::TransportCommunicatorOptions tiny;
  tiny.small_bytes = 0;
  tiny.backend = "tcp";
  auto small = comm::TransportCommunicator::Create(info, fabric->Connect(0), tiny);
  ASSERT_TRUE(small.ok());
  EXPECT_EQ((*small)->backend(), "tcp");
  EXPECT_STREQ((*small)->AllReduceAlgorithmName(5, DType::kFloat32), "ring");
  EXPECT_STREQ((*small)->AllReduceAlgorithmName(4, DType::kFloat32), "recursive doubling");  // fewer than ranks
}

TEST(TransportCommunicatorTest, TheTransportMustMatchTheCommInfo) {
  auto fabric = transport::LocalFabric::Create(4);
  CommInfo info = Base(milliseconds(1000));
  info.size = 4;
  info.rank = 1;
  auto wrong_rank = comm::TransportCommunicator::Create(info, fabric->Connect(2));
  ASSERT_FALSE(wrong_rank.ok());
  EXPECT_EQ(wrong_rank.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Contains(wrong_rank.status().message(), "is rank 1 of 4, but its transport is rank 2 of 4"))
      << wrong_rank.status().message();
  info.size = 3;
  EXPECT_FALSE(comm::TransportCommunicator::Create(info, fabric->Connect(1)).ok());
  EXPECT_FALSE(comm::TransportCommunicator::Create(info, nullptr).ok());
}

}  // namespace
}  // namespace tandem::comm_test
