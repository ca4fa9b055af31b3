// Pipeline schedules and their executor (pipeline.h).
#include "worker/runtime/pipeline.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <optional>

#include "common/trace.h"

namespace tandem::worker {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// The span of a send or receive in a trace (null: forward and backward).
const char* TraceName(PipeOp::Kind kind) {
  switch (kind) {
    case PipeOp::kRecvActivation:
      return "recv_activation";
    case PipeOp::kSendActivation:
      return "send_activation";
    case PipeOp::kRecvGradient:
      return "recv_gradient";
    case PipeOp::kSendGradient:
      return "send_gradient";
    case PipeOp::kSendActivationRecvGradient:
      return "send_activation_recv_gradient";
    case PipeOp::kSendGradientRecvActivation:
      return "send_gradient_recv_activation";
    default:
      return nullptr;
  }
}

const char* KindName(PipeOp::Kind kind) {
  switch (kind) {
    case PipeOp::kRecvActivation:
      return "receiving the activations of";
    case PipeOp::kForward:
      return "the forward of";
    case PipeOp::kSendActivation:
      return "sending the activations of";
    case PipeOp::kRecvGradient:
      return "receiving the output gradient of";
    case PipeOp::kBackward:
      return "the backward of";
    case PipeOp::kSendGradient:
      return "sending the input gradient of";
    case PipeOp::kSendActivationRecvGradient:
      return "exchanging activations for gradients after";
    case PipeOp::kSendGradientRecvActivation:
      return "exchanging gradients for activations after";
  }
  return "?";
}

}  // namespace

std::string_view ScheduleName(PipelineSchedule schedule) {
  return schedule == PipelineSchedule::kGPipe ? "gpipe" : "1f1b";
}

Result<PipelineSchedule> ParseSchedule(std::string_view name) {
  if (name == "gpipe") return PipelineSchedule::kGPipe;
  if (name == "1f1b") return PipelineSchedule::kOneFOneB;
  return InvalidArgument("pipeline schedule: expected gpipe or 1f1b, got \"{}\"", name);
}

std::vector<PipeOp> BuildSchedule(PipelineSchedule schedule, int stages, int stage, int micro_batches) {
  const bool first = stage == 0, last = stage == stages - 1;
  const int m = micro_batches;
  std::vector<PipeOp> ops;
  auto add = [&](PipeOp::Kind kind, int micro, int other = -1) { ops.push_back(PipeOp{kind, micro, other}); };
  auto forward = [&](int i) {
    if (!first) add(PipeOp::kRecvActivation, i);
    add(PipeOp::kForward, i);
    if (!last) add(PipeOp::kSendActivation, i);
  };
  auto backward = [&](int i) {
    if (!last) add(PipeOp::kRecvGradient, i);
    add(PipeOp::kBackward, i);
    if (!first) add(PipeOp::kSendGradient, i);
  };
  if (schedule == PipelineSchedule::kGPipe) {
    for (int i = 0; i < m; ++i) forward(i);
    for (int i = 0; i < m; ++i) backward(i);
    return ops;
  }
  const int warmup = std::min(stages - stage - 1, m);
  const int steady = m - warmup;
  for (int i = 0; i < warmup; ++i) forward(i);
  if (steady > 0 && !first) add(PipeOp::kRecvActivation, warmup);
  for (int i = 0; i < steady; ++i) {
    const int f = warmup + i;
    add(PipeOp::kForward, f);
    if (!last) add(PipeOp::kSendActivationRecvGradient, f, i);
    add(PipeOp::kBackward, i);
    if (first) continue;
    if (i == steady - 1) {
      add(PipeOp::kSendGradient, i);
    } else {
      add(PipeOp::kSendGradientRecvActivation, i, f + 1);
    }
  }
  for (int i = steady; i < m; ++i) backward(i);
  return ops;
}

int SlotsNeeded(PipelineSchedule schedule, int stages, int stage, int micro_batches) {
  if (schedule == PipelineSchedule::kGPipe) return micro_batches;
  return std::min(stages - stage, micro_batches);
}

double AnalyticBubble(int stages, int micro_batches) {
  return static_cast<double>(stages - 1) / static_cast<double>(micro_batches + stages - 1);
}

Result<PipelineTiming> RunPipeline(comm::Communicator& pp, const std::vector<PipeOp>& ops, size_t elements,
                                   const StageCompute& compute) {
  const int stage = pp.rank(), stages = pp.size();
  const bool first = stage == 0, last = stage == stages - 1;
  std::vector<float> input(first ? 0 : elements), output_grad(last ? 0 : elements);
  std::map<int, std::span<const float>> outputs, input_grads;  // by micro-batch, until sent
  PipelineTiming timing;
  const auto start = Clock::now();
  // What goes out for `micro`: the span itself, or a copy padded with zeros
  // to `elements` when the micro-batch is smaller than the largest.
  std::vector<float> padded;
  auto outgoing = [&](std::map<int, std::span<const float>>& held, int micro, const char* what,
                      const float** data) -> Status {
    auto it = held.find(micro);
    if (it == held.end()) return FailedPrecondition("micro-batch {}: no {} to send", micro, what);
    if (it->second.size() > elements) {
      return InvalidArgument("micro-batch {}: the stage's {} has {} elements, the pipeline carries at most {}", micro,
                             what, it->second.size(), elements);
    }
    *data = it->second.data();
    if (it->second.size() < elements) {
      padded.assign(elements, 0.0f);
      std::copy(it->second.begin(), it->second.end(), padded.begin());
      *data = padded.data();
    }
    held.erase(it);
    return Status::Ok();
  };
  const uint64_t step = trace::ThreadStep();
  for (const PipeOp& op : ops) {
    Status status;
    const auto dt = comm::DType::kFloat32;
    // Sends and receives on the step's timeline (forward and backward are the trainer's spans).
    std::optional<trace::Span> span;
    if (const char* name = TraceName(op.kind); name != nullptr && trace::StepOn(step)) {
      span.emplace(name, "pipeline", step);
      span->Add("micro", op.micro);
      span->Add("stage", stage);
    }
    switch (op.kind) {
      case PipeOp::kRecvActivation:
        status = pp.Recv(stage - 1, input.data(), elements, dt);
        break;
      case PipeOp::kForward: {
        const auto t0 = Clock::now();
        auto out = compute.forward(op.micro, first ? nullptr : input.data());
        timing.compute_seconds += Seconds(Clock::now() - t0);
        if (!out.ok()) {
          status = out.status();
        } else if (!last) {
          outputs[op.micro] = *out;
        }
        break;
      }
      case PipeOp::kSendActivation: {
        const float* data = nullptr;
        status = outgoing(outputs, op.micro, "output", &data);
        if (status.ok()) status = pp.Send(stage + 1, data, elements, dt);
        break;
      }
      case PipeOp::kRecvGradient:
        status = pp.Recv(stage + 1, output_grad.data(), elements, dt);
        break;
      case PipeOp::kBackward: {
        const auto t0 = Clock::now();
        auto grad = compute.backward(op.micro, last ? nullptr : output_grad.data());
        timing.compute_seconds += Seconds(Clock::now() - t0);
        if (!grad.ok()) {
          status = grad.status();
        } else if (!first) {
          input_grads[op.micro] = *grad;
        }
        break;
      }
      case PipeOp::kSendGradient: {
        const float* data = nullptr;
        status = outgoing(input_grads, op.micro, "input gradient", &data);
        if (status.ok()) status = pp.Send(stage - 1, data, elements, dt);
        break;
      }
      case PipeOp::kSendActivationRecvGradient: {
        const float* data = nullptr;
        status = outgoing(outputs, op.micro, "output", &data);
        if (status.ok()) status = pp.SendRecv(stage + 1, data, stage + 1, output_grad.data(), elements, dt);
        break;
      }
      case PipeOp::kSendGradientRecvActivation: {
        const float* data = nullptr;
        status = outgoing(input_grads, op.micro, "input gradient", &data);
        if (status.ok()) status = pp.SendRecv(stage - 1, data, stage - 1, input.data(), elements, dt);
        break;
      }
    }
    if (!status.ok()) {
      return status.WithContext(
          fmt::format("pipeline stage {} of {}: {} micro-batch {}", stage, stages, KindName(op.kind), op.micro));
    }
  }
  timing.seconds = Seconds(Clock::now() - start);
  return timing;
}

}  // namespace tandem::worker
