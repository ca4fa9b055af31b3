// The optimizer module (common/optimizer/): every
// validation error of OptimizerConfig; the learning-rate schedule; SGD, Adam
// and AdamW over 200 steps against a double-precision reference written
// here from PyTorch's formulas; group overrides; bit-identical results
// however an update is split (ranges, thread pools); the thread pool itself;
// gradient scans; and the wire conversions against references built from
// the formats' definitions (not from the code under test).
#include "common/optimizer/optimizer.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/mutex.h"
#include "common/optimizer/gradient.h"
#include "common/optimizer/thread_pool.h"
#include "optimizer_reference.h"

namespace tandem::optim {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

v1::OptimizerConfig Adam(double lr = 1e-3) {
  v1::OptimizerConfig c;
  c.mutable_adam()->set_lr(lr);
  return c;
}

v1::OptimizerConfig Sgd(double lr = 0.1) {
  v1::OptimizerConfig c;
  c.mutable_sgd()->set_lr(lr);
  return c;
}

// --- Validation -------------------------------------------------------------

struct BadConfig {
  std::string what;
  std::function<void(v1::OptimizerConfig&)> edit;  // applied to Adam() unless it sets another rule
  std::string message;                             // the exact message expected
};

std::vector<BadConfig> BadConfigs() {
  using C = v1::OptimizerConfig;
  std::vector<BadConfig> cases = {
      {"no rule", [](C& c) { c.clear_optimizer(); },
       "optimizer: no update rule: set exactly one of optimizer.sgd or optimizer.adam"},
      {"sgd lr 0", [](C& c) { c = Sgd(0); }, "optimizer.sgd.lr: 0 must be > 0 and finite"},
      {"sgd lr negative", [](C& c) { c = Sgd(-0.5); }, "optimizer.sgd.lr: -0.5 must be > 0 and finite"},
      {"sgd lr nan", [](C& c) { c = Sgd(kNaN); }, "optimizer.sgd.lr: nan must be > 0 and finite"},
      {"sgd lr inf", [](C& c) { c = Sgd(kInf); }, "optimizer.sgd.lr: inf must be > 0 and finite"},
      {"sgd momentum 1",
       [](C& c) {
         c = Sgd();
         c.mutable_sgd()->set_momentum(1);
       },
       "optimizer.sgd.momentum: 1 must be in [0, 1)"},
      {"sgd momentum negative",
       [](C& c) {
         c = Sgd();
         c.mutable_sgd()->set_momentum(-0.1);
       },
       "optimizer.sgd.momentum: -0.1 must be in [0, 1)"},
      {"sgd momentum nan",
       [](C& c) {
         c = Sgd();
         c.mutable_sgd()->set_momentum(kNaN);
       },
       "optimizer.sgd.momentum: nan must be in [0, 1)"},
      {"sgd nesterov without momentum",
       [](C& c) {
         c = Sgd();
         c.mutable_sgd()->set_nesterov(true);
       },
       "optimizer.sgd.nesterov: true requires optimizer.sgd.momentum > 0 (it is 0)"},
      {"sgd weight decay negative",
       [](C& c) {
         c = Sgd();
         c.mutable_sgd()->set_weight_decay(-1);
       },
       "optimizer.sgd.weight_decay: -1 must be >= 0 and finite"},
      {"sgd weight decay inf",
       [](C& c) {
         c = Sgd();
         c.mutable_sgd()->set_weight_decay(kInf);
       },
       "optimizer.sgd.weight_decay: inf must be >= 0 and finite"},
      {"adam lr 0", [](C& c) { c.mutable_adam()->set_lr(0); }, "optimizer.adam.lr: 0 must be > 0 and finite"},
      {"adam lr inf", [](C& c) { c.mutable_adam()->set_lr(kInf); }, "optimizer.adam.lr: inf must be > 0 and finite"},
      {"adam beta1 1.5", [](C& c) { c.mutable_adam()->set_beta1(1.5); }, "optimizer.adam.beta1: 1.5 must be in [0, 1)"},
      {"adam beta1 1", [](C& c) { c.mutable_adam()->set_beta1(1); }, "optimizer.adam.beta1: 1 must be in [0, 1)"},
      {"adam beta1 negative", [](C& c) { c.mutable_adam()->set_beta1(-0.5); },
       "optimizer.adam.beta1: -0.5 must be in [0, 1)"},
      {"adam beta2 1", [](C& c) { c.mutable_adam()->set_beta2(1); }, "optimizer.adam.beta2: 1 must be in [0, 1)"},
      {"adam beta2 nan", [](C& c) { c.mutable_adam()->set_beta2(kNaN); },
       "optimizer.adam.beta2: nan must be in [0, 1)"},
      {"adam eps 0", [](C& c) { c.mutable_adam()->set_eps(0); }, "optimizer.adam.eps: 0 must be > 0 and finite"},
      {"adam eps negative", [](C& c) { c.mutable_adam()->set_eps(-1e-08); },
       "optimizer.adam.eps: -1e-08 must be > 0 and finite"},
      {"adam eps inf", [](C& c) { c.mutable_adam()->set_eps(kInf); }, "optimizer.adam.eps: inf must be > 0 and finite"},
      {"adam weight decay negative", [](C& c) { c.mutable_adam()->set_weight_decay(-0.01); },
       "optimizer.adam.weight_decay: -0.01 must be >= 0 and finite"},
      {"adam weight decay nan", [](C& c) { c.mutable_adam()->set_weight_decay(kNaN); },
       "optimizer.adam.weight_decay: nan must be >= 0 and finite"},
      {"schedule kind unknown", [](C& c) { c.mutable_lr_schedule()->set_kind(static_cast<v1::LrScheduleKind>(7)); },
       "optimizer.lr_schedule.kind: 7 is not a known LrScheduleKind"},
      {"cosine total below warmup",
       [](C& c) {
         c.mutable_lr_schedule()->set_kind(v1::LR_SCHEDULE_KIND_COSINE);
         c.mutable_lr_schedule()->set_warmup_steps(100);
         c.mutable_lr_schedule()->set_total_steps(50);
       },
       "optimizer.lr_schedule.total_steps: 50 must be > warmup_steps (100) for LR_SCHEDULE_KIND_COSINE"},
      {"cosine total unset", [](C& c) { c.mutable_lr_schedule()->set_kind(v1::LR_SCHEDULE_KIND_COSINE); },
       "optimizer.lr_schedule.total_steps: 0 must be > warmup_steps (0) for LR_SCHEDULE_KIND_COSINE"},
      {"linear total equal to warmup",
       [](C& c) {
         c.mutable_lr_schedule()->set_kind(v1::LR_SCHEDULE_KIND_LINEAR);
         c.mutable_lr_schedule()->set_warmup_steps(10);
         c.mutable_lr_schedule()->set_total_steps(10);
       },
       "optimizer.lr_schedule.total_steps: 10 must be > warmup_steps (10) for LR_SCHEDULE_KIND_LINEAR"},
      {"min lr ratio above 1", [](C& c) { c.mutable_lr_schedule()->set_min_lr_ratio(1.5); },
       "optimizer.lr_schedule.min_lr_ratio: 1.5 must be in [0, 1]"},
      {"min lr ratio negative", [](C& c) { c.mutable_lr_schedule()->set_min_lr_ratio(-0.1); },
       "optimizer.lr_schedule.min_lr_ratio: -0.1 must be in [0, 1]"},
      {"min lr ratio nan", [](C& c) { c.mutable_lr_schedule()->set_min_lr_ratio(kNaN); },
       "optimizer.lr_schedule.min_lr_ratio: nan must be in [0, 1]"},
      {"max grad norm negative", [](C& c) { c.set_max_grad_norm(-1); },
       "optimizer.max_grad_norm: -1 must be >= 0 and finite"},
      {"max grad norm inf", [](C& c) { c.set_max_grad_norm(kInf); },
       "optimizer.max_grad_norm: inf must be >= 0 and finite"},
      {"max grad norm nan", [](C& c) { c.set_max_grad_norm(kNaN); },
       "optimizer.max_grad_norm: nan must be >= 0 and finite"},
      {"non-finite policy unknown", [](C& c) { c.set_non_finite_policy(static_cast<v1::NonFinitePolicy>(9)); },
       "optimizer.non_finite_policy: 9 is not a known NonFinitePolicy"},
      {"reduction unknown", [](C& c) { c.set_reduction(static_cast<v1::GradientReduction>(-2)); },
       "optimizer.reduction: -2 is not a known GradientReduction"},
      {"too many groups",
       [](C& c) {
         for (int i = 0; i < 65; ++i) (*c.mutable_group_overrides())["g" + std::to_string(i)].set_lr_scale(1);
       },
       "optimizer.group_overrides: 65 groups; at most 64 are allowed"},
      {"empty group key", [](C& c) { (*c.mutable_group_overrides())[""].set_lr_scale(1); },
       "optimizer.group_overrides: key \"\" is 0 bytes; keys must be 1 to 128 bytes"},
      {"long group key", [](C& c) { (*c.mutable_group_overrides())[std::string(129, 'k')].set_lr_scale(1); },
       "optimizer.group_overrides: key \"" + std::string(40, 'k') + "\"… is 129 bytes; keys must be 1 to 128 bytes"},
      {"group lr scale negative", [](C& c) { (*c.mutable_group_overrides())["embed"].set_lr_scale(-1); },
       "optimizer.group_overrides[\"embed\"].lr_scale: -1 must be >= 0 and finite"},
      {"group lr scale nan", [](C& c) { (*c.mutable_group_overrides())["embed"].set_lr_scale(kNaN); },
       "optimizer.group_overrides[\"embed\"].lr_scale: nan must be >= 0 and finite"},
      {"group weight decay inf", [](C& c) { (*c.mutable_group_overrides())["norm"].set_weight_decay(kInf); },
       "optimizer.group_overrides[\"norm\"].weight_decay: inf must be >= 0 and finite"},
      {"group weight decay negative",
       [](C& c) {
         (*c.mutable_group_overrides())["a"].set_weight_decay(0.1);
         (*c.mutable_group_overrides())["b"].set_weight_decay(-0.1);
       },
       "optimizer.group_overrides[\"b\"].weight_decay: -0.1 must be >= 0 and finite"},
  };
  return cases;
}

TEST(OptimizerConfigTest, EveryInvalidFieldIsNamedWithItsValue) {
  for (const BadConfig& bad : BadConfigs()) {
    SCOPED_TRACE(bad.what);
    v1::OptimizerConfig c = Adam();
    bad.edit(c);
    auto made = Optimizer::Create(c);
    ASSERT_FALSE(made.ok());
    EXPECT_EQ(made.status().code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(made.status().message(), bad.message);
  }
}

TEST(OptimizerConfigTest, AcceptsTheBoundaries) {
  std::vector<v1::OptimizerConfig> good;
  good.push_back(Sgd());
  {
    v1::OptimizerConfig c = Sgd(1e-30);
    c.mutable_sgd()->set_momentum(0.999999);
    c.mutable_sgd()->set_nesterov(true);
    c.mutable_sgd()->set_weight_decay(0);
    good.push_back(c);
  }
  {
    v1::OptimizerConfig c = Adam();
    c.mutable_adam()->set_beta1(0);
    c.mutable_adam()->set_beta2(0);
    c.mutable_adam()->set_eps(1e-300);
    c.mutable_lr_schedule()->set_kind(v1::LR_SCHEDULE_KIND_CONSTANT);
    c.mutable_lr_schedule()->set_warmup_steps(10);  // total_steps is ignored for CONSTANT
    c.mutable_lr_schedule()->set_min_lr_ratio(1);
    c.set_max_grad_norm(0);
    for (int i = 0; i < 64; ++i) (*c.mutable_group_overrides())["g" + std::to_string(i)].set_lr_scale(0);
    (*c.mutable_group_overrides())["g0"].set_weight_decay(0);
    good.push_back(c);
  }
  {
    v1::OptimizerConfig c = Adam();
    c.mutable_lr_schedule()->set_kind(v1::LR_SCHEDULE_KIND_LINEAR);
    c.mutable_lr_schedule()->set_warmup_steps(9);
    c.mutable_lr_schedule()->set_total_steps(10);
    (*c.mutable_group_overrides())[std::string(128, 'x')].set_lr_scale(2);
    c.set_non_finite_policy(v1::NON_FINITE_POLICY_FAIL);
    c.set_reduction(v1::GRADIENT_REDUCTION_SUM);
    good.push_back(c);
  }
  for (const auto& c : good) {
    auto made = Optimizer::Create(c);
    EXPECT_TRUE(made.ok()) << made.status().ToString() << " for " << c.ShortDebugString();
  }
}

TEST(OptimizerConfigTest, NamesBuffersGroupsAndNormalisedEnums) {
  {
    auto o = Optimizer::Create(Sgd());
    ASSERT_TRUE(o.ok());
    EXPECT_EQ(o->name(), "sgd");
    EXPECT_EQ(o->state_buffers(), 0);
    EXPECT_EQ(o->non_finite_policy(), v1::NON_FINITE_POLICY_SKIP_STEP);
    EXPECT_EQ(o->reduction(), v1::GRADIENT_REDUCTION_MEAN);
    EXPECT_EQ(o->max_grad_norm(), 0);
  }
  {
    v1::OptimizerConfig c = Sgd();
    c.mutable_sgd()->set_momentum(0.9);
    c.set_non_finite_policy(v1::NON_FINITE_POLICY_FAIL);
    c.set_reduction(v1::GRADIENT_REDUCTION_SUM);
    c.set_max_grad_norm(1.5);
    auto o = Optimizer::Create(c);
    ASSERT_TRUE(o.ok());
    EXPECT_EQ(o->state_buffers(), 1);
    EXPECT_EQ(o->non_finite_policy(), v1::NON_FINITE_POLICY_FAIL);
    EXPECT_EQ(o->reduction(), v1::GRADIENT_REDUCTION_SUM);
    EXPECT_EQ(o->max_grad_norm(), 1.5);
    EXPECT_EQ(o->config().sgd().momentum(), 0.9);
  }
  {
    v1::OptimizerConfig c = Adam();
    c.mutable_adam()->set_weight_decay(0.1);
    (*c.mutable_group_overrides())["bias"].set_weight_decay(0);
    (*c.mutable_group_overrides())["embed"].set_lr_scale(0.5);
    (*c.mutable_group_overrides())["both"].set_lr_scale(0);
    (*c.mutable_group_overrides())["both"].set_weight_decay(0.3);
    auto o = Optimizer::Create(c);
    ASSERT_TRUE(o.ok());
    EXPECT_EQ(o->name(), "adam");
    EXPECT_EQ(o->state_buffers(), 2);
    auto check = [&](std::string_view g, double lr_scale, double wd) {
      const GroupParams p = o->Group(g);
      EXPECT_EQ(p.lr_scale, lr_scale) << g;
      EXPECT_EQ(p.weight_decay, wd) << g;
    };
    check("", 1, 0.1);
    check("unlisted", 1, 0.1);
    check("bias", 1, 0);
    check("embed", 0.5, 0.1);
    check("both", 0, 0.3);
    c.mutable_adam()->set_decoupled_weight_decay(true);
    auto w = Optimizer::Create(c);
    ASSERT_TRUE(w.ok());
    EXPECT_EQ(w->name(), "adamw");
  }
}

// --- Learning-rate schedule ---------------------------------------------------

TEST(LrScheduleTest, ConstantWithoutWarmupIsThePeakForever) {
  auto o = Optimizer::Create(Adam(0.25));
  ASSERT_TRUE(o.ok());
  for (uint64_t s : {0ULL, 1ULL, 1000ULL, 1ULL << 40}) EXPECT_EQ(o->LearningRate(s), 0.25) << s;
}

TEST(LrScheduleTest, WarmupRisesLinearlyToThePeak) {
  v1::OptimizerConfig c = Adam(1.0);
  c.mutable_lr_schedule()->set_warmup_steps(4);
  c.mutable_lr_schedule()->set_total_steps(2);  // ignored for CONSTANT
  auto o = Optimizer::Create(c);
  ASSERT_TRUE(o.ok());
  EXPECT_DOUBLE_EQ(o->LearningRate(0), 0.25);
  EXPECT_DOUBLE_EQ(o->LearningRate(1), 0.5);
  EXPECT_DOUBLE_EQ(o->LearningRate(2), 0.75);
  EXPECT_DOUBLE_EQ(o->LearningRate(3), 1.0);
  EXPECT_DOUBLE_EQ(o->LearningRate(4), 1.0);
  EXPECT_DOUBLE_EQ(o->LearningRate(1000000), 1.0);
}

TEST(LrScheduleTest, CosineDecaysFromThePeakToTheFloorThenStays) {
  v1::OptimizerConfig c = Sgd(2.0);
  c.mutable_lr_schedule()->set_kind(v1::LR_SCHEDULE_KIND_COSINE);
  c.mutable_lr_schedule()->set_warmup_steps(10);
  c.mutable_lr_schedule()->set_total_steps(110);
  c.mutable_lr_schedule()->set_min_lr_ratio(0.1);
  auto o = Optimizer::Create(c);
  ASSERT_TRUE(o.ok());
  EXPECT_DOUBLE_EQ(o->LearningRate(0), 0.2);   // warmup: 2 * 1/10
  EXPECT_DOUBLE_EQ(o->LearningRate(9), 2.0);   // last warmup step reaches the peak
  EXPECT_DOUBLE_EQ(o->LearningRate(10), 2.0);  // decay starts at the peak
  // Half way: floor + (1 - floor) * 0.5 = 0.55 of the peak.
  EXPECT_DOUBLE_EQ(o->LearningRate(60), 2.0 * 0.55);
  // A quarter: 0.1 + 0.9 * (1 + cos(pi/4)) / 2.
  EXPECT_NEAR(o->LearningRate(35), 2.0 * (0.1 + 0.9 * (1 + std::sqrt(0.5)) / 2), 1e-12);
  EXPECT_GT(o->LearningRate(109), 0.2);
  EXPECT_DOUBLE_EQ(o->LearningRate(110), 0.2);  // total_steps: the floor
  EXPECT_DOUBLE_EQ(o->LearningRate(5000), 0.2);
  // Monotone after warmup.
  for (uint64_t s = 10; s < 120; ++s) EXPECT_LE(o->LearningRate(s + 1), o->LearningRate(s)) << s;
}

TEST(LrScheduleTest, LinearDecaysToZeroOrToTheFloor) {
  v1::OptimizerConfig c = Adam(1.0);
  c.mutable_lr_schedule()->set_kind(v1::LR_SCHEDULE_KIND_LINEAR);
  c.mutable_lr_schedule()->set_total_steps(100);
  auto o = Optimizer::Create(c);
  ASSERT_TRUE(o.ok());
  EXPECT_DOUBLE_EQ(o->LearningRate(0), 1.0);
  EXPECT_DOUBLE_EQ(o->LearningRate(25), 0.75);
  EXPECT_NEAR(o->LearningRate(99), 0.01, 1e-15);
  EXPECT_EQ(o->LearningRate(100), 0.0);
  EXPECT_EQ(o->LearningRate(101), 0.0);

  c.mutable_lr_schedule()->set_warmup_steps(20);
  c.mutable_lr_schedule()->set_min_lr_ratio(0.2);
  auto f = Optimizer::Create(c);
  ASSERT_TRUE(f.ok());
  EXPECT_DOUBLE_EQ(f->LearningRate(4), 0.25);
  EXPECT_DOUBLE_EQ(f->LearningRate(20), 1.0);
  EXPECT_DOUBLE_EQ(f->LearningRate(60), 0.2 + 0.8 * 0.5);
  EXPECT_DOUBLE_EQ(f->LearningRate(100), 0.2);
  EXPECT_DOUBLE_EQ(f->LearningRate(1ULL << 50), 0.2);
}

TEST(LrScheduleTest, MinRatioOneKeepsThePeak) {
  v1::OptimizerConfig c = Adam(0.5);
  c.mutable_lr_schedule()->set_kind(v1::LR_SCHEDULE_KIND_COSINE);
  c.mutable_lr_schedule()->set_total_steps(10);
  c.mutable_lr_schedule()->set_min_lr_ratio(1);
  auto o = Optimizer::Create(c);
  ASSERT_TRUE(o.ok());
  for (uint64_t s = 0; s < 20; ++s) EXPECT_DOUBLE_EQ(o->LearningRate(s), 0.5) << s;
}

// --- Update rules against a double-precision reference ------------------------

struct RuleCase {
  std::string name;
  v1::OptimizerConfig config;
  std::string group;  // the group whose parameters the run uses
};

void PrintTo(const RuleCase& c, std::ostream* os) {
  *os << c.name;
}

std::vector<RuleCase> RuleCases() {
  std::vector<RuleCase> cases;
  auto add = [&](std::string name, v1::OptimizerConfig c, std::string group = "") {
    cases.push_back({std::move(name), std::move(c), std::move(group)});
  };
  add("SgdPlain", Sgd(0.05));
  {
    v1::OptimizerConfig c = Sgd(0.05);
    c.mutable_sgd()->set_weight_decay(0.01);
    add("SgdWeightDecay", c);
  }
  {
    v1::OptimizerConfig c = Sgd(0.01);
    c.mutable_sgd()->set_momentum(0.9);
    add("SgdMomentum", c);
  }
  {
    v1::OptimizerConfig c = Sgd(0.01);
    c.mutable_sgd()->set_momentum(0.9);
    c.mutable_sgd()->set_nesterov(true);
    c.mutable_sgd()->set_weight_decay(0.05);
    c.mutable_lr_schedule()->set_kind(v1::LR_SCHEDULE_KIND_COSINE);
    c.mutable_lr_schedule()->set_warmup_steps(10);
    c.mutable_lr_schedule()->set_total_steps(150);  // the last 50 steps run at the floor
    c.mutable_lr_schedule()->set_min_lr_ratio(0.1);
    add("SgdNesterovWeightDecayCosine", c);
  }
  {
    v1::OptimizerConfig c = Adam(1e-2);
    c.mutable_adam()->set_weight_decay(0.05);
    add("AdamL2", c);
  }
  {
    v1::OptimizerConfig c = Adam(1e-2);
    c.mutable_adam()->set_beta1(0.8);
    c.mutable_adam()->set_beta2(0.99);
    c.mutable_adam()->set_eps(1e-6);
    c.mutable_adam()->set_bias_correction(false);
    add("AdamNoBiasCorrection", c);
  }
  {
    v1::OptimizerConfig c = Adam(1e-2);
    c.mutable_adam()->set_decoupled_weight_decay(true);
    c.mutable_adam()->set_weight_decay(0.1);
    c.mutable_lr_schedule()->set_kind(v1::LR_SCHEDULE_KIND_LINEAR);
    c.mutable_lr_schedule()->set_warmup_steps(20);
    c.mutable_lr_schedule()->set_total_steps(180);
    c.mutable_lr_schedule()->set_min_lr_ratio(0.05);
    add("AdamW", c);
  }
  {
    v1::OptimizerConfig c = Adam(1e-2);
    c.mutable_adam()->set_decoupled_weight_decay(true);
    c.mutable_adam()->set_weight_decay(0.1);
    c.mutable_adam()->set_bias_correction(false);
    add("AdamWNoBiasCorrection", c);
  }
  // Group overrides: a decay override and a scaled learning rate.
  {
    v1::OptimizerConfig c = Adam(1e-2);
    c.mutable_adam()->set_decoupled_weight_decay(true);
    c.mutable_adam()->set_weight_decay(0.01);
    (*c.mutable_group_overrides())["strong"].set_weight_decay(0.5);
    (*c.mutable_group_overrides())["strong"].set_lr_scale(2);
    add("AdamWGroupOverride", c, "strong");
  }
  {
    v1::OptimizerConfig c = Sgd(0.01);
    c.mutable_sgd()->set_momentum(0.5);
    c.mutable_sgd()->set_weight_decay(0.1);
    (*c.mutable_group_overrides())["bias"].set_weight_decay(0);
    add("SgdGroupNoDecay", c, "bias");
  }
  return cases;
}

std::vector<float> RandomVector(size_t n, uint64_t seed, double stddev) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, static_cast<float>(stddev));
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

class UpdateRuleTest : public ::testing::TestWithParam<RuleCase> {};

TEST_P(UpdateRuleTest, TwoHundredStepsMatchADoublePrecisionReference) {
  const RuleCase& rc = GetParam();
  auto made = Optimizer::Create(rc.config);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  const Optimizer& o = *made;
  const GroupParams gp = o.Group(rc.group);
  constexpr size_t kN = 3001;  // not a multiple of any vector width: the scalar tail runs too
  constexpr int kSteps = 200;
  constexpr double kScale = 0.5;

  std::vector<float> w = RandomVector(kN, 1, 1.0);
  std::vector<float> s0(kN, 0.0f);
  std::vector<float> s1(kN, 0.0f);
  Reference ref{std::vector<double>(w.begin(), w.end()), std::vector<double>(kN, 0), std::vector<double>(kN, 0)};
  const std::vector<float> w0 = w;
  for (int step = 0; step < kSteps; ++step) {
    // Gradients pull the weights towards a target, with noise, so the run
    // both moves the weights and keeps exercising the moments.
    std::vector<float> g = RandomVector(kN, 100 + static_cast<uint64_t>(step), 1.0);
    for (size_t i = 0; i < kN; ++i) g[i] += 2 * (w[i] - 0.5f);
    o.Apply(w.data(), o.state_buffers() > 0 ? s0.data() : nullptr, o.state_buffers() > 1 ? s1.data() : nullptr,
            g.data(), kN, static_cast<uint64_t>(step), gp, kScale);
    ref.Step(o, g, static_cast<uint64_t>(step), gp, kScale);
  }
  double max_err = 0;
  double moved = 0;
  for (size_t i = 0; i < kN; ++i) {
    ASSERT_TRUE(std::isfinite(w[i])) << i;
    max_err = std::max(max_err, std::fabs(w[i] - ref.w[i]) / std::max(1.0, std::fabs(ref.w[i])));
    if (o.state_buffers() > 0) {
      max_err = std::max(max_err, std::fabs(s0[i] - ref.s0[i]) / std::max(1.0, std::fabs(ref.s0[i])));
    }
    if (o.state_buffers() > 1) {
      max_err = std::max(max_err, std::fabs(s1[i] - ref.s1[i]) / std::max(1.0, std::fabs(ref.s1[i])));
    }
    moved += std::fabs(w[i] - w0[i]);
  }
  // Float rounding only: a few ulp per step, accumulated over 200 steps.
  EXPECT_LT(max_err, 2e-5) << rc.name;
  EXPECT_GT(moved / kN, 0.05) << "the weights hardly moved: the test would prove nothing";
  // State buffers the rule does not use stay untouched.
  if (o.state_buffers() < 2) {
    EXPECT_TRUE(std::all_of(s1.begin(), s1.end(), [](float x) { return x == 0; }));
  }
  if (o.state_buffers() < 1) {
    EXPECT_TRUE(std::all_of(s0.begin(), s0.end(), [](float x) { return x == 0; }));
  }
}

std::string RuleName(const ::testing::TestParamInfo<RuleCase>& param) {
  return param.param.name;
}

INSTANTIATE_TEST_SUITE_P(Rules, UpdateRuleTest, ::testing::ValuesIn(RuleCases()), RuleName);

TEST(UpdateRuleTest, FirstMomentumStepSetsTheBufferToTheGradient) {
  v1::OptimizerConfig c = Sgd(0.1);
  c.mutable_sgd()->set_momentum(0.9);
  auto o = Optimizer::Create(c);
  ASSERT_TRUE(o.ok());
  std::vector<float> w = {1, 2, 3};
  std::vector<float> buf = {100, -100, 7};  // stale contents: step 0 ignores them
  const std::vector<float> g = {0.5f, -1, 2};
  o->Apply(w.data(), buf.data(), nullptr, g.data(), 3, 0, o->Group(""), 1.0);
  EXPECT_EQ(buf, g);
  EXPECT_EQ(w, (std::vector<float>{1 - 0.1f * 0.5f, 2 + 0.1f, 3 - 0.1f * 2}));
  o->Apply(w.data(), buf.data(), nullptr, g.data(), 3, 1, o->Group(""), 1.0);
  EXPECT_FLOAT_EQ(buf[0], 0.9f * 0.5f + 0.5f);
}

TEST(UpdateRuleTest, AdamFirstStepMovesEachWeightByTheLearningRate) {
  // With bias correction, step 1 of Adam is lr * g / (|g| + eps'): about lr.
  auto o = Optimizer::Create(Adam(0.01));
  ASSERT_TRUE(o.ok());
  std::vector<float> w = {1, 1, 1, 1};
  std::vector<float> m(4, 0);
  std::vector<float> v(4, 0);
  const std::vector<float> g = {3, -0.001f, 1e6f, -7};
  o->Apply(w.data(), m.data(), v.data(), g.data(), 4, 0, o->Group(""), 1.0);
  EXPECT_NEAR(w[0], 0.99, 1e-6);
  EXPECT_NEAR(w[1], 1.01, 1e-6);
  EXPECT_NEAR(w[2], 0.99, 1e-6);
  EXPECT_NEAR(w[3], 1.01, 1e-6);
}

TEST(UpdateRuleTest, LrScaleZeroFreezesTheWeightsBitForBit) {
  for (bool adam : {true, false}) {
    v1::OptimizerConfig c = adam ? Adam(0.1) : Sgd(0.1);
    if (adam) {
      c.mutable_adam()->set_decoupled_weight_decay(true);
      c.mutable_adam()->set_weight_decay(0.1);
    } else {
      c.mutable_sgd()->set_momentum(0.9);
      c.mutable_sgd()->set_weight_decay(0.1);
    }
    (*c.mutable_group_overrides())["frozen"].set_lr_scale(0);
    auto o = Optimizer::Create(c);
    ASSERT_TRUE(o.ok());
    const GroupParams frozen = o->Group("frozen");
    EXPECT_EQ(frozen.lr_scale, 0);
    constexpr size_t kN = 1000;
    std::vector<float> w = RandomVector(kN, 7, 3.0);
    const std::vector<float> w0 = w;
    std::vector<float> s0(kN, 0);
    std::vector<float> s1(kN, 0);
    for (uint64_t step = 0; step < 50; ++step) {
      const std::vector<float> g = RandomVector(kN, 1000 + step, 1.0);
      o->Apply(w.data(), s0.data(), adam ? s1.data() : nullptr, g.data(), kN, step, frozen, 1.0);
    }
    EXPECT_EQ(std::memcmp(w.data(), w0.data(), kN * sizeof(float)), 0) << (adam ? "adamw" : "sgd");
    // The moments still follow the gradients, as torch's do at lr 0.
    EXPECT_TRUE(std::any_of(s0.begin(), s0.end(), [](float x) { return x != 0; }));
  }
}

// --- Determinism --------------------------------------------------------------

struct Buffers {
  std::vector<float> w;
  std::vector<float> s0;
  std::vector<float> s1;
  bool operator==(const Buffers& o) const {
    auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
      return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
    };
    return same(w, o.w) && same(s0, o.s0) && same(s1, o.s1);
  }
};

// Runs `steps` updates, each through `apply(o, buffers, g, step)`.
Buffers RunSteps(const Optimizer& o, size_t n, int steps,
                 const std::function<void(const Optimizer&, Buffers&, const float*, uint64_t)>& apply) {
  Buffers b{RandomVector(n, 3, 1.0), std::vector<float>(n, 0), std::vector<float>(n, 0)};
  for (int step = 0; step < steps; ++step) {
    const std::vector<float> g = RandomVector(n, 500 + static_cast<uint64_t>(step), 2.0);
    apply(o, b, g.data(), static_cast<uint64_t>(step));
  }
  return b;
}

TEST(DeterminismTest, SplitRangesAndThreadPoolsAreBitIdenticalToOneCall) {
  constexpr size_t kN = 10007;
  constexpr int kSteps = 4;
  for (const RuleCase& rc : RuleCases()) {
    SCOPED_TRACE(rc.name);
    auto made = Optimizer::Create(rc.config);
    ASSERT_TRUE(made.ok());
    const GroupParams gp = made->Group(rc.group);
    auto range = [&](const Optimizer& o, Buffers& b, const float* g, uint64_t step, size_t begin, size_t end) {
      o.Apply(b.w.data() + begin, b.s0.data() + begin, b.s1.data() + begin, g + begin, end - begin, step, gp, 0.25);
    };
    const Buffers whole = RunSteps(*made, kN, kSteps, [&](const Optimizer& o, Buffers& b, const float* g, uint64_t s) {
      range(o, b, g, s, 0, kN);
    });
    // Odd cut points: pieces start unaligned and mix vector bodies and scalar tails differently.
    const Buffers pieces = RunSteps(*made, kN, kSteps, [&](const Optimizer& o, Buffers& b, const float* g, uint64_t s) {
      const size_t cuts[] = {0, 1, 3, 4, 17, 31, 1000, 1001, 4099, 9990, kN};
      for (size_t k = 0; k + 1 < std::size(cuts); ++k) range(o, b, g, s, cuts[k], cuts[k + 1]);
    });
    EXPECT_TRUE(pieces == whole);
    // Backwards, one element at a time over a stretch: order does not matter either.
    const Buffers reversed =
        RunSteps(*made, kN, kSteps, [&](const Optimizer& o, Buffers& b, const float* g, uint64_t s) {
          range(o, b, g, s, 5000, kN);
          for (size_t i = 5000; i-- > 4000;) range(o, b, g, s, i, i + 1);
          range(o, b, g, s, 0, 4000);
        });
    EXPECT_TRUE(reversed == whole);
    for (int threads : {1, 2, 3, 4, 7}) {
      ThreadPool pool(threads);
      for (size_t grain : {size_t{1}, size_t{100}, size_t{4096}}) {
        const Buffers pooled =
            RunSteps(*made, kN, kSteps, [&](const Optimizer& o, Buffers& b, const float* g, uint64_t s) {
              pool.ParallelFor(kN, grain, [&](size_t begin, size_t end) { range(o, b, g, s, begin, end); });
            });
        EXPECT_TRUE(pooled == whole) << threads << " threads, grain " << grain;
      }
    }
  }
}

// --- A learning rate per update ----------------------------------------------

// A learning rate given for an update (Apply's step_lr: a PyTorch LR
// scheduler's, carried by the servers' pushes) replaces the schedule's and
// nothing else: every rule, over a warmup and a cosine decay, gives the same
// bits as an optimizer whose constant rate is that update's; a group's
// lr_scale multiplies it; 0 keeps the schedule.
TEST(UpdateRuleTest, AStepLearningRateReplacesTheScheduleBitForBit) {
  constexpr size_t kN = 1001;
  constexpr int kSteps = 12;
  auto step_lr = [](uint64_t step) { return 0.01 * (1 + static_cast<double>(step % 4)); };
  for (const RuleCase& rc : RuleCases()) {
    SCOPED_TRACE(rc.name);
    v1::OptimizerConfig scheduled = rc.config;
    scheduled.mutable_lr_schedule()->set_kind(v1::LR_SCHEDULE_KIND_COSINE);
    scheduled.mutable_lr_schedule()->set_warmup_steps(3);
    scheduled.mutable_lr_schedule()->set_total_steps(10);
    auto made = Optimizer::Create(scheduled);
    ASSERT_TRUE(made.ok()) << made.status().ToString();
    const GroupParams gp = made->Group(rc.group);
    const Buffers given = RunSteps(*made, kN, kSteps, [&](const Optimizer& o, Buffers& b, const float* g, uint64_t s) {
      o.Apply(b.w.data(), b.s0.data(), b.s1.data(), g, kN, s, gp, 0.5, step_lr(s));
    });
    const Buffers constant = RunSteps(*made, kN, kSteps, [&](const Optimizer&, Buffers& b, const float* g, uint64_t s) {
      v1::OptimizerConfig c = rc.config;
      c.clear_lr_schedule();
      if (c.has_sgd()) c.mutable_sgd()->set_lr(step_lr(s));
      if (c.has_adam()) c.mutable_adam()->set_lr(step_lr(s));
      auto o = Optimizer::Create(c);
      ASSERT_TRUE(o.ok());
      o->Apply(b.w.data(), b.s0.data(), b.s1.data(), g, kN, s, o->Group(rc.group), 0.5);
    });
    EXPECT_TRUE(given == constant);
    // 0: the schedule's, as without the argument.
    const Buffers zero = RunSteps(*made, kN, kSteps, [&](const Optimizer& o, Buffers& b, const float* g, uint64_t s) {
      o.Apply(b.w.data(), b.s0.data(), b.s1.data(), g, kN, s, gp, 0.5, 0);
    });
    const Buffers schedule =
        RunSteps(*made, kN, kSteps, [&](const Optimizer& o, Buffers& b, const float* g, uint64_t s) {
          o.Apply(b.w.data(), b.s0.data(), b.s1.data(), g, kN, s, gp, 0.5);
        });
    EXPECT_TRUE(zero == schedule);
    EXPECT_FALSE(zero == given);
    // lr_scale 0.5 times 2x is x (exactly, in binary).
    GroupParams half = gp;
    half.lr_scale = 0.5 * gp.lr_scale;
    const Buffers scaled = RunSteps(*made, kN, kSteps, [&](const Optimizer& o, Buffers& b, const float* g, uint64_t s) {
      o.Apply(b.w.data(), b.s0.data(), b.s1.data(), g, kN, s, half, 0.5, 2 * step_lr(s));
    });
    EXPECT_TRUE(scaled == given);
  }
}

TEST(UpdateRuleTest, AStepLearningRateMustBeZeroOrPositiveAndFinite) {
  for (double ok : {0.0, -0.0, 1e-8, 0.5, 1e300}) EXPECT_TRUE(Optimizer::CheckStepLearningRate(ok).ok()) << ok;
  for (double bad : {-1e-3, -kInf, kInf, kNaN}) {
    const Status s = Optimizer::CheckStepLearningRate(bad);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.message().find("must be 0 (the configured schedule) or > 0 and finite"), std::string::npos)
        << s.message();
  }
  EXPECT_EQ(Optimizer::CheckStepLearningRate(-1e-3).message(),
            "learning rate -0.001: must be 0 (the configured schedule) or > 0 and finite");
  auto o = Optimizer::Create(Adam(0.25));
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->LearningRate(3, 0), 0.25);
  EXPECT_EQ(o->LearningRate(3, 0.125), 0.125);
}

// --- ThreadPool ---------------------------------------------------------------

TEST(ThreadPoolTest, CoversEveryIndexOnceInAlignedChunksOfAtLeastTheGrain) {
  for (const auto& [threads, spin] : {std::pair{1, 0}, {2, 0}, {2, 200}, {4, 0}, {4, 200}}) {
    ThreadPool pool(threads, std::chrono::microseconds(spin));  // spin 0: threads sleep at once
    EXPECT_EQ(pool.size(), threads);
    for (size_t n : {size_t{0}, size_t{1}, size_t{15}, size_t{16}, size_t{17}, size_t{1000}, size_t{100003}}) {
      for (size_t grain : {size_t{1}, size_t{16}, size_t{50}, size_t{1 << 20}}) {
        std::vector<std::atomic<int>> hits(n);
        std::atomic<int> calls{0};
        std::atomic<bool> bad_chunk{false};
        pool.ParallelFor(n, grain, [&](size_t begin, size_t end) {
          ++calls;
          if (begin >= end || begin % 16 != 0) bad_chunk = true;
          // Every chunk but the last is at least the grain long.
          if (end != n && end - begin < grain) bad_chunk = true;
          for (size_t i = begin; i < end; ++i) ++hits[i];
        });
        EXPECT_FALSE(bad_chunk) << n << " " << grain;
        for (size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << "n " << n << " grain " << grain << " i " << i;
        if (n == 0) {
          EXPECT_EQ(calls.load(), 0);
        } else if (threads == 1) {
          EXPECT_EQ(calls.load(), 1);  // inline, one call
        }
        const size_t chunk = pool.ChunkSize(n, grain);
        EXPECT_EQ(chunk % 16, 0u);
        EXPECT_GE(chunk, grain);
      }
    }
  }
}

TEST(ThreadPoolTest, UsesThePoolThreadsAndTheCaller) {
  ThreadPool pool(3);
  Mutex mu;
  std::map<std::thread::id, int> seen;
  std::atomic<int> running{0};
  std::atomic<int> most{0};
  pool.ParallelFor(12 * 16, 16, [&](size_t, size_t) {
    const int now = ++running;
    int prev = most.load();
    while (prev < now && !most.compare_exchange_weak(prev, now)) {
    }
    // Wait a little for the others, so all three threads get a chunk.
    for (int i = 0; i < 2000 && most.load() < 3; ++i) std::this_thread::sleep_for(std::chrono::microseconds(100));
    --running;
    MutexLock lock(&mu);
    ++seen[std::this_thread::get_id()];
  });
  EXPECT_EQ(most.load(), 3);
  EXPECT_EQ(seen.size(), 3u);
  EXPECT_TRUE(seen.count(std::this_thread::get_id()));
}

TEST(ThreadPoolTest, ConcurrentCallersEachGetTheirOwnWorkDone) {
  ThreadPool pool(3, std::chrono::microseconds(50));
  constexpr int kCallers = 4;
  constexpr int kRounds = 100;
  std::vector<std::thread> callers;
  std::vector<int> failures(kCallers, 0);
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      for (int round = 0; round < kRounds; ++round) {
        const size_t n = 1000 + static_cast<size_t>(c * 97 + round * 13);
        std::vector<uint8_t> hits(n, 0);
        pool.ParallelFor(n, 16, [&](size_t begin, size_t end) {
          for (size_t i = begin; i < end; ++i) ++hits[i];
        });
        if (std::any_of(hits.begin(), hits.end(), [](uint8_t h) { return h != 1; })) ++failures[c];
      }
    });
  }
  for (auto& t : callers) t.join();
  for (int c = 0; c < kCallers; ++c) EXPECT_EQ(failures[c], 0) << "caller " << c;
}

// --- ScanGradient -------------------------------------------------------------

TEST(ScanGradientTest, SumsSquaresInDouble) {
  EXPECT_EQ(ScanGradient(nullptr, 0).sum_squares, 0);
  EXPECT_TRUE(ScanGradient(nullptr, 0).finite);
  const std::vector<float> g = RandomVector(2000, 11, 3.0);
  for (size_t n : {size_t{1}, size_t{5}, size_t{15}, size_t{16}, size_t{17}, size_t{33}, size_t{1023}, size_t{1999}}) {
    for (size_t offset : {size_t{0}, size_t{1}}) {  // offset 1: not 16-byte aligned
      double want = 0;
      for (size_t i = 0; i < n; ++i) want += static_cast<double>(g[offset + i]) * g[offset + i];
      const GradScan scan = ScanGradient(g.data() + offset, n);
      EXPECT_TRUE(scan.finite);
      EXPECT_NEAR(scan.sum_squares, want, want * 1e-14) << n;
    }
  }
  // Squares of the largest floats do not overflow the double sum.
  const std::vector<float> big(100, 3e38f);
  const GradScan scan = ScanGradient(big.data(), big.size());
  EXPECT_TRUE(scan.finite);
  const double sq = static_cast<double>(3e38f) * 3e38f;
  EXPECT_NEAR(scan.sum_squares, 100 * sq, 1e-12 * 100 * sq);
}

TEST(ScanGradientTest, FindsNanAndInfAnywhereIncludingTheTail) {
  constexpr size_t kN = 53;  // three blocks of 16 and a tail of 5
  const float bad[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::quiet_NaN()};
  for (float b : bad) {
    for (size_t pos = 0; pos < kN; ++pos) {
      std::vector<float> g(kN, 0.5f);
      g[pos] = b;
      const GradScan scan = ScanGradient(g.data(), kN);
      EXPECT_FALSE(scan.finite) << b << " at " << pos;
      EXPECT_FALSE(std::isfinite(scan.sum_squares));
    }
  }
  std::vector<float> g(kN, 0.5f);
  EXPECT_TRUE(ScanGradient(g.data(), kN).finite);
  EXPECT_DOUBLE_EQ(ScanGradient(g.data(), kN).sum_squares, 0.25 * kN);
}

// --- Wire conversions ---------------------------------------------------------

uint32_t Bits(float f) {
  return std::bit_cast<uint32_t>(f);
}
float FromBits(uint32_t b) {
  return std::bit_cast<float>(b);
}

// The values of a 16-bit format from its definition: 1 sign bit, `exp_bits`
// exponent bits (bias 2^(exp_bits-1) - 1), the rest mantissa; subnormals at
// exponent 0.
double Decode16(uint16_t h, int exp_bits) {
  const int mant_bits = 15 - exp_bits;
  const int bias = (1 << (exp_bits - 1)) - 1;
  const int e = (h >> mant_bits) & ((1 << exp_bits) - 1);
  const int m = h & ((1 << mant_bits) - 1);
  const double sign = (h & 0x8000) ? -1 : 1;
  if (e == (1 << exp_bits) - 1) return m ? kNaN : sign * kInf;
  if (e == 0) return sign * std::ldexp(m, 1 - bias - mant_bits);
  return sign * std::ldexp(m + (1 << mant_bits), e - bias - mant_bits);
}

// Round to nearest, ties to the even pattern, by comparing distances in
// double to the two neighbouring representable values. Values at or beyond
// the largest finite value plus half an ulp become Inf, as IEEE rounding
// does (the "next" value after the largest finite one has an even pattern).
uint16_t Encode16Reference(float f, int exp_bits) {
  const double x = f;
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  if (std::isnan(x)) return 0xffff;  // any NaN: compared with isnan below
  const double a = std::fabs(x);
  const uint16_t inf = static_cast<uint16_t>(((1 << exp_bits) - 1) << (15 - exp_bits));
  // Largest pattern whose value is <= a (binary search over the monotone positive patterns).
  uint16_t lo = 0;
  uint16_t hi = inf;  // value(inf) treated as the next step after the largest finite value
  auto value = [&](uint16_t p) {
    if (p == inf) {
      const double max = Decode16(inf - 1, exp_bits);
      return max + (max - Decode16(inf - 2, exp_bits));
    }
    return Decode16(p, exp_bits);
  };
  if (a >= value(inf)) return sign | inf;
  while (hi - lo > 1) {
    const auto mid = static_cast<uint16_t>((lo + hi) / 2);
    if (value(mid) <= a) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  // Now value(lo) <= a < value(hi), hi == lo + 1.
  const double dlo = a - value(lo);
  const double dhi = value(hi) - a;
  uint16_t pick = dlo < dhi ? lo : dhi < dlo ? hi : ((lo & 1) ? hi : lo);
  return sign | pick;
}

std::vector<float> InterestingFloats() {
  std::vector<float> v = {0.0f,
                          -0.0f,
                          1.0f,
                          -1.0f,
                          0.1f,
                          3.14159f,
                          65504.0f,
                          65519.0f,
                          65519.996f,
                          65520.0f,
                          65536.0f,
                          1e10f,
                          -1e10f,
                          std::numeric_limits<float>::max(),
                          -std::numeric_limits<float>::max(),
                          std::numeric_limits<float>::min(),
                          std::numeric_limits<float>::denorm_min(),
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          std::ldexp(1.0f, -24),
                          std::ldexp(1.0f, -25),
                          std::ldexp(3.0f, -25),
                          std::ldexp(1.0f, -14),
                          std::ldexp(1.0f, -14) - std::ldexp(1.0f, -25),
                          std::ldexp(1.0f, -26),
                          1e-30f};
  // Every tie between neighbouring halves (11 significant bits: the midpoints
  // have 12, exact in float), and every tie between neighbouring bf16 values.
  std::mt19937_64 rng(5);
  for (int k = 0; k < 4000; ++k) {
    const auto h = static_cast<uint16_t>(rng() % 0x7bff);
    v.push_back(static_cast<float>((Decode16(h, 5) + Decode16(h + 1, 5)) / 2));
    const auto b = static_cast<uint16_t>(rng() % 0x7f7f);
    v.push_back(static_cast<float>((Decode16(b, 8) + Decode16(b + 1, 8)) / 2));
  }
  // Random values across fp16's range and random bit patterns across fp32's.
  std::uniform_real_distribution<double> exponent(-27, 17);
  for (int k = 0; k < 20000; ++k) {
    v.push_back(static_cast<float>((rng() & 1 ? -1 : 1) * std::exp2(exponent(rng))));
    v.push_back(FromBits(static_cast<uint32_t>(rng())));
  }
  return v;
}

TEST(WireTest, BytesPerElement) {
  EXPECT_EQ(WireBytes(v1::WIRE_DTYPE_UNSPECIFIED, 10), 40u);
  EXPECT_EQ(WireBytes(v1::WIRE_DTYPE_FP32, 10), 40u);
  EXPECT_EQ(WireBytes(v1::WIRE_DTYPE_BF16, 10), 20u);
  EXPECT_EQ(WireBytes(v1::WIRE_DTYPE_FP16, 10), 20u);
  EXPECT_EQ(WireBytes(v1::WIRE_DTYPE_FP16, 0), 0u);
  EXPECT_EQ(WireBytes(static_cast<v1::WireDType>(9), 10), 0u);
}

TEST(WireTest, Bf16RoundsToNearestEvenAndKeepsNan) {
  auto encode = [](float f) {
    uint16_t out;
    EncodeWire(&out, &f, v1::WIRE_DTYPE_BF16, 1);
    return out;
  };
  EXPECT_EQ(encode(1.0f), 0x3f80);
  EXPECT_EQ(encode(FromBits(0x3f808000)), 0x3f80);               // tie, even below
  EXPECT_EQ(encode(FromBits(0x3f818000)), 0x3f82);               // tie, even above
  EXPECT_EQ(encode(FromBits(0x3f808001)), 0x3f81);               // just above the tie
  EXPECT_EQ(encode(FromBits(0x3f807fff)), 0x3f80);               // just below
  EXPECT_EQ(encode(FromBits(0xbf818000)), 0xbf82);               // negative tie
  EXPECT_EQ(encode(std::numeric_limits<float>::max()), 0x7f80);  // rounds up to Inf
  EXPECT_EQ(encode(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(encode(-std::numeric_limits<float>::infinity()), 0xff80);
  for (uint32_t nan : {0x7fc00000u, 0x7f800001u /* signalling: truncation would make it Inf */, 0xff80ffffu}) {
    const uint16_t b = encode(FromBits(nan));
    EXPECT_TRUE(std::isnan(Decode16(b, 8))) << std::hex << nan;
    EXPECT_EQ(b & 0x8000, (nan >> 16) & 0x8000);
  }
  // Against the reference from the format's definition.
  const std::vector<float> in = InterestingFloats();
  std::vector<uint16_t> out(in.size());
  EncodeWire(out.data(), in.data(), v1::WIRE_DTYPE_BF16, in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    if (std::isnan(in[i])) {
      EXPECT_TRUE(std::isnan(Decode16(out[i], 8)));
      continue;
    }
    ASSERT_EQ(out[i], Encode16Reference(in[i], 8)) << std::hex << Bits(in[i]);
  }
}

TEST(WireTest, Fp16RoundsToNearestEvenOverflowsToInfAndHasSubnormals) {
  auto encode = [](float f) {
    uint16_t out;
    EncodeWire(&out, &f, v1::WIRE_DTYPE_FP16, 1);
    return out;
  };
  EXPECT_EQ(encode(1.0f), 0x3c00);
  EXPECT_EQ(encode(1.0f + std::ldexp(1.0f, -11)), 0x3c00);      // tie, even below
  EXPECT_EQ(encode(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);  // tie, even above
  EXPECT_EQ(encode(65504.0f), 0x7bff);                          // largest finite
  EXPECT_EQ(encode(65519.996f), 0x7bff);
  EXPECT_EQ(encode(65520.0f), 0x7c00);  // the tie above the largest rounds to Inf
  EXPECT_EQ(encode(1e10f), 0x7c00);
  EXPECT_EQ(encode(-1e10f), 0xfc00);
  EXPECT_EQ(encode(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(encode(std::ldexp(1.0f, -14)), 0x0400);                          // smallest normal
  EXPECT_EQ(encode(std::ldexp(1.0f, -24)), 0x0001);                          // smallest subnormal
  EXPECT_EQ(encode(std::ldexp(1.0f, -25)), 0x0000);                          // tie with 0: even
  EXPECT_EQ(encode(std::ldexp(3.0f, -25)), 0x0002);                          // tie 1|2: even
  EXPECT_EQ(encode(std::ldexp(1.0f, -25) * 1.0001f), 0x0001);                // just above the tie
  EXPECT_EQ(encode(std::ldexp(1.0f, -14) - std::ldexp(1.0f, -25)), 0x0400);  // tie into the normals
  EXPECT_EQ(encode(-std::ldexp(1.0f, -24)), 0x8001);
  EXPECT_EQ(encode(1e-30f), 0x0000);
  EXPECT_EQ(encode(-1e-30f), 0x8000);
  EXPECT_TRUE(std::isnan(Decode16(encode(std::numeric_limits<float>::quiet_NaN()), 5)));
  EXPECT_TRUE(std::isnan(Decode16(encode(FromBits(0x7f800001)), 5)));
  const std::vector<float> in = InterestingFloats();
  std::vector<uint16_t> out(in.size());
  EncodeWire(out.data(), in.data(), v1::WIRE_DTYPE_FP16, in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    if (std::isnan(in[i])) {
      EXPECT_TRUE(std::isnan(Decode16(out[i], 5)));
      continue;
    }
    ASSERT_EQ(out[i], Encode16Reference(in[i], 5)) << std::hex << Bits(in[i]) << " " << in[i];
  }
}

TEST(WireTest, EveryHalfAndBf16WidensExactlyAndRoundTrips) {
  for (int exp_bits : {5, 8}) {
    const v1::WireDType dtype = exp_bits == 5 ? v1::WIRE_DTYPE_FP16 : v1::WIRE_DTYPE_BF16;
    std::vector<uint16_t> all(65536);
    for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
    std::vector<float> wide(all.size(), 123.0f);
    AccumulateWire(wide.data(), all.data(), dtype, all.size(), /*overwrite=*/true);
    std::vector<uint16_t> back(all.size());
    EncodeWire(back.data(), wide.data(), dtype, wide.size());
    for (size_t i = 0; i < all.size(); ++i) {
      const double want = Decode16(all[i], exp_bits);
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(wide[i])) << exp_bits << " " << i;
        ASSERT_TRUE(std::isnan(Decode16(back[i], exp_bits)));
        continue;
      }
      ASSERT_EQ(static_cast<double>(wide[i]), want) << exp_bits << " " << std::hex << i;
      ASSERT_EQ(std::signbit(wide[i]), (all[i] & 0x8000) != 0) << i;  // -0 stays -0
      ASSERT_EQ(back[i], all[i]) << exp_bits << " " << std::hex << i;
    }
  }
}

TEST(WireTest, AccumulateAddsOrOverwritesFromUnalignedData) {
  constexpr size_t kN = 37;  // a vector body and a tail
  const std::vector<float> values = RandomVector(kN, 21, 4.0);
  for (v1::WireDType dtype :
       {v1::WIRE_DTYPE_UNSPECIFIED, v1::WIRE_DTYPE_FP32, v1::WIRE_DTYPE_BF16, v1::WIRE_DTYPE_FP16}) {
    const size_t bytes = WireBytes(dtype, kN);
    // Encode to an odd address: the wire data sits at any offset in a frame.
    std::vector<unsigned char> frame(bytes + 3, 0xee);
    EncodeWire(frame.data() + 1, values.data(), dtype, kN);
    EXPECT_EQ(frame[0], 0xee);
    EXPECT_EQ(frame[bytes + 1], 0xee);
    // What the wire holds, widened by the reference decoder.
    std::vector<float> wire(kN);
    for (size_t i = 0; i < kN; ++i) {
      if (bytes == 4 * kN) {
        std::memcpy(&wire[i], frame.data() + 1 + 4 * i, 4);
      } else {
        uint16_t h;
        std::memcpy(&h, frame.data() + 1 + 2 * i, 2);
        wire[i] = static_cast<float>(Decode16(h, dtype == v1::WIRE_DTYPE_FP16 ? 5 : 8));
      }
    }
    if (bytes == 4 * kN) {
      EXPECT_EQ(std::memcmp(wire.data(), values.data(), 4 * kN), 0);
    }
    const std::vector<float> base = RandomVector(kN, 22, 1.0);
    std::vector<float> acc = base;
    AccumulateWire(acc.data(), frame.data() + 1, dtype, kN, /*overwrite=*/false);
    for (size_t i = 0; i < kN; ++i) EXPECT_EQ(acc[i], base[i] + wire[i]) << dtype << " " << i;
    AccumulateWire(acc.data(), frame.data() + 1, dtype, kN, /*overwrite=*/false);
    for (size_t i = 0; i < kN; ++i) EXPECT_EQ(acc[i], (base[i] + wire[i]) + wire[i]) << dtype << " " << i;
    AccumulateWire(acc.data(), frame.data() + 1, dtype, kN, /*overwrite=*/true);
    for (size_t i = 0; i < kN; ++i) EXPECT_EQ(acc[i], wire[i]) << dtype << " " << i;
    // n == 0 touches nothing.
    AccumulateWire(acc.data(), nullptr, dtype, 0, true);
    EncodeWire(nullptr, acc.data(), dtype, 0);
    for (size_t i = 0; i < kN; ++i) EXPECT_EQ(acc[i], wire[i]);
  }
}

}  // namespace
}  // namespace tandem::optim
