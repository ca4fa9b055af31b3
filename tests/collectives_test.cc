// The CPU collectives over the in-process transport: one shared suite over
// world size x element count x dtype x op, checked against a double-precision
// reference; plus disagreeing ranks, a dead peer, and the dtype arithmetic.
#include "worker/collectives/collectives.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <thread>

#include <gtest/gtest.h>

#include "common/transport/local_transport.h"
#include "reference.h"

namespace tandem::collectives {
namespace {

using std::chrono::milliseconds;

// Runs `body(rank, transport)` on `n` threads, one per rank; returns each rank's status.
std::vector<Status> RunRanks(int n, const std::function<Status(int, transport::Transport&)>& body,
                             std::shared_ptr<transport::LocalFabric> fabric = nullptr) {
  if (!fabric) fabric = transport::LocalFabric::Create(n);
  std::vector<Status> results(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      auto t = fabric->Connect(r);
      results[static_cast<size_t>(r)] = body(r, *t);
    });
  }
  for (auto& th : threads) th.join();
  return results;
}

using reference::Expected;
using reference::IsInt;
using reference::Load;
using reference::Store;
using reference::Tolerance;
using reference::Value;

struct Case {
  int world;
  size_t count;
  DType dtype;
  ReduceOp op;
};

class AllReduceTest : public ::testing::TestWithParam<Case> {};

TEST_P(AllReduceTest, MatchesADoublePrecisionReference) {
  const Case c = GetParam();
  const uint64_t seed = 0x7a4de3ULL + c.count * 31 + static_cast<uint64_t>(c.world);
  std::vector<std::vector<char>> buffers(static_cast<size_t>(c.world));
  for (int r = 0; r < c.world; ++r) {
    auto& b = buffers[static_cast<size_t>(r)];
    b.resize(c.count * SizeOf(c.dtype) + 1);
    for (size_t i = 0; i < c.count; ++i) Store(c.dtype, b.data(), i, Value(r, i, seed));
  }
  CollectiveOptions options;
  options.chunk_bytes = 4096;  // many chunks, so the pipelining is exercised
  options.timeout = milliseconds(20000);
  const auto results = RunRanks(c.world, [&](int r, transport::Transport& t) {
    return AllReduce(t, buffers[static_cast<size_t>(r)].data(), c.count, c.dtype, c.op, options);
  });
  std::vector<double> expected(c.count);
  for (size_t i = 0; i < c.count; ++i) expected[i] = Expected(c.world, i, seed, c.op, c.dtype);
  for (int r = 0; r < c.world; ++r) {
    ASSERT_TRUE(results[static_cast<size_t>(r)].ok()) << results[static_cast<size_t>(r)].ToString();
    size_t wrong = 0;
    for (size_t i = 0; i < c.count; ++i) {
      const double got = Load(c.dtype, buffers[static_cast<size_t>(r)].data(), i);
      const double want = expected[i];
      if (std::abs(got - want) > Tolerance(c.dtype, c.op) * std::max(1.0, std::abs(want))) {
        if (wrong++ < 3) ADD_FAILURE() << "rank " << r << " element " << i << ": " << got << " != " << want;
      }
    }
    EXPECT_EQ(wrong, 0u) << "rank " << r;
  }
}

std::vector<Case> AllReduceCases() {
  std::vector<Case> cases;
  for (int world : {1, 2, 3, 4, 5, 8}) {
    for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{13}, size_t{1009}, size_t{4099}}) {
      for (DType d : {DType::kFloat32, DType::kFloat16, DType::kBFloat16, DType::kInt32, DType::kInt64}) {
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMin, ReduceOp::kMax}) {
          cases.push_back({world, count, d, op});
        }
      }
    }
  }
  // Several MiB, for the chunked pipeline.
  for (int world : {2, 3, 8}) cases.push_back({world, (size_t{3} << 20) + 5, DType::kFloat32, ReduceOp::kSum});
  cases.push_back({4, (size_t{1} << 20) + 3, DType::kBFloat16, ReduceOp::kSum});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Collectives, AllReduceTest, ::testing::ValuesIn(AllReduceCases()), [](const auto& p) {
  return "w" + std::to_string(p.param.world) + "_n" + std::to_string(p.param.count) + "_" +
         std::string(Name(p.param.dtype)) + "_" + std::string(Name(p.param.op));
});

TEST(CollectivesTest, ReduceScatterAllGatherAndBroadcast) {
  for (int world : {1, 2, 3, 5, 8}) {
    for (size_t count : {size_t{0}, size_t{1}, size_t{13}, size_t{5003}}) {
      const uint64_t seed = 99 + count;
      std::vector<std::vector<float>> in(static_cast<size_t>(world)), out(static_cast<size_t>(world)),
          gathered(static_cast<size_t>(world)), bcast(static_cast<size_t>(world));
      for (int r = 0; r < world; ++r) {
        auto ur = static_cast<size_t>(r);
        in[ur].resize(count * static_cast<size_t>(world));
        for (size_t i = 0; i < in[ur].size(); ++i) in[ur][i] = static_cast<float>(Value(r, i, seed));
        out[ur].resize(count);
        gathered[ur].resize(count * static_cast<size_t>(world));
        bcast[ur].assign(count, r == world - 1 ? 0.f : -1.f);
        for (size_t i = 0; i < count && r == world - 1; ++i) bcast[ur][i] = static_cast<float>(i);
      }
      const auto results = RunRanks(world, [&](int r, transport::Transport& t) -> Status {
        auto ur = static_cast<size_t>(r);
        TANDEM_RETURN_IF_ERROR(ReduceScatter(t, in[ur].data(), out[ur].data(), count, DType::kFloat32, ReduceOp::kSum));
        TANDEM_RETURN_IF_ERROR(AllGather(t, out[ur].data(), gathered[ur].data(), count, DType::kFloat32));
        CollectiveOptions small;
        small.chunk_bytes = 1000;
        return Broadcast(t, bcast[ur].data(), count, DType::kFloat32, world - 1, small);
      });
      for (int r = 0; r < world; ++r) {
        auto ur = static_cast<size_t>(r);
        ASSERT_TRUE(results[ur].ok()) << results[ur].ToString();
        for (size_t i = 0; i < count; ++i) {
          double want = 0;
          for (int q = 0; q < world; ++q) want += Value(q, ur * count + i, seed);
          ASSERT_EQ(out[ur][i], static_cast<float>(want)) << "reduce-scatter w" << world << " rank " << r << " i " << i;
          ASSERT_EQ(bcast[ur][i], static_cast<float>(i)) << "broadcast w" << world << " rank " << r;
        }
        // After the all-gather every rank holds every rank's reduced block.
        for (int q = 0; q < world; ++q) {
          for (size_t i = 0; i < count; ++i) {
            ASSERT_EQ(gathered[ur][static_cast<size_t>(q) * count + i], out[static_cast<size_t>(q)][i]);
          }
        }
      }
    }
  }
}

TEST(CollectivesTest, RanksThatDisagreeGetAnErrorNotCorruptedData) {
  std::vector<std::vector<float>> data(3, std::vector<float>(100, 1.f));
  const auto results = RunRanks(3, [&](int r, transport::Transport& t) {
    CollectiveOptions options;
    options.timeout = milliseconds(2000);
    const size_t count = r == 1 ? 99 : 100;  // rank 1 got the count wrong
    return AllReduce(t, data[static_cast<size_t>(r)].data(), count, DType::kFloat32, ReduceOp::kSum, options);
  });
  int named = 0;
  for (const auto& s : results) {
    if (!s.ok() && s.message().find("rank 1 runs all-reduce of 99 float32 elements") != std::string::npos) ++named;
  }
  EXPECT_GE(named, 1);
  const auto dtypes = RunRanks(2, [&](int r, transport::Transport& t) {
    CollectiveOptions options;
    options.timeout = milliseconds(2000);
    return AllReduce(t, data[static_cast<size_t>(r)].data(), 50, r == 0 ? DType::kFloat16 : DType::kBFloat16,
                     ReduceOp::kSum, options);
  });
  EXPECT_FALSE(dtypes[0].ok());
  EXPECT_NE(dtypes[0].message().find("bfloat16"), std::string::npos) << dtypes[0].message();
  EXPECT_NE(dtypes[0].message().find("float16"), std::string::npos);
}

TEST(CollectivesTest, ADeadPeerIsAnErrorNamingItNotAHang) {
  auto fabric = transport::LocalFabric::Create(4);
  std::vector<std::vector<float>> data(4, std::vector<float>(1 << 16, 1.f));
  const auto t0 = std::chrono::steady_clock::now();
  const auto results = RunRanks(
      4,
      [&](int r, transport::Transport& t) -> Status {
        if (r == 2) {
          fabric->Kill(2);  // dies before entering
          return Status::Ok();
        }
        CollectiveOptions options;
        options.timeout = milliseconds(3000);
        return AllReduce(t, data[static_cast<size_t>(r)].data(), data[0].size(), DType::kFloat32, ReduceOp::kSum,
                         options);
      },
      fabric);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
  // Rank 3 receives from rank 2: it must name it. The others fail too (as the ring stalls), by timeout or otherwise.
  EXPECT_FALSE(results[3].ok());
  EXPECT_NE(results[3].message().find("rank 2 is gone"), std::string::npos) << results[3].message();
  EXPECT_FALSE(results[0].ok());
  EXPECT_FALSE(results[1].ok());
}

TEST(DTypeTest, HalfAndBFloat16RoundToNearestEven) {
  EXPECT_EQ(FloatToHalf(1.0f), 0x3c00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xc000);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);                      // rounds up to inf
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -24)), 0x0001);         // smallest subnormal
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -25)), 0x0000);         // a tie rounds to even (zero)
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie to even
  EXPECT_EQ(FloatToHalf(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(NAN))));
  for (uint32_t h = 0; h < 0x7c00; ++h) {  // every finite positive half survives a round trip
    ASSERT_EQ(FloatToHalf(HalfToFloat(static_cast<uint16_t>(h))), h) << h;
  }
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3f80);
  EXPECT_EQ(BFloat16ToFloat(0x3f80), 1.0f);
  EXPECT_EQ(FloatToBFloat16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);  // tie to even
  EXPECT_EQ(FloatToBFloat16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(NAN))));
}

}  // namespace
}  // namespace tandem::collectives
