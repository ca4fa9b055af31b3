// The reference model (worker/model/): the tensor table covers the flat
// buffer exactly; bad configurations are refused with clear errors; the
// initialisation is deterministic and gives a loss of about ln(256); backward
// matches central finite differences in every tensor; gradient accumulation
// over micro-batches equals one batch of both; backward reports gradients as
// they become final, from the end of the flat buffer down; activation
// checkpointing gives bit-identical losses and gradients in less memory; and
// a few hundred SGD steps on a small repetitive text drive the loss well down.
// Pipeline stages: the split is balanced and covers the flat buffer, each
// stage initialises to the whole model's values, and stages chained by hand
// (with micro-batches in separate slots, backward in any order) give the
// whole model's losses and gradients bit for bit. Tensor parallelism: ranks
// computing together equal the whole model within fp32 rounding, and their
// parts in the servers' space map back to the whole model exactly.
#include "worker/model/model.h"

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

namespace tandem::model {
namespace {

ModelConfig Tiny() {
  ModelConfig c;
  c.context = 8;
  c.d_model = 16;
  c.heads = 2;
  c.layers = 2;
  c.seed = 7;
  return c;
}

std::vector<uint8_t> RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> out(n);
  for (uint8_t& b : out) b = static_cast<uint8_t>(rng() & 0xff);
  return out;
}

TEST(ModelTest, TensorTableCoversTheFlatBufferExactly) {
  ModelConfig config = Tiny();
  config.layers = 3;
  auto model = Model::Create(config);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  const std::vector<v1::TensorSpec> specs = model->Tensors();
  ASSERT_EQ(specs.size(), 2u + 12u * 3u + 3u);
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const v1::TensorSpec& s : specs) {
    EXPECT_TRUE(names.insert(s.name()).second) << "duplicate " << s.name();
    EXPECT_EQ(s.flat_offset(), offset) << s.name();
    EXPECT_EQ(s.dtype(), v1::DTYPE_FLOAT32);
    uint64_t size = 1;
    for (int64_t d : s.shape()) size *= static_cast<uint64_t>(d);
    offset += size;
    const bool no_decay = s.name().ends_with(".bias") || s.name().find("ln") != std::string::npos ||
                          s.name().starts_with("wte") || s.name().starts_with("wpe");
    EXPECT_EQ(s.group(), no_decay ? "no_decay" : "") << s.name();
  }
  EXPECT_EQ(offset, model->num_parameters());
  EXPECT_EQ(model->grads().size(), model->num_parameters());
  // The documented order and shapes.
  EXPECT_EQ(specs.front().name(), "wte.weight");
  EXPECT_EQ(specs[1].name(), "wpe.weight");
  EXPECT_EQ(specs[4].name(), "blocks.0.attn.qkv.weight");
  EXPECT_EQ(specs[4].shape(0), 48);
  EXPECT_EQ(specs[4].shape(1), 16);
  EXPECT_EQ(specs[2 + 12 * 2 + 10].name(), "blocks.2.mlp.proj.weight");
  EXPECT_EQ(specs[2 + 12 * 2 + 10].shape(1), 64);
  EXPECT_EQ(specs.back().name(), "head.weight");
  // V·C + T·C + L·(12C² + 13C) + 2C + V·C with V=256, T=8, C=16, L=3.
  EXPECT_EQ(model->num_parameters(), 256u * 16 + 8 * 16 + 3 * (12 * 256 + 13 * 16) + 2 * 16 + 256 * 16);
}

TEST(ModelTest, BadConfigsAreRefusedWithClearErrors) {
  struct Case {
    void (*mutate)(ModelConfig&);
    std::string expect;
  };
  const std::vector<Case> cases = {
      {[](ModelConfig& c) { c.vocab = 300; }, "vocab"},
      {[](ModelConfig& c) { c.vocab = 1; }, "vocab"},
      {[](ModelConfig& c) { c.context = 0; }, "context"},
      {[](ModelConfig& c) { c.d_model = -4; }, "d_model"},
      {[](ModelConfig& c) { c.heads = 0; }, "heads"},
      {[](ModelConfig& c) { c.heads = 3; }, "must divide d_model (16)"},
      {[](ModelConfig& c) { c.layers = 0; }, "layers"},
      {[](ModelConfig& c) { c.mlp_ratio = 0; }, "mlp_ratio"},
      {[](ModelConfig& c) { c.blas_threads = -1; }, "blas_threads"},
      {[](ModelConfig& c) {
         c.d_model = 16384;
         c.layers = 1024;
       },
       "parameters"},
  };
  for (const Case& k : cases) {
    ModelConfig c = Tiny();
    k.mutate(c);
    auto model = Model::Create(c);
    ASSERT_FALSE(model.ok()) << k.expect;
    EXPECT_EQ(model.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(model.status().message().find(k.expect), std::string::npos) << model.status().ToString();
  }

  ModelConfig small_vocab = Tiny();
  small_vocab.vocab = 16;
  auto model = Model::Create(small_vocab);
  ASSERT_TRUE(model.ok());
  std::vector<uint8_t> tokens(8, 3);
  EXPECT_EQ(model->Backward().code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(model->Forward(tokens.data(), tokens.data(), 0).status().code(), StatusCode::kInvalidArgument);
  tokens[5] = 200;
  auto bad = model->Forward(tokens.data(), nullptr, 1);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("token 200 at 5"), std::string::npos) << bad.status().ToString();
}

TEST(ModelTest, InitialisationIsDeterministicAndLossIsAboutLn256) {
  auto a = Model::Create(Tiny());
  auto b = Model::Create(Tiny());
  ModelConfig other = Tiny();
  other.seed = 8;
  auto c = Model::Create(other);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_TRUE(std::equal(a->params().begin(), a->params().end(), b->params().begin()));
  EXPECT_FALSE(std::equal(a->params().begin(), a->params().end(), c->params().begin()));

  // GPT-2 initialisation: LN weights 1, biases 0, weights with std 0.02
  // (residual projections 0.02/sqrt(2·layers) = 0.01 here).
  for (const TensorInfo& t : a->layout()) {
    std::span<const float> p = a->params().subspan(t.offset, t.size);
    double sum = 0, sq = 0;
    for (float x : p) {
      sum += x;
      sq += static_cast<double>(x) * x;
    }
    const double mean = sum / static_cast<double>(t.size);
    const double std = std::sqrt(sq / static_cast<double>(t.size) - mean * mean);
    if (t.name.ends_with(".bias")) {
      EXPECT_EQ(sq, 0.0) << t.name;
    } else if (t.name.find("ln") != std::string::npos) {
      EXPECT_EQ(mean, 1.0) << t.name;
    } else if (t.size >= 1024) {  // enough samples for a 10% check of the std
      const double want = t.name.ends_with("proj.weight") ? 0.01 : 0.02;
      EXPECT_NEAR(std, want, 0.1 * want) << t.name;
    }
  }

  // At initialisation the logits are nearly equal (std ≈ 0.02·sqrt(C) = 0.08),
  // so the loss is ln(256) plus about half their variance (≈ 0.003).
  const std::vector<uint8_t> tokens = RandomBytes(size_t{4} * 8, 1), targets = RandomBytes(size_t{4} * 8, 2);
  auto loss = a->Forward(tokens.data(), targets.data(), 4);
  ASSERT_TRUE(loss.ok()) << loss.status().ToString();
  EXPECT_NEAR(*loss, std::log(256.0f), 0.05f);
}

// Re-draws every parameter at a scale where all nonlinearities matter
// (attention far from uniform, GELU away from linear, LN weights and biases
// not at their trivial values), so finite differences test every path.
void Randomize(Model& model, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const TensorInfo& t : model.layout()) {
    float* p = model.params().data() + t.offset;
    const bool ln = t.name.find("ln") != std::string::npos && t.name.ends_with(".weight");
    const float std = t.name.ends_with(".bias") ? 0.1f : t.name.starts_with("w") ? 0.5f : ln ? 0.2f : 0.3f;
    for (size_t i = 0; i < t.size; ++i) p[i] = (ln ? 1.0f : 0.0f) + std * normal(rng);
  }
}

TEST(ModelTest, BackwardMatchesCentralFiniteDifferences) {
  auto created = Model::Create(Tiny());
  ASSERT_TRUE(created.ok());
  Model& model = *created;
  Randomize(model, 11);
  const int batch = 2;
  const std::vector<uint8_t> tokens = RandomBytes(static_cast<size_t>(batch) * 8, 3),
                             targets = RandomBytes(static_cast<size_t>(batch) * 8, 4);
  ASSERT_TRUE(model.Forward(tokens.data(), targets.data(), batch).ok());
  ASSERT_TRUE(model.Backward().ok());
  const std::vector<float> grads(model.grads().begin(), model.grads().end());

  auto loss_at = [&](size_t index, float value) {
    const float saved = model.params()[index];
    model.params()[index] = value;
    const float loss = *model.Forward(tokens.data(), targets.data(), batch);
    model.params()[index] = saved;
    return loss;
  };

  // Central differences in fp32 with eps = 1e-2. The truncation error is
  // O(eps^2 f''') and the rounding error of the loss (about 5.5: its fp32 ulp
  // is 5e-7, a few ulps from the forward's sums) over 2 eps is about 1e-4
  // absolute; measured, the worst element is off by 1e-4 on a gradient of
  // 0.18 (5e-4 relative). So an element passes when
  //   |fd - analytic| <= 2e-4 + 5e-3 |analytic|,
  // and each tensor's sample must also agree as a vector to 3e-3 relative.
  // That catches a wrong gradient (a missed term, a transposed product: off
  // by O(1)) and also a 1% error in one term of a kernel (checked by hand
  // with such mutations of the LayerNorm, attention, GELU, linear and
  // embedding backward).
  // The sample: per tensor, the 4 elements with the largest analytic gradient
  // (so the check has signal even where most entries are ~0, like the rows of
  // wte for bytes not in the input) and 4 random ones (which also catch an
  // analytic gradient of 0 where the true one is not).
  const float eps = 1e-2f;
  std::mt19937_64 rng(5);
  for (const TensorInfo& t : model.layout()) {
    std::vector<size_t> order(t.size);
    std::iota(order.begin(), order.end(), t.offset);
    std::partial_sort(order.begin(), order.begin() + 4, order.end(),
                      [&](size_t a, size_t b) { return std::fabs(grads[a]) > std::fabs(grads[b]); });
    std::vector<size_t> sample(order.begin(), order.begin() + 4);
    for (int k = 0; k < 4; ++k) sample.push_back(t.offset + rng() % t.size);
    double diff2 = 0, ref2 = 0;
    for (size_t i : sample) {
      const float x = model.params()[i];
      const float fd = (loss_at(i, x + eps) - loss_at(i, x - eps)) / (2 * eps);
      const float an = grads[i];
      EXPECT_LE(std::fabs(fd - an), 2e-4f + 5e-3f * std::fabs(an))
          << t.name << "[" << i - t.offset << "]: finite difference " << fd << ", backward " << an;
      diff2 += static_cast<double>(fd - an) * (fd - an);
      ref2 += static_cast<double>(an) * an;
    }
    EXPECT_GT(ref2, 1e-8) << t.name << ": no gradient signal in the sample";
    EXPECT_LE(std::sqrt(diff2), 3e-3 * std::sqrt(ref2)) << t.name;
  }
}

TEST(ModelTest, GradientAccumulationEqualsOneBatch) {
  auto created = Model::Create(Tiny());
  ASSERT_TRUE(created.ok());
  Model& model = *created;
  Randomize(model, 12);
  const std::vector<uint8_t> tokens = RandomBytes(size_t{4} * 8, 6), targets = RandomBytes(size_t{4} * 8, 7);

  auto full = model.Forward(tokens.data(), targets.data(), 4);
  ASSERT_TRUE(full.ok());
  ASSERT_TRUE(model.Backward().ok());
  const std::vector<float> want(model.grads().begin(), model.grads().end());

  // Two micro-batches of 2 sequences; each loss is a mean over its own
  // positions, so a scale of 1/2 makes the sum the mean over all four.
  auto first = model.Forward(tokens.data(), targets.data(), 2);
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(model.Backward(GradMode::kOverwrite, 0.5f).ok());
  auto second = model.Forward(tokens.data() + 16, targets.data() + 16, 2);
  ASSERT_TRUE(second.ok());
  ASSERT_TRUE(model.Backward(GradMode::kAccumulate, 0.5f).ok());
  EXPECT_NEAR(0.5f * (*first + *second), *full, 1e-5f);

  // Only the order of fp32 summation differs (over 32 positions in one GEMM
  // against 16 + 16 in two), so each element agrees to a few ulps of the
  // largest gradient.
  float max_abs = 0;
  for (float g : want) max_abs = std::max(max_abs, std::fabs(g));
  ASSERT_GT(max_abs, 0.0f);
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR(model.grads()[i], want[i], 1e-5f * max_abs) << "element " << i;
  }
}

// Same bits, not just equal values (-0 vs 0 and NaNs would count).
bool Bitwise(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(ModelTest, BackwardReportsGradientsAsTheyBecomeFinal) {
  for (const bool checkpointing : {false, true}) {
    SCOPED_TRACE(checkpointing ? "with activation checkpointing" : "without activation checkpointing");
    ModelConfig config = Tiny();
    config.layers = 3;
    config.activation_checkpointing = checkpointing;
    auto created = Model::Create(config);
    ASSERT_TRUE(created.ok());
    Model& model = *created;
    Randomize(model, 13);
    const std::vector<uint8_t> tokens = RandomBytes(size_t{4} * 8, 8), targets = RandomBytes(size_t{4} * 8, 9);

    // Reference: the same two micro-batches without a callback.
    ASSERT_TRUE(model.Forward(tokens.data(), targets.data(), 2).ok());
    ASSERT_TRUE(model.Backward(GradMode::kOverwrite, 0.5f).ok());
    const std::vector<float> want_first(model.grads().begin(), model.grads().end());
    ASSERT_TRUE(model.Forward(tokens.data() + 16, targets.data() + 16, 2).ok());
    ASSERT_TRUE(model.Backward(GradMode::kAccumulate, 0.5f).ok());
    const std::vector<float> want_sum(model.grads().begin(), model.grads().end());

    for (const GradMode mode : {GradMode::kOverwrite, GradMode::kAccumulate}) {
      const bool overwrite = mode == GradMode::kOverwrite;
      SCOPED_TRACE(overwrite ? "overwrite" : "accumulate");
      const size_t at = overwrite ? 0 : 16;
      ASSERT_TRUE(model.Forward(tokens.data() + at, targets.data() + at, 2).ok());
      // At each call, a copy of the range it declares final.
      std::vector<std::pair<size_t, std::vector<float>>> calls;
      ASSERT_TRUE(model
                      .Backward(mode, 0.5f,
                                [&](size_t ready_from) {
                                  ASSERT_LT(ready_from, model.num_parameters());
                                  calls.emplace_back(ready_from, std::vector<float>(model.grads().begin() + ready_from,
                                                                                    model.grads().end()));
                                })
                      .ok());
      EXPECT_TRUE(Bitwise(model.grads(), overwrite ? want_first : want_sum));

      // ln_f (and the head after it), then each block from the last, then everything.
      ASSERT_EQ(calls.size(), static_cast<size_t>(config.layers) + 2);
      const std::vector<TensorInfo>& layout = model.layout();
      EXPECT_EQ(calls.front().first, layout[layout.size() - 3].offset);
      EXPECT_EQ(layout[layout.size() - 3].name, "ln_f.weight");
      for (int l = config.layers - 1; l >= 0; --l) {
        const TensorInfo& first = layout[2 + 12 * static_cast<size_t>(l)];
        EXPECT_EQ(first.name, "blocks." + std::to_string(l) + ".ln1.weight");
        EXPECT_EQ(calls[static_cast<size_t>(config.layers - l)].first, first.offset);
      }
      EXPECT_EQ(calls.back().first, 0u);
      for (size_t i = 1; i < calls.size(); ++i) EXPECT_LT(calls[i].first, calls[i - 1].first) << "call " << i;
      // What was declared final then is what Backward left.
      for (const auto& [ready_from, snapshot] : calls) {
        EXPECT_TRUE(Bitwise(snapshot, model.grads().subspan(ready_from))) << "from " << ready_from;
      }
    }
  }
}

// Runs the same sequence of calls on a model with and one without activation
// checkpointing and requires the same bits from both at every step.
TEST(ModelTest, ActivationCheckpointingIsBitIdentical) {
  ModelConfig wider;
  wider.context = 16;
  wider.d_model = 32;
  wider.heads = 4;
  wider.layers = 3;
  wider.mlp_ratio = 2;
  wider.seed = 4;
  for (const ModelConfig& base : {Tiny(), wider}) {
    SCOPED_TRACE("layers " + std::to_string(base.layers) + ", d_model " + std::to_string(base.d_model));
    ModelConfig config = base;
    auto plain = Model::Create(config);
    config.activation_checkpointing = true;
    auto checkpointed = Model::Create(config);
    ASSERT_TRUE(plain.ok() && checkpointed.ok());
    Randomize(*plain, 14);
    Randomize(*checkpointed, 14);
    const size_t T = static_cast<size_t>(config.context);
    const std::vector<uint8_t> tokens = RandomBytes(4 * T, 10), targets = RandomBytes(4 * T, 11);

    // (first sequence, batch, mode): batch sizes that change between calls,
    // then two micro-batches accumulated.
    struct Step {
      size_t first;
      int batch;
      GradMode mode;
    };
    const std::vector<Step> steps = {{0, 3, GradMode::kOverwrite},
                                     {3, 1, GradMode::kOverwrite},
                                     {0, 2, GradMode::kOverwrite},
                                     {2, 2, GradMode::kAccumulate}};
    for (size_t s = 0; s < steps.size(); ++s) {
      SCOPED_TRACE("step " + std::to_string(s));
      const Step& step = steps[s];
      const float scale = step.batch == 2 ? 0.5f : 1.0f;
      auto loss_plain = plain->Forward(tokens.data() + step.first * T, targets.data() + step.first * T, step.batch);
      auto loss_checkpointed =
          checkpointed->Forward(tokens.data() + step.first * T, targets.data() + step.first * T, step.batch);
      ASSERT_TRUE(loss_plain.ok() && loss_checkpointed.ok());
      EXPECT_TRUE(Bitwise({&*loss_plain, 1}, {&*loss_checkpointed, 1})) << *loss_plain << " vs " << *loss_checkpointed;
      EXPECT_TRUE(Bitwise(plain->logits(), checkpointed->logits()));
      ASSERT_TRUE(plain->Backward(step.mode, scale).ok());
      ASSERT_TRUE(checkpointed->Backward(step.mode, scale).ok());
      EXPECT_TRUE(Bitwise(plain->grads(), checkpointed->grads()));
      EXPECT_LT(checkpointed->activation_bytes(), plain->activation_bytes());
    }
    // A forward without targets leaves what the next one with targets needs.
    ASSERT_TRUE(plain->Forward(tokens.data(), nullptr, 4).ok());
    ASSERT_TRUE(checkpointed->Forward(tokens.data(), nullptr, 4).ok());
    EXPECT_TRUE(Bitwise(plain->logits(), checkpointed->logits()));
    ASSERT_TRUE(plain->Forward(tokens.data(), targets.data(), 4).ok());
    ASSERT_TRUE(checkpointed->Forward(tokens.data(), targets.data(), 4).ok());
    ASSERT_TRUE(plain->Backward().ok());
    ASSERT_TRUE(checkpointed->Backward().ok());
    EXPECT_TRUE(Bitwise(plain->grads(), checkpointed->grads()));
  }
}

// With checkpointing, a block beyond the first costs only its saved input
// ([N, C]) instead of all its internal activations.
TEST(ModelTest, ActivationCheckpointingKeepsOneBlocksInternals) {
  auto bytes = [](int layers, bool checkpointing, int batch) {
    ModelConfig config;  // the default widths: T=64, C=128, 4 heads
    config.layers = layers;
    config.activation_checkpointing = checkpointing;
    auto model = Model::Create(config);
    EXPECT_TRUE(model.ok());
    EXPECT_EQ(model->activation_bytes(), 0u);
    const std::vector<uint8_t> tokens(static_cast<size_t>(batch) * 64, 1);
    EXPECT_TRUE(model->Forward(tokens.data(), tokens.data(), batch).ok());
    return model->activation_bytes();
  };
  const int batch = 8;
  const size_t block_input = size_t{batch} * 64 * 128 * sizeof(float);
  const size_t one_layer = bytes(1, false, batch);
  EXPECT_EQ(bytes(1, true, batch), one_layer);
  const size_t per_layer = bytes(2, false, batch) - one_layer;  // internals and output of one block
  EXPECT_GT(per_layer, 10 * block_input);
  for (const int layers : {2, 4, 8}) {
    SCOPED_TRACE("layers " + std::to_string(layers));
    const size_t plain = bytes(layers, false, batch), checkpointed = bytes(layers, true, batch);
    EXPECT_EQ(plain, one_layer + static_cast<size_t>(layers - 1) * per_layer);
    EXPECT_EQ(checkpointed, one_layer + static_cast<size_t>(layers - 1) * block_input);
  }

  // The workspace follows the batch size down as well as up.
  ModelConfig config = Tiny();
  config.activation_checkpointing = true;
  auto model = Model::Create(config);
  ASSERT_TRUE(model.ok());
  const std::vector<uint8_t> tokens = RandomBytes(size_t{4} * 8, 12);
  ASSERT_TRUE(model->Forward(tokens.data(), nullptr, 4).ok());
  const size_t four = model->activation_bytes();
  ASSERT_TRUE(model->Forward(tokens.data(), nullptr, 1).ok());
  EXPECT_LT(model->activation_bytes(), four);
}

TEST(ModelTest, SgdOnRepetitiveTextDrivesTheLossDown) {
  ModelConfig config;
  config.context = 16;
  config.d_model = 32;
  config.heads = 4;
  config.layers = 2;
  config.seed = 3;
  auto created = Model::Create(config);
  ASSERT_TRUE(created.ok());
  Model& model = *created;

  std::string text;
  while (text.size() < 2000) text += "the quick brown fox jumps over the lazy dog. ";
  const int batch = 8, T = config.context;
  std::mt19937_64 rng(9);
  std::vector<uint8_t> tokens(static_cast<size_t>(batch) * T), targets(tokens.size());
  auto sample = [&]() {
    for (int b = 0; b < batch; ++b) {
      const size_t start = rng() % (text.size() - T - 1);
      for (int t = 0; t < T; ++t) {
        tokens[static_cast<size_t>(b) * T + static_cast<size_t>(t)] = static_cast<uint8_t>(text[start + t]);
        targets[static_cast<size_t>(b) * T + static_cast<size_t>(t)] = static_cast<uint8_t>(text[start + t + 1]);
      }
    }
  };

  // SGD with momentum; every step a fresh batch of windows.
  const float lr = 0.1f, momentum = 0.9f;
  std::vector<float> velocity(model.num_parameters(), 0.0f);
  float first = 0, last = 0;
  for (int step = 0; step < 300; ++step) {
    sample();
    auto loss = model.Forward(tokens.data(), targets.data(), batch);
    ASSERT_TRUE(loss.ok());
    if (step == 0) first = *loss;
    last = *loss;
    ASSERT_TRUE(model.Backward().ok());
    for (size_t i = 0; i < velocity.size(); ++i) {
      velocity[i] = momentum * velocity[i] + model.grads()[i];
      model.params()[i] -= lr * velocity[i];
    }
  }
  EXPECT_NEAR(first, std::log(256.0f), 0.05f);
  EXPECT_LT(last, 1.0f) << "first loss " << first;
}

TEST(ModelTest, PipelineStagesSplitTheBlocksAndCoverTheBuffer) {
  ModelConfig c = Tiny();
  c.layers = 6;
  for (int stages = 1; stages <= c.layers; ++stages) {
    c.pipeline_stages = stages;
    const std::vector<StagePlan> plan = PlanStages(c);
    ASSERT_EQ(plan.size(), static_cast<size_t>(stages));
    EXPECT_EQ(plan.front().first_block, 0);
    EXPECT_EQ(plan.back().end_block, c.layers);
    EXPECT_EQ(plan.front().flat_begin, 0u);
    EXPECT_TRUE(plan.front().embeddings);
    EXPECT_TRUE(plan.back().head);
    double total = 0, largest = 0;
    for (size_t s = 0; s < plan.size(); ++s) {
      EXPECT_LT(plan[s].first_block, plan[s].end_block) << "stage " << s << " of " << stages;
      if (s > 0) {
        EXPECT_EQ(plan[s].first_block, plan[s - 1].end_block);
        EXPECT_EQ(plan[s].flat_begin, plan[s - 1].flat_end);
      }
      total += plan[s].cost;
      largest = std::max(largest, plan[s].cost);
    }
    const auto layout = TensorLayout(c);
    EXPECT_EQ(plan.back().flat_end, layout.back().offset + layout.back().size);
    // Balanced: no split into contiguous runs of blocks has a cheaper most
    // expensive stage (every split tried).
    const double C = c.d_model, T = c.context, V = c.vocab, F = 4 * C;
    const double block = 3 * C * C + C * C + 2 * F * C + T * C, head = C * V + 2 * V, embed = C;
    double optimum = std::numeric_limits<double>::infinity();
    std::vector<int> cuts;
    std::function<void(int)> search = [&](int from) {
      if (static_cast<int>(cuts.size()) == stages - 1) {
        double worst = 0;
        int first = 0;
        for (int s = 0; s < stages; ++s) {
          const int end = s + 1 < stages ? cuts[s] : c.layers;
          worst = std::max(worst, (end - first) * block + (s == 0 ? embed : 0) + (s == stages - 1 ? head : 0));
          first = end;
        }
        optimum = std::min(optimum, worst);
        return;
      }
      for (int cut = from; cut < c.layers; ++cut) {
        cuts.push_back(cut);
        search(cut + 1);
        cuts.pop_back();
      }
    };
    search(1);
    EXPECT_NEAR(largest, optimum, 1e-9 * optimum) << stages << " stages";
    EXPECT_NEAR(total, c.layers * block + embed + head, 1e-9 * total);
  }
  c.pipeline_stages = 7;
  EXPECT_EQ(c.Validate().code(), StatusCode::kInvalidArgument);
  c.pipeline_stages = 3;
  c.pipeline_stage = 3;
  EXPECT_EQ(c.Validate().code(), StatusCode::kInvalidArgument);
}

// InitialValues gives any range of the whole model's flat buffer exactly
// what Model::Create puts there: ranges inside a tensor, across tensors, the
// empty range, and the whole buffer.
TEST(ModelTest, InitialValuesOfAnyRangeAreTheModelsOwn) {
  ModelConfig c;
  c.context = 8;
  c.d_model = 16;
  c.heads = 2;
  c.layers = 3;
  c.seed = 7;
  auto m = Model::Create(c);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const auto params = m->params();
  const size_t n = params.size();
  for (const auto& [begin, end] : std::vector<std::pair<size_t, size_t>>{
           {0, n}, {0, 1}, {n - 1, n}, {5, 5}, {100, 4097}, {n / 3, 2 * n / 3}, {1234, 1235}}) {
    std::vector<float> out(end - begin, -1.0f);
    InitialValues(c, begin, end, out.data());
    EXPECT_TRUE(std::equal(out.begin(), out.end(), params.begin() + static_cast<std::ptrdiff_t>(begin)))
        << "[" << begin << ", " << end << ")";
  }
  // A stream over ranges in ascending order, then one behind it.
  InitialValueStream stream(c);
  for (const auto& [begin, end] : std::vector<std::pair<size_t, size_t>>{
           {0, 7}, {7, 100}, {300, 4000}, {4000, 4001}, {n - 10, n}, {50, 60}, {60, n}}) {
    std::vector<float> out(end - begin, -1.0f);
    stream.Fill(begin, end, out.data());
    EXPECT_TRUE(std::equal(out.begin(), out.end(), params.begin() + static_cast<std::ptrdiff_t>(begin)))
        << "stream [" << begin << ", " << end << ")";
  }
}

// On-demand parameters: a model whose parameters are all handed back
// (zeros) and brought in segment by segment through ParameterAccess, each
// released after use, computes the same loss and gradients bit for bit; the
// passes ask for the segments in order, naming the next one: forward the
// embeddings, each block in four parts and the head; backward the head and
// the blocks' parts in reverse, or with activation checkpointing each block
// whole (its recomputation needs three of the parts at once).
TEST(ModelTest, ParametersBroughtInSegmentBySegmentGiveTheSameResults) {
  for (bool checkpointing : {false, true}) {
    SCOPED_TRACE(checkpointing ? "checkpointing" : "no checkpointing");
    ModelConfig c = Tiny();
    c.layers = 3;
    c.activation_checkpointing = checkpointing;
    auto whole = Model::Create(c);
    ASSERT_TRUE(whole.ok());
    auto lazy = Model::Create(c, /*initialize=*/false);
    ASSERT_TRUE(lazy.ok());
    const std::vector<float> values(whole->params().begin(), whole->params().end());
    const auto segments = lazy->Segments();
    ASSERT_EQ(segments.size(), 14u);  // embeddings, 3 blocks x 4 parts, head
    EXPECT_EQ(segments.front().first, 0u);
    EXPECT_EQ(segments.back().second, lazy->num_parameters());
    for (size_t i = 1; i < segments.size(); ++i) EXPECT_EQ(segments[i].first, segments[i - 1].second);
    std::vector<std::pair<FlatRange, FlatRange>> asked;
    int released = 0;
    ParameterAccess access;
    access.acquire = [&](FlatRange now, FlatRange next) {
      asked.emplace_back(now, next);
      std::copy(values.begin() + static_cast<std::ptrdiff_t>(now.first),
                values.begin() + static_cast<std::ptrdiff_t>(now.second), lazy->params().begin() + now.first);
      return Status::Ok();
    };
    access.release = [&](FlatRange now) {
      ++released;
      lazy->param_buffer().Release(now.first, now.second);
    };
    lazy->SetParameterAccess(access);
    const std::vector<uint8_t> tokens = RandomBytes(16, 31), targets = RandomBytes(16, 32);
    auto want = whole->Forward(tokens.data(), targets.data(), 2);
    auto got = lazy->Forward(tokens.data(), targets.data(), 2);
    ASSERT_TRUE(want.ok() && got.ok());
    EXPECT_EQ(*want, *got);
    ASSERT_TRUE(whole->Backward().ok());
    ASSERT_TRUE(lazy->Backward().ok());
    EXPECT_EQ(std::memcmp(whole->grads().data(), lazy->grads().data(), whole->grads().size_bytes()), 0);
    // Forward: every segment in order, each naming the next.
    std::vector<FlatRange> backward;
    backward.push_back(segments.back());
    for (int l = 2; l >= 0; --l) {
      const auto* part = &segments[1 + 4 * static_cast<size_t>(l)];
      if (checkpointing) {
        backward.emplace_back(part[0].first, part[3].second);
      } else {
        for (int k = 3; k >= 0; --k) backward.push_back(part[k]);
      }
    }
    ASSERT_EQ(asked.size(), segments.size() + backward.size());
    for (size_t i = 0; i < segments.size(); ++i) {
      EXPECT_EQ(asked[i].first, segments[i]);
      EXPECT_EQ(asked[i].second, i + 1 < segments.size() ? segments[i + 1] : FlatRange(0, 0));
    }
    for (size_t i = 0; i < backward.size(); ++i) {
      const auto& [now, next] = asked[segments.size() + i];
      EXPECT_EQ(now, backward[i]) << "backward segment " << i;
      EXPECT_EQ(next, i + 1 < backward.size() ? backward[i + 1] : FlatRange(0, 0));
    }
    EXPECT_EQ(released, static_cast<int>(asked.size()));
    // Everything was handed back: the parameters read as zeros.
    for (float v : lazy->params()) ASSERT_EQ(v, 0.0f);
  }
}

TEST(ModelTest, PipelineStagesChainedEqualTheWholeModelBitForBit) {
  ModelConfig c = Tiny();
  c.layers = 4;
  for (bool checkpointing : {false, true}) {
    c.activation_checkpointing = checkpointing;
    auto whole = Model::Create(c);
    ASSERT_TRUE(whole.ok());
    const int micro = 3, batch = 2;
    const size_t n = size_t{batch} * 8;
    const std::vector<uint8_t> tokens = RandomBytes(micro * n, 21), targets = RandomBytes(micro * n, 22);
    std::vector<float> want_loss;
    for (int m = 0; m < micro; ++m) {
      auto loss = whole->Forward(tokens.data() + m * n, targets.data() + m * n, batch);
      ASSERT_TRUE(loss.ok());
      want_loss.push_back(*loss);
      ASSERT_TRUE(whole->Backward(m == 0 ? GradMode::kOverwrite : GradMode::kAccumulate, 1.0f / micro).ok());
    }
    for (int stages : {2, 3}) {
      c.pipeline_stages = stages;
      std::vector<Model> pipe;
      for (int s = 0; s < stages; ++s) {
        c.pipeline_stage = s;
        auto stage = Model::Create(c);
        ASSERT_TRUE(stage.ok());
        stage->SetSlots(micro);
        // The stage starts from the whole model's values at its range.
        ASSERT_TRUE(Bitwise(stage->params(), std::span<const float>(whole->params().data() + stage->flat_begin(),
                                                                    stage->num_parameters())));
        pipe.push_back(std::move(*stage));
      }
      // All forwards (each micro-batch in its slot), then the backwards in
      // micro-batch order, the order the whole model accumulated in.
      std::vector<float> got_loss(micro);
      for (int m = 0; m < micro; ++m) {
        const float* x = nullptr;
        for (int s = 0; s < stages; ++s) {
          auto loss = pipe[s].Forward(tokens.data() + m * n, targets.data() + m * n, batch, m, x);
          ASSERT_TRUE(loss.ok()) << loss.status().ToString();
          if (s == stages - 1) got_loss[m] = *loss;
          x = pipe[s].output(m).data();
        }
      }
      for (int m = 0; m < micro; ++m) EXPECT_EQ(got_loss[m], want_loss[m]) << "micro-batch " << m;
      for (int m = 0; m < micro; ++m) {
        const float* dy = nullptr;
        for (int s = stages - 1; s >= 0; --s) {
          ASSERT_TRUE(pipe[s]
                          .Backward(m == 0 ? GradMode::kOverwrite : GradMode::kAccumulate, 1.0f / micro, nullptr, m, dy)
                          .ok());
          dy = pipe[s].input_grad(m).data();
        }
      }
      for (int s = 0; s < stages; ++s) {
        EXPECT_TRUE(Bitwise(pipe[s].grads(), std::span<const float>(whole->grads().data() + pipe[s].flat_begin(),
                                                                    pipe[s].num_parameters())))
            << stages << " stages, stage " << s << (checkpointing ? ", checkpointing" : "");
      }
      // A stage before the last needs its output's gradient; one after the
      // first needs an input.
      EXPECT_EQ(pipe[0].Backward(GradMode::kOverwrite, 1.0f, nullptr, 0, nullptr).code(),
                StatusCode::kFailedPrecondition);
      EXPECT_EQ(pipe[1].Forward(tokens.data(), targets.data(), batch, 0, nullptr).status().code(),
                StatusCode::kInvalidArgument);
      EXPECT_EQ(pipe[0].Forward(tokens.data(), targets.data(), batch, micro, nullptr).status().code(),
                StatusCode::kInvalidArgument);
    }
    c.pipeline_stages = 1;
    c.pipeline_stage = 0;
  }
}

}  // namespace
}  // namespace tandem::model

namespace tandem::model {
namespace {

// The all-reduce of ranks that are threads of one process: each rank
// reduces every rank's data in rank order, so all get the same bits.
class ThreadGroup {
 public:
  explicit ThreadGroup(int n) : n_(n), barrier_(n), data_(static_cast<size_t>(n)) {}
  TpAllReduce For(int rank) {
    return [this, rank](float* data, size_t count, TpReduce op) {
      data_[static_cast<size_t>(rank)] = data;
      barrier_.arrive_and_wait();
      std::vector<float> out(count);
      for (size_t i = 0; i < count; ++i) {
        float acc = data_[0][i];
        for (int k = 1; k < n_; ++k) {
          const float x = data_[static_cast<size_t>(k)][i];
          acc = op == TpReduce::kSum ? acc + x : std::max(acc, x);
        }
        out[i] = acc;
      }
      barrier_.arrive_and_wait();  // everyone has read before anyone writes
      std::copy(out.begin(), out.end(), data);
      ++calls_;
      return Status::Ok();
    };
  }
  int calls() const { return calls_ / n_; }

 private:
  int n_;
  std::barrier<> barrier_;
  std::vector<float*> data_;
  std::atomic<int> calls_{0};
};

// Tensor parallelism: T ranks (threads) computing together start from the
// whole model's values (sliced), give the whole model's loss and, mapped
// back through the tensor table, its gradients within fp32 rounding (the
// only difference is the order of the all-reduced partial sums: a dot
// product of C or 4C terms summed as T partial sums, so about T·C ulps of
// the terms' magnitudes; 2e-5 relative to the tensor's largest gradient,
// plus a floor, holds that with a margin and still catches any misplaced
// or missing element, which is off by the size of a gradient). Replicated
// tensors get equal gradients on every rank, bit for bit. Two all-reduces
// per block go each way, plus the embeddings, the logits' maxima and sums
// forward and ln_f's gradient backward.
TEST(ModelTest, TensorParallelRanksEqualTheWholeModel) {
  ModelConfig c = Tiny();
  c.heads = 4;
  c.layers = 2;
  const int batch = 3, micro = 2;
  const size_t n = size_t{batch} * 8;
  const std::vector<uint8_t> tokens = RandomBytes(micro * n, 41), targets = RandomBytes(micro * n, 42);
  for (bool checkpointing : {false, true}) {
    c.activation_checkpointing = checkpointing;
    c.tensor_parallel = 1;
    c.tensor_rank = 0;
    auto whole = Model::Create(c);
    ASSERT_TRUE(whole.ok());
    std::vector<float> want_loss;
    for (int m = 0; m < micro; ++m) {
      auto loss = whole->Forward(tokens.data() + m * n, targets.data() + m * n, batch);
      ASSERT_TRUE(loss.ok());
      want_loss.push_back(*loss);
      ASSERT_TRUE(whole->Backward(m == 0 ? GradMode::kOverwrite : GradMode::kAccumulate, 0.5f).ok());
    }
    for (int tp : {2, 4}) {
      SCOPED_TRACE(fmt::format("tp={}{}", tp, checkpointing ? ", checkpointing" : ""));
      c.tensor_parallel = tp;
      ThreadGroup group(tp);
      std::vector<Model> ranks;
      for (int r = 0; r < tp; ++r) {
        c.tensor_rank = r;
        auto m = Model::Create(c);
        ASSERT_TRUE(m.ok()) << m.status().ToString();
        m->SetTensorParallel(group.For(r));
        ranks.push_back(std::move(*m));
      }
      // Every rank's initial values are the whole model's, sliced.
      for (int r = 0; r < tp; ++r) {
        for (const TensorInfo& t : ranks[r].layout()) {
          for (size_t i = 0; i < t.size; ++i) {
            ASSERT_EQ(ranks[r].params()[t.offset + i], whole->params()[WholeElement(t, i)]) << t.name << " " << i;
          }
        }
      }
      std::vector<std::vector<float>> losses(static_cast<size_t>(tp));
      std::vector<Status> failed(static_cast<size_t>(tp));
      std::vector<std::thread> threads;
      for (int r = 0; r < tp; ++r) {
        threads.emplace_back([&, r] {
          for (int m = 0; m < micro; ++m) {
            auto loss = ranks[r].Forward(tokens.data() + m * n, targets.data() + m * n, batch);
            if (!loss.ok()) {
              failed[r] = loss.status();
              return;
            }
            losses[r].push_back(*loss);
            failed[r] = ranks[r].Backward(m == 0 ? GradMode::kOverwrite : GradMode::kAccumulate, 0.5f);
            if (!failed[r].ok()) return;
          }
        });
      }
      for (auto& t : threads) t.join();
      for (int r = 0; r < tp; ++r) {
        ASSERT_TRUE(failed[r].ok()) << failed[r].ToString();
        for (int m = 0; m < micro; ++m) {
          EXPECT_NEAR(losses[r][m], want_loss[m], 2e-6f * want_loss[m]) << "rank " << r << " micro-batch " << m;
        }
      }
      // 2 blocks × 2 all-reduces each way, the embeddings, the maxima and the
      // sums; ln_f backward; with checkpointing the recomputed first block's
      // attention all-reduce again.
      EXPECT_EQ(group.calls(), micro * (2 * 2 + 3 + 2 * 2 + 1 + (checkpointing ? 1 : 0)));
      for (size_t k = 0; k < ranks[0].layout().size(); ++k) {
        const TensorInfo& t0 = ranks[0].layout()[k];
        float largest = 0;
        for (size_t i = 0; i < t0.whole_size; ++i) {
          largest = std::max(largest, std::fabs(whole->grads()[t0.whole_offset + i]));
        }
        for (int r = 0; r < tp; ++r) {
          const TensorInfo& t = ranks[r].layout()[k];
          ASSERT_EQ(t.name, t0.name);
          for (size_t i = 0; i < t.size; ++i) {
            const float got = ranks[r].grads()[t.offset + i];
            ASSERT_NEAR(got, whole->grads()[WholeElement(t, i)], 2e-5f * largest + 1e-9f)
                << t.name << " element " << i << " of rank " << r;
            if (t.replicated) {
              ASSERT_EQ(got, ranks[0].grads()[t0.offset + i]) << t.name << " rank " << r;
            }
          }
        }
      }
    }
  }
}

// The servers' space with tp=2 × pp=2: the parts one after another, each
// initialised by InitialValueStream exactly as the model of that stage and
// rank, and WriteWholeStage turns each stage's parts back into the whole
// model's values at that stage's range; the tensor table names each rank's
// copy of a tensor apart.
TEST(ModelTest, TensorParallelPartsMapBackToTheWholeModel) {
  ModelConfig c = Tiny();
  c.heads = 2;
  c.layers = 3;
  auto whole = Model::Create(c);
  ASSERT_TRUE(whole.ok());
  c.tensor_parallel = 2;
  c.pipeline_stages = 2;
  const std::vector<size_t> bounds = PartBounds(c);
  ASSERT_EQ(bounds.size(), 5u);
  const std::vector<TensorInfo> server = ServerLayout(c);
  EXPECT_EQ(server.back().offset + server.back().size, bounds.back());
  std::set<std::string> names;
  for (const TensorInfo& t : server) EXPECT_TRUE(names.insert(t.name).second) << t.name;
  EXPECT_TRUE(names.contains("wte.weight@tp1"));
  EXPECT_TRUE(names.contains("blocks.2.ln1.weight@tp0"));
  // The replicated tensors twice, the split ones once in halves.
  size_t total = 0;
  for (const TensorInfo& t : server) total += t.size;
  size_t replicated = 0;
  for (const TensorInfo& t : TensorLayout(c)) replicated += t.replicated ? t.size : 0;
  EXPECT_EQ(total, whole->num_parameters() + replicated);

  InitialValueStream stream(c);
  std::vector<float> all(bounds.back());
  stream.Fill(0, all.size(), all.data());
  std::vector<float> rewritten;
  for (int s = 0; s < 2; ++s) {
    std::vector<std::span<const float>> parts;
    for (int r = 0; r < 2; ++r) {
      c.pipeline_stage = s;
      c.tensor_rank = r;
      auto m = Model::Create(c);
      ASSERT_TRUE(m.ok());
      const size_t part = static_cast<size_t>(s * 2 + r);
      EXPECT_EQ(m->flat_begin(), bounds[part]);
      ASSERT_EQ(m->num_parameters(), bounds[part + 1] - bounds[part]);
      EXPECT_TRUE(std::equal(m->params().begin(), m->params().end(), all.begin() + bounds[part]))
          << "stage " << s << " rank " << r;
      parts.emplace_back(all.data() + bounds[part], m->num_parameters());
      // The table the servers get for the part is ServerLayout's.
      const auto specs = m->Tensors();
      ASSERT_FALSE(specs.empty());
      EXPECT_TRUE(specs.front().name().ends_with(fmt::format("@tp{}", r)));
    }
    ASSERT_TRUE(WriteWholeStage(c, s, parts, [&](std::span<const float> piece) {
                  rewritten.insert(rewritten.end(), piece.begin(), piece.end());
                  return Status::Ok();
                }).ok());
  }
  ASSERT_EQ(rewritten.size(), whole->num_parameters());
  EXPECT_EQ(std::memcmp(rewritten.data(), whole->params().data(), whole->params().size_bytes()), 0);
  // A stream asked in pieces, one behind another, gives the same.
  InitialValueStream pieces(c);
  for (const auto& [b, e] : std::vector<std::pair<size_t, size_t>>{{5, 900}, {900, bounds[3]}, {1, 2}}) {
    std::vector<float> out(e - b);
    pieces.Fill(b, e, out.data());
    EXPECT_TRUE(std::equal(out.begin(), out.end(), all.begin() + static_cast<std::ptrdiff_t>(b))) << b << " " << e;
  }
  // Bad splits are refused naming the field.
  c.tensor_rank = 0;
  c.tensor_parallel = 3;
  EXPECT_EQ(c.Validate().code(), StatusCode::kInvalidArgument);
  c.tensor_parallel = 4;  // 2 heads
  EXPECT_NE(c.Validate().message().find("heads"), std::string::npos);
  // Without the group's all-reduce a rank refuses to compute.
  c.tensor_parallel = 2;
  c.pipeline_stages = 1;
  c.pipeline_stage = 0;
  auto lone = Model::Create(c);
  ASSERT_TRUE(lone.ok());
  const std::vector<uint8_t> tokens = RandomBytes(8, 3);
  EXPECT_EQ(lone->Forward(tokens.data(), tokens.data(), 1).status().code(), StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace tandem::model
