// The parameter store's rules, with several stores in one process linked
// directly (no transport): exactly-once sync steps across servers, the
// decision (non-finite skip, global clipping), duplicates and order,
// learning rates, initialisation, wire dtypes and the optimizer rules
// against a reference. Failover, asynchronous modes and checkpoints are in
// ps_failover_test.cc, ps_async_test.cc and ps_capture_test.cc (one binary).
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <future>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <set>

#include <gtest/gtest.h>

#include "ps_core_fixture.h"

namespace tandem::server::store_test {
namespace {

TEST_F(PsCoreTest, ThreeServersEqualOneServerBitForBit) {
  Job job;
  Start(3, job);
  std::vector<float> params;
  for (uint64_t s = 1; s <= 20; ++s)
    params = RunStep(s, 3, s % 2 ? std::vector<uint32_t>{2, 0, 1} : std::vector<uint32_t>{});
  const auto reference = ReferenceRun(job, 20, 3);
  ASSERT_EQ(params.size(), reference.size());
  EXPECT_EQ(std::memcmp(params.data(), reference.data(), params.size() * sizeof(float)), 0);
  ExpectReplicasEqual();
  // The step moved the parameters.
  EXPECT_NE(params[0], job.initial[0]);
}

// An fp32 pull is answered with the partition's weights themselves, not a
// copy: a reply still being sent must keep the bytes of its step while the
// next update is applied, and after the partition is gone.
TEST_F(PsCoreTest, APullReplyStillBeingSentKeepsItsStepWhileTheNextUpdateApplies) {
  Job job;
  Start(1, job);
  RunStep(1, 2);
  auto [b, e] = Range(0);
  ps::Frame h = PullHeader(1, 1, 0);
  std::vector<ReplyBody> held;  // replies "in flight"
  for (int i = 0; i < 2; ++i) {
    PrimaryOf(0).Pull(1, h, [&held](ps::Frame r, ReplyBody body) {
      EXPECT_EQ(r.status, 0);
      held.push_back(std::move(body));
    });
  }
  ASSERT_EQ(held.size(), 2u);
  ASSERT_NE(held[0].borrowed, nullptr) << "an fp32 pull borrows the weights";
  ASSERT_EQ(held[0].size(), (e - b) * sizeof(float));
  const std::vector<char> step1(held[0].data(), held[0].data() + held[0].size());
  const auto reference1 = ReferenceRun(job, 1, 2);
  EXPECT_EQ(std::memcmp(step1.data(), reference1.data(), step1.size()), 0);

  // Step 2 updates the partition while both replies hold its weights.
  const auto params = RunStep(2, 2);
  for (const auto& body : held) EXPECT_EQ(std::memcmp(body.data(), step1.data(), step1.size()), 0);
  const auto reference2 = ReferenceRun(job, 2, 2);
  EXPECT_EQ(std::memcmp(params.data(), reference2.data(), params.size() * sizeof(float)), 0);
  EXPECT_NE(std::memcmp(params.data(), step1.data(), step1.size()), 0);

  // One reply is sent; a new one borrows the current weights; then the
  // server goes away with both still held.
  held.erase(held.begin());
  h.step = 2;
  PrimaryOf(0).Pull(1, h, [&held](ps::Frame, ReplyBody body) { held.push_back(std::move(body)); });
  ASSERT_EQ(held.size(), 2u);
  cluster_.nodes.clear();
  EXPECT_EQ(std::memcmp(held[0].data(), step1.data(), step1.size()), 0);
  EXPECT_EQ(std::memcmp(held[1].data(), params.data(), step1.size()), 0);
}

// A push that completes a step is acknowledged before the step's scan and
// update run (they follow on the same thread): a worker's push does not
// wait for the optimizer.
TEST_F(PsCoreTest, APushThatCompletesTheStepIsAnsweredBeforeTheUpdate) {
  Job job;
  Start(1, job);
  ParameterStore& store = PrimaryOf(0);
  for (uint32_t p = 0; p < Partitions(); ++p) {
    auto [b, e] = Range(p);
    const auto grad = Grad(1, 0, b, e);
    const ps::Frame h = PushHeader(1, 1, p, 0, 1, grad.size() * sizeof(float));
    std::optional<uint64_t> updates_at_reply;
    store.Push(1, h, grad.data(), [&](ps::Frame r, ReplyBody) {
      EXPECT_EQ(r.status, 0);
      updates_at_reply = store.counters().updates.load();
    });
    ASSERT_TRUE(updates_at_reply.has_value());
    EXPECT_EQ(*updates_at_reply, 0u) << "partition " << p;
  }
  EXPECT_EQ(store.counters().updates.load(), Partitions());
  ExpectOneStepReference(job, PullAll(1));
}

// The scans of a step's partitions wait until every partition here has the
// step: no update is applied before the last partition's last push, and
// then all of them are.
TEST_F(PsCoreTest, TheLastPartitionsPushReleasesTheScansOfTheOthers) {
  Job job;
  job.partition = 128 * 1024;
  job.params = job.partition * 2 + 1000;  // a small last partition
  job.initial.resize(job.params, 0.5f);
  Start(1, job);
  ParameterStore& store = PrimaryOf(0);
  ASSERT_EQ(Partitions(), 3u);
  for (uint32_t p = 0; p < Partitions(); ++p) {
    auto [b, e] = Range(p);
    auto a = Push(store, epoch_, 1, p, 0, 1, Grad(1, 0, b, e));
    ASSERT_TRUE(a->done);
    EXPECT_TRUE(a->status().ok()) << a->status().ToString();
    EXPECT_EQ(store.counters().updates.load(), p + 1 < Partitions() ? 0u : Partitions()) << "partition " << p;
  }
  ExpectOneStepReference(job, PullAll(1));
}

// Pushes received straight into store buffers (PushLanding, as the server's
// frame channel does): the first contribution becomes the accumulator, later
// and early ones are folded from theirs, buffers are reused across steps, and
// the result is bit for bit that of pushes from the caller's memory.
TEST_F(PsCoreTest, PushesLandedInStoreBuffersEqualCopiedPushesBitForBit) {
  Job job;
  Start(3, job);
  Landings landings(*this);
  auto landing_of = [&](uint32_t p) -> PushLanding& { return landings.Of(p); };
  std::vector<float> params;
  for (uint64_t s = 1; s <= 6; ++s) {
    const std::vector<uint32_t> order = s % 2 ? std::vector<uint32_t>{2, 0, 1} : std::vector<uint32_t>{0, 1, 2};
    for (uint32_t p = 0; p < Partitions(); ++p) {
      auto [b, e] = Range(p);
      for (uint32_t c : order) {
        const auto grad = Grad(s, c, b, e);
        const ps::Frame h = PushHeader(epoch_, s, p, c, 3, grad.size() * sizeof(float));
        const int peer = static_cast<int>(c);
        void* into = landings.Receive(p, peer, h, grad);
        ASSERT_NE(into, nullptr);
        auto a = std::make_shared<Answer>();
        std::shared_ptr<std::vector<float>> landed = landing_of(p).Take(peer, into);
        ASSERT_NE(landed, nullptr);
        PrimaryOf(p).Push(1, h, std::move(landed), Into(a));
        ASSERT_TRUE(a->done);
        ASSERT_TRUE(a->status().ok()) << a->status().ToString();
      }
    }
    params = PullAll(s);
  }
  const auto reference = ReferenceRun(job, 6, 3);
  ASSERT_EQ(params.size(), reference.size());
  EXPECT_EQ(std::memcmp(params.data(), reference.data(), params.size() * sizeof(float)), 0);
  ExpectReplicasEqual();

  // No buffer where the store could not keep it: the channel allocates.
  auto [b, e] = Range(0);
  ps::Frame h = PushHeader(epoch_, 7, 0, 0, 3, (e - b) * 2, v1::WIRE_DTYPE_BF16);
  EXPECT_EQ(PrimaryOf(0).PushBuffer(h), nullptr) << "bf16";
  h.dtype = v1::WIRE_DTYPE_FP32;
  h.payload_bytes = (e - b) * 4 + 4;
  EXPECT_EQ(PrimaryOf(0).PushBuffer(h), nullptr) << "wrong size";
  h.payload_bytes = (e - b) * 4;
  h.partition = 999;
  EXPECT_EQ(PrimaryOf(0).PushBuffer(h), nullptr) << "unknown partition";
  h.partition = 0;
  h.type = ps::FrameType::kPull;
  EXPECT_EQ(PrimaryOf(0).PushBuffer(h), nullptr) << "not a push";
  // A landed push with a wrong size is refused like any other.
  h.type = ps::FrameType::kPush;
  auto buffer = PrimaryOf(0).PushBuffer(h);
  ASSERT_NE(buffer, nullptr);
  h.payload_bytes -= 4;
  auto a = std::make_shared<Answer>();
  PrimaryOf(0).Push(1, h, buffer, Into(a));
  ASSERT_TRUE(a->done);
  EXPECT_EQ(a->status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(PullAll(6), params);
}

TEST_F(PsCoreTest, DuplicatePushesAreIgnoredAndFlagged) {
  Job job;
  Start(2, job);
  auto [b, e] = Range(0);
  auto first = Push(PrimaryOf(0), 1, 1, 0, 0, 2, Grad(1, 0, b, e));
  ASSERT_TRUE(first->status().ok());
  EXPECT_EQ(first->header.flags & ps::kFlagDuplicate, 0);
  auto again = Push(PrimaryOf(0), 1, 1, 0, 0, 2, Grad(1, 0, b, e));
  ASSERT_TRUE(again->status().ok());
  EXPECT_NE(again->header.flags & ps::kFlagDuplicate, 0);
  // Finish the step, then push it again: a duplicate of an applied step.
  for (uint32_t p = 0; p < Partitions(); ++p) {
    auto [pb, pe] = Range(p);
    for (uint32_t c = 0; c < 2; ++c) ASSERT_TRUE(Push(PrimaryOf(p), 1, 1, p, c, 2, Grad(1, c, pb, pe))->status().ok());
  }
  auto pulled = PullAll(1);
  auto late = Push(PrimaryOf(0), 1, 1, 0, 1, 2, Grad(1, 1, b, e));
  EXPECT_NE(late->header.flags & ps::kFlagDuplicate, 0);
  auto after = PullAll(1);
  EXPECT_EQ(pulled, after);
  EXPECT_EQ(PrimaryOf(0).Stats({0}).partitions(0).version(), 2u);
}

TEST_F(PsCoreTest, BadPushesGetClearErrorsAndChangeNothing) {
  Job job;
  Start(2, job);
  auto [b, e] = Range(0);
  const auto before = PrimaryOf(0).Stats({0});
  auto expect_error = [&](std::shared_ptr<Answer> a, StatusCode code, const std::string& words) {
    ASSERT_TRUE(a->done);
    EXPECT_EQ(a->status().code(), code) << a->status().ToString();
    EXPECT_NE(a->status().message().find(words), std::string::npos) << a->status().message();
  };
  expect_error(Push(PrimaryOf(0), 0, 1, 0, 0, 2, Grad(1, 0, b, e)), StatusCode::kFailedPrecondition, "stale");
  expect_error(Push(PrimaryOf(0), 2, 1, 0, 0, 2, Grad(1, 0, b, e)), StatusCode::kUnavailable, "not reached epoch 2");
  expect_error(Push(PrimaryOf(0), 1, 3, 0, 0, 2, Grad(1, 0, b, e)), StatusCode::kFailedPrecondition, "future");
  expect_error(Push(PrimaryOf(0), 1, 1, 0, 0, 2, Grad(1, 0, b, e - 1)), StatusCode::kInvalidArgument, "bytes");
  expect_error(Push(PrimaryOf(0), 1, 1, 0, 2, 2, Grad(1, 0, b, e)), StatusCode::kInvalidArgument, "contributor 2");
  expect_error(Push(PrimaryOf(0), 1, 1, 99, 0, 2, Grad(1, 0, b, e)), StatusCode::kNotFound, "partition 99");
  expect_error(Push(*BackupOf(0), 1, 1, 0, 0, 2, Grad(1, 0, b, e)), StatusCode::kFailedPrecondition, "not the primary");
  auto far = Pull(PrimaryOf(0), 1, 3, 0);
  ASSERT_TRUE(far->done);
  EXPECT_EQ(far->status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(far->status().message().find("future"), std::string::npos);
  auto wrong_dtype = Push(PrimaryOf(0), 1, 1, 0, 0, 2, Grad(1, 0, b, e), static_cast<v1::WireDType>(9));
  expect_error(wrong_dtype, StatusCode::kInvalidArgument, "dtype");
  // A push naming another contributor count than the step's first push.
  ASSERT_TRUE(Push(PrimaryOf(0), 1, 1, 0, 0, 2, Grad(1, 0, b, e))->status().ok());
  expect_error(Push(PrimaryOf(0), 1, 1, 0, 1, 3, Grad(1, 1, b, e)), StatusCode::kInvalidArgument, "contributors");
  const auto after = PrimaryOf(0).Stats({0});
  EXPECT_EQ(before.partitions(0).version(), after.partitions(0).version());
  EXPECT_EQ(before.partitions(0).step(), after.partitions(0).step());
  EXPECT_EQ(PullAll(0), job.initial);
  // Nothing refused was folded into step 1's sum: completed, it equals a
  // clean run's step (contributor 0's push of partition 0 is a duplicate).
  EXPECT_EQ(RunStep(1, 2), ReferenceRun(job, 1, 2));
  ExpectReplicasEqual();
}

// A learning rate per step (ps::Frame::value): every push of a step must
// carry the step's rate. A push that carries another one (than the step's
// first push, also one still waiting in the buffer for its turn, or the
// same contributor's) is refused with INVALID_ARGUMENT naming both rates and
// is not folded in: the step, completed by the right pushes, equals a clean
// run's bit for bit.
TEST_F(PsCoreTest, APushWhoseLearningRateDiffersFromItsStepsIsRefusedAndChangesNothing) {
  Job job;
  Start(2, job);
  auto [b, e] = Range(0);
  const auto before = PrimaryOf(0).Stats({0});
  auto expect_mismatch = [&](std::shared_ptr<Answer> a, const std::string& words) {
    ASSERT_TRUE(a->done);
    EXPECT_EQ(a->status().code(), StatusCode::kInvalidArgument) << a->status().ToString();
    EXPECT_NE(a->status().message().find(words), std::string::npos) << a->status().message();
  };
  // Contributor 2 of 3 comes first: buffered until 0 and 1 are folded in.
  ASSERT_TRUE(Push(PrimaryOf(0), 1, 1, 0, 2, 3, Grad(1, 2, b, e), v1::WIRE_DTYPE_FP32, 0.01)->status().ok());
  expect_mismatch(Push(PrimaryOf(0), 1, 1, 0, 0, 3, Grad(1, 0, b, e), v1::WIRE_DTYPE_FP32, 0.02),
                  "push of step 1 carries learning rate 0.02, but the step's other pushes carry 0.01");
  // The schedule's (0) is another rate too.
  expect_mismatch(Push(PrimaryOf(0), 1, 1, 0, 1, 3, Grad(1, 1, b, e)),
                  "carries learning rate 0, but the step's other pushes carry 0.01");
  ASSERT_TRUE(Push(PrimaryOf(0), 1, 1, 0, 0, 3, Grad(1, 0, b, e), v1::WIRE_DTYPE_FP32, 0.01)->status().ok());
  // The same contributor again with another rate: refused, not a duplicate.
  expect_mismatch(Push(PrimaryOf(0), 1, 1, 0, 0, 3, Grad(1, 0, b, e), v1::WIRE_DTYPE_FP32, 0.03),
                  "carries learning rate 0.03");
  const auto after = PrimaryOf(0).Stats({0});
  EXPECT_EQ(after.partitions(0).version(), before.partitions(0).version());
  EXPECT_EQ(after.partitions(0).step(), before.partitions(0).step());
  // Completed with the step's rate, it equals a clean run's step (the
  // pushes already taken are duplicates).
  const StepLr lr = [](uint64_t) { return 0.01; };
  const auto params = RunStep(1, 3, {}, 0.01);
  const auto reference = ReferenceRun(job, 1, 3, lr);
  ASSERT_EQ(params.size(), reference.size());
  EXPECT_EQ(std::memcmp(params.data(), reference.data(), params.size() * sizeof(float)), 0);
  ExpectReplicasEqual();
}

// A negative, NaN or infinite learning rate is refused with INVALID_ARGUMENT
// naming it, before anything else of the push is taken: it fixes neither
// the step's rate nor a contribution, so the step then completes with the
// schedule's rate (value 0) exactly as a clean run does.
TEST_F(PsCoreTest, ANegativeNanOrInfiniteLearningRateIsRefusedAndChangesNothing) {
  Job job;
  Start(2, job);
  auto [b, e] = Range(0);
  for (double lr : {-0.01, -std::numeric_limits<double>::infinity(), std::numeric_limits<double>::infinity(),
                    std::numeric_limits<double>::quiet_NaN()}) {
    auto a = Push(PrimaryOf(0), 1, 1, 0, 0, 2, Grad(1, 0, b, e), v1::WIRE_DTYPE_FP32, lr);
    ASSERT_TRUE(a->done);
    EXPECT_EQ(a->status().code(), StatusCode::kInvalidArgument) << lr << ": " << a->status().ToString();
    EXPECT_NE(a->status().message().find("must be 0 (the configured schedule) or > 0 and finite"), std::string::npos)
        << a->status().message();
  }
  auto negative = Push(PrimaryOf(0), 1, 1, 0, 0, 2, Grad(1, 0, b, e), v1::WIRE_DTYPE_FP32, -0.01);
  EXPECT_NE(negative->status().message().find("learning rate -0.01"), std::string::npos)
      << negative->status().message();
  EXPECT_EQ(PrimaryOf(0).Stats({0}).partitions(0).version(), 1u);
  EXPECT_EQ(RunStep(1, 2), ReferenceRun(job, 1, 2));
  ExpectReplicasEqual();
}

// A pushed learning rate replaces the schedule's, nothing else: pushing the
// rate the (constant) schedule has gives the same bits as pushing 0.
TEST_F(PsCoreTest, APushedLearningRateEqualToTheSchedulesChangesNoBit) {
  Job job;  // AdamW, lr 1e-2, constant
  Start(3, job);
  std::vector<float> params;
  for (uint64_t s = 1; s <= 4; ++s) params = RunStep(s, 2, {}, job.optimizer.adam().lr());
  const auto reference = ReferenceRun(job, 4, 2);
  ASSERT_EQ(params.size(), reference.size());
  EXPECT_EQ(std::memcmp(params.data(), reference.data(), params.size() * sizeof(float)), 0);
  ExpectReplicasEqual();
}

TEST_F(PsCoreTest, NonFiniteGradientSkipsTheStepOnEveryServer) {
  Job job;
  Start(3, job);
  auto p1 = RunStep(1, 2);
  // Step 2: one element of one partition is NaN.
  for (uint32_t p = 0; p < Partitions(); ++p) {
    auto [b, e] = Range(p);
    for (uint32_t c = 0; c < 2; ++c) {
      auto g = Grad(2, c, b, e);
      if (p == 4 && c == 1) g[3] = std::nanf("");
      ASSERT_TRUE(Push(PrimaryOf(p), 1, 2, p, c, 2, g)->status().ok());
    }
  }
  auto p2 = PullAll(2);
  EXPECT_EQ(p1, p2);  // nothing changed anywhere
  for (uint64_t id : cluster_.Live()) {
    auto stats = cluster_[id].Stats({});
    for (const auto& s : stats.partitions()) {
      EXPECT_EQ(s.step(), 2u);
      EXPECT_EQ(s.version(), 2u);  // one applied update (step 1), step 2 skipped
    }
  }
  EXPECT_GE(PrimaryOf(4).Stats({}).skipped_steps(), 1u);
  // Training goes on.
  auto p3 = RunStep(3, 2);
  EXPECT_NE(p2, p3);
}

TEST_F(PsCoreTest, FailPolicyRefusesNonFinitePushes) {
  Job job;
  job.optimizer.set_non_finite_policy(v1::NON_FINITE_POLICY_FAIL);
  Start(2, job);
  auto [b, e] = Range(0);
  auto g = Grad(1, 0, b, e);
  g[0] = INFINITY;
  auto a = Push(PrimaryOf(0), 1, 1, 0, 0, 2, g);
  EXPECT_EQ(a->status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(a->status().message().find("NaN or Inf"), std::string::npos);
  EXPECT_EQ(PrimaryOf(0).Stats({0}).partitions(0).version(), 1u);
  // The refused push is as if never sent: the contributor sends a finite
  // gradient and the step completes as in a clean run.
  EXPECT_EQ(RunStep(1, 2), ReferenceRun(job, 1, 2));
  ExpectReplicasEqual();
}

TEST_F(PsCoreTest, GlobalNormClippingUsesEveryServersGradient) {
  Job job;
  job.optimizer.Clear();
  job.optimizer.mutable_sgd()->set_lr(1.0);
  job.optimizer.set_max_grad_norm(1.0);
  job.optimizer.set_reduction(v1::GRADIENT_REDUCTION_SUM);
  Start(3, job);
  // One contributor; the gradient is 1 everywhere: norm sqrt(params).
  for (uint32_t p = 0; p < Partitions(); ++p) {
    auto [b, e] = Range(p);
    ASSERT_TRUE(Push(PrimaryOf(p), 1, 1, p, 0, 1, std::vector<float>(e - b, 1.0f))->status().ok());
  }
  auto params = PullAll(1);
  const double norm = std::sqrt(static_cast<double>(job.params));
  const double coef = 1.0 / (norm + 1e-6);
  for (size_t i = 0; i < params.size(); i += 97) {
    EXPECT_NEAR(params[i], job.initial[i] - coef, 1e-6) << i;
  }
}

TEST_F(PsCoreTest, InitializationHappensOnceAndChecksItsInput) {
  Job job;
  Start(2, job);
  // Again with other values: ignored, said so.
  Job other = job;
  for (auto& x : other.initial) x += 1;
  auto again = cluster_[kFirstServer].Initialize(other.Init(1));
  ASSERT_TRUE(again.ok());
  for (const auto& p : again->partitions()) EXPECT_FALSE(p.newly_initialized());
  auto params = PullAll(0);
  EXPECT_EQ(params, job.initial);
  // From a checkpoint, partitions that hold state are not read again: a
  // checkpoint that is gone by now does not matter to them.
  auto from_gone = job.Init(1);
  from_gone.set_checkpoint_path("/nonexistent/tandem-checkpoint");
  auto kept = cluster_[kFirstServer].Initialize(from_gone);
  ASSERT_TRUE(kept.ok()) << kept.status().ToString();
  EXPECT_GT(kept->partitions_size(), 0);
  for (const auto& p : kept->partitions()) {
    EXPECT_FALSE(p.newly_initialized());
    EXPECT_EQ(p.version(), 1u);
  }
  // A different tensor table, optimizer, or incomplete values.
  auto bad = job.Init(1);
  bad.mutable_tensors(0)->set_name("renamed");
  EXPECT_EQ(cluster_[kFirstServer].Initialize(bad).status().code(), StatusCode::kFailedPrecondition);
  bad = job.Init(1);
  bad.mutable_optimizer()->mutable_adam()->set_lr(5);
  EXPECT_EQ(cluster_[kFirstServer].Initialize(bad).status().code(), StatusCode::kFailedPrecondition);
  Cluster fresh;
  fresh.Add(kFirstServer);
  fresh[kFirstServer].SetEpoch(1, kFirstServer, MakeMap(job.params, job.partition, {kFirstServer}), 1, 0);
  bad = job.Init(1);
  bad.mutable_values()->mutable_chunks(0)->mutable_range()->set_end(job.params - 10);
  bad.mutable_values()->mutable_chunks(0)->mutable_data()->resize((job.params - 10) * 4);
  auto incomplete = fresh[kFirstServer].Initialize(bad);
  EXPECT_EQ(incomplete.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(incomplete.status().message().find("not fully covered"), std::string::npos)
      << incomplete.status().message();
  bad = job.Init(1);
  bad.mutable_optimizer()->mutable_adam()->set_beta1(1.5);
  auto invalid = fresh[kFirstServer].Initialize(bad);
  EXPECT_EQ(invalid.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(invalid.status().message().find("beta1"), std::string::npos);
}

// Gradients pushed as fp32, bf16 and fp16 in one step are widened exactly
// and summed; a bf16 pull is the weights rounded to nearest even (as
// EncodeWire, which WireTest checks bit by bit); an fp16 pull is refused.
// Values are multiples of 1/16 of at most 8 significant bits, exact in
// every wire dtype, so the result is exact: SGD at lr 1 with a plain sum.
TEST_F(PsCoreTest, WireDTypesAreWidenedSummedAndNarrowedExactly) {
  Job job;
  job.optimizer.Clear();
  job.optimizer.mutable_sgd()->set_lr(1.0);
  job.optimizer.set_reduction(v1::GRADIENT_REDUCTION_SUM);
  for (size_t i = 0; i < job.initial.size(); ++i)
    job.initial[i] = static_cast<float>(static_cast<int>(i % 65) - 32) / 8;
  Start(2, job);
  const v1::WireDType dtypes[] = {v1::WIRE_DTYPE_FP32, v1::WIRE_DTYPE_BF16, v1::WIRE_DTYPE_FP16};
  auto grad = [](uint32_t c, size_t i) {
    return static_cast<float>(static_cast<int>((i * 7 + c * 13) % 33) - 16) / 16;
  };
  for (uint32_t p = 0; p < Partitions(); ++p) {
    auto [b, e] = Range(p);
    for (uint32_t c = 0; c < 3; ++c) {
      std::vector<float> g(e - b);
      for (size_t i = 0; i < g.size(); ++i) g[i] = grad(c, b + i);
      std::vector<char> wire(optim::WireBytes(dtypes[c], g.size()));
      optim::EncodeWire(wire.data(), g.data(), dtypes[c], g.size());
      auto a = std::make_shared<Answer>();
      PrimaryOf(p).Push(1, PushHeader(epoch_, 1, p, c, 3, wire.size(), dtypes[c]), wire.data(), Into(a));
      ASSERT_TRUE(a->done);
      ASSERT_TRUE(a->status().ok()) << a->status().ToString();
    }
  }
  std::vector<float> want(job.params);
  for (size_t i = 0; i < want.size(); ++i) want[i] = job.initial[i] - (grad(0, i) + grad(1, i) + grad(2, i));
  EXPECT_EQ(PullAll(1), want);
  for (uint32_t p = 0; p < Partitions(); ++p) {
    auto [b, e] = Range(p);
    ps::Frame h = PullHeader(epoch_, 1, p);
    h.dtype = v1::WIRE_DTYPE_BF16;
    auto bf16 = std::make_shared<Answer>();
    PrimaryOf(p).Pull(1, h, Into(bf16));
    ASSERT_TRUE(bf16->done);
    ASSERT_TRUE(bf16->status().ok()) << bf16->status().ToString();
    std::vector<char> expected(optim::WireBytes(v1::WIRE_DTYPE_BF16, e - b));
    optim::EncodeWire(expected.data(), want.data() + b, v1::WIRE_DTYPE_BF16, e - b);
    EXPECT_EQ(bf16->payload, expected) << "partition " << p;
    h.dtype = v1::WIRE_DTYPE_FP16;
    auto fp16 = std::make_shared<Answer>();
    PrimaryOf(p).Pull(1, h, Into(fp16));
    ASSERT_TRUE(fp16->done);
    EXPECT_EQ(fp16->status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(fp16->status().message().find("pulls return FP32 or BF16"), std::string::npos);
  }
  ExpectReplicasEqual();
}

// The checksums that ExpectReplicasEqual compares tell copies apart: two
// servers given different initial values (which PsClient never does: a
// backup only gets the values its primary kept) report different
// checksums exactly for the partitions whose values differ; stats without
// checksums carry none.
TEST_F(PsCoreTest, StateChecksumsTellDivergedReplicasApart) {
  Job job;
  cluster_.Add(kFirstServer);
  cluster_.Add(kFirstServer + 1);
  map_ = MakeMap(job.params, job.partition, cluster_.Live());
  SetEpoch(1);
  Job other = job;
  other.initial[0] += 1;
  other.initial[job.params - 1] += 1;
  ASSERT_TRUE(cluster_[kFirstServer].Initialize(job.Init(1)).ok());
  ASSERT_TRUE(cluster_[kFirstServer + 1].Initialize(other.Init(1)).ok());
  auto first = cluster_[kFirstServer].Stats({}, /*checksums=*/true);
  auto second = cluster_[kFirstServer + 1].Stats({}, /*checksums=*/true);
  ASSERT_EQ(first.partitions_size(), static_cast<int>(Partitions()));
  ASSERT_EQ(second.partitions_size(), static_cast<int>(Partitions()));
  int differ = 0;
  for (int i = 0; i < first.partitions_size(); ++i) {
    const auto& a = first.partitions(i);
    const auto& b = second.partitions(i);
    ASSERT_EQ(a.partition_id(), b.partition_id());
    ASSERT_TRUE(a.has_state_crc32c());
    EXPECT_FALSE(cluster_[kFirstServer].Stats({a.partition_id()}).partitions(0).has_state_crc32c());
    const auto [begin, end] = Range(a.partition_id());
    const bool changed = begin == 0 || end == job.params;
    EXPECT_EQ(a.state_crc32c() != b.state_crc32c(), changed) << "partition " << a.partition_id();
    differ += a.state_crc32c() != b.state_crc32c() ? 1 : 0;
  }
  EXPECT_EQ(differ, 2);
}

// Each update rule through the store (three servers with backups, two
// contributors, two tensor groups with their own hyperparameters, a warmup
// then a decay) against PyTorch's rules in double precision
// (tests/optimizer_reference.h): weights equal within float rounding after
// sixty steps, and every backup equals its primary.
struct StoreRuleCase {
  std::string name;
  v1::OptimizerConfig config;
};

void PrintTo(const StoreRuleCase& c, std::ostream* os) {
  *os << c.name;
}

class StoreMatchesReference : public PsCoreTest, public ::testing::WithParamInterface<StoreRuleCase> {
 protected:
  // Sixty steps whose pushes carry lr(step) (null: 0, the schedule's).
  void RunAgainstReference(const StepLr& lr) {
    constexpr uint64_t kSteps = 60;
    Job job;
    job.optimizer = GetParam().config;
    Start(3, job);
    auto made = optim::Optimizer::Create(job.optimizer);
    ASSERT_TRUE(made.ok()) << made.status().ToString();
    const optim::Optimizer& o = *made;
    const uint64_t split = job.params - 500;  // tensor "w", then "b" (group no_decay)
    auto reference = [&](uint64_t b, uint64_t e) {
      return optim::Reference{std::vector<double>(job.initial.begin() + b, job.initial.begin() + e),
                              std::vector<double>(e - b, 0), std::vector<double>(e - b, 0)};
    };
    optim::Reference w = reference(0, split);
    optim::Reference bias = reference(split, job.params);
    std::vector<float> params;
    for (uint64_t step = 1; step <= kSteps; ++step) {
      const double step_lr = lr ? lr(step) : 0;
      params = RunStep(step, 2, {}, step_lr);
      // The step's gradient as the store sums it: contributor 0's, plus 1's.
      std::vector<float> g;
      for (uint32_t p = 0; p < Partitions(); ++p) {
        auto [b, e] = Range(p);
        auto g0 = Grad(step, 0, b, e);
        const auto g1 = Grad(step, 1, b, e);
        for (size_t i = 0; i < g0.size(); ++i) g0[i] += g1[i];
        g.insert(g.end(), g0.begin(), g0.end());
      }
      w.Step(o, std::vector<float>(g.begin(), g.begin() + static_cast<ptrdiff_t>(split)), step - 1, o.Group(""), 0.5,
             step_lr);
      bias.Step(o, std::vector<float>(g.begin() + static_cast<ptrdiff_t>(split), g.end()), step - 1,
                o.Group("no_decay"), 0.5, step_lr);
    }
    double max_err = 0;
    double moved = 0;
    for (uint64_t i = 0; i < job.params; ++i) {
      const double want = i < split ? w.w[i] : bias.w[i - split];
      ASSERT_TRUE(std::isfinite(params[i])) << i;
      max_err = std::max(max_err, std::fabs(params[i] - want) / std::max(1.0, std::fabs(want)));
      moved += std::fabs(params[i] - job.initial[i]);
    }
    EXPECT_LT(max_err, 2e-5) << GetParam().name;
    EXPECT_GT(moved / static_cast<double>(job.params), 0.01)
        << "the weights hardly moved: the test would prove nothing";
    ExpectReplicasEqual();
  }
};

TEST_P(StoreMatchesReference, SixtyStepsMatchADoublePrecisionReference) {
  RunAgainstReference(nullptr);
}

// The same with a learning rate pushed for every step (LambdaLr: a PyTorch
// LR scheduler's sequence, every seventh step left to the schedule): the
// store applies the pushed rates, times the group's lr_scale, and the
// backups, which replay each update with its rate, stay bit-identical.
TEST_P(StoreMatchesReference, APushedLearningRatePerStepReplacesTheSchedule) {
  RunAgainstReference(LambdaLr);
}

std::vector<StoreRuleCase> StoreRuleCases() {
  auto schedule = [](v1::OptimizerConfig& c, v1::LrScheduleKind kind) {
    c.mutable_lr_schedule()->set_kind(kind);
    c.mutable_lr_schedule()->set_warmup_steps(5);
    c.mutable_lr_schedule()->set_total_steps(60);
    c.mutable_lr_schedule()->set_min_lr_ratio(0.1);
  };
  std::vector<StoreRuleCase> cases;
  {
    v1::OptimizerConfig c;
    c.mutable_sgd()->set_lr(0.05);
    c.mutable_sgd()->set_momentum(0.9);
    c.mutable_sgd()->set_nesterov(true);
    c.mutable_sgd()->set_weight_decay(0.01);
    schedule(c, v1::LR_SCHEDULE_KIND_COSINE);
    (*c.mutable_group_overrides())["no_decay"].set_weight_decay(0);
    cases.push_back({"SgdNesterovWeightDecayCosine", c});
  }
  {
    v1::OptimizerConfig c;
    c.mutable_adam()->set_lr(1e-2);
    c.mutable_adam()->set_weight_decay(0.01);  // L2, added to the gradient
    schedule(c, v1::LR_SCHEDULE_KIND_LINEAR);
    (*c.mutable_group_overrides())["no_decay"].set_weight_decay(0);
    cases.push_back({"AdamL2Linear", c});
  }
  {
    v1::OptimizerConfig c;
    c.mutable_adam()->set_lr(1e-2);
    c.mutable_adam()->set_weight_decay(0.1);
    c.mutable_adam()->set_decoupled_weight_decay(true);
    schedule(c, v1::LR_SCHEDULE_KIND_COSINE);
    auto& group = (*c.mutable_group_overrides())["no_decay"];
    group.set_weight_decay(0);
    group.set_lr_scale(0.5);
    cases.push_back({"AdamWGroupsCosine", c});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Rules, StoreMatchesReference, ::testing::ValuesIn(StoreRuleCases()),
                         [](const auto& rule) { return rule.param.name; });

}  // namespace
}  // namespace tandem::server::store_test
