// Pipeline parallelism: the order in which one stage runs the forward and
// backward passes of a step's micro-batches (the schedule), and an executor
// that runs a schedule over the pipeline group ("pp/<i>", group rank =
// stage), sending activations to the next stage and gradients to the
// previous one.
//
// Schedules, for P stages and M micro-batches:
// - GPipe: every forward, then every backward (in micro-batch order). A
//   stage keeps the activations of all M micro-batches.
// - 1F1B (one forward, one backward): stage s runs min(P - s - 1, M)
//   forwards to fill the pipeline, then alternates one forward and one
//   backward, then drains the remaining backwards. A stage keeps at most
//   P - s micro-batches' activations, so memory no longer grows with M; the
//   bubble is the same as GPipe's.
// Both run backwards in micro-batch order 0 .. M-1, so a stage's gradients
// are accumulated in the same order as gradient accumulation over M
// micro-batches without a pipeline: the results are the same bit for bit.
// In the steady state of 1F1B, "send my activation, receive my gradient" and
// "send my gradient, receive the next activation" are single SendRecv
// exchanges with the neighbour doing the opposite one, so blocking sends
// cannot deadlock.
//
// The ideal idle fraction of a stage (the "bubble") is (P - 1) / (M + P - 1)
// when a backward costs a fixed multiple of a forward on every stage;
// RunPipeline measures the real one (wall time not spent computing).
//
// Thread safety: BuildSchedule and AnalyticBubble are pure; RunPipeline uses
// the communicator from the calling thread only.
#pragma once

#include <cstddef>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "worker/comm/communicator.h"

namespace tandem::worker {

enum class PipelineSchedule { kGPipe, kOneFOneB };

// "gpipe" or "1f1b".
std::string_view ScheduleName(PipelineSchedule schedule);
// INVALID_ARGUMENT naming the accepted values for anything else.
Result<PipelineSchedule> ParseSchedule(std::string_view name);

// One step of a stage's schedule.
struct PipeOp {
  enum Kind {
    kRecvActivation,              // the input of `micro` from the previous stage
    kForward,                     // forward of `micro`
    kSendActivation,              // the output of `micro` to the next stage
    kRecvGradient,                // the output gradient of `micro` from the next stage
    kBackward,                    // backward of `micro`
    kSendGradient,                // the input gradient of `micro` to the previous stage
    kSendActivationRecvGradient,  // output of `micro` out, output gradient of `other` in (next stage)
    kSendGradientRecvActivation,  // input gradient of `micro` out, input of `other` in (previous stage)
  };
  Kind kind;
  int micro = 0;
  int other = -1;

  bool operator==(const PipeOp&) const = default;
};

// Stage `stage`'s schedule. REQUIRES: stages >= 1, 0 <= stage < stages,
// micro_batches >= 1.
std::vector<PipeOp> BuildSchedule(PipelineSchedule schedule, int stages, int stage, int micro_batches);

// How many micro-batches' activations stage `stage` holds at once under the
// schedule; micro-batch m uses slot m % SlotsNeeded(...).
int SlotsNeeded(PipelineSchedule schedule, int stages, int stage, int micro_batches);

// (stages - 1) / (micro_batches + stages - 1).
double AnalyticBubble(int stages, int micro_batches);

// What a stage computes. Spans returned must stay valid until the next call
// for the same slot.
struct StageCompute {
  // Forward of micro-batch `micro`; `input` is the previous stage's output
  // (null on the first stage). Returns this stage's output (empty on the
  // last stage).
  std::function<Result<std::span<const float>>(int micro, const float* input)> forward;
  // Backward of `micro`; `output_grad` is the gradient of this stage's
  // output (null on the last stage). Returns the gradient of this stage's
  // input (empty on the first stage).
  std::function<Result<std::span<const float>>(int micro, const float* output_grad)> backward;
};

struct PipelineTiming {
  double seconds = 0;          // the whole schedule, wall time
  double compute_seconds = 0;  // inside forward and backward
  double idle_fraction() const { return seconds > 0 ? 1.0 - compute_seconds / seconds : 0.0; }
};

// Runs `ops` (this stage's schedule) over `pp`, whose rank is the stage and
// whose size is the number of stages. Every transfer carries `elements`
// floats: the largest micro-batch's activation. A smaller micro-batch's
// output or input gradient is padded with zeros on the way out, and its
// receiver reads the front of what arrived. Errors name the operation and the micro-batch; a
// communicator error leaves the pipeline group unusable (as any collective
// failure does).
Result<PipelineTiming> RunPipeline(comm::Communicator& pp, const std::vector<PipeOp>& ops, size_t elements,
                                   const StageCompute& compute);

}  // namespace tandem::worker
