// Tandem's C++ API for a training loop of your own (docs/training.md,
// "Your own training loop").
//
// A program that calls RunWorker is a tandem-worker: the same flags, YAML
// configuration, health service, metrics and clean shutdown on SIGTERM, and
// it registers with the coordinator at --coordinator-address. Its training
// loop runs on a thread of its own and drives a Runtime:
//
//   int main(int argc, char** argv) {
//     return tandem::RunWorker(argc, argv, [](tandem::WorkerContext& ctx) -> tandem::Status {
//       MyModel model;                                   // flat fp32 params and grads
//       auto options = tandem::RuntimeOptionsOf(ctx.train);  // train.mode, wires, buckets, optimizer
//       if (!options.ok()) return options.status();
//       tandem::Runtime runtime(*options, ctx.data_plane);
//       TANDEM_RETURN_IF_ERROR(runtime.Attach(model.params(), model.grads(), model.tensors()));
//       while (!ctx.stopping()) {
//         auto plan = runtime.BeginStep();                // step, dp_rank, dp_size
//         if (!plan.ok()) return plan.status();
//         if (plan->step > last_step) {                   // done; async modes: wait for the others
//           if (runtime.FinishRun().ok()) break;
//           continue;                                     // a membership change: resync, then again
//         }
//         double loss = model.ForwardBackward(plan->dp_rank, plan->dp_size,
//                                             [&](size_t from) { runtime.GradientsReady(from); });
//         auto done = runtime.EndStep(loss_share, samples, tokens);
//         if (!done.ok()) continue;                       // a membership change: retried after a resync
//       }
//       return tandem::Status::Ok();
//     });
//   }
//
// examples/custom_loop.cc is a complete program.
#pragma once

#include "worker/runtime/runtime.h"
#include "worker/runtime/trainer.h"
#include "worker/worker_daemon.h"

namespace tandem {

using worker::Runtime;
using worker::RuntimeOptions;
using worker::RuntimeOptionsOf;
using worker::StepPlan;
using worker::StepResult;
using worker::TrainConfig;
using worker::TrainingLoop;
using worker::TrainingMode;
using worker::WorkerContext;

// Runs this process as a tandem-worker whose training thread runs `loop`.
// Returns the exit code for main(): 0 after a clean shutdown, 1 when the
// loop failed or the worker could not start, 2 for bad flags.
int RunWorker(int argc, char** argv, TrainingLoop loop);

}  // namespace tandem
