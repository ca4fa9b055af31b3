#include "worker/runtime/trainer.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include <fmt/ranges.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>
#include <spdlog/spdlog.h>

#include "common/failpoint.h"
#include "common/json.h"
#include "common/trace.h"
#include "worker/data/dataset.h"
#include "worker/data/sampler.h"
#include "worker/runtime/pipeline.h"

namespace tandem::worker {

using Clock = std::chrono::steady_clock;

namespace {

double Seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

Result<v1::WireDType> ParseWire(const std::string& name, const char* key) {
  if (name == "fp32") return v1::WIRE_DTYPE_FP32;
  if (name == "bf16") return v1::WIRE_DTYPE_BF16;
  return InvalidArgument("{}: '{}' is not fp32 or bf16", key, name);
}

// What training needs besides the runtime: the model, the data and the
// sampler, and the cursor of the step being trained.
struct Setup {
  Setup(std::unique_ptr<model::Model> m, data::TextDataset d, data::DistributedSampler s)
      : model(std::move(m)), dataset(std::move(d)), sampler(std::move(s)) {}
  // Training in a cluster: made when the runtime binds the first epoch's
  // pipeline stage (the whole model never exists when there are stages).
  std::unique_ptr<model::Model> model;
  data::TextDataset dataset;
  data::DistributedSampler sampler;
  uint64_t global_batch = 0;
  int accumulation = 1;
  // The cursor of step cursor_step (1-based: the batch step trains on).
  uint64_t cursor_step = 1;
  data::Cursor cursor;
  // The micro-batches of the step in flight (all of them: a pipeline runs
  // several at once).
  std::vector<std::vector<uint8_t>> micro_tokens, micro_targets;
};

// With `create_model` false, setup.model stays null until a stage is bound.
Result<Setup> Prepare(const TrainConfig& config, bool create_model) {
  auto model_config = ModelConfigOf(config);
  if (!model_config.ok()) return model_config.status();
  std::unique_ptr<model::Model> model;
  if (create_model) {
    auto created = model::Model::Create(*model_config);
    if (!created.ok()) return created.status().WithContext("model");
    model = std::make_unique<model::Model>(std::move(*created));
  }
  const auto context = static_cast<size_t>(config.context);
  auto dataset =
      config.data.empty() ? data::TextDataset::Default(context) : data::TextDataset::Open(config.data, context);
  if (!dataset.ok()) return dataset.status().WithContext("train.data");
  auto sampler = data::DistributedSampler::Create(dataset->size(), static_cast<uint64_t>(config.seed));
  if (!sampler.ok()) return sampler.status();
  Setup setup(std::move(model), std::move(*dataset), std::move(*sampler));
  setup.global_batch = static_cast<uint64_t>(config.global_batch);
  setup.accumulation = static_cast<int>(config.accumulation);
  return setup;
}

// The cursor of `step`: the global batch is fixed, so it is the start
// advanced step - 1 times (cached: steps mostly follow one another).
Result<data::Cursor> CursorOf(Setup& s, uint64_t step) {
  if (step < s.cursor_step) {
    s.cursor_step = 1;
    s.cursor = {};
  }
  while (s.cursor_step < step) {
    auto next = s.sampler.Advance(s.cursor, s.global_batch);
    if (!next.ok()) return next.status();
    s.cursor = *next;
    ++s.cursor_step;
  }
  return s.cursor;
}

struct Share {
  double loss_share = 0;  // this rank's loss times its share of the global batch
  uint64_t samples = 0;
  uint64_t tokens = 0;
  data::Cursor cursor;
  std::vector<uint64_t> indices;
};

// This rank's shard of the step's batch, split into micro-batches (at most
// train.accumulation, all samples loaded into s.micro_tokens and
// s.micro_targets). No micro-batches when the shard is empty (more ranks
// than samples in the batch).
struct Shard {
  Share share;
  uint64_t batch = 0;       // the global batch of the step
  std::vector<int> counts;  // sequences per micro-batch
};

Result<Shard> LoadShard(Setup& s, uint64_t step, uint32_t dp_rank, uint32_t dp_size) {
  auto cursor = CursorOf(s, step);
  if (!cursor.ok()) return cursor.status();
  auto batch = s.sampler.BatchSize(*cursor, s.global_batch);
  if (!batch.ok()) return batch.status();
  auto indices = s.sampler.Batch(*cursor, s.global_batch, dp_rank, dp_size);
  if (!indices.ok()) return indices.status();
  Shard shard;
  shard.batch = *batch;
  shard.share.cursor = *cursor;
  shard.share.indices = std::move(*indices);
  const auto& ids = shard.share.indices;
  const size_t n = ids.size(), T = s.dataset.context();
  const size_t micro = std::min<size_t>(static_cast<size_t>(s.accumulation), n);
  s.micro_tokens.resize(micro);
  s.micro_targets.resize(micro);
  size_t begin = 0;
  for (size_t m = 0; m < micro; ++m) {
    const size_t count = n / micro + (m < n % micro ? 1 : 0);
    shard.counts.push_back(static_cast<int>(count));
    s.micro_tokens[m].resize(count * T);
    s.micro_targets[m].resize(count * T);
    for (size_t b = 0; b < count; ++b) {
      const data::Sample sample = s.dataset.Get(ids[begin + b]);
      std::memcpy(s.micro_tokens[m].data() + b * T, sample.inputs.data(), T);
      std::memcpy(s.micro_targets[m].data() + b * T, sample.targets.data(), T);
    }
    begin += count;
  }
  return shard;
}

// Forward and backward of this rank's shard of the step's batch, in
// micro-batches; on_ready follows the last micro-batch's backward.
Result<Share> ComputeShare(Setup& s, uint64_t step, uint32_t dp_rank, uint32_t dp_size,
                           const std::function<void(size_t)>& on_ready) {
  auto shard = LoadShard(s, step, dp_rank, dp_size);
  if (!shard.ok()) return shard.status();
  Share& share = shard->share;
  if (shard->counts.empty()) {  // more ranks than samples in this batch: contribute zeros
    s.model->ZeroGrads();
    if (on_ready) on_ready(0);
    return std::move(share);
  }
  const size_t micro = shard->counts.size();
  for (size_t m = 0; m < micro; ++m) {
    const int count = shard->counts[m];
    trace::Span forward("forward", "compute", step);
    forward.Add("micro", static_cast<int64_t>(m));
    forward.Add("samples", count);
    auto loss = s.model->Forward(s.micro_tokens[m].data(), s.micro_targets[m].data(), count);
    forward.End();
    if (!loss.ok()) return loss.status();
    const double weight = static_cast<double>(count) / static_cast<double>(shard->batch);
    share.loss_share += *loss * weight;
    const bool last = m + 1 == micro;
    trace::Span backward("backward", "compute", step);
    backward.Add("micro", static_cast<int64_t>(m));
    TANDEM_RETURN_IF_ERROR(s.model->Backward(m == 0 ? model::GradMode::kOverwrite : model::GradMode::kAccumulate,
                                             static_cast<float>(weight), last ? on_ready : nullptr));
  }
  share.samples = share.indices.size();
  share.tokens = share.samples * s.dataset.context();
  return std::move(share);
}

// The same through a pipeline: this stage's forward and backward of the
// shard's micro-batches on `schedule`, over plan.pipeline. The last stage
// has the loss; the samples and tokens are counted there too.
Result<Share> ComputePipelineShare(Setup& s, const StepPlan& plan, PipelineSchedule schedule,
                                   const std::function<void(size_t)>& on_ready, PipelineTiming* timing) {
  auto shard = LoadShard(s, plan.step, plan.dp_rank, plan.dp_size);
  if (!shard.ok()) return shard.status();
  Share& share = shard->share;
  if (shard->counts.empty()) {  // every stage of this pp group has the same empty shard
    s.model->ZeroGrads();
    if (on_ready) on_ready(0);
    return std::move(share);
  }
  const int stages = static_cast<int>(plan.stages), stage = static_cast<int>(plan.stage);
  const bool last = s.model->last_stage();
  const size_t T = s.dataset.context();
  const std::vector<int>& counts = shard->counts;
  const int micro = static_cast<int>(counts.size());
  const int slots = SlotsNeeded(schedule, stages, stage, micro);
  if (s.model->slots() != slots) s.model->SetSlots(slots);
  const auto weight = [&](int m) {
    return static_cast<double>(counts[static_cast<size_t>(m)]) / static_cast<double>(shard->batch);
  };
  StageCompute compute;
  compute.forward = [&](int m, const float* input) -> Result<std::span<const float>> {
    trace::Span span("forward", "compute", plan.step);
    span.Add("micro", m);
    span.Add("stage", stage);
    const auto i = static_cast<size_t>(m);
    auto loss = s.model->Forward(s.micro_tokens[i].data(), s.micro_targets[i].data(), counts[i], m % slots, input);
    if (!loss.ok()) return loss.status();
    if (last) {
      share.loss_share += *loss * weight(m);
      return std::span<const float>();
    }
    return s.model->output(m % slots);
  };
  compute.backward = [&](int m, const float* output_grad) -> Result<std::span<const float>> {
    trace::Span span("backward", "compute", plan.step);
    span.Add("micro", m);
    span.Add("stage", stage);
    TANDEM_RETURN_IF_ERROR(s.model->Backward(m == 0 ? model::GradMode::kOverwrite : model::GradMode::kAccumulate,
                                             static_cast<float>(weight(m)), m + 1 == micro ? on_ready : nullptr,
                                             m % slots, output_grad));
    if (s.model->first_stage()) return std::span<const float>();
    return s.model->input_grad(m % slots);
  };
  const size_t elements = static_cast<size_t>(*std::max_element(counts.begin(), counts.end())) * T *
                          static_cast<size_t>(s.model->config().d_model);
  auto ran = RunPipeline(*plan.pipeline, BuildSchedule(schedule, stages, stage, micro), elements, compute);
  if (!ran.ok()) return ran.status();
  *timing = *ran;
  if (last) {
    share.samples = share.indices.size();
    share.tokens = share.samples * T;
  }
  return std::move(share);
}

// The model as the runtime binds it to parts (pipeline stages of
// tensor-parallel ranks): `s.model` becomes the part asked for (the whole
// model for one stage of one rank).
// Sharded placement: the model is made without its initial values (the
// servers get them from model::InitialValues) and reads its parameters
// through the runtime's Acquire and Release.
ModelBinding BindingOf(Setup& s, const model::ModelConfig& whole, Runtime* runtime, bool sharded) {
  ModelBinding b;
  const auto split = [whole](int stages, int tp) {
    model::ModelConfig c = whole;
    c.pipeline_stages = stages;
    c.tensor_parallel = tp;
    return c;
  };
  b.tensors = [split](int stages, int tp) {
    const std::vector<model::TensorInfo> layout = model::ServerLayout(split(stages, tp));
    return model::TensorSpecs(layout, 0, layout.back().offset + layout.back().size);
  };
  b.bounds = [split](int stages, int tp) -> Result<std::vector<size_t>> {
    const model::ModelConfig c = split(stages, tp);
    TANDEM_RETURN_IF_ERROR(
        c.Validate().WithContext(fmt::format("splitting the model into pp={} stages of tp={} ranks", stages, tp)));
    return model::PartBounds(c);
  };
  // One stream for the split bound last: the servers' partitions come
  // mostly in order.
  auto stream = std::make_shared<std::unique_ptr<model::InitialValueStream>>();
  b.bind = [&s, split, runtime, sharded, stream](int stage, int stages, int tp_rank, int tp) -> Result<StageBuffers> {
    const model::ModelConfig* had = s.model ? &s.model->config() : nullptr;
    if (had == nullptr || had->pipeline_stages != stages || had->pipeline_stage != stage ||
        had->tensor_parallel != tp || had->tensor_rank != tp_rank) {
      model::ModelConfig c = split(stages, tp);
      c.pipeline_stage = stage;
      c.tensor_rank = tp_rank;
      if (!*stream || had == nullptr || had->pipeline_stages != stages || had->tensor_parallel != tp) {
        *stream = std::make_unique<model::InitialValueStream>(c);
      }
      s.model.reset();  // the old part goes before the new one is made
      auto m = model::Model::Create(c, /*initialize=*/!sharded);
      if (!m.ok()) return m.status();
      s.model = std::make_unique<model::Model>(std::move(*m));
      if (c.gpu >= 0) spdlog::info("the model's forward and backward run on {}", s.model->gpu_description());
      // Replicated too: the forward after a step waits in Acquire for the
      // parameters still landing from the servers.
      model::ParameterAccess access;
      access.acquire = [runtime](model::FlatRange now, model::FlatRange next) { return runtime->Acquire(now, next); };
      access.release = [runtime](model::FlatRange now) { runtime->Release(now); };
      access.paged = sharded;
      s.model->SetParameterAccess(std::move(access));
      if (stages > 1 || tp > 1) {
        spdlog::info("pipeline stage {} of {}, tensor-parallel rank {} of {}: blocks {}..{}{}{}, {} parameters", stage,
                     stages, tp_rank, tp, s.model->stage().first_block, s.model->stage().end_block - 1,
                     s.model->first_stage() ? ", embeddings" : "", s.model->last_stage() ? ", head" : "",
                     s.model->num_parameters());
      }
    }
    return StageBuffers{s.model->params(),     s.model->grads(),         s.model->Tensors(),
                        s.model->flat_begin(), &s.model->param_buffer(), &s.model->grad_buffer()};
  };
  b.initial = [stream](uint64_t begin, uint64_t end, float* out) { (*stream)->Fill(begin, end, out); };
  return b;
}

// Writes train.params_out through a temporary file: `pieces` calls `write`
// for each run of parameters, in order.
using ParamWriter = std::function<Status(std::span<const float>)>;
Status WriteParamsFrom(const std::string& path, const std::function<Status(const ParamWriter&)>& pieces) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return Unavailable("train.params_out: cannot write '{}': {}", tmp, std::strerror(errno));
    TANDEM_RETURN_IF_ERROR(pieces([&](std::span<const float> params) -> Status {
      out.write(reinterpret_cast<const char*>(params.data()), static_cast<std::streamsize>(params.size_bytes()));
      if (!out) return Unavailable("train.params_out: writing '{}' failed: {}", tmp, std::strerror(errno));
      return Status::Ok();
    }));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return Unavailable("train.params_out: cannot rename '{}' to '{}': {}", tmp, path, ec.message());
  return Status::Ok();
}

Status WriteParams(const std::string& path, std::span<const float> params) {
  return WriteParamsFrom(path, [&](const ParamWriter& write) { return write(params); });
}

// The stage's parameters a segment at a time, in order (sharded: each
// gathered from the node for the call and handed back after, so every
// worker of the node calls this).
Status ForEachParamPiece(Setup& s, Runtime& runtime, const ParamWriter& fn) {
  for (const model::FlatRange& segment : s.model->Segments()) {
    TANDEM_RETURN_IF_ERROR(runtime.Acquire(segment, {0, 0}));
    Status status = fn(s.model->params().subspan(segment.first, segment.second - segment.first));
    runtime.Release(segment);
    TANDEM_RETURN_IF_ERROR(status);
  }
  return Status::Ok();
}

// Sends a run of parameters to a peer in pieces of kPiece floats (the last
// one shorter); ReceivePieces takes them the same way.
constexpr size_t kPiece = size_t{1} << 20;  // floats: 4 MiB

class PieceSender {
 public:
  PieceSender(comm::Communicator& comm, int to, std::string what) : comm_(comm), to_(to), what_(std::move(what)) {
    piece_.reserve(kPiece);
  }
  Status Write(std::span<const float> part) {
    while (!part.empty()) {
      const size_t take = std::min(part.size(), kPiece - piece_.size());
      piece_.insert(piece_.end(), part.begin(), part.begin() + static_cast<std::ptrdiff_t>(take));
      part = part.subspan(take);
      if (piece_.size() == kPiece) TANDEM_RETURN_IF_ERROR(Flush());
    }
    return Status::Ok();
  }
  Status Flush() {
    if (piece_.empty()) return Status::Ok();
    Status sent = comm_.Send(to_, piece_.data(), piece_.size(), comm::DType::kFloat32).WithContext(what_);
    piece_.clear();
    return sent;
  }

 private:
  comm::Communicator& comm_;
  int to_;
  std::string what_;
  std::vector<float> piece_;
};

Status ReceivePieces(comm::Communicator& comm, int from, size_t n, const ParamWriter& write, const std::string& what) {
  std::vector<float> piece;
  for (size_t at = 0; at < n; at += kPiece) {
    piece.resize(std::min(kPiece, n - at));
    TANDEM_RETURN_IF_ERROR(comm.Recv(from, piece.data(), piece.size(), comm::DType::kFloat32).WithContext(what));
    TANDEM_RETURN_IF_ERROR(write(piece));
  }
  return Status::Ok();
}

// The whole model into train.params_out, in the whole model's layout
// whatever the split, written by global rank 0 (stage 0, tensor rank 0, dp
// rank 0). The dp-rank-0 workers take part: with tensor parallelism each
// stage's tensor rank 0 receives its group's parts and turns them into the
// whole model's tensors of the stage (model::WriteWholeStage); with
// pipeline stages each stage's tensor rank 0 sends its stage to rank 0 in
// pieces of 4 MiB. Rank 0 never holds more than one stage's worth and a
// piece. Every worker calls this.
Status WriteFinalParams(Setup& s, Runtime& runtime, const StepPlan& plan, const model::ModelConfig& whole,
                        const std::string& path) {
  const ParamWriter ignore = [](std::span<const float>) { return Status::Ok(); };
  if (plan.stages <= 1 && plan.tensor_size <= 1) {
    if (plan.rank != 0) return ForEachParamPiece(s, runtime, ignore);
    return WriteParamsFrom(path, [&](const ParamWriter& write) { return ForEachParamPiece(s, runtime, write); });
  }
  if (plan.dp_rank != 0) return ForEachParamPiece(s, runtime, ignore);
  // This stage's values in the whole model's layout.
  std::function<Status(const ParamWriter&)> stage_values = [&](const ParamWriter& out) {
    return ForEachParamPiece(s, runtime, out);
  };
  if (plan.tensor_size > 1) {
    if (plan.tensor_rank != 0) {
      PieceSender to_rank0(*plan.tensor, 0, "sending this rank's final parameters to tensor-parallel rank 0");
      TANDEM_RETURN_IF_ERROR(
          ForEachParamPiece(s, runtime, [&](std::span<const float> p) { return to_rank0.Write(p); }));
      return to_rank0.Flush();
    }
    stage_values = [&](const ParamWriter& out) -> Status {
      model::ModelConfig c = s.model->config();
      const int tp = static_cast<int>(plan.tensor_size);
      const std::vector<size_t> bounds = model::PartBounds(c);
      std::vector<std::vector<float>> parts(static_cast<size_t>(tp));
      TANDEM_RETURN_IF_ERROR(ForEachParamPiece(s, runtime, [&](std::span<const float> p) {
        parts[0].insert(parts[0].end(), p.begin(), p.end());
        return Status::Ok();
      }));
      for (int r = 1; r < tp; ++r) {
        const auto part = static_cast<size_t>(static_cast<int>(plan.stage) * tp + r);
        auto& into = parts[static_cast<size_t>(r)];
        into.reserve(bounds[part + 1] - bounds[part]);
        TANDEM_RETURN_IF_ERROR(ReceivePieces(
            *plan.tensor, r, bounds[part + 1] - bounds[part],
            [&](std::span<const float> p) {
              into.insert(into.end(), p.begin(), p.end());
              return Status::Ok();
            },
            fmt::format("receiving tensor-parallel rank {}'s final parameters", r)));
      }
      const std::vector<std::span<const float>> spans(parts.begin(), parts.end());
      return model::WriteWholeStage(c, static_cast<int>(plan.stage), spans, out);
    };
  }
  if (plan.stages <= 1) return WriteParamsFrom(path, stage_values);
  comm::Communicator& pp = *plan.pipeline;
  if (plan.stage != 0) {
    PieceSender to_stage0(pp, 0, "sending this stage's final parameters to stage 0");
    TANDEM_RETURN_IF_ERROR(stage_values([&](std::span<const float> p) { return to_stage0.Write(p); }));
    return to_stage0.Flush();
  }
  model::ModelConfig c = whole;
  c.pipeline_stages = static_cast<int>(plan.stages);
  const auto stages = model::PlanStages(c);  // the whole model's stage ranges
  return WriteParamsFrom(path, [&](const ParamWriter& write) -> Status {
    TANDEM_RETURN_IF_ERROR(stage_values(write));
    for (size_t i = 1; i < stages.size(); ++i) {
      TANDEM_RETURN_IF_ERROR(ReceivePieces(pp, static_cast<int>(i), stages[i].flat_end - stages[i].flat_begin, write,
                                           fmt::format("receiving stage {}'s final parameters", i)));
    }
    return Status::Ok();
  });
}

}  // namespace

void DeclareTrainOptions(OptionSet& o, TrainConfig* c, bool job_keys) {
  if (job_keys) {
    o.Int("train.steps", &c->steps, "training steps of the reference model (0: do not train, only serve)", 0,
          int64_t{1} << 40);
    o.Choice("train.mode", &c->mode, TrainingModeNames(),
             "hybrid (node reduce-scatter, servers, node all-gather), allreduce (no servers: DDP-like), ps (every "
             "worker pushes to the servers)");
    o.String("train.data", &c->data, "text file to train on (empty: the built-in corpus)");
    o.Int("train.seed", &c->seed, "seed of the model's initialisation and of the data order", 0, INT64_MAX);
  }
  o.Int("train.global_batch", &c->global_batch, "sequences per step over all data-parallel ranks", 1, 1 << 20);
  o.Int("train.accumulation", &c->accumulation, "micro-batches per rank and step, summed without communication", 1,
        1 << 16);
  o.Choice("train.pipeline_schedule", &c->pipeline_schedule, {"gpipe", "1f1b"},
           "with pp > 1: all forwards then all backwards (gpipe), or one forward one backward (1f1b: a stage keeps "
           "at most pp - stage micro-batches' activations)");
  o.Choice("train.placement", &c->placement, {"replicated", "sharded"},
           "replicated: every worker keeps all parameters; sharded (ZeRO-3, hybrid mode): each worker of a node keeps "
           "only its parameter-server partitions and gathers a segment's parameters from the node when it needs them");
  o.Choice("train.consistency", &c->consistency, {"sync", "async", "bounded"},
           "server modes (tp = pp = 1 for async and bounded): sync applies each step once every worker pushed it; "
           "async applies each push on arrival and workers never wait for each other; bounded is async with no "
           "worker more than train.staleness_bound steps ahead of the slowest");
  o.Int("train.staleness_bound", &c->staleness_bound,
        "train.consistency bounded: a worker computing step s sees every worker's updates up to step s - k - 1", 1,
        1000000);
  o.Int("train.context", &c->context, "tokens (bytes) per sequence", 1, 1 << 16);
  o.Int("train.d_model", &c->d_model, "width of the model", 1, 1 << 16);
  o.Int("train.heads", &c->heads, "attention heads (divides d_model)", 1, 1 << 10);
  o.Int("train.layers", &c->layers, "transformer blocks", 1, 1 << 10);
  o.Bool("train.activation_checkpointing", &c->activation_checkpointing,
         "keep only each block's input and recompute the rest during backward");
  o.Int("train.blas_threads", &c->blas_threads, "BLAS threads of this worker", 1, 1024);
  o.Int("train.gpu", &c->gpu,
        "CUDA device on which this worker runs the model's forward and backward (-1: the CPU; workers may share a "
        "device)",
        -1, 1024);
  o.Choice("train.optimizer", &c->optimizer, {"adamw", "adam", "sgd"}, "update rule");
  o.Double("train.lr", &c->lr, "peak learning rate", 0, 1e6);
  o.Double("train.weight_decay", &c->weight_decay,
           "weight decay (not applied to biases, LayerNorm parameters and embeddings)", 0, 1e6);
  o.Double("train.max_grad_norm", &c->max_grad_norm, "global gradient-norm clipping threshold (0: off)", 0, 1e30);
  o.Choice("train.schedule", &c->schedule, {"constant", "cosine", "linear"},
           "learning-rate decay after the warmup, over train.steps");
  o.Int("train.warmup_steps", &c->warmup_steps, "linear learning-rate warmup steps", 0, int64_t{1} << 40);
  o.Int("train.lr_base_batch", &c->lr_base_batch,
        "linear scaling: train.lr was tuned for this global batch, so the rate is lr * global_batch / "
        "lr_base_batch (0: off)",
        0, 1 << 30);
  o.Bytes("train.bucket_bytes", &c->bucket_bytes, "gradients travel in buckets of about this size", 4, 1ULL << 34);
  o.Choice("train.gradient_wire", &c->gradient_wire, {"fp32", "bf16"}, "element type of gradients on the wire");
  o.Choice("train.parameter_wire", &c->parameter_wire, {"fp32", "bf16"},
           "element type of parameters pulled from the servers");
  o.Duration("train.step_timeout", &c->step_timeout, "longest wait for one step's communication",
             std::chrono::milliseconds(100), std::chrono::hours(24));
  o.Duration("train.epoch_wait", &c->epoch_wait, "after a failed step, how long to wait for a new epoch",
             std::chrono::milliseconds(100), std::chrono::hours(24));
  o.String("train.progress_file", &c->progress_file,
           "append one JSON line per completed step here, and a last one with \"finished\" once training and its "
           "last checkpoint are done (written by global rank 0)");
  o.String("train.params_out", &c->params_out,
           "write the final parameters here, raw little-endian fp32 (written by global rank 0)");
  o.String("train.checkpoint_dir", &c->checkpoint_dir,
           "server modes: where the parameter servers save checkpoints during training (absolute, on the servers' "
           "filesystem; each in step-<step>)");
  o.Int("train.checkpoint_every", &c->checkpoint_every,
        "server modes: save a checkpoint every this many steps and after the last one (0: never)", 0, int64_t{1} << 40);
  o.String("train.resume_from", &c->resume_from,
           "server modes: start from this checkpoint directory (absolute, on the servers' filesystem): parameters, "
           "optimizer state and step; training goes on to train.steps");
  o.String("train.sample_log", &c->sample_log,
           "append one JSON line per step attempt with the samples this worker trained on (for checking the "
           "sampler across membership changes)");
}

std::vector<std::string> TrainFlags(const TrainConfig& c) {
  // From the declaration itself: every train.* option, the job keys too.
  TrainConfig values = c;
  OptionSet options("tandem-worker", "");
  DeclareTrainOptions(options, &values, /*job_keys=*/true);
  return options.Flags("train.");
}

Result<model::ModelConfig> ModelConfigOf(const TrainConfig& c) {
  model::ModelConfig m;
  m.context = static_cast<int>(c.context);
  m.d_model = static_cast<int>(c.d_model);
  m.heads = static_cast<int>(c.heads);
  m.layers = static_cast<int>(c.layers);
  m.seed = static_cast<uint64_t>(c.seed);
  m.blas_threads = static_cast<int>(c.blas_threads);
  m.activation_checkpointing = c.activation_checkpointing;
  m.gpu = static_cast<int>(c.gpu);
  TANDEM_RETURN_IF_ERROR(m.Validate().WithContext("train"));
  return m;
}

Result<v1::OptimizerConfig> OptimizerConfigOf(const TrainConfig& c) {
  double lr = c.lr;
  if (c.lr_base_batch > 0) {
    auto scaled =
        data::ScaledLearningRate(c.lr, static_cast<uint64_t>(c.global_batch), static_cast<uint64_t>(c.lr_base_batch));
    if (!scaled.ok()) return scaled.status();
    lr = *scaled;
  }
  if (!(lr > 0)) return InvalidArgument("train.lr: must be > 0");
  v1::OptimizerConfig o;
  if (c.optimizer == "sgd") {
    o.mutable_sgd()->set_lr(lr);
    o.mutable_sgd()->set_momentum(0.9);
    o.mutable_sgd()->set_weight_decay(c.weight_decay);
  } else {
    o.mutable_adam()->set_lr(lr);
    o.mutable_adam()->set_weight_decay(c.weight_decay);
    o.mutable_adam()->set_decoupled_weight_decay(c.optimizer == "adamw");
  }
  auto* schedule = o.mutable_lr_schedule();
  schedule->set_kind(c.schedule == "cosine"   ? v1::LR_SCHEDULE_KIND_COSINE
                     : c.schedule == "linear" ? v1::LR_SCHEDULE_KIND_LINEAR
                                              : v1::LR_SCHEDULE_KIND_CONSTANT);
  schedule->set_warmup_steps(static_cast<uint64_t>(c.warmup_steps));
  if (c.schedule != "constant") schedule->set_total_steps(static_cast<uint64_t>(std::max<int64_t>(c.steps, 1)));
  o.set_max_grad_norm(c.max_grad_norm);
  (*o.mutable_group_overrides())["no_decay"].set_weight_decay(0);
  o.set_reduction(v1::GRADIENT_REDUCTION_SUM);
  return o;
}

Result<RuntimeOptions> RuntimeOptionsOf(const TrainConfig& c) {
  RuntimeOptions r;
  auto mode = ParseTrainingMode(c.mode);
  if (!mode.ok()) return mode.status();
  r.mode = *mode;
  auto placement = ParsePlacement(c.placement);
  if (!placement.ok()) return placement.status().WithContext("train.placement");
  r.placement = *placement;
  if (r.placement == Placement::kSharded && r.mode != TrainingMode::kHybrid) {
    return InvalidArgument("train.placement sharded needs train.mode hybrid, not {}", c.mode);
  }
  // Checkpoints are the parameter servers' (docs/checkpoints.md).
  if (c.checkpoint_every > 0 || !c.checkpoint_dir.empty() || !c.resume_from.empty()) {
    const char* key = c.checkpoint_every > 0      ? "train.checkpoint_every"
                      : !c.checkpoint_dir.empty() ? "train.checkpoint_dir"
                                                  : "train.resume_from";
    if (r.mode == TrainingMode::kAllReduce) {
      return InvalidArgument(
          "{}: checkpoints are saved and restored by the parameter servers; train.mode allreduce has none (use "
          "hybrid or ps)",
          key);
    }
  }
  // Consistency (docs/training.md, "Asynchronous and bounded-staleness
  // training").
  if (c.consistency == "async") {
    r.consistency.set_mode(v1::CONSISTENCY_MODE_ASYNC);
  } else if (c.consistency == "bounded") {
    r.consistency.set_mode(v1::CONSISTENCY_MODE_BOUNDED_STALENESS);
    r.consistency.set_staleness_bound(static_cast<uint32_t>(c.staleness_bound));
  } else if (c.consistency != "sync") {
    return InvalidArgument("train.consistency: '{}' is not one of sync, async, bounded", c.consistency);
  }
  if (c.consistency != "sync") {
    if (r.mode == TrainingMode::kAllReduce) {
      return InvalidArgument(
          "train.consistency {}: asynchronous updates are the parameter servers'; train.mode allreduce is "
          "synchronous (use hybrid or ps)",
          c.consistency);
    }
    if (c.max_grad_norm > 0) {
      return InvalidArgument(
          "train.max_grad_norm {}: global gradient-norm clipping needs whole steps, which train.consistency {} "
          "does not have (set it to 0, or use sync)",
          c.max_grad_norm, c.consistency);
    }
    if (c.schedule != "constant") {
      // The servers' schedule counts their updates, one per contributor's
      // push here, not training steps: a decay over train.steps updates
      // would end long before the run does.
      return InvalidArgument(
          "train.schedule {}: the servers' learning-rate schedule counts updates, which train.consistency {} makes "
          "one per worker's push, so a decay would not end at train.steps (use constant)",
          c.schedule, c.consistency);
    }
    if (c.checkpoint_every > 0 || !c.checkpoint_dir.empty() || !c.resume_from.empty()) {
      return InvalidArgument(
          "{}: a checkpoint is a cut at a step boundary, which train.consistency {} does not have (use sync)",
          c.checkpoint_every > 0      ? "train.checkpoint_every"
          : !c.checkpoint_dir.empty() ? "train.checkpoint_dir"
                                      : "train.resume_from",
          c.consistency);
    }
  }
  if (c.checkpoint_every > 0 && c.checkpoint_dir.empty()) {
    return InvalidArgument("train.checkpoint_every: {} needs train.checkpoint_dir", c.checkpoint_every);
  }
  for (const auto& [key, path] : {std::pair<const char*, const std::string&>{"train.checkpoint_dir", c.checkpoint_dir},
                                  {"train.resume_from", c.resume_from}}) {
    if (!path.empty() && path.front() != '/') {
      return InvalidArgument("{}: '{}' must be an absolute path (the servers open it on their filesystem)", key, path);
    }
  }
  r.resume_from = c.resume_from;
  r.checkpoint_dir = c.checkpoint_dir;
  auto gw = ParseWire(c.gradient_wire, "train.gradient_wire");
  if (!gw.ok()) return gw.status();
  auto pw = ParseWire(c.parameter_wire, "train.parameter_wire");
  if (!pw.ok()) return pw.status();
  r.gradient_wire = *gw;
  r.parameter_wire = *pw;
  r.bucket_bytes = c.bucket_bytes;
  r.timeout = c.step_timeout;
  r.epoch_wait = c.epoch_wait;
  auto optimizer = OptimizerConfigOf(c);
  if (!optimizer.ok()) return optimizer.status();
  r.optimizer = *optimizer;
  return r;
}

double WallSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

TrainMetrics::TrainMetrics(prometheus::Registry& r)
    : step(prometheus::BuildGauge()
               .Name("tandem_train_step")
               .Help("The last training step this worker completed.")
               .Register(r)
               .Add({})),
      loss(prometheus::BuildGauge()
               .Name("tandem_train_loss")
               .Help("The global training loss of the last completed step (mean over the global batch).")
               .Register(r)
               .Add({})),
      tokens_per_second(prometheus::BuildGauge()
                            .Name("tandem_train_tokens_per_second")
                            .Help("Tokens of the global batch per second of the last step's wall time.")
                            .Register(r)
                            .Add({})),
      samples_per_second(prometheus::BuildGauge()
                             .Name("tandem_train_samples_per_second")
                             .Help("Sequences of the global batch per second of the last step's wall time.")
                             .Register(r)
                             .Add({})),
      world_size(prometheus::BuildGauge()
                     .Name("tandem_train_world_size")
                     .Help("Workers in the epoch of the last completed step.")
                     .Register(r)
                     .Add({})),
      exposed_ratio(prometheus::BuildGauge()
                        .Name("tandem_train_exposed_comm_ratio")
                        .Help("Fraction of the last step's time spent waiting for communication after backward and "
                              "for parameters still arriving during forward.")
                        .Register(r)
                        .Add({})),
      step_seconds(prometheus::BuildHistogram()
                       .Name("tandem_train_step_seconds")
                       .Help("Wall time of completed training steps.")
                       .Register(r)
                       .Add({}, prometheus::Histogram::BucketBoundaries{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                                                                        2.5, 5, 10})),
      steps(prometheus::BuildCounter()
                .Name("tandem_train_steps_total")
                .Help("Training steps this worker completed.")
                .Register(r)
                .Add({})),
      failures(prometheus::BuildCounter()
                   .Name("tandem_train_step_failures_total")
                   .Help("Step attempts that failed (membership changes, lost peers) and were retried.")
                   .Register(r)
                   .Add({})),
      rollbacks(prometheus::BuildCounter()
                    .Name("tandem_train_rollbacks_total")
                    .Help("Rollbacks of the job to a checkpoint after partitions lost both their primary and their "
                          "backup server.")
                    .Register(r)
                    .Add({})),
      steps_redone(prometheus::BuildCounter()
                       .Name("tandem_train_steps_redone_total")
                       .Help("Steps trained again after rollbacks to a checkpoint.")
                       .Register(r)
                       .Add({})),
      tokens(prometheus::BuildCounter()
                 .Name("tandem_train_tokens_total")
                 .Help("Tokens of the global batches of the steps this worker completed.")
                 .Register(r)
                 .Add({})),
      samples(prometheus::BuildCounter()
                  .Name("tandem_train_samples_total")
                  .Help("Sequences of the global batches of the steps this worker completed.")
                  .Register(r)
                  .Add({})),
      comm_seconds(prometheus::BuildCounter()
                       .Name("tandem_train_comm_seconds_total")
                       .Help("Time the communication thread worked on completed steps.")
                       .Register(r)
                       .Add({})),
      exposed_seconds(prometheus::BuildCounter()
                          .Name("tandem_train_exposed_comm_seconds_total")
                          .Help("Time completed steps waited for communication after backward and for parameters "
                                "still arriving during forward.")
                          .Register(r)
                          .Add({})) {}

void TrainMetrics::Record(const StepRecord& record) {
  step.Set(static_cast<double>(record.step));
  loss.Set(record.loss);
  world_size.Set(record.world_size);
  if (record.step_seconds > 0) {
    tokens_per_second.Set(static_cast<double>(record.tokens) / record.step_seconds);
    samples_per_second.Set(static_cast<double>(record.samples) / record.step_seconds);
    exposed_ratio.Set(record.exposed_seconds / record.step_seconds);
  }
  step_seconds.Observe(record.step_seconds);
  steps.Increment();
  tokens.Increment(static_cast<double>(record.tokens));
  samples.Increment(static_cast<double>(record.samples));
  comm_seconds.Increment(record.comm_seconds);
  exposed_seconds.Increment(record.exposed_seconds);
}

void TrainMetrics::Record(const Runtime::Rollback& rollback) {
  rollbacks.Increment();
  steps_redone.Increment(static_cast<double>(rollback.from - rollback.to));
}

std::string ToJson(const Runtime::Rollback& r) {
  return fmt::format("{{\"rollback\":true,\"from\":{},\"to\":{},\"checkpoint\":{},\"time\":{:.6f}}}", r.from, r.to,
                     JsonQuote(r.checkpoint), WallSeconds());
}

std::string ToJson(const StepRecord& r) {
  return fmt::format(
      "{{\"step\":{},\"epoch\":{},\"loss\":{},\"tokens\":{},\"tokens_per_second\":{:.1f},\"step_seconds\":{:.6f},"
      "\"compute_seconds\":{:.6f},\"comm_seconds\":{:.6f},\"exposed_seconds\":{:.6f},\"world_size\":{},\"rank\":{},"
      "\"retries\":{},\"resynced\":{},\"parameter_bytes\":{}{},\"time\":{:.3f}}}",
      r.step, r.epoch, std::isfinite(r.loss) ? fmt::format("{:.6f}", r.loss) : "null", r.tokens,
      r.step_seconds > 0 ? static_cast<double>(r.tokens) / r.step_seconds : 0.0, r.step_seconds, r.compute_seconds,
      r.comm_seconds, r.exposed_seconds, r.world_size, r.rank, r.retries, r.resynced ? "true" : "false",
      r.parameter_bytes,
      r.pipeline_idle.empty() ? "" : fmt::format(",\"pipeline_idle\":[{:.4f}]", fmt::join(r.pipeline_idle, ",")),
      WallSeconds());
}

// A completed step's record.
StepRecord RecordOf(const StepResult& result, const StepPlan& plan, double step_seconds, double compute_seconds,
                    uint64_t retries, std::vector<double> pipeline_idle) {
  StepRecord record;
  record.step = result.step;
  record.epoch = result.epoch;
  record.loss = result.loss;
  record.tokens = result.tokens;
  record.samples = result.samples;
  record.step_seconds = step_seconds;
  record.compute_seconds = compute_seconds;
  record.comm_seconds = result.comm_seconds;
  record.exposed_seconds = result.exposed_seconds;
  record.world_size = plan.world_size;
  record.rank = plan.rank;
  record.retries = retries;
  record.resynced = plan.resynced;
  record.pipeline_idle = std::move(pipeline_idle);
  record.parameter_bytes = result.parameter_bytes;
  return record;
}

// The trainer's progress file and sample log (either may be unused), closed
// with the trainer.
struct TrainFiles {
  TrainFiles() = default;
  TrainFiles(const TrainFiles&) = delete;
  TrainFiles& operator=(const TrainFiles&) = delete;
  ~TrainFiles() { Close(); }

  Status Open(const TrainConfig& config) {
    if (!config.progress_file.empty()) {
      progress = std::fopen(config.progress_file.c_str(), "a");
      if (progress == nullptr) {
        return Unavailable("train.progress_file: cannot open '{}': {}", config.progress_file, std::strerror(errno));
      }
    }
    if (!config.sample_log.empty()) {
      sample_log = std::fopen(config.sample_log.c_str(), "a");
      if (sample_log == nullptr) {
        return Unavailable("train.sample_log: cannot open '{}': {}", config.sample_log, std::strerror(errno));
      }
    }
    return Status::Ok();
  }
  void Close() {
    if (progress != nullptr) std::fclose(progress);
    if (sample_log != nullptr) std::fclose(sample_log);
    progress = nullptr;
    sample_log = nullptr;
  }

  std::FILE* progress = nullptr;
  std::FILE* sample_log = nullptr;
};

// The run's checkpoints (global rank 0, server modes), taken through the
// runtime: periodic ones in the background, the last one waited for.
class RunCheckpoints {
 public:
  RunCheckpoints(Runtime& runtime, const TrainConfig& config, std::function<bool()> stopping)
      : runtime_(runtime), config_(config), stopping_(std::move(stopping)) {}

  // Takes the checkpoint of `step`; `last` waits until it is written.
  void Save(uint64_t step, bool last);
  // The last step saved, and the final checkpoint's directory once written.
  uint64_t saved_step() const { return saved_step_; }
  const std::string& last() const { return last_; }

 private:
  Runtime& runtime_;
  const TrainConfig& config_;
  const std::function<bool()> stopping_;
  uint64_t saved_step_ = 0;
  std::string last_;
};

void RunCheckpoints::Save(uint64_t step, bool last) {
  // A server still writing the previous checkpoint refuses a new one
  // while the others write theirs: an incomplete checkpoint. A periodic
  // save skips its step then; the last one waits.
  const auto give_up = Clock::now() + std::max<Clock::duration>(config_.step_timeout, std::chrono::minutes(10));
  for (;;) {
    auto writing = runtime_.CheckpointWriting();
    if (!writing.ok()) {
      spdlog::warn("step {}: no checkpoint: {}", step, writing.status().ToString());
      return;
    }
    if (!*writing) break;
    if (!last || Clock::now() >= give_up || stopping_()) {
      spdlog::warn("step {}: no checkpoint: a server is still writing the previous one", step);
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  auto saved = runtime_.SaveCheckpoint(config_.checkpoint_dir, step);
  if (!saved.ok() || saved->empty()) {
    // A membership change under way: this checkpoint only is lost (the
    // servers that wrote theirs leave an incomplete directory, which
    // `tandem checkpoint verify` and a restore report as such).
    spdlog::warn("step {}: the checkpoint was not taken: {}", step,
                 saved.ok() ? "no parameter servers" : saved.status().ToString());
    return;
  }
  const std::string where = fmt::format("{}/{}", config_.checkpoint_dir, saved->front().checkpoint_id());
  if (!last) {
    spdlog::info("step {}: checkpoint {} is being written by {} server(s)", step, where, saved->size());
    saved_step_ = step;
    return;
  }
  const Status written = runtime_.WaitForCheckpoint(saved->front().checkpoint_id(), give_up);
  if (written.ok()) {
    spdlog::info("step {}: checkpoint {} written by {} server(s)", step, where, saved->size());
    saved_step_ = step;
    last_ = where;
  } else {
    spdlog::error("step {}: checkpoint {} was not written: {}", step, where, written.ToString());
  }
}

Status Train(const TrainConfig& config, DataPlane& plane, const TrainerHooks& hooks) {
  trace::SetThreadName("train");
  auto setup = Prepare(config, /*create_model=*/false);
  if (!setup.ok()) return setup.status();
  auto options = RuntimeOptionsOf(config);
  if (!options.ok()) return options.status();
  auto schedule = ParseSchedule(config.pipeline_schedule);
  if (!schedule.ok()) return schedule.status().WithContext("train.pipeline_schedule");
  auto whole = ModelConfigOf(config);
  if (!whole.ok()) return whole.status();
  // The reference model acquires each segment before it reads it.
  options->overlap_parameter_landing = true;
  Runtime runtime(*options, plane);
  TANDEM_RETURN_IF_ERROR(
      runtime.AttachModel(BindingOf(*setup, *whole, &runtime, options->placement == Placement::kSharded)));
  std::unique_ptr<TrainMetrics> metrics;
  if (hooks.registry != nullptr) metrics = std::make_unique<TrainMetrics>(*hooks.registry);
  TrainFiles files;
  TANDEM_RETURN_IF_ERROR(files.Open(config));
  std::FILE*& progress = files.progress;
  std::FILE*& sample_log = files.sample_log;
  const auto close_progress = [&] { files.Close(); };
  size_t parameters = 0;
  for (const auto& t : model::TensorLayout(*whole)) parameters += t.size;
  spdlog::info("training: {} steps of a {}-parameter model on {} ({} samples of {} bytes), global batch {}, {} mode{}",
               config.steps, parameters, setup->dataset.name(), setup->dataset.size(), config.context,
               config.global_batch, config.mode,
               config.consistency == "sync"      ? ""
               : config.consistency == "bounded" ? fmt::format(", bounded staleness {}", config.staleness_bound)
                                                 : ", asynchronous");
  const auto stopping = [&] { return hooks.stopping && hooks.stopping(); };
  // A completed step, to the caller and (global rank 0) to the progress file.
  const auto report = [&](const StepRecord& record) {
    if (hooks.on_step) hooks.on_step(record);
    if (progress != nullptr && record.rank == 0) {
      std::fprintf(progress, "%s\n", ToJson(record).c_str());
      std::fflush(progress);
    }
  };
  // Checkpoints (global rank 0, server modes): every `every` steps in the
  // background, and after the last step, which the run waits for.
  const uint64_t every = static_cast<uint64_t>(config.checkpoint_every);
  const uint64_t last_step = static_cast<uint64_t>(config.steps);
  RunCheckpoints checkpoints(runtime, config, stopping);
  uint64_t retries = 0;
  uint64_t completed_step = 0;  // by this worker's knowledge
  uint64_t attempted_step = 0;
  uint64_t attempted_epoch = 0;
  StepPlan last_plan;
  while (true) {
    if (stopping()) {
      close_progress();
      return Cancelled("stopped at step {}", runtime.completed_steps());
    }
    auto plan = runtime.BeginStep();
    if (!plan.ok()) {
      close_progress();
      return plan.status();
    }
    if (auto rollback = runtime.TakeRollback()) {
      // Every rank learns it; the epoch's rank 0 tells the progress file.
      if (metrics) metrics->Record(*rollback);
      if (progress != nullptr && plan->rank == 0) {
        std::fprintf(progress, "%s\n", ToJson(*rollback).c_str());
        std::fflush(progress);
      }
      completed_step = rollback->to;
      attempted_step = 0;
    }
    if (attempted_step > completed_step && plan->step > attempted_step) {
      // The step this worker attempted failed here but was applied by the
      // servers before the membership change: it is complete, its loss
      // unknown to this worker.
      StepRecord record;
      record.step = attempted_step;
      record.epoch = attempted_epoch;
      record.loss = std::nan("");
      record.world_size = plan->world_size;
      record.rank = plan->rank;
      record.retries = retries;
      record.resynced = true;
      retries = 0;
      report(record);
    }
    completed_step = plan->step - 1;
    last_plan = *plan;
    if (plan->step > static_cast<uint64_t>(config.steps)) {
      // The last step's parameters may still be landing: all of them must be
      // in place before they are written out, and a landing cut off by a
      // membership change is pulled again by a resync.
      Status landed = runtime.WaitForParameters();
      // Asynchronous modes: the other workers may still be training.
      if (landed.ok()) landed = runtime.FinishRun();
      if (landed.ok()) break;
      if (runtime.Fatal(landed)) {
        close_progress();
        return landed;
      }
      spdlog::warn("the final parameters after step {} are not all in; resynchronising: {}", completed_step,
                   landed.ToString());
      runtime.AbandonStep(landed);
      continue;
    }
    attempted_step = plan->step;
    attempted_epoch = plan->epoch;
    if (plan->tensor_size > 1) {
      // This epoch's tp group: the model's all-reduces go over it.
      std::shared_ptr<comm::Communicator> group = plan->tensor;
      setup->model->SetTensorParallel([group](float* data, size_t count, model::TpReduce op) {
        return group->AllReduce(data, data, count, comm::DType::kFloat32,
                                op == model::TpReduce::kMax ? comm::ReduceOp::kMax : comm::ReduceOp::kSum);
      });
    }
    // A slow worker, for tests: from step train.step_delay_from (default 1) on.
    if (auto delay = FailpointNumber("train.step_delay_ms");
        delay && plan->step >= FailpointNumber("train.step_delay_from").value_or(1)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(*delay));
    }
    const auto t0 = Clock::now();
    const double started = WallSeconds();
    const auto ready = [&runtime](size_t from) { runtime.GradientsReady(from); };
    PipelineTiming timing;
    auto share = plan->stages > 1 ? ComputePipelineShare(*setup, *plan, *schedule, ready, &timing)
                                  : ComputeShare(*setup, plan->step, plan->dp_rank, plan->dp_size, ready);
    std::vector<double> idle;
    if (share.ok() && plan->stages > 1) {
      // Every stage's idle fraction, for the progress record.
      std::vector<float> mine = {static_cast<float>(timing.idle_fraction())};
      std::vector<float> all(plan->stages);
      Status gathered = plan->pipeline->AllGather(mine.data(), all.data(), 1, comm::DType::kFloat32);
      if (!gathered.ok()) share = gathered.WithContext("gathering the stages' idle fractions");
      idle.assign(all.begin(), all.end());
    }
    if (!share.ok()) {
      if (!runtime.Fatal(share.status())) {
        // A peer failed during the computation (a pipeline stage, a worker
        // holding part of the sharded parameters): the step is retried in
        // the next epoch.
        ++retries;
        if (metrics) metrics->failures.Increment();
        spdlog::warn("step {} failed in epoch {} and will be retried after a resync: {}", plan->step, plan->epoch,
                     share.status().ToString());
        runtime.AbandonStep(share.status());
        continue;
      }
      close_progress();
      return share.status().WithContext(fmt::format("step {}", plan->step));
    }
    const auto t1 = Clock::now();
    if (plan->tensor_rank != 0) {
      // The whole tp group computed the same loss on the same samples: rank 0 counts them.
      share->loss_share = 0;
      share->samples = 0;
      share->tokens = 0;
    }
    if (sample_log != nullptr && setup->model->first_stage() && plan->tensor_rank == 0) {
      // Before the gradients leave: a step cannot complete without this line.
      std::fprintf(sample_log, "%s\n",
                   fmt::format("{{\"step\":{},\"epoch\":{},\"dp_rank\":{},\"dp_size\":{},\"data_epoch\":{},"
                               "\"offset\":{},\"start\":{:.6f},\"time\":{:.6f},\"samples\":[{}]}}",
                               plan->step, plan->epoch, plan->dp_rank, plan->dp_size, share->cursor.epoch,
                               share->cursor.offset, started, WallSeconds(), fmt::join(share->indices, ","))
                       .c_str());
      std::fflush(sample_log);
    }
    auto result = runtime.EndStep(share->loss_share, share->samples, share->tokens);
    if (!result.ok()) {
      ++retries;
      if (metrics) metrics->failures.Increment();
      spdlog::warn("step {} failed in epoch {} and will be retried after a resync: {}", plan->step, plan->epoch,
                   result.status().ToString());
      continue;
    }
    StepRecord record = RecordOf(*result, *plan, Seconds(Clock::now() - t0),
                                 Seconds(t1 - t0) - result->parameter_wait_seconds, retries, std::move(idle));
    retries = 0;
    completed_step = record.step;
    if (metrics) metrics->Record(record);
    report(record);
    if (every > 0 && plan->rank == 0 && record.step % every == 0 && record.step < last_step) {
      // Before the next step begins, so no server can be past this one.
      checkpoints.Save(record.step, /*last=*/false);
    }
  }
  close_progress();
  spdlog::info("training done: {} steps", runtime.completed_steps());
  if (!config.params_out.empty()) {
    TANDEM_RETURN_IF_ERROR(WriteFinalParams(*setup, runtime, last_plan, *whole, config.params_out));
  }
  // The last checkpoint, after the final parameters are out (the other
  // ranks take part in writing them), also when this worker lost the last
  // step's result while the servers applied it.
  if (every > 0 && last_plan.rank == 0 && checkpoints.saved_step() < runtime.completed_steps()) {
    checkpoints.Save(runtime.completed_steps(), /*last=*/true);
  }
  // The progress file's last line: training and its last checkpoint are
  // done, so whoever waits on the file (tandem run) may stop the cluster.
  if (!config.progress_file.empty() && last_plan.rank == 0) {
    if (std::FILE* f = std::fopen(config.progress_file.c_str(), "a")) {
      std::fprintf(
          f, "%s\n",
          fmt::format("{{\"finished\":true,\"steps\":{},\"checkpoint\":{},\"time\":{:.6f}}}", runtime.completed_steps(),
                      checkpoints.last().empty() ? "null" : JsonQuote(checkpoints.last()), WallSeconds())
              .c_str());
      std::fclose(f);
    } else {
      spdlog::warn("train.progress_file: cannot open '{}' for the final line: {}", config.progress_file,
                   std::strerror(errno));
    }
  }
  return Status::Ok();
}

Status TrainLocally(const TrainConfig& config, const std::function<void(const StepRecord&)>& on_step,
                    std::vector<float>* final_params) {
  auto setup = Prepare(config, /*create_model=*/true);
  if (!setup.ok()) return setup.status();
  auto optimizer_config = OptimizerConfigOf(config);
  if (!optimizer_config.ok()) return optimizer_config.status();
  auto optimizer = LocalOptimizer::Create(*optimizer_config, setup->model->num_parameters());
  if (!optimizer.ok()) return optimizer.status();
  const auto tensors = setup->model->Tensors();
  for (uint64_t step = 1; step <= static_cast<uint64_t>(config.steps); ++step) {
    const auto t0 = Clock::now();
    auto share = ComputeShare(*setup, step, 0, 1, nullptr);
    if (!share.ok()) return share.status().WithContext(fmt::format("step {}", step));
    const auto t1 = Clock::now();
    bool skipped = false;
    TANDEM_RETURN_IF_ERROR((*optimizer)->Step(setup->model->params(), setup->model->grads(), tensors, &skipped));
    StepRecord record;
    record.step = step;
    record.loss = share->loss_share;
    record.tokens = share->tokens;
    record.step_seconds = Seconds(Clock::now() - t0);
    record.compute_seconds = Seconds(t1 - t0);
    if (on_step) on_step(record);
  }
  if (final_params != nullptr) final_params->assign(setup->model->params().begin(), setup->model->params().end());
  if (!config.params_out.empty()) TANDEM_RETURN_IF_ERROR(WriteParams(config.params_out, setup->model->params()));
  return Status::Ok();
}

}  // namespace tandem::worker
