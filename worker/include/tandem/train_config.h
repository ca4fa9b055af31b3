// The train.* options of a worker (flags --train-*, YAML keys train.*;
// docs/training.md lists them): what the worker was started with, handed to
// a training loop in WorkerContext::train. tandem::RuntimeOptionsOf turns
// them into a Runtime's options.
//
// Self-contained: the standard library only.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace tandem {
namespace worker {

struct TrainConfig {
  int64_t steps = 0;  // 0: no training (the worker only serves its data plane)
  std::string mode = "hybrid";
  std::string data;  // a text file; empty: the built-in corpus
  int64_t seed = 1;  // model initialisation and data order
  int64_t global_batch = 16;
  int64_t accumulation = 1;                // micro-batches per rank and step (the pipeline's micro-batches when pp > 1)
  std::string pipeline_schedule = "1f1b";  // gpipe | 1f1b, when the mesh has pp > 1
  std::string placement = "replicated";    // replicated | sharded (ZeRO-3; hybrid mode)
  // Server modes: sync (every step applied whole), async (each push applied
  // on arrival) or bounded (async, no worker more than staleness_bound steps
  // ahead of the slowest).
  std::string consistency = "sync";
  int64_t staleness_bound = 2;
  // The model.
  int64_t context = 64;
  int64_t d_model = 128;
  int64_t heads = 4;
  int64_t layers = 4;
  bool activation_checkpointing = false;
  int64_t blas_threads = 1;
  int64_t gpu = -1;  // the CUDA device of the model's forward and backward; -1: the CPU
  // The optimizer.
  std::string optimizer = "adamw";
  double lr = 3e-3;
  double weight_decay = 0.01;
  double max_grad_norm = 0;
  std::string schedule = "constant";
  int64_t warmup_steps = 10;
  int64_t lr_base_batch = 0;  // linear scaling: lr was tuned for this global batch (0: off)
  // Communication.
  uint64_t bucket_bytes = 1 << 20;
  std::string gradient_wire = "fp32";
  std::string parameter_wire = "fp32";
  std::chrono::milliseconds step_timeout{60000};
  std::chrono::milliseconds epoch_wait{60000};
  // Output.
  std::string progress_file;  // JSON lines, one per step (global rank 0 writes)
  std::string params_out;     // the final parameters, raw little-endian fp32 (global rank 0 writes)
  std::string sample_log;     // append which samples each step attempt trained on (every worker)
  // Checkpoints (server modes): every checkpoint_every steps and after the
  // last, global rank 0 has the servers save to checkpoint_dir/step-<step>
  // (written in the background); resume_from starts the job from such a
  // checkpoint (parameters, optimizer state, step) instead of the model's
  // initial values. Paths are on the servers' filesystem, absolute.
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;  // 0: no checkpoints
  std::string resume_from;
};

}  // namespace worker

using worker::TrainConfig;

}  // namespace tandem
