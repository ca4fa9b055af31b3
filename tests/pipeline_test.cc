// Pipeline parallelism (worker/runtime/pipeline.h): the schedules run every
// micro-batch's forward and backward once, in an order that respects the
// data flow, with backwards in micro-batch order and 1F1B's activations
// bounded by P - s; the executor moves the right activations and gradients
// between stages (over in-process communicators, every P and M tried, so a
// schedule that could deadlock would hang here); and the reference model
// split into 2 and 3 stages gives, under both schedules, the same losses and
// gradients bit for bit as the whole model accumulating over the same
// micro-batches.
#include "worker/runtime/pipeline.h"

#include <atomic>
#include <cstring>
#include <future>
#include <set>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "tests/comm_backends.h"
#include "worker/model/model.h"

namespace tandem::worker {
namespace {

using comm_test::Group;

Group MakePipe(int stages, const std::string& name) {
  comm::CommInfo base;
  base.name = name;
  base.epoch = 1;
  auto group = comm_test::LocalBackend().make_group(stages, base);
  EXPECT_TRUE(group.ok()) << group.status().ToString();
  return std::move(*group);
}

// Runs every stage on a thread of its own; fails the test instead of hanging.
void RunStages(int stages, const std::function<void(int stage)>& body) {
  std::vector<std::future<void>> done;
  for (int s = 0; s < stages; ++s) done.push_back(std::async(std::launch::async, body, s));
  for (int s = 0; s < stages; ++s) {
    ASSERT_EQ(done[s].wait_for(std::chrono::seconds(30)), std::future_status::ready) << "stage " << s << " hung";
  }
}

TEST(PipelineTest, SchedulesRunEachMicroBatchOnceInDataFlowOrder) {
  for (auto schedule : {PipelineSchedule::kGPipe, PipelineSchedule::kOneFOneB}) {
    for (int p = 1; p <= 5; ++p) {
      for (int m = 1; m <= 9; ++m) {
        for (int s = 0; s < p; ++s) {
          const auto ops = BuildSchedule(schedule, p, s, m);
          std::vector<int> forwards, backwards;
          int in_flight = 0, most = 0;
          for (const PipeOp& op : ops) {
            if (op.kind == PipeOp::kForward) {
              forwards.push_back(op.micro);
              most = std::max(most, ++in_flight);
            }
            if (op.kind == PipeOp::kBackward) {
              // Its own forward came first.
              EXPECT_NE(std::find(forwards.begin(), forwards.end(), op.micro), forwards.end());
              backwards.push_back(op.micro);
              --in_flight;
            }
          }
          std::vector<int> order(m);
          for (int i = 0; i < m; ++i) order[i] = i;
          const std::string where = std::string(ScheduleName(schedule)) + " p=" + std::to_string(p) +
                                    " m=" + std::to_string(m) + " stage " + std::to_string(s);
          EXPECT_EQ(forwards, order) << where;
          EXPECT_EQ(backwards, order) << where;  // the accumulation order of gradient accumulation
          EXPECT_LE(most, SlotsNeeded(schedule, p, s, m)) << where;
        }
      }
    }
  }
  EXPECT_DOUBLE_EQ(AnalyticBubble(4, 8), 3.0 / 11.0);
  EXPECT_DOUBLE_EQ(AnalyticBubble(1, 8), 0.0);
  EXPECT_FALSE(ParseSchedule("interleaved").ok());
  EXPECT_EQ(*ParseSchedule("1f1b"), PipelineSchedule::kOneFOneB);
}

// Stage s's forward adds s + 1 to every element; the first stage starts from
// 1000·micro. Backward sends 7·micro + stage back. Each stage checks what it
// receives, so a message for the wrong micro-batch or stage is caught.
TEST(PipelineTest, ActivationsAndGradientsReachTheRightStageForEveryShape) {
  constexpr size_t kElements = 5;
  int shapes = 0;
  for (auto schedule : {PipelineSchedule::kGPipe, PipelineSchedule::kOneFOneB}) {
    for (int p = 2; p <= 4; ++p) {
      for (int m : {1, 2, 3, 4, 7}) {
        Group group = MakePipe(p, "pipe" + std::to_string(++shapes));
        std::atomic<int> errors{0};
        RunStages(p, [&](int s) {
          std::vector<std::vector<float>> out(m, std::vector<float>(kElements)), in_grad(m, out[0]);
          StageCompute compute;
          compute.forward = [&](int micro, const float* input) -> Result<std::span<const float>> {
            const float expect = 1000.0f * micro + static_cast<float>(s * (s + 1) / 2);
            for (size_t j = 0; j < kElements; ++j) {
              const float x = input == nullptr ? 1000.0f * micro : input[j];
              if (x != expect) errors++;
              out[micro][j] = x + static_cast<float>(s + 1);
            }
            if (s == p - 1) return std::span<const float>();
            return std::span<const float>(out[micro]);
          };
          compute.backward = [&](int micro, const float* grad) -> Result<std::span<const float>> {
            for (size_t j = 0; grad != nullptr && j < kElements; ++j) {
              if (grad[j] != 7.0f * micro + static_cast<float>(s + 1)) errors++;
            }
            if (s == 0) return std::span<const float>();
            std::fill(in_grad[micro].begin(), in_grad[micro].end(), 7.0f * micro + static_cast<float>(s));
            return std::span<const float>(in_grad[micro]);
          };
          auto timing = RunPipeline(*group.comms[s], BuildSchedule(schedule, p, s, m), kElements, compute);
          if (!timing.ok()) {
            ADD_FAILURE() << timing.status().ToString();
            return;
          }
          EXPECT_GE(timing->idle_fraction(), 0.0);
          EXPECT_LE(timing->idle_fraction(), 1.0);
        });
        EXPECT_EQ(errors.load(), 0) << ScheduleName(schedule) << " p=" << p << " m=" << m;
      }
    }
  }
}

TEST(PipelineTest, ModelStagesEqualTheWholeModelUnderBothSchedules) {
  model::ModelConfig config;
  config.context = 16;
  config.d_model = 32;
  config.heads = 2;
  config.layers = 3;
  config.seed = 11;
  const int micro = 4, batch = 2;
  const size_t rows = size_t{batch} * config.context;
  std::vector<uint8_t> tokens(micro * rows), targets(micro * rows);
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<uint8_t>((i * 37 + 11) % 256);
    targets[i] = static_cast<uint8_t>((i * 53 + 5) % 256);
  }
  // The whole model, accumulating over the micro-batches.
  auto whole = model::Model::Create(config);
  ASSERT_TRUE(whole.ok());
  std::vector<float> want_loss;
  for (int m = 0; m < micro; ++m) {
    auto loss = whole->Forward(tokens.data() + m * rows, targets.data() + m * rows, batch);
    ASSERT_TRUE(loss.ok());
    want_loss.push_back(*loss);
    ASSERT_TRUE(
        whole->Backward(m == 0 ? model::GradMode::kOverwrite : model::GradMode::kAccumulate, 1.0f / micro).ok());
  }
  int run = 0;
  for (auto schedule : {PipelineSchedule::kGPipe, PipelineSchedule::kOneFOneB}) {
    for (int p : {2, 3}) {
      config.pipeline_stages = p;
      Group group = MakePipe(p, "model" + std::to_string(++run));
      std::vector<std::vector<float>> grads(p);
      std::vector<size_t> begin(p);
      std::vector<float> got_loss(micro, -1.0f);
      RunStages(p, [&](int s) {
        model::ModelConfig c = config;
        c.pipeline_stage = s;
        auto stage = model::Model::Create(c);
        ASSERT_TRUE(stage.ok());
        const int slots = SlotsNeeded(schedule, p, s, micro);
        stage->SetSlots(slots);
        StageCompute compute;
        compute.forward = [&](int m, const float* input) -> Result<std::span<const float>> {
          auto loss = stage->Forward(tokens.data() + m * rows, targets.data() + m * rows, batch, m % slots, input);
          if (!loss.ok()) return loss.status();
          if (stage->last_stage()) got_loss[m] = *loss;
          return stage->output(m % slots);
        };
        compute.backward = [&](int m, const float* grad) -> Result<std::span<const float>> {
          TANDEM_RETURN_IF_ERROR(stage->Backward(m == 0 ? model::GradMode::kOverwrite : model::GradMode::kAccumulate,
                                                 1.0f / micro, nullptr, m % slots, grad));
          return stage->input_grad(m % slots);
        };
        auto timing =
            RunPipeline(*group.comms[s], BuildSchedule(schedule, p, s, micro), rows * config.d_model, compute);
        ASSERT_TRUE(timing.ok()) << timing.status().ToString();
        grads[s].assign(stage->grads().begin(), stage->grads().end());
        begin[s] = stage->flat_begin();
      });
      for (int m = 0; m < micro; ++m) EXPECT_EQ(got_loss[m], want_loss[m]) << ScheduleName(schedule) << " p=" << p;
      for (int s = 0; s < p; ++s) {
        ASSERT_LE(begin[s] + grads[s].size(), whole->grads().size());
        EXPECT_EQ(std::memcmp(grads[s].data(), whole->grads().data() + begin[s], grads[s].size() * sizeof(float)), 0)
            << ScheduleName(schedule) << " p=" << p << " stage " << s;
      }
    }
  }
}

}  // namespace
}  // namespace tandem::worker
