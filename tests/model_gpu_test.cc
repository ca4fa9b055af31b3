// The reference model on a GPU (worker/model/gpu_engine.h) against the same
// model on the CPU: loss, logits, gradients, accumulation, the on_ready
// order, slots and on-demand parameters, and a few training steps.
//
// Tolerances: both paths run the same fp32 arithmetic in a different order
// (cuBLAS's products, warp-wide sums, atomic adds for the token embedding
// and the LayerNorm parameters), so each value differs by a few units of
// fp32 rounding of the sums that make it. Over the model's depth that stays
// far below 1e-4 relative to the largest magnitude of each tensor, which is
// the bound used; a wrong index or a missing term gives errors of order 1.
//
// The GPU tests skip without a device (or fail, with TANDEM_REQUIRE_GPU set,
// as on a machine lent with one); the rest run everywhere.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <random>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "tandem/config.h"
#include "worker/model/model.h"
#include "worker/nccl/gpu_info.h"

namespace tandem::model {
namespace {

ModelConfig Small(int gpu) {
  ModelConfig c;
  c.context = 16;
  c.d_model = 64;
  c.heads = 4;
  c.layers = 2;
  c.seed = 7;
  c.gpu = gpu;
  return c;
}

std::vector<uint8_t> Bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> out(n);
  for (auto& b : out) b = static_cast<uint8_t>(rng() % 256);
  return out;
}

// Each tensor's gradients within the bound (named when not).
void ExpectGradsMatch(const Model& gpu, const Model& cpu, double bound) {
  for (const TensorInfo& t : cpu.layout()) {
    const auto g = gpu.grads().subspan(t.offset, t.size);
    const auto c = cpu.grads().subspan(t.offset, t.size);
    EXPECT_LE(RelativeDifference(g, c), bound) << t.name;
  }
}

TEST(ModelGpuConfigTest, TheGpuPathRunsTheWholeModelOnly) {
  ModelConfig c = Small(0);
  c.pipeline_stages = 2;
  EXPECT_NE(c.Validate().message().find("model gpu"), std::string::npos) << c.Validate().message();
  c = Small(0);
  c.tensor_parallel = 2;
  EXPECT_NE(c.Validate().message().find("tensor_parallel 2"), std::string::npos) << c.Validate().message();
  c = Small(0);
  c.activation_checkpointing = true;
  EXPECT_NE(c.Validate().message().find("activation_checkpointing"), std::string::npos);
  c = Small(-2);
  EXPECT_EQ(c.Validate().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(Small(-1).Validate().ok());
  EXPECT_TRUE(Small(3).Validate().ok());
}

TEST(ModelGpuConfigTest, RelativeDifferenceIsScaledByTheReference) {
  const std::vector<float> b = {1.0f, -4.0f, 2.0f}, a = {1.5f, -4.0f, 2.0f};
  EXPECT_DOUBLE_EQ(RelativeDifference(a, b), 0.5 / 4.0);
  EXPECT_DOUBLE_EQ(RelativeDifference(b, b), 0.0);
  const std::vector<float> zeros(3, 0.0f);
  EXPECT_DOUBLE_EQ(RelativeDifference(a, zeros), 4.0);  // against all zeros: the absolute difference
}

TEST(ModelGpuConfigTest, CreateNamesWhyTheGpuCannotBeUsed) {
  const gpu::GpuInfo info = gpu::Probe();
  // A device past the last one fails in any build, naming the device asked for.
  auto model = Model::Create(Small(info.device_count + 3));
  ASSERT_FALSE(model.ok());
  EXPECT_EQ(model.status().code(), StatusCode::kFailedPrecondition) << model.status().ToString();
  EXPECT_NE(model.status().message().find(fmt::format("device {}", info.device_count + 3)), std::string::npos)
      << model.status().ToString();
#if !TANDEM_CUDA_ENABLED
  EXPECT_NE(model.status().message().find("no CUDA"), std::string::npos) << model.status().ToString();
#endif
}

class ModelGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const gpu::GpuInfo info = gpu::Probe();
    if (!info.compiled || info.device_count == 0) {
      const std::string reason = "needs a CUDA device and a build with CUDA; here: " + gpu::Describe(info);
      if (std::getenv("TANDEM_REQUIRE_GPU") != nullptr) FAIL() << reason << " (TANDEM_REQUIRE_GPU is set)";
      GTEST_SKIP() << reason;
    }
  }

  // The same model (same seed) on the CPU and on device 0.
  static std::pair<Model, Model> Pair(ModelConfig c) {
    c.gpu = -1;
    auto cpu = Model::Create(c);
    c.gpu = 0;
    auto gpu = Model::Create(c);
    EXPECT_TRUE(cpu.ok() && gpu.ok()) << gpu.status().ToString();
    return {std::move(*cpu), std::move(*gpu)};
  }
};

TEST_F(ModelGpuTest, ForwardMatchesTheCpu) {
  auto [cpu, gpu] = Pair(Small(0));
  EXPECT_NE(gpu.gpu_description().find("device 0"), std::string::npos) << gpu.gpu_description();
  const int batch = 3;
  const auto tokens = Bytes(static_cast<size_t>(batch) * 16, 1), targets = Bytes(static_cast<size_t>(batch) * 16, 2);
  auto lc = cpu.Forward(tokens.data(), targets.data(), batch);
  auto lg = gpu.Forward(tokens.data(), targets.data(), batch);
  ASSERT_TRUE(lc.ok() && lg.ok()) << lg.status().ToString();
  EXPECT_NEAR(*lg, *lc, 1e-5 * std::abs(*lc));
  EXPECT_NEAR(*lc, std::log(256.0), 0.1);  // an untrained model guesses uniformly
  const std::vector<float> want(cpu.logits().begin(), cpu.logits().end());
  const auto got = gpu.logits();
  ASSERT_EQ(got.size(), want.size());
  EXPECT_LE(RelativeDifference(got, want), 1e-4);
  // Without targets: logits only.
  auto none = gpu.Forward(tokens.data(), nullptr, batch);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(*none, 0.0f);
  EXPECT_LE(RelativeDifference(gpu.logits(), want), 1e-4);
  EXPECT_EQ(gpu.Backward().code(), StatusCode::kFailedPrecondition);
  EXPECT_GT(gpu.activation_bytes(), 0u);
}

TEST_F(ModelGpuTest, BackwardMatchesTheCpuAndReportsTheSameSuffixes) {
  // Not a structured binding: clang 14 cannot capture one in a lambda.
  auto models = Pair(Small(0));
  Model& cpu = models.first;
  Model& gpu = models.second;
  const int batch = 4;
  const auto tokens = Bytes(static_cast<size_t>(batch) * 16, 3), targets = Bytes(static_cast<size_t>(batch) * 16, 4);
  ASSERT_TRUE(cpu.Forward(tokens.data(), targets.data(), batch).ok());
  ASSERT_TRUE(gpu.Forward(tokens.data(), targets.data(), batch).ok());
  std::vector<size_t> cpu_ready, gpu_ready;
  ASSERT_TRUE(cpu.Backward(GradMode::kOverwrite, 0.5f, [&](size_t from) { cpu_ready.push_back(from); }).ok());
  // The gradients of [from, end) are on the host when on_ready says so.
  std::vector<double> seen_norm;
  const Status st = gpu.Backward(GradMode::kOverwrite, 0.5f, [&](size_t from) {
    gpu_ready.push_back(from);
    double sum = 0;
    for (size_t i = from; i < gpu.grads().size(); ++i) sum += std::abs(gpu.grads()[i]);
    seen_norm.push_back(sum);
  });
  ASSERT_TRUE(st.ok()) << st.ToString();
  EXPECT_EQ(gpu_ready, cpu_ready);
  ASSERT_EQ(seen_norm.size(), 4u);  // head, two blocks, embeddings
  for (size_t i = 1; i < seen_norm.size(); ++i) EXPECT_GT(seen_norm[i], seen_norm[i - 1]);
  ExpectGradsMatch(gpu, cpu, 1e-4);
  EXPECT_EQ(gpu.Backward().code(), StatusCode::kFailedPrecondition);  // once per forward
}

TEST_F(ModelGpuTest, AccumulationAddsToTheHostGradients) {
  auto [cpu, gpu] = Pair(Small(0));
  for (int micro = 0; micro < 3; ++micro) {
    const int batch = 1 + micro;  // a new batch size reallocates the slot
    const auto tokens = Bytes(static_cast<size_t>(batch) * 16, 10 + micro);
    const auto targets = Bytes(static_cast<size_t>(batch) * 16, 20 + micro);
    for (Model* m : {&cpu, &gpu}) {
      ASSERT_TRUE(m->Forward(tokens.data(), targets.data(), batch).ok());
      const Status st = m->Backward(micro == 0 ? GradMode::kOverwrite : GradMode::kAccumulate, 1.0f / 3);
      ASSERT_TRUE(st.ok()) << st.ToString();
    }
  }
  ExpectGradsMatch(gpu, cpu, 1e-4);
}

TEST_F(ModelGpuTest, SlotsKeepTheirOwnActivations) {
  auto [cpu, gpu] = Pair(Small(0));
  cpu.SetSlots(2);
  gpu.SetSlots(2);
  const auto t0 = Bytes(32, 30), y0 = Bytes(32, 31), t1 = Bytes(48, 32), y1 = Bytes(48, 33);
  for (Model* m : {&cpu, &gpu}) {
    ASSERT_TRUE(m->Forward(t0.data(), y0.data(), 2, 0).ok());
    ASSERT_TRUE(m->Forward(t1.data(), y1.data(), 3, 1).ok());
    ASSERT_TRUE(m->Backward(GradMode::kOverwrite, 1.0f, nullptr, 0).ok());
    ASSERT_TRUE(m->Backward(GradMode::kAccumulate, 1.0f, nullptr, 1).ok());
  }
  ExpectGradsMatch(gpu, cpu, 1e-4);
}

TEST_F(ModelGpuTest, OnDemandParametersAreTakenInTheCpusOrder) {
  // Paged buffers (sharded placement) are not page-locked: their gradients
  // come back through the engine's pinned staging buffer instead.
  for (const bool paged : {false, true}) {
    SCOPED_TRACE(paged ? "paged" : "not paged");
    // Not a structured binding: clang 14 cannot capture one in a lambda.
    auto models = Pair(Small(0));
    Model& cpu = models.first;
    Model& gpu = models.second;
    // Both models see the same acquire/release calls; the GPU's parameters
    // come from the host buffer only through them (the buffer is cleared
    // outside the segment being uploaded).
    std::vector<std::pair<size_t, size_t>> cpu_calls, gpu_calls;
    const std::vector<float> values(gpu.params().begin(), gpu.params().end());
    ParameterAccess ca;
    ca.paged = paged;
    ca.acquire = [&](FlatRange now, FlatRange) {
      cpu_calls.push_back(now);
      return Status::Ok();
    };
    cpu.SetParameterAccess(ca);
    ParameterAccess ga;
    ga.paged = paged;
    ga.acquire = [&](FlatRange now, FlatRange) {
      gpu_calls.push_back(now);
      std::copy(values.begin() + static_cast<ptrdiff_t>(now.first), values.begin() + static_cast<ptrdiff_t>(now.second),
                gpu.params().begin() + static_cast<ptrdiff_t>(now.first));
      return Status::Ok();
    };
    ga.release = [&](FlatRange now) {
      std::fill(gpu.params().begin() + static_cast<ptrdiff_t>(now.first),
                gpu.params().begin() + static_cast<ptrdiff_t>(now.second), 0.0f);
    };
    std::fill(gpu.params().begin(), gpu.params().end(), 0.0f);
    gpu.SetParameterAccess(ga);
    const auto tokens = Bytes(32, 40), targets = Bytes(32, 41);
    auto lc = cpu.Forward(tokens.data(), targets.data(), 2);
    auto lg = gpu.Forward(tokens.data(), targets.data(), 2);
    ASSERT_TRUE(lc.ok() && lg.ok());
    EXPECT_NEAR(*lg, *lc, 1e-5 * std::abs(*lc));
    ASSERT_TRUE(cpu.Backward().ok());
    ASSERT_TRUE(gpu.Backward().ok());
    EXPECT_EQ(gpu_calls, cpu_calls);
    ExpectGradsMatch(gpu, cpu, 1e-4);
    // An acquire error ends the pass with it.
    ga.acquire = [](FlatRange, FlatRange) { return Unavailable("parameters lost"); };
    gpu.SetParameterAccess(ga);
    EXPECT_EQ(gpu.Forward(tokens.data(), targets.data(), 2).status().code(), StatusCode::kUnavailable);
  }
}

TEST_F(ModelGpuTest, SgdStepsFollowTheCpusLossCurve) {
  ModelConfig c = Small(0);
  c.context = 32;
  c.d_model = 96;
  c.heads = 3;
  c.layers = 3;
  auto [cpu, gpu] = Pair(c);
  const int batch = 8;
  std::vector<float> cpu_loss, gpu_loss;
  for (int step = 0; step < 8; ++step) {
    const auto tokens = Bytes(static_cast<size_t>(batch) * 32, 100 + step);
    std::vector<uint8_t> targets(tokens.size());
    for (size_t i = 0; i < tokens.size(); ++i) targets[i] = static_cast<uint8_t>(tokens[i] ^ 0x5a);  // learnable
    for (auto [m, losses] : {std::pair{&cpu, &cpu_loss}, std::pair{&gpu, &gpu_loss}}) {
      auto loss = m->Forward(tokens.data(), targets.data(), batch);
      ASSERT_TRUE(loss.ok()) << loss.status().ToString();
      losses->push_back(*loss);
      ASSERT_TRUE(m->Backward().ok());
      for (size_t i = 0; i < m->params().size(); ++i) m->params()[i] -= 0.05f * m->grads()[i];
    }
  }
  for (size_t i = 0; i < cpu_loss.size(); ++i)
    EXPECT_NEAR(gpu_loss[i], cpu_loss[i], 1e-4 * cpu_loss[i]) << "step " << i;
  EXPECT_LT(gpu_loss.back(), gpu_loss.front() - 0.1f);  // the CPU's curve drops about 0.2 in these 8 steps
  EXPECT_LE(RelativeDifference(gpu.params(), cpu.params()), 1e-4);
}

}  // namespace
}  // namespace tandem::model
