// The reference trainer in one process (worker/runtime/trainer.h): it learns,
// gradient accumulation equals one larger batch, its configuration errors
// name the option, and the flags a launcher gives a worker say exactly what
// the launcher's configuration says.
#include "worker/runtime/trainer.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <memory>

#include <gtest/gtest.h>

#include "common/config.h"

namespace tandem::worker {
namespace {

TrainConfig Small() {
  TrainConfig c;
  c.layers = 2;
  c.d_model = 32;
  c.heads = 2;
  c.context = 16;
  c.global_batch = 8;
  c.steps = 12;
  return c;
}

struct Trained {
  std::vector<double> losses;
  std::vector<float> params;
};

Trained TrainOnce(const TrainConfig& c) {
  Trained run;
  const Status s = TrainLocally(
      c, [&](const StepRecord& r) { run.losses.push_back(r.loss); }, &run.params);
  EXPECT_TRUE(s.ok()) << s.ToString();
  return run;
}

TEST(TrainerTest, TheReferenceModelLearnsTheBuiltInCorpus) {
  TrainConfig c = Small();
  c.steps = 40;
  const Trained run = TrainOnce(c);
  ASSERT_EQ(run.losses.size(), 40u);
  // Bytes start near uniform (ln 256 = 5.55); the corpus is English-like text.
  EXPECT_NEAR(run.losses.front(), std::log(256.0), 0.3);
  EXPECT_LT(run.losses.back(), run.losses.front() - 2.0);
}

// Accumulating four micro-batches of two sequences computes the gradient of
// the same eight sequences as one batch of eight, summed in another order:
// with SGD the parameters agree to float rounding of the sum; with AdamW the
// normalisation by the gradient's running RMS turns rounding of near-zero
// gradient elements into larger but still tiny differences (see
// train_process_test.cc for the bounds, measured and justified there).
TEST(TrainerTest, GradientAccumulationEqualsOneLargerBatch) {
  for (const std::string optimizer : {"sgd", "adamw"}) {
    TrainConfig one = Small();
    one.optimizer = optimizer;
    TrainConfig four = one;
    four.accumulation = 4;
    const Trained a = TrainOnce(one);
    const Trained b = TrainOnce(four);
    ASSERT_EQ(a.params.size(), b.params.size());
    double max_diff = 0;
    for (size_t i = 0; i < a.params.size(); ++i)
      max_diff = std::max<double>(max_diff, std::fabs(a.params[i] - b.params[i]));
    EXPECT_LT(max_diff, optimizer == "sgd" ? 1e-6 : 0.01 * one.lr) << optimizer;
    for (size_t i = 0; i < a.losses.size(); ++i)
      EXPECT_NEAR(a.losses[i], b.losses[i], 1e-5) << optimizer << " step " << i + 1;
  }
}

TEST(TrainerTest, ConfigurationErrorsNameTheOption) {
  TrainConfig c = Small();
  c.heads = 3;  // does not divide 32
  EXPECT_EQ(ModelConfigOf(c).status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(ModelConfigOf(c).status().message().find("heads"), std::string::npos)
      << ModelConfigOf(c).status().message();
  c = Small();
  c.data = "/nonexistent/corpus.txt";
  const Status s = TrainLocally(c, nullptr, nullptr);
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s.ToString();
  EXPECT_NE(s.message().find("/nonexistent/corpus.txt"), std::string::npos) << s.ToString();
  c = Small();
  c.mode = "gossip";
  EXPECT_EQ(RuntimeOptionsOf(c).status().code(), StatusCode::kInvalidArgument);
}

// train.consistency reaches the servers' configuration, and what the
// asynchronous modes cannot do is refused naming the key.
TEST(TrainerTest, AsynchronousModesAndWhatTheyRefuse) {
  TrainConfig c = Small();
  c.mode = "ps";
  auto sync = RuntimeOptionsOf(c);
  ASSERT_TRUE(sync.ok()) << sync.status().ToString();
  EXPECT_EQ(sync->consistency.mode(), v1::CONSISTENCY_MODE_UNSPECIFIED);  // the servers' SYNC
  c.consistency = "async";
  auto async = RuntimeOptionsOf(c);
  ASSERT_TRUE(async.ok()) << async.status().ToString();
  EXPECT_EQ(async->consistency.mode(), v1::CONSISTENCY_MODE_ASYNC);
  c.consistency = "bounded";
  c.staleness_bound = 3;
  auto bounded = RuntimeOptionsOf(c);
  ASSERT_TRUE(bounded.ok()) << bounded.status().ToString();
  EXPECT_EQ(bounded->consistency.mode(), v1::CONSISTENCY_MODE_BOUNDED_STALENESS);
  EXPECT_EQ(bounded->consistency.staleness_bound(), 3u);
  const std::vector<std::pair<std::function<void(TrainConfig&)>, std::string>> refusals = {
      {[](TrainConfig& x) { x.mode = "allreduce"; }, "train.mode allreduce is synchronous"},
      {[](TrainConfig& x) { x.max_grad_norm = 1; }, "train.max_grad_norm"},
      {[](TrainConfig& x) { x.schedule = "cosine"; }, "train.schedule cosine"},
      {[](TrainConfig& x) { x.checkpoint_dir = "/ckpt"; }, "train.checkpoint_dir: a checkpoint is a cut"},
      {[](TrainConfig& x) { x.resume_from = "/ckpt/step-0000000010"; }, "train.resume_from"},
      {[](TrainConfig& x) { x.consistency = "eventual"; }, "train.consistency: 'eventual'"},
  };
  for (const auto& [change, why] : refusals) {
    TrainConfig bad = c;
    change(bad);
    const Status s = RuntimeOptionsOf(bad).status();
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_NE(s.message().find(why), std::string::npos) << s.ToString();
  }
}

TEST(TrainerTest, WorkerFlagsCarryTheWholeConfiguration) {
  TrainConfig c = Small();
  c.mode = "ps";
  c.data = "/tmp/some corpus.txt";
  c.accumulation = 3;
  c.activation_checkpointing = true;
  c.optimizer = "sgd";
  c.lr = 0.0123456789;
  c.schedule = "cosine";
  c.warmup_steps = 7;
  c.max_grad_norm = 2.5;
  c.bucket_bytes = 12345;
  c.gradient_wire = "bf16";
  c.step_timeout = std::chrono::milliseconds(4321);
  c.sample_log = "/tmp/samples.jsonl";
  c.consistency = "bounded";
  c.staleness_bound = 7;
  std::vector<std::string> args = {"worker"};
  for (const auto& f : TrainFlags(c)) args.push_back(f);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  TrainConfig parsed;
  OptionSet options("worker", "test");
  DeclareTrainOptions(options, &parsed);
  std::string output;
  auto outcome = options.Parse(static_cast<int>(argv.size()), argv.data(), &output);
  ASSERT_TRUE(outcome.ok()) << outcome.status().ToString();
  EXPECT_EQ(parsed.mode, c.mode);
  EXPECT_EQ(parsed.data, c.data);
  EXPECT_EQ(parsed.accumulation, c.accumulation);
  EXPECT_TRUE(parsed.activation_checkpointing);
  EXPECT_EQ(parsed.optimizer, c.optimizer);
  EXPECT_EQ(parsed.lr, c.lr);
  EXPECT_EQ(parsed.schedule, c.schedule);
  EXPECT_EQ(parsed.warmup_steps, c.warmup_steps);
  EXPECT_EQ(parsed.max_grad_norm, c.max_grad_norm);
  EXPECT_EQ(parsed.bucket_bytes, c.bucket_bytes);
  EXPECT_EQ(parsed.gradient_wire, c.gradient_wire);
  EXPECT_EQ(parsed.step_timeout, c.step_timeout);
  EXPECT_EQ(parsed.sample_log, c.sample_log);
  EXPECT_EQ(parsed.consistency, c.consistency);
  EXPECT_EQ(parsed.staleness_bound, c.staleness_bound);
  EXPECT_EQ(parsed.layers, c.layers);
  EXPECT_EQ(parsed.d_model, c.d_model);
}

TEST(TrainerTest, LinearScalingAndWarmupReachTheOptimizer) {
  TrainConfig c = Small();
  c.lr = 0.001;
  c.global_batch = 64;
  c.lr_base_batch = 16;
  c.warmup_steps = 5;
  auto o = OptimizerConfigOf(c);
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_DOUBLE_EQ(o->adam().lr(), 0.004);
  EXPECT_EQ(o->lr_schedule().warmup_steps(), 5u);
  EXPECT_EQ(o->reduction(), v1::GRADIENT_REDUCTION_SUM);
  EXPECT_EQ(o->group_overrides().at("no_decay").weight_decay(), 0.0);
}

// Allreduce mode's local optimizer takes the learning rate the runtime
// gives it for the step (Runtime::SetStepLearningRate), as the servers take a
// push's: it replaces the schedule's, bit for bit the update of an optimizer
// whose constant rate it is; 0 goes back to the schedule; a negative rate
// fails the update and changes nothing.
TEST(TrainerTest, TheLocalOptimizerAppliesTheStepsLearningRate) {
  constexpr size_t kN = 300;
  std::vector<v1::TensorSpec> tensors(2);
  tensors[0].set_name("w");
  tensors[0].add_shape(200);
  tensors[1].set_name("b");
  tensors[1].add_shape(100);
  tensors[1].set_flat_offset(200);
  tensors[1].set_group("no_decay");
  v1::OptimizerConfig scheduled;
  scheduled.mutable_adam()->set_lr(0.003);
  scheduled.mutable_adam()->set_weight_decay(0.01);
  scheduled.mutable_adam()->set_decoupled_weight_decay(true);
  (*scheduled.mutable_group_overrides())["no_decay"].set_weight_decay(0);
  (*scheduled.mutable_group_overrides())["no_decay"].set_lr_scale(0.5);
  v1::OptimizerConfig constant = scheduled;
  scheduled.mutable_lr_schedule()->set_kind(v1::LR_SCHEDULE_KIND_LINEAR);
  scheduled.mutable_lr_schedule()->set_warmup_steps(2);
  scheduled.mutable_lr_schedule()->set_total_steps(6);
  std::vector<float> grads(kN);
  for (size_t i = 0; i < kN; ++i) grads[i] = std::sin(static_cast<float>(i)) * 0.1f;
  std::vector<float> given(kN, 1.0f);
  std::vector<float> fixed(kN, 1.0f);
  auto a = LocalOptimizer::Create(scheduled, kN);
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  bool skipped = false;
  for (int step = 0; step < 5; ++step) {
    const double lr = 0.02 / (1 + step);
    (*a)->set_learning_rate(lr);
    ASSERT_TRUE((*a)->Step(given, grads, tensors, &skipped).ok());
  }
  // The same five updates by optimizers of constant rates, each carrying on
  // from the state of the one before: the same bits.
  {
    std::unique_ptr<LocalOptimizer> carried;
    for (int step = 0; step < 5; ++step) {
      constant.mutable_adam()->set_lr(0.02 / (1 + step));
      auto b = LocalOptimizer::Create(constant, kN);
      ASSERT_TRUE(b.ok());
      if (carried) {
        (*b)->state0() = carried->state0();
        (*b)->state1() = carried->state1();
        (*b)->set_updates(carried->updates());
      }
      ASSERT_TRUE((*b)->Step(fixed, grads, tensors, &skipped).ok());
      carried = std::move(*b);
    }
  }
  EXPECT_EQ(std::memcmp(given.data(), fixed.data(), kN * sizeof(float)), 0);
  // 0: the schedule's again; a negative rate fails and changes nothing.
  (*a)->set_learning_rate(-0.01);
  const std::vector<float> before = given;
  const Status refused = (*a)->Step(given, grads, tensors, &skipped);
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << refused.ToString();
  EXPECT_NE(refused.message().find("learning rate -0.01"), std::string::npos) << refused.message();
  EXPECT_EQ(given, before);
  EXPECT_EQ((*a)->updates(), 5u);
  (*a)->set_learning_rate(0);
  ASSERT_TRUE((*a)->Step(given, grads, tensors, &skipped).ok());
  EXPECT_NE(given, before);
}

}  // namespace
}  // namespace tandem::worker
