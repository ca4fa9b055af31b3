// A training loop of one's own on Tandem: linear regression fitted by
// data-parallel SGD through the worker runtime (worker/include/tandem/worker.h).
// It uses the public API only: examples/CMakeLists.txt builds it in the tree
// or, configured on its own, against an installed Tandem (find_package).
//
// Every process that runs this is a tandem-worker: start a coordinator, then
// two or more of these, for example
//
//   build/bin/tandem-coordinator --job-min-workers 2 --job-max-workers 2 &
//   build/bin/tandem-example-custom-loop --coordinator-address 127.0.0.1:7400
//       --node-id a --train-mode allreduce --train-steps 100
//       --listen-address 127.0.0.1:0 --metrics-address 127.0.0.1:0 &
//   (the same with --node-id b; each command on one line)
//
// In hybrid or ps mode, give the coordinator parameter servers and
// --job-parameter-count 17 (the model's size). Global rank 0 logs the loss;
// the fitted weights approach the true ones (w_j = j / 8, b = 0.5).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "tandem/worker.h"

namespace {

constexpr int kDim = 16;
constexpr uint64_t kSamples = 4096;
constexpr uint64_t kBatch = 64;

// Sample i, the same in every process: x from a hash of (i, j), y exact.
float Feature(uint64_t i, int j) {
  uint64_t z = i * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(j) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 31)) * 0x94D049BB133111EBULL;
  return static_cast<float>((z >> 40) & 0xFFFF) / 32768.0f - 1.0f;
}

float Target(uint64_t i) {
  float y = 0.5f;
  for (int j = 0; j < kDim; ++j) y += static_cast<float>(j) / 8.0f * Feature(i, j);
  return y;
}

tandem::Status Fit(tandem::WorkerContext& ctx) {
  std::vector<float> params(kDim + 1, 0.0f);
  std::vector<float> grads(kDim + 1, 0.0f);
  std::vector<tandem::TensorSpec> tensors = {
      {.name = "weight", .shape = {kDim}, .flat_offset = 0, .group = ""},
      {.name = "bias", .shape = {1}, .flat_offset = kDim, .group = "no_decay"},
  };

  auto options = tandem::RuntimeOptionsOf(ctx.train);
  if (!options.ok()) return options.status();
  // Plain SGD for this model, whatever the reference trainer's defaults are.
  options->UseSgd(0.1);
  tandem::Runtime runtime(*options, ctx);
  TANDEM_RETURN_IF_ERROR(runtime.Attach(params, grads, tensors));

  const uint64_t steps = ctx.train.steps > 0 ? static_cast<uint64_t>(ctx.train.steps) : 100;
  while (!ctx.stopping()) {
    auto plan = runtime.BeginStep();
    if (!plan.ok()) return plan.status();
    if (plan->step > steps) {
      // With train.consistency async or bounded, the other workers may still
      // be training: wait for them (nothing to do in sync mode).
      tandem::Status finished = runtime.FinishRun();
      if (finished.ok()) break;
      if (runtime.Fatal(finished)) return finished;
      continue;  // a membership change: the next BeginStep resynchronises
    }
    // This rank's contiguous share of the step's batch.
    const uint64_t first = (plan->step - 1) * kBatch % kSamples;
    const uint64_t begin = kBatch * plan->dp_rank / plan->dp_size;
    const uint64_t end = kBatch * (plan->dp_rank + 1) / plan->dp_size;
    std::fill(grads.begin(), grads.end(), 0.0f);
    double loss = 0;
    for (uint64_t k = begin; k < end; ++k) {
      const uint64_t i = (first + k) % kSamples;
      float pred = params[kDim];
      for (int j = 0; j < kDim; ++j) pred += params[j] * Feature(i, j);
      const float err = pred - Target(i);
      loss += 0.5 * err * err / kBatch;  // this rank's share of the batch mean
      for (int j = 0; j < kDim; ++j) grads[j] += err * Feature(i, j) / kBatch;
      grads[kDim] += err / kBatch;
    }
    auto done = runtime.EndStep(loss, end - begin, 0);
    if (!done.ok()) {
      tandem::Log(tandem::LogLevel::kWarning, "step " + std::to_string(plan->step) +
                                                  " failed, retrying after a resync: " + done.status().ToString());
      continue;
    }
    if (plan->rank == 0 && (done->step % 10 == 0 || done->step == steps)) {
      char line[160];
      std::snprintf(
          line, sizeof line, "step %llu: loss %.6f (%u workers); w[15] = %.4f (true 1.875), b = %.4f (true 0.5)",
          static_cast<unsigned long long>(done->step), done->loss, plan->world_size, params[15], params[kDim]);
      tandem::Log(tandem::LogLevel::kInfo, line);
    }
  }
  return tandem::Status::Ok();
}

}  // namespace

int main(int argc, char** argv) {
  return tandem::RunWorker(argc, argv, Fit);
}
