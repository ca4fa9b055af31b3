#include "worker/runtime/runtime.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <iterator>
#include <set>
#include <thread>

#include <spdlog/spdlog.h>

#include "common/optimizer/gradient.h"

namespace tandem::worker {

using Clock = std::chrono::steady_clock;

namespace {

// "pipeline stage 1 of 2, tensor-parallel rank 0 of 2" (the parts a mesh has).
std::string PartName(int stage, int stages, int tp_rank, int tp) {
  std::string name = stages > 1 || tp == 1 ? fmt::format("pipeline stage {} of {}", stage, stages) : "";
  if (tp > 1) name += fmt::format("{}tensor-parallel rank {} of {}", name.empty() ? "" : ", ", tp_rank, tp);
  return name;
}

double Seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

}  // namespace

std::string_view ModeName(TrainingMode mode) {
  switch (mode) {
    case TrainingMode::kHybrid:
      return "hybrid";
    case TrainingMode::kAllReduce:
      return "allreduce";
    case TrainingMode::kPs:
      return "ps";
  }
  return "hybrid";
}

Result<TrainingMode> ParseTrainingMode(std::string_view name) {
  if (name == "hybrid") return TrainingMode::kHybrid;
  if (name == "allreduce") return TrainingMode::kAllReduce;
  if (name == "ps") return TrainingMode::kPs;
  return InvalidArgument("training mode '{}' is not one of hybrid, allreduce, ps", name);
}

std::string_view PlacementName(Placement placement) {
  return placement == Placement::kSharded ? "sharded" : "replicated";
}

Result<Placement> ParsePlacement(std::string_view name) {
  if (name == "replicated") return Placement::kReplicated;
  if (name == "sharded") return Placement::kSharded;
  return InvalidArgument("placement '{}' is not one of replicated, sharded", name);
}

// One bucket: a range of the flat buffer whose gradients travel together.
struct Runtime::Bucket {
  size_t begin = 0;
  size_t end = 0;
  // Server modes: the partitions this worker pushes and pulls, each with
  // where its reduced gradient comes from and where its parameters go.
  struct Owned {
    uint32_t partition = 0;
    const float* grad = nullptr;
    float* param = nullptr;
    size_t count = 0;
    size_t wire_offset = 0;    // elements into wire_out / wire_in
    uint32_t contributor = 0;  // among the partition's contributors (its stages' together)
    uint32_t contributors = 0;
    // A partition only partly in this stage (not packed): the whole
    // partition's gradient (zeros outside the stage) and pulled parameters.
    size_t cut = 0;  // index into the bucket's partitions
    std::vector<float> edge_grad, edge_param;
  };
  std::vector<Owned> owned;
  // Hybrid with L > 1 local ranks: partition k of the bucket belongs to local
  // rank k % L, at slot[k] in that rank's block of `block` elements.
  std::vector<uint32_t> partitions;
  std::vector<std::pair<size_t, size_t>> ranges;  // whole partitions, in the whole model's elements
  // The part of each partition in this stage: [first, second) of params_,
  // and where it starts inside the partition.
  std::vector<std::pair<size_t, size_t>> cuts;
  std::vector<size_t> cut_offset;
  std::vector<size_t> slot;
  std::vector<uint32_t> owner;  // the local rank of each partition: its id % L
  size_t block = 0;
  size_t share = 0;  // elements of this rank's partitions in the bucket (its block's first `share`)
  // This rank's share of the block (`share` elements; the node collectives
  // move whole blocks, through scratch when share < block): the node's sum
  // of its partitions' gradients, and their new parameters.
  std::vector<float> mine;
  std::vector<float> pulled;
  std::vector<uint16_t> wire_out;
  std::vector<uint16_t> wire_in;
  std::vector<std::shared_ptr<PsOp>> pushes;
  std::vector<std::shared_ptr<PsOp>> pulls;
  // The task that lands the last step's pulled parameters (0: none since
  // the last resync); Acquire waits for it.
  uint64_t landed = 0;
};

Runtime::Runtime(RuntimeOptions options, DataPlane& plane) : options_(std::move(options)), plane_(plane) {
  options_.optimizer.set_reduction(v1::GRADIENT_REDUCTION_SUM);
  comm_thread_ = std::thread([this] { CommLoop(); });
}

Runtime::~Runtime() {
  Stop();
  {
    std::lock_guard lock(mu_);
    quit_ = true;
    cv_.notify_all();
  }
  comm_thread_.join();
}

void Runtime::Stop() {
  stopped_ = true;
  std::lock_guard lock(mu_);
  cv_.notify_all();
}

Status Runtime::CheckBuffers(std::span<float> params, std::span<float> grads,
                             const std::vector<v1::TensorSpec>& tensors) {
  if (params.size() != grads.size()) {
    return InvalidArgument("parameters ({} elements) and gradients ({} elements) differ in size", params.size(),
                           grads.size());
  }
  if (params.empty()) return InvalidArgument("the model has no parameters");
  uint64_t covered = 0;
  for (const auto& t : tensors) {
    uint64_t n = 1;
    for (int64_t d : t.shape()) n *= static_cast<uint64_t>(d);
    if (t.flat_offset() != covered) {
      return InvalidArgument("tensor '{}' starts at element {}, but the tensors before it end at {}", t.name(),
                             t.flat_offset(), covered);
    }
    covered += n;
  }
  if (covered != params.size()) {
    return InvalidArgument("the tensor table covers {} elements, but the parameters have {}", covered, params.size());
  }
  return Status::Ok();
}

Status Runtime::Attach(std::span<float> params, std::span<float> grads, std::vector<v1::TensorSpec> tensors) {
  TANDEM_RETURN_IF_ERROR(CheckBuffers(params, grads, tensors));
  ModelBinding model;
  model.tensors = [tensors](int, int) { return tensors; };
  const size_t n = params.size();
  model.bounds = [n](int stages, int tensor_parallel) -> Result<std::vector<size_t>> {
    if (stages != 1 || tensor_parallel != 1) {
      return InvalidArgument(
          "the mesh has pp={} pipeline stages and tp={} tensor-parallel ranks, but the training loop attached one "
          "flat model (Runtime::Attach); model parallelism needs a model that can be split (Runtime::AttachModel)",
          stages, tensor_parallel);
    }
    return std::vector<size_t>{0, n};
  };
  model.bind = [params, grads, tensors](int, int, int, int) -> Result<StageBuffers> {
    return StageBuffers{params, grads, tensors, 0};
  };
  model.initial = [params](uint64_t b, uint64_t e, float* out) {
    std::memcpy(out, params.data() + b, (e - b) * sizeof(float));
  };
  return AttachModel(std::move(model));
}

Status Runtime::AttachModel(ModelBinding model) {
  if (!model.tensors || !model.bounds || !model.bind || !model.initial) {
    return InvalidArgument("the model binding needs tensors, bounds, bind and initial");
  }
  if (options_.gradient_wire != v1::WIRE_DTYPE_FP32 && options_.gradient_wire != v1::WIRE_DTYPE_BF16) {
    return InvalidArgument("gradient wire type must be fp32 or bf16");
  }
  if (options_.parameter_wire != v1::WIRE_DTYPE_FP32 && options_.parameter_wire != v1::WIRE_DTYPE_BF16) {
    return InvalidArgument("parameter wire type must be fp32 or bf16");
  }
  if (asynchronous()) {
    const char* name = options_.consistency.mode() == v1::CONSISTENCY_MODE_ASYNC ? "async" : "bounded";
    if (options_.mode == TrainingMode::kAllReduce) {
      return InvalidArgument(
          "consistency {}: asynchronous updates are the parameter servers'; allreduce mode is "
          "synchronous (use hybrid or ps)",
          name);
    }
    if (options_.optimizer.max_grad_norm() > 0) {
      return InvalidArgument("consistency {}: global gradient-norm clipping (max_grad_norm) needs whole steps", name);
    }
    const auto kind = options_.optimizer.lr_schedule().kind();
    if (kind == v1::LR_SCHEDULE_KIND_COSINE || kind == v1::LR_SCHEDULE_KIND_LINEAR) {
      return InvalidArgument(
          "consistency {}: the servers' learning-rate schedule counts updates, one per contributor's push here, so a "
          "decaying schedule would not end with the run (use a constant one)",
          name);
    }
  }
  if (options_.placement == Placement::kSharded && options_.mode != TrainingMode::kHybrid) {
    return InvalidArgument(
        "placement sharded needs hybrid mode (the workers of a node share the parameters there), not {} mode",
        ModeName(options_.mode));
  }
  auto whole = model.bounds(1, 1);
  if (!whole.ok()) return whole.status();
  // The optimizer configuration is checked now, not at the first epoch.
  auto local = LocalOptimizer::Create(options_.optimizer, 0);
  if (!local.ok()) return local.status().WithContext("optimizer");
  model_ = std::move(model);
  attached_ = true;
  stages_ = 0;
  return Status::Ok();
}

v1::OptimizerConfig Runtime::OptimizerFor(int tp) const {
  v1::OptimizerConfig config = options_.optimizer;
  if (tp > 1) {
    auto& copies = (*config.mutable_group_overrides())[std::string(kTensorParallelCopyGroup)];
    copies.set_weight_decay(0);
    copies.set_exclude_from_grad_norm(true);
  }
  return config;
}

Status Runtime::BindStage(const DataPlane::EpochView& view) {
  const int stages = static_cast<int>(std::max<uint32_t>(1, view.epoch.mesh().pp()));
  const int stage = static_cast<int>(view.rank.mesh().pp());
  const int tp = static_cast<int>(std::max<uint32_t>(1, view.epoch.mesh().tp()));
  const int tp_rank = static_cast<int>(view.rank.mesh().tp());
  if (stages == stages_ && stage == stage_ && tp == tp_size_ && tp_rank == tp_rank_) return Status::Ok();
  const std::string part_name = PartName(stage, stages, tp_rank, tp);
  auto bounds = model_.bounds(stages, tp);
  if (!bounds.ok()) return bounds.status();
  const auto part = static_cast<size_t>(stage * tp + tp_rank);
  if (bounds->size() != static_cast<size_t>(stages * tp) + 1 || stage >= stages || tp_rank >= tp) {
    return Internal("the model's split into {} stages of {} tensor-parallel ranks has {} bounds ({})", stages, tp,
                    bounds->size(), part_name);
  }
  auto buffers = model_.bind(stage, stages, tp_rank, tp);
  if (!buffers.ok()) return buffers.status().WithContext(part_name);
  TANDEM_RETURN_IF_ERROR(CheckBuffers(buffers->params, buffers->grads, buffers->tensors));
  if (buffers->base != (*bounds)[part] || buffers->base + buffers->params.size() != (*bounds)[part + 1]) {
    return Internal("{} holds elements [{}, {}), but the split says [{}, {})", part_name, buffers->base,
                    buffers->base + buffers->params.size(), (*bounds)[part], (*bounds)[part + 1]);
  }
  if (options_.mode == TrainingMode::kAllReduce) {
    // An external optimizer keeps its own state: the local one only counts updates.
    auto local = LocalOptimizer::Create(OptimizerFor(tp), options_.external_optimizer ? 0 : buffers->params.size());
    if (!local.ok()) return local.status().WithContext("optimizer");
    local_ = std::move(*local);
  }
  if (stages_ != 0) {
    spdlog::info("epoch {}: this worker now trains {} (was {})", view.epoch.epoch(), part_name,
                 PartName(stage_, stages_, tp_rank_, tp_size_));
  }
  if (options_.placement == Placement::kSharded && (buffers->param_pages == nullptr || buffers->grad_pages == nullptr ||
                                                    buffers->param_pages->data() != buffers->params.data() ||
                                                    buffers->grad_pages->data() != buffers->grads.data())) {
    return InvalidArgument("placement sharded needs the model's parameters and gradients in page buffers");
  }
  param_pages_ = buffers->param_pages;
  grad_pages_ = buffers->grad_pages;
  bounds_ = std::move(*bounds);
  params_ = buffers->params;
  grads_ = buffers->grads;
  tensors_ = std::move(buffers->tensors);
  base_ = buffers->base;
  stage_ = stage;
  stages_ = stages;
  tp_rank_ = tp_rank;
  tp_size_ = tp;
  servers_initialized_ = false;
  stage_valid_ = stages * tp == 1 || completed_ == 0;  // a fresh model is valid only before the first step
  grads_step_ = 0;
  return Status::Ok();
}

bool Runtime::Fatal(const Status& status) const {
  switch (status.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kPermissionDenied:
    case StatusCode::kUnauthenticated:
    case StatusCode::kUnimplemented:
    case StatusCode::kOutOfRange:
    case StatusCode::kDataLoss:
      return true;
    default:
      return stopped_;
  }
}

Result<StepPlan> Runtime::BeginStep() {
  if (!attached_) return FailedPrecondition("BeginStep before Attach");
  if (in_step_) return FailedPrecondition("BeginStep while step {} is not ended (call EndStep first)", step_);
  bool resynced = false;
  while (true) {
    if (stopped_ || plane_.stopping()) return Cancelled("the worker is stopping");
    std::shared_ptr<const DataPlane::EpochView> view = plane_.built();
    if (!view || view->epoch.epoch() <= failed_epoch_) {
      const auto waited_from = Clock::now();
      view = plane_.WaitNewer(failed_epoch_, options_.epoch_wait);
      if (!view) {
        if (stopped_ || plane_.stopping()) return Cancelled("the worker is stopping");
        if (failed_epoch_ == 0) {
          return DeadlineExceeded("no membership epoch within {:.0f} s: is the coordinator forming the job?",
                                  Seconds(Clock::now() - waited_from));
        }
        return DeadlineExceeded("step {} failed in epoch {} ({}), and no new epoch came within {:.0f} s",
                                completed_ + 1, failed_epoch_, last_failure_.ToString(),
                                Seconds(Clock::now() - waited_from));
      }
    }
    if (view->epoch.epoch() != synced_epoch_) {
      // The last step's parameters may still be landing: they are pulled
      // again by the resync, so a failure to land them only matters when it
      // ends training.
      if (Status landing = Settle(); !landing.ok()) {
        if (Fatal(landing)) return landing;
        spdlog::info("epoch {}: the parameters of step {} did not all arrive ({}); the resync pulls them",
                     view->epoch.epoch(), completed_, landing.ToString());
      }
      for (auto& b : buckets_) b->landed = 0;
      Status s = Resync(*view);
      if (!s.ok()) {
        if (Fatal(s)) return s.WithContext(fmt::format("joining epoch {}", view->epoch.epoch()));
        spdlog::warn("epoch {}: resynchronising failed, waiting for the next epoch: {}", view->epoch.epoch(),
                     s.ToString());
        failed_epoch_ = view->epoch.epoch();
        last_failure_ = s;
        continue;
      }
      resynced = true;
    }
    if (view->epoch.paused()) {
      // Paused (the job is below its minimum of workers): every member has
      // resynchronised at the epoch's start, and none trains until a later
      // epoch. No time limit: a join or an operator ends the pause.
      if (paused_epoch_ != view->epoch.epoch()) {
        paused_epoch_ = view->epoch.epoch();
        spdlog::info(
            "epoch {}: training paused after step {}: the job has {} workers, below its minimum; waiting "
            "for workers to join",
            view->epoch.epoch(), completed_, view->epoch.worker_count());
      }
      (void)plane_.WaitNewer(view->epoch.epoch(), std::chrono::milliseconds(500));
      continue;
    }
    break;
  }
  in_step_ = true;
  parameter_bytes_ = 0;
  step_ = completed_ + 1;
  // Server modes: the last bucket's landing clears it (EnqueueFinish).
  if (options_.mode == TrainingMode::kAllReduce) grads_step_ = 0;
  next_bucket_ = 0;
  pulls_posted_ = false;
  parameter_wait_ = 0;
  StepPlan plan;
  plan.step = step_;
  plan.epoch = synced_epoch_;
  plan.rank = view_->rank.global_rank();
  plan.world_size = view_->rank.world_size();
  plan.dp_rank = view_->rank.mesh().dp();
  plan.dp_size = std::max<uint32_t>(1, view_->epoch.mesh().dp());
  plan.resynced = resynced;
  plan.stage = static_cast<uint32_t>(stage_);
  plan.stages = static_cast<uint32_t>(stages_);
  plan.pipeline = pipeline_;
  plan.tensor_rank = static_cast<uint32_t>(tp_rank_);
  plan.tensor_size = static_cast<uint32_t>(tp_size_);
  plan.tensor = tensor_;
  return plan;
}

Status Runtime::Resync(const DataPlane::EpochView& view) {
  const uint64_t epoch = view.epoch.epoch();
  const auto& mesh = view.epoch.mesh();
  auto& manager = plane_.manager();
  const bool pipelined = mesh.pp() > 1, tensor_parallel = mesh.tp() > 1, split = pipelined || tensor_parallel;
  // This worker's part of the model: its stage's slice of its tensor rank.
  const uint32_t tp = std::max<uint32_t>(1, mesh.tp()), dp = std::max<uint32_t>(1, mesh.dp());
  const uint32_t parts = std::max<uint32_t>(1, mesh.pp()) * tp;
  const uint32_t part = view.rank.mesh().pp() * tp + view.rank.mesh().tp();
  world_ = manager.Get("world");
  node_ = split ? manager.Get(fmt::format("node-dp/{}", view.rank.node_rank() * parts + part)) : manager.Get("node");
  dp_ = split ? manager.Get(fmt::format("dp/{}", part)) : world_;
  pipeline_ =
      pipelined ? manager.Get(fmt::format("pp/{}", view.rank.mesh().dp() * tp + view.rank.mesh().tp())) : nullptr;
  tensor_ =
      tensor_parallel ? manager.Get(fmt::format("tp/{}", view.rank.mesh().pp() * dp + view.rank.mesh().dp())) : nullptr;
  if (!world_ || !node_ || !dp_ || (pipelined && !pipeline_) || (tensor_parallel && !tensor_)) {
    return FailedPrecondition("epoch {} lacks the communicators the runtime needs (is data_plane.backend off?)", epoch);
  }
  if (world_->epoch() != epoch) return Aborted("epoch {} was superseded while joining it", epoch);
  if (asynchronous() && split) {
    return InvalidArgument(
        "train.consistency {}: asynchronous updates need a data-parallel mesh (tp = pp = 1), but epoch {} has pp {} "
        "and tp {} (a partition shared by two parts would be updated by each part's push on its own)",
        options_.consistency.mode() == v1::CONSISTENCY_MODE_ASYNC ? "async" : "bounded", epoch,
        std::max<uint32_t>(1, mesh.pp()), tp);
  }
  TANDEM_RETURN_IF_ERROR(BindStage(view));
  view_ = std::make_shared<DataPlane::EpochView>(view);
  // Server modes: who contributes to a part's partitions. In hybrid mode
  // one contribution per node-dp group (a node's workers of the part), in
  // ps mode one per worker; contributors are numbered part after part, and
  // node by node within a part.
  stage_contributors_.assign(parts, 0);
  contributor_ = 0;
  std::vector<std::set<uint32_t>> part_nodes(parts);
  for (const auto& p : view.epoch.peers()) {
    if (p.role() != v1::ROLE_WORKER || !p.has_rank()) continue;
    const uint32_t q = p.rank().mesh().pp() * tp + p.rank().mesh().tp();
    if (q < part_nodes.size()) part_nodes[q].insert(p.rank().node_rank());
  }
  for (uint32_t q = 0; q < parts; ++q) {
    stage_contributors_[q] = options_.mode == TrainingMode::kHybrid ? static_cast<uint32_t>(part_nodes[q].size()) : dp;
  }
  if (options_.mode == TrainingMode::kHybrid) {
    const auto& mine = part_nodes[part];
    contributor_ = static_cast<uint32_t>(std::distance(mine.begin(), mine.find(view.rank.node_rank())));
    if (stage_contributors_[part] == 0 || contributor_ >= mine.size()) {
      return FailedPrecondition("epoch {}: this worker's node is not among its part's in the peer table", epoch);
    }
  } else {
    contributor_ = view.rank.mesh().dp();
  }
  sharded_ = options_.placement == Placement::kSharded;
  gathers_.clear();  // no gather is queued: a failed step drained the queue
  prefetched_ = prefetched_span_ = {0, 0};
  prefetch_ticket_ = 0;
  TANDEM_RETURN_IF_ERROR(PlanBuckets(view));
  const uint64_t before = completed_;
  TANDEM_RETURN_IF_ERROR(options_.mode == TrainingMode::kAllReduce ? ResyncAllReduce() : ResyncFromServers(view));
  synced_epoch_ = epoch;
  spdlog::info("epoch {}: rank {} of {} (node {} of {}){}, {} mode, {} placement, {} buckets; resuming after step {}{}",
               epoch, view.rank.global_rank(), view.rank.world_size(), view.rank.node_rank(), view.rank.node_count(),
               split ? ", " + PartName(stage_, stages_, tp_rank_, tp_size_) : "", ModeName(options_.mode),
               PlacementName(options_.placement), buckets_.size(), completed_,
               completed_ != before ? fmt::format(" (this worker had completed {})", before) : "");
  plane_.ReportStep(completed_);
  return Status::Ok();
}

Status Runtime::PlanBuckets(const DataPlane::EpochView& view) {
  buckets_.clear();
  const size_t n = params_.size();
  const size_t per_bucket = std::max<size_t>(1, options_.bucket_bytes / sizeof(float));
  if (options_.mode == TrainingMode::kAllReduce) {
    for (size_t end = n; end > 0;) {
      auto b = std::make_unique<Bucket>();
      b->end = end;
      b->begin = end > per_bucket ? end - per_bucket : 0;
      if (options_.gradient_wire == v1::WIRE_DTYPE_BF16) b->wire_out.resize(b->end - b->begin);
      end = b->begin;
      buckets_.push_back(std::move(b));
    }
    return Status::Ok();
  }
  const auto& map = view.epoch.shard_map();
  if (view.epoch.server_count() == 0 || map.partitions_size() == 0) {
    return FailedPrecondition(
        "{} mode needs parameter servers, but epoch {} has none (start servers and give the coordinator "
        "job.parameter_count)",
        ModeName(options_.mode), view.epoch.epoch());
  }
  const size_t total = bounds_.back();
  if (map.parameter_count() != total) {
    return InvalidArgument(
        "the shard map covers {} parameters, but the model has {} (set the coordinator's "
        "job.parameter_count to {})",
        map.parameter_count(), total, total);
  }
  const bool hybrid = options_.mode == TrainingMode::kHybrid;
  const int local = hybrid ? node_->size() : 1;
  const int me = hybrid ? node_->rank() : 0;
  const bool bf16_out = options_.gradient_wire == v1::WIRE_DTYPE_BF16;
  const bool bf16_in = options_.parameter_wire == v1::WIRE_DTYPE_BF16;
  const size_t lo = base_, hi = base_ + n;  // this stage's elements
  places_.assign(static_cast<size_t>(map.partitions_size()), PartitionPlace{});
  size_t largest = 0;        // of L * block over the buckets
  size_t largest_block = 0;  // of block
  const auto range = [&](int p) {
    return std::pair<size_t, size_t>(map.partitions(p).range().begin(), map.partitions(p).range().end());
  };
  // The stage's partitions (those that overlap [lo, hi)), from the last to
  // the first, grouped into buckets.
  int last = map.partitions_size() - 1;
  while (last >= 0 && range(last).first >= hi) --last;
  while (last >= 0 && range(last).second > lo) {
    auto b = std::make_unique<Bucket>();
    int first = last;
    size_t elements = range(last).second - range(last).first;
    while (first > 0 && range(first - 1).second > lo && elements < per_bucket) {
      --first;
      elements += range(first).second - range(first).first;
    }
    for (int p = first; p <= last; ++p) {
      const auto [pb, pe] = range(p);
      places_[static_cast<size_t>(p)] = PartitionPlace{b.get(), b->partitions.size()};
      b->partitions.push_back(map.partitions(p).id());
      b->ranges.emplace_back(pb, pe);
      b->cuts.emplace_back(std::max(pb, lo) - lo, std::min(pe, hi) - lo);
      b->cut_offset.push_back(std::max(pb, lo) - pb);
    }
    b->begin = b->cuts.front().first;
    b->end = b->cuts.back().second;
    // Slots in each local rank's block.
    // Partition p belongs to local rank p % L, whatever bucket it is in,
    // so that the partitions spread evenly over a node's workers even when
    // a bucket holds fewer partitions than L.
    std::vector<size_t> fill(local, 0);
    for (size_t k = 0; k < b->partitions.size(); ++k) {
      const uint32_t owner = b->partitions[k] % static_cast<uint32_t>(local);
      b->owner.push_back(owner);
      b->slot.push_back(fill[owner]);
      fill[owner] += b->ranges[k].second - b->ranges[k].first;
    }
    b->block = *std::max_element(fill.begin(), fill.end());
    // Sharded: the pulled partitions are the worker's shard, kept apart from
    // the model's buffer even when it is alone on its node.
    const bool packed = local > 1 || sharded_;
    if (packed) {
      largest = std::max(largest, b->block * static_cast<size_t>(local));
      // Only this worker's share: the collectives go through shared scratch.
      b->share = fill[static_cast<size_t>(me)];
      b->mine.assign(b->share, 0.0f);
      b->pulled.assign(b->share, 0.0f);
      largest_block = std::max(largest_block, b->block);
    }
    size_t wire = 0;
    for (size_t k = 0; k < b->partitions.size(); ++k) {
      if (static_cast<int>(b->owner[k]) != me) continue;
      Bucket::Owned o;
      o.partition = b->partitions[k];
      o.count = b->ranges[k].second - b->ranges[k].first;
      o.cut = k;
      const bool whole = b->cuts[k].second - b->cuts[k].first == o.count;
      if (packed) {
        o.grad = b->mine.data() + b->slot[k];
        o.param = b->pulled.data() + b->slot[k];
      } else if (whole) {
        o.grad = grads_.data() + b->cuts[k].first;
        o.param = params_.data() + b->cuts[k].first;
      } else {
        o.edge_grad.assign(o.count, 0.0f);
        o.edge_param.assign(o.count, 0.0f);
        o.grad = o.edge_grad.data();
        o.param = o.edge_param.data();
      }
      // The partition's contributors: those of every part it overlaps,
      // numbered part after part.
      for (size_t q = 0; q + 1 < bounds_.size(); ++q) {
        if (bounds_[q + 1] <= b->ranges[k].first || bounds_[q] >= b->ranges[k].second) continue;
        if (q == static_cast<size_t>(stage_ * tp_size_ + tp_rank_)) o.contributor = o.contributors + contributor_;
        o.contributors += stage_contributors_[q];
      }
      o.wire_offset = wire;
      wire += o.count;
      b->owned.push_back(std::move(o));
    }
    if (bf16_out) b->wire_out.resize(wire);
    if (bf16_in) b->wire_in.resize(wire);
    buckets_.push_back(std::move(b));
    last = first - 1;
  }
  staging_.assign(largest, 0.0f);
  block_scratch_.assign(largest_block, 0.0f);
  return Status::Ok();
}

Status Runtime::ResyncFromServers(const DataPlane::EpochView& view) {
  PsClient* ps = plane_.ps_client();
  if (ps == nullptr || ps->epoch() != view.epoch.epoch()) {
    return Aborted("epoch {} was superseded while joining its parameter-server group", view.epoch.epoch());
  }
  const size_t lo = base_, hi = base_ + params_.size();  // this stage's elements
  if (!servers_initialized_) {
    // The stage's partitions; the parts of a straddling partition outside
    // the stage come from the model's initial values.
    const std::vector<v1::TensorSpec> table = model_.tensors(stages_, tp_size_);
    google::protobuf::RepeatedPtrField<v1::TensorSpec> tensors(table.begin(), table.end());
    v1::ConsistencyConfig consistency = options_.consistency;
    if (consistency.mode() == v1::CONSISTENCY_MODE_UNSPECIFIED) consistency.set_mode(v1::CONSISTENCY_MODE_SYNC);
    const PsClient::ValueSource values = [&](uint64_t b, uint64_t e, float* out) {
      if (sharded_) {  // the model's buffer was never filled
        model_.initial(b, e, out);
        return;
      }
      if (b < lo) model_.initial(b, std::min<uint64_t>(e, lo), out);
      if (e > hi) model_.initial(std::max<uint64_t>(b, hi), e, out + (std::max<uint64_t>(b, hi) - b));
      const uint64_t from = std::max<uint64_t>(b, lo), to = std::min<uint64_t>(e, hi);
      if (from < to) std::memcpy(out + (from - b), params_.data() + (from - lo), (to - from) * sizeof(float));
    };
    // A server of the epoch may not answer yet (its gRPC channel still
    // connecting, a loaded host): UNAVAILABLE is retried with backoff while
    // the epoch lasts, up to train.epoch_wait. Initialising is idempotent
    // (a server takes the first values it gets), and nothing collective has
    // run yet, so a retry repeats nothing the other workers wait for. A
    // server that is really gone ends the epoch, which ends the retries.
    const auto initialize = [&] {
      if (!options_.resume_from.empty()) {
        return ps->InitializeFromCheckpoint(tensors, OptimizerFor(tp_size_), consistency, options_.resume_from);
      }
      return ps->Initialize(tensors, OptimizerFor(tp_size_), consistency, lo, hi, values);
    };
    auto initialized = initialize();
    const auto give_up = Clock::now() + options_.epoch_wait;
    auto backoff = std::chrono::milliseconds(100);
    while (!initialized.ok() && initialized.status().code() == StatusCode::kUnavailable &&
           Clock::now() + backoff < give_up && !stopped_ && !plane_.stopping()) {
      spdlog::warn("epoch {}: initialising the parameter servers: {}; retrying in {} ms", view.epoch.epoch(),
                   initialized.status().ToString(), backoff.count());
      if (plane_.WaitNewer(view.epoch.epoch(), backoff) || ps->epoch() != view.epoch.epoch()) {
        return Aborted("epoch {} was superseded while initialising its parameter servers", view.epoch.epoch());
      }
      backoff = std::min(backoff * 2, std::chrono::milliseconds(2000));
      initialized = initialize();
    }
    if (!initialized.ok()) {
      const Status& s = initialized.status();
      const bool checkpoint_fault = s.code() == StatusCode::kNotFound || s.code() == StatusCode::kDataLoss ||
                                    s.code() == StatusCode::kInvalidArgument ||
                                    s.message().find("checkpoint_path:") != std::string::npos;
      if (!options_.resume_from.empty() && checkpoint_fault && ps->epoch() == view.epoch.epoch()) {
        // A checkpoint that is missing, corrupt or of another model is a
        // configuration error, not a membership change to wait out (those
        // come back as UNAVAILABLE, ABORTED or a stale epoch, as without
        // resume_from).
        return InvalidArgument("train.resume_from: {}", s.ToString());
      }
      return s.WithContext("initialising the parameter servers");
    }
    if (*initialized > 0) {
      spdlog::info("initialised {} partitions on the parameter servers{}", *initialized,
                   options_.resume_from.empty() ? "" : " from checkpoint " + options_.resume_from);
    }
    servers_initialized_ = true;
  }
  // The stage's partitions as the servers hold them now, then agree on the
  // last step they applied: a step decided before the membership change is
  // complete even where its pull was cut off.
  const auto& map = view.epoch.shard_map();
  if (asynchronous()) {
    // Steps are each worker's own: go on from the highest any worker
    // completed, and past the epoch's start_step, at or below which the
    // servers' clocks count pushes as duplicates. The pulls name the step
    // this worker computes next, which moves its clocks there (and, with
    // bounded staleness, waits until every contributor's pull did).
    // A step of which this worker sent any push counts as done (its pushes
    // were applied, or lost with the old epoch): pushing it again could
    // apply it twice.
    int64_t mine = static_cast<int64_t>(std::max({completed_, sent_step_.load(), view.epoch.start_step()}));
    int64_t agreed = 0;
    TANDEM_RETURN_IF_ERROR(world_->AllReduce(&mine, &agreed, 1, comm::DType::kInt64, comm::ReduceOp::kMax)
                               .WithContext("agreeing on the step to go on from"));
    auto pulled = PullStage(map, static_cast<uint64_t>(agreed) + 1, nullptr, contributor_, stage_contributors_[0]);
    if (!pulled.ok()) return pulled.status();
    completed_ = static_cast<uint64_t>(agreed);
    return Status::Ok();
  }
  auto steps = PullStage(map, 0, nullptr);
  if (!steps.ok()) return steps.status();
  int64_t mine = 0;
  for (int64_t step : *steps) {
    if (step != INT64_MAX) mine = std::max(mine, step);
  }
  int64_t agreed = 0;
  TANDEM_RETURN_IF_ERROR(world_->AllReduce(&mine, &agreed, 1, comm::DType::kInt64, comm::ReduceOp::kMax)
                             .WithContext("agreeing on the servers' last step"));
  // Each partition's step, the lowest any rank saw: every rank decides alike.
  std::vector<int64_t> seen(steps->begin(), steps->end());
  std::vector<int64_t> lowest(seen.size());
  TANDEM_RETURN_IF_ERROR(
      world_->AllReduce(seen.data(), lowest.data(), seen.size(), comm::DType::kInt64, comm::ReduceOp::kMin)
          .WithContext("agreeing on each partition's step"));
  std::vector<bool> behind(map.partitions_size(), false);
  std::string lagging;
  size_t count = 0;
  for (size_t p = 0; p < lowest.size(); ++p) {
    if (lowest[p] >= agreed) continue;  // applied it (or, INT64_MAX, pulled by no rank: impossible)
    const uint32_t id = map.partitions(static_cast<int>(p)).id();
    if (lowest[p] + 1 < agreed) {
      return Internal(
          "partition {} is at step {} while others applied step {}: more than one step apart, which no failure of "
          "the synchronous protocol leaves (was a partition restored on its own?)",
          id, lowest[p], agreed);
    }
    behind[p] = true;
    if (++count <= 8) lagging += fmt::format("{}{}", lagging.empty() ? "" : ", ", id);
  }
  if (count > 0) {
    if (count > 8) lagging += ", ...";
    // Step `agreed` was decided, but these partitions have not applied it.
    // Either their servers still hold its aggregation from the old epoch
    // and apply it once the other servers' decision shares reach them, or
    // their server died before its backup had the update (the promoted
    // backup is a step behind, and nothing short of the gradients again can
    // complete it). When the same workers that pushed the step are all here
    // with its gradient, they push it again, whole: that covers both cases
    // with the same sums. Otherwise the old epoch's aggregation is the only
    // complete one, and the pulls wait for it.
    auto pushed = PushStepAgainIfWhole(static_cast<uint64_t>(agreed), count, lagging);
    if (!pushed.ok()) return pushed.status();
    if (!*pushed) {
      auto again = PullStage(map, static_cast<uint64_t>(agreed), &behind);
      if (!again.ok()) {
        return again.status().WithContext(fmt::format(
            "waiting for partitions {} to apply step {} (if their server died in the same membership change as a "
            "worker, no server holds the step's whole gradient any more: restore the job from a checkpoint)",
            lagging, agreed));
      }
    }
  }
  completed_ = static_cast<uint64_t>(agreed);
  return Status::Ok();
}

Result<std::vector<int64_t>> Runtime::PullStage(const v1::ShardMap& map, uint64_t step, const std::vector<bool>* only,
                                                uint32_t contributor, uint32_t contributors) {
  PsClient* ps = plane_.ps_client();
  const size_t lo = base_, hi = base_ + params_.size();  // this stage's elements
  const auto overlaps = [&](int p) {
    return map.partitions(p).range().end() > lo && map.partitions(p).range().begin() < hi;
  };
  std::vector<std::shared_ptr<PsOp>> ops(map.partitions_size());
  std::vector<std::vector<float>> edges(map.partitions_size());
  const int me = node_->rank();
  for (int p = 0; p < map.partitions_size(); ++p) {
    if (!overlaps(p) || (only != nullptr && !(*only)[p])) continue;
    const auto& r = map.partitions(p).range();
    const size_t count = r.end() - r.begin();
    float* into = params_.data() + (std::max<uint64_t>(r.begin(), lo) - lo);
    if (sharded_) {
      // Only the partitions of this worker's shard, into the shard.
      const PartitionPlace& place = places_[static_cast<size_t>(p)];
      if (static_cast<int>(place.bucket->owner[place.k]) != me) continue;
      into = place.bucket->pulled.data() + place.bucket->slot[place.k];
    } else if (r.begin() < lo || r.end() > hi) {
      edges[p].resize(count);
      into = edges[p].data();
    }
    ops[p] = ps->Pull(map.partitions(p).id(), step, v1::WIRE_DTYPE_FP32, into, count * sizeof(float), contributor,
                      contributors);
  }
  // INT64_MAX: a partition of other stages only.
  std::vector<int64_t> steps(map.partitions_size(), INT64_MAX);
  for (int p = 0; p < map.partitions_size(); ++p) {
    if (!ops[p]) continue;
    TANDEM_RETURN_IF_ERROR(
        ops[p]
            ->Wait(options_.timeout)
            .WithContext(fmt::format("pulling partition {} from the parameter servers", map.partitions(p).id())));
    steps[p] = static_cast<int64_t>(ops[p]->reply().step);
    if (!edges[p].empty()) {
      const auto& r = map.partitions(p).range();
      const uint64_t from = std::max<uint64_t>(r.begin(), lo), to = std::min<uint64_t>(r.end(), hi);
      std::memcpy(params_.data() + (from - lo), edges[p].data() + (from - r.begin()), (to - from) * sizeof(float));
    }
  }
  return steps;
}

Result<std::vector<v1::CheckpointInfo>> Runtime::SaveCheckpoint(const std::string& directory, uint64_t step) {
  PsClient* ps = plane_.ps_client();
  if (ps == nullptr) return FailedPrecondition("checkpoints need parameter servers (train.mode hybrid or ps)");
  return ps->SaveCheckpoint(directory, step, "", /*async=*/true);
}

Result<bool> Runtime::CheckpointWriting() {
  PsClient* ps = plane_.ps_client();
  if (ps == nullptr) return FailedPrecondition("checkpoints need parameter servers (train.mode hybrid or ps)");
  TANDEM_ASSIGN_OR_RETURN(auto stats, ps->Stats());
  for (const auto& [member, s] : stats) {
    if (s.last_checkpoint().state() == v1::CHECKPOINT_STATE_IN_PROGRESS) return true;
  }
  return false;
}

Status Runtime::WaitForCheckpoint(const std::string& id, std::chrono::steady_clock::time_point deadline) {
  PsClient* ps = plane_.ps_client();
  if (ps == nullptr) return FailedPrecondition("checkpoints need parameter servers (train.mode hybrid or ps)");
  for (;;) {
    TANDEM_ASSIGN_OR_RETURN(auto stats, ps->Stats());
    bool done = true;
    for (const auto& [member, s] : stats) {
      const v1::CheckpointInfo& c = s.last_checkpoint();
      if (c.checkpoint_id() != id) {
        return Aborted("server {} reports checkpoint '{}', not '{}'", member, c.checkpoint_id(), id);
      }
      if (c.state() == v1::CHECKPOINT_STATE_FAILED) {
        return Internal("server {} failed to write checkpoint '{}': {}", member, id, c.error());
      }
      if (c.state() != v1::CHECKPOINT_STATE_COMPLETE) done = false;
    }
    if (done) return Status::Ok();
    if (std::chrono::steady_clock::now() >= deadline || stopped_) {
      return DeadlineExceeded("checkpoint '{}' is still being written", id);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

Result<bool> Runtime::PushStepAgainIfWhole(uint64_t step, size_t lagging, const std::string& which) {
  // The servers wait for every contributor of this epoch; the sums are the
  // old ones only if the workers are the same: none joined (each holds the
  // gradient) and none left (as many as before). Counting workers, not
  // contributors: in hybrid mode a node that lost a worker still contributes.
  int64_t whole = grads_step_ == step && grads_world_ == view_->rank.world_size() ? 1 : 0;
  int64_t everyone = 0;
  TANDEM_RETURN_IF_ERROR(world_->AllReduce(&whole, &everyone, 1, comm::DType::kInt64, comm::ReduceOp::kMin)
                             .WithContext("checking that every rank holds the gradient of the step to push again"));
  if (everyone == 0) {
    spdlog::info(
        "step {}: {} partition(s) ({}) have not applied it yet; the workers changed since it was pushed, so its "
        "parameter servers complete it from the old epoch's pushes: waiting for them",
        step, lagging, which);
    return false;
  }
  spdlog::warn(
      "step {}: {} partition(s) ({}) have not applied it (their server died, or the decision did not reach it); "
      "every worker pushes the step again: servers that applied it count the pushes as duplicates",
      step, lagging, which);
  step_ = step;
  step_lr_ = grads_lr_;  // the learning rate the step was pushed with
  pulls_posted_ = false;
  for (auto& b : buckets_) {
    b->pushes.clear();
    b->pulls.clear();
  }
  for (auto& b : buckets_) {
    TANDEM_RETURN_IF_ERROR(RunBucket(*b).WithContext(fmt::format("pushing step {} again", step)));
  }
  TANDEM_RETURN_IF_ERROR(FinishPushes().WithContext(fmt::format("pushing step {} again", step)));
  for (auto it = buckets_.rbegin(); it != buckets_.rend(); ++it) {
    TANDEM_RETURN_IF_ERROR(LandBucket(**it, step).WithContext(fmt::format("pushing step {} again", step)));
  }
  return true;
}

Status Runtime::BroadcastExternalState(int root) {
  const auto& external = *options_.external_optimizer;
  const bool sender = dp_->rank() == root;
  std::string state;
  if (sender) {
    auto saved = external.save();
    // Fatal (INVALID_ARGUMENT): the others would wait for a state that never comes; they fail with the broadcast.
    if (!saved.ok()) return InvalidArgument("saving the optimizer's state to send it: {}", saved.status().message());
    state = std::move(*saved);
  }
  int64_t bytes = static_cast<int64_t>(state.size());
  TANDEM_RETURN_IF_ERROR(
      dp_->Broadcast(&bytes, 1, comm::DType::kInt64, root).WithContext("broadcasting the optimizer state's size"));
  if (bytes < 0 || bytes > (int64_t{1} << 40)) return DataLoss("the optimizer state sent is {} bytes", bytes);
  // Whole 4-byte words: the collectives move typed elements.
  std::vector<int32_t> words((static_cast<size_t>(bytes) + 3) / 4, 0);
  if (sender && bytes > 0) std::memcpy(words.data(), state.data(), state.size());
  if (!words.empty()) {
    TANDEM_RETURN_IF_ERROR(dp_->Broadcast(words.data(), words.size(), comm::DType::kInt32, root)
                               .WithContext("broadcasting the optimizer state"));
  }
  if (sender) return Status::Ok();
  Status loaded =
      external.load(std::string_view(reinterpret_cast<const char*>(words.data()), static_cast<size_t>(bytes)));
  if (!loaded.ok()) return InvalidArgument("loading the optimizer state received: {}", loaded.message());
  return Status::Ok();
}

Status Runtime::ResyncAllReduce() {
  int64_t mine = static_cast<int64_t>(completed_);
  int64_t agreed = 0;
  TANDEM_RETURN_IF_ERROR(world_->AllReduce(&mine, &agreed, 1, comm::DType::kInt64, comm::ReduceOp::kMax)
                             .WithContext("agreeing on the last completed step"));
  // The lowest rank of the stage's data-parallel group that holds the
  // stage's state after that step sends it to the others.
  int64_t candidate = mine == agreed && stage_valid_ ? dp_->rank() : INT64_MAX;
  int64_t root = 0;
  TANDEM_RETURN_IF_ERROR(dp_->AllReduce(&candidate, &root, 1, comm::DType::kInt64, comm::ReduceOp::kMin)
                             .WithContext("choosing the rank that broadcasts the parameters"));
  if (root == INT64_MAX) {
    // Fatal: waiting for another epoch brings nothing back.
    return DataLoss(
        "{}: no worker holds its parameters after step {} (in allreduce mode only the workers hold them, and every "
        "worker that trained this part of the model is gone or moved): restart from a checkpoint, or train in hybrid "
        "or ps mode, where the servers keep every part",
        PartName(stage_, stages_, tp_rank_, tp_size_), agreed);
  }
  const int r = static_cast<int>(root);
  TANDEM_RETURN_IF_ERROR(dp_->Broadcast(params_.data(), params_.size(), comm::DType::kFloat32, r)
                             .WithContext("broadcasting the parameters"));
  for (auto* state : {&local_->state0(), &local_->state1()}) {
    if (state->empty()) continue;
    TANDEM_RETURN_IF_ERROR(dp_->Broadcast(state->data(), state->size(), comm::DType::kFloat32, r)
                               .WithContext("broadcasting the optimizer state"));
  }
  int64_t updates = static_cast<int64_t>(local_->updates());
  TANDEM_RETURN_IF_ERROR(
      dp_->Broadcast(&updates, 1, comm::DType::kInt64, r).WithContext("broadcasting the optimizer's update count"));
  local_->set_updates(static_cast<uint64_t>(updates));
  if (options_.external_optimizer) TANDEM_RETURN_IF_ERROR(BroadcastExternalState(r));
  completed_ = static_cast<uint64_t>(agreed);
  stage_valid_ = true;
  return Status::Ok();
}

void Runtime::SetStepLearningRate(double lr) {
  lr_.store(lr);
}

Status Runtime::SetInitialState(std::string resume_from, v1::OptimizerConfig optimizer) {
  if (options_.mode == TrainingMode::kAllReduce) return FailedPrecondition("allreduce mode has no parameter servers");
  if (in_step_ || synced_epoch_ != 0 || completed_ != 0 || servers_initialized_) {
    return FailedPrecondition("the servers' initial state is set before the first step");
  }
  optimizer.set_reduction(v1::GRADIENT_REDUCTION_SUM);  // as the constructor sets the options' (see "Gradients")
  options_.resume_from = std::move(resume_from);
  options_.optimizer = std::move(optimizer);
  return Status::Ok();
}

void Runtime::GradientsReady(size_t ready_from) {
  if (!in_step_) return;
  if (next_bucket_ == 0) {  // nothing of the step sent yet: the step's learning rate
    step_lr_ = lr_.load();
    if (local_) local_->set_learning_rate(step_lr_);
  }
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_]->begin >= ready_from) {
    Bucket* b = buckets_[next_bucket_++].get();
    Enqueue([this, b] { return RunBucket(*b); });
  }
}

Status Runtime::RunBucket(Bucket& b) {
  const size_t count = b.end - b.begin;
  if (options_.mode == TrainingMode::kAllReduce) {
    float* g = grads_.data() + b.begin;
    if (options_.gradient_wire == v1::WIRE_DTYPE_BF16) {
      optim::EncodeWire(b.wire_out.data(), g, v1::WIRE_DTYPE_BF16, count);
      TANDEM_RETURN_IF_ERROR(
          dp_->AllReduce(b.wire_out.data(), b.wire_out.data(), count, comm::DType::kBFloat16, comm::ReduceOp::kSum));
      optim::AccumulateWire(g, b.wire_out.data(), v1::WIRE_DTYPE_BF16, count, /*overwrite=*/true);
      return Status::Ok();
    }
    return dp_->AllReduce(g, g, count, comm::DType::kFloat32, comm::ReduceOp::kSum);
  }
  const bool hybrid = options_.mode == TrainingMode::kHybrid;
  const int local = hybrid ? node_->size() : 1;
  if (local > 1 || sharded_) {
    // Pack: local rank j's partitions side by side in block j (a partition
    // only partly in this stage with zeros around its part).
    for (size_t k = 0; k < b.partitions.size(); ++k) {
      const size_t owner = b.owner[k];
      float* slot = staging_.data() + owner * b.block + b.slot[k];
      const size_t whole = b.ranges[k].second - b.ranges[k].first;
      const size_t part = b.cuts[k].second - b.cuts[k].first;
      if (part != whole) std::fill(slot, slot + whole, 0.0f);
      std::memcpy(slot + b.cut_offset[k], grads_.data() + b.cuts[k].first, part * sizeof(float));
    }
    if (sharded_) grad_pages_->Release(b.begin, b.end);  // packed: this worker's copy is no longer needed
    // Straight into this rank's share when it fills the block (no copy);
    // through one block of scratch when its share is smaller.
    float* out = b.share == b.block ? b.mine.data() : block_scratch_.data();
    TANDEM_RETURN_IF_ERROR(
        node_->ReduceScatter(staging_.data(), out, b.block, comm::DType::kFloat32, comm::ReduceOp::kSum));
    if (out != b.mine.data()) std::copy_n(out, b.share, b.mine.begin());
  }
  for (auto& o : b.owned) {
    if (o.edge_grad.empty()) continue;
    const auto [from, to] = b.cuts[o.cut];
    std::memcpy(o.edge_grad.data() + b.cut_offset[o.cut], grads_.data() + from, (to - from) * sizeof(float));
  }
  PsClient* ps = plane_.ps_client();
  const bool bf16_out = options_.gradient_wire == v1::WIRE_DTYPE_BF16;
  for (const auto& o : b.owned) {
    const void* src = o.grad;
    size_t bytes = o.count * sizeof(float);
    if (bf16_out) {
      optim::EncodeWire(b.wire_out.data() + o.wire_offset, o.grad, v1::WIRE_DTYPE_BF16, o.count);
      src = b.wire_out.data() + o.wire_offset;
      bytes = o.count * sizeof(uint16_t);
    }
    b.pushes.push_back(
        ps->Push(o.partition, step_, o.contributor, o.contributors, options_.gradient_wire, src, bytes, step_lr_));
  }
  if (!b.owned.empty()) sent_step_ = std::max(sent_step_.load(), step_);
  if (!pulls_posted_ && !asynchronous()) {  // asynchronous: after the pushes are applied (EnqueueFinish)
    PostPulls();
    pulls_posted_ = true;
  }
  return Status::Ok();
}

void Runtime::PostPulls() {
  // Every pull of the step at once, in the order the next forward reads the
  // parameters, with the first bucket's pushes: they wait at the servers, so
  // each partition's new parameters leave as soon as it is applied. A pull
  // is answered once the step is applied, which needs every contribution of
  // every partition (synchronous steps are decided whole): never before
  // this worker's backward is over, so it may land in the parameters
  // directly.
  //
  // Asynchronous modes: posted once this worker's pushes are applied, and
  // answered with the parameters as they are then. Bounded staleness: the
  // pull names the step this worker computes next, s = step_ + 1, and the
  // servers answer it once every contributor's updates up to s - k - 1 are
  // in, the condition on which they take this worker's push of s.
  PsClient* ps = plane_.ps_client();
  const bool bf16_in = options_.parameter_wire == v1::WIRE_DTYPE_BF16;
  const bool async = asynchronous();
  const uint64_t step = async ? step_ + 1 : step_;
  for (auto it = buckets_.rbegin(); it != buckets_.rend(); ++it) {
    Bucket& b = **it;
    for (const auto& o : b.owned) {
      const uint32_t contributor = async ? o.contributor : 0, contributors = async ? o.contributors : 0;
      if (bf16_in) {
        b.pulls.push_back(ps->Pull(o.partition, step, v1::WIRE_DTYPE_BF16, b.wire_in.data() + o.wire_offset,
                                   o.count * sizeof(uint16_t), contributor, contributors));
      } else {
        b.pulls.push_back(ps->Pull(o.partition, step, v1::WIRE_DTYPE_FP32, o.param, o.count * sizeof(float),
                                   contributor, contributors));
      }
    }
  }
}

Status Runtime::ReduceLoss() {
  if (asynchronous()) {
    // No collective over the workers during a step: this worker's own
    // shard's loss, scaled to the global mean's scale.
    loss_out_ = loss_in_;
    loss_out_[0] = loss_in_[0] * static_cast<float>(std::max<uint32_t>(1, view_->epoch.mesh().dp()));
    return Status::Ok();
  }
  return world_->AllReduce(loss_in_.data(), loss_out_.data(), figures_, comm::DType::kFloat32, comm::ReduceOp::kSum);
}

Status Runtime::FinishPushes() {
  for (auto& bp : buckets_) {
    Bucket& b = *bp;
    for (size_t i = 0; i < b.pushes.size(); ++i) {
      Status pushed = b.pushes[i]->Wait(options_.timeout);
      if (!pushed.ok())
        return pushed.WithContext(fmt::format("step {}: pushing partition {}", step_, b.owned[i].partition));
    }
    b.pushes.clear();
  }
  return Status::Ok();
}

Status Runtime::LandBucket(Bucket& b, uint64_t step) {
  for (size_t i = 0; i < b.pulls.size(); ++i) {
    const auto& o = b.owned[i];
    Status pulled = b.pulls[i]->Wait(options_.timeout);
    if (!pulled.ok()) return pulled.WithContext(fmt::format("step {}: pulling partition {}", step, o.partition));
    if (options_.parameter_wire == v1::WIRE_DTYPE_BF16) {
      optim::AccumulateWire(o.param, b.wire_in.data() + o.wire_offset, v1::WIRE_DTYPE_BF16, o.count, true);
    }
    if (!o.edge_param.empty()) {
      const auto [from, to] = b.cuts[o.cut];
      std::memcpy(params_.data() + from, o.edge_param.data() + b.cut_offset[o.cut], (to - from) * sizeof(float));
    }
  }
  b.pulls.clear();
  const bool hybrid = options_.mode == TrainingMode::kHybrid;
  if (hybrid && node_->size() > 1 && !sharded_) {  // sharded: the pulled partitions stay the shard
    const float* in = b.pulled.data();
    if (b.share != b.block) {
      std::copy(b.pulled.begin(), b.pulled.end(), block_scratch_.begin());
      in = block_scratch_.data();
    }
    TANDEM_RETURN_IF_ERROR(node_->AllGather(in, staging_.data(), b.block, comm::DType::kFloat32));
    for (size_t k = 0; k < b.partitions.size(); ++k) {
      const size_t owner = b.owner[k];
      std::memcpy(params_.data() + b.cuts[k].first, staging_.data() + owner * b.block + b.slot[k] + b.cut_offset[k],
                  (b.cuts[k].second - b.cuts[k].first) * sizeof(float));
    }
  }
  return Status::Ok();
}

uint64_t Runtime::EnqueueFinish() {
  if (options_.mode == TrainingMode::kAllReduce) return Enqueue([this] { return ReduceLoss(); });
  if (asynchronous()) {
    Enqueue([this]() -> Status {
      TANDEM_RETURN_IF_ERROR(FinishPushes());
      PostPulls();
      pulls_posted_ = true;
      return Status::Ok();
    });
  } else {
    Enqueue([this] { return FinishPushes(); });
  }
  // Buckets land in the order the next forward reads them (the first
  // elements first). Any pull answered proves the step decided, and a
  // decided step is applied on every server (a server that died before
  // applying it has it pushed again after the resync, from the gradient
  // kept until the last bucket landed): the step is complete once the first
  // bucket landed, and the rest arrive while the next step's forward runs,
  // which waits for each bucket in Acquire.
  uint64_t complete = 0;
  for (auto it = buckets_.rbegin(); it != buckets_.rend(); ++it) {
    Bucket* b = it->get();
    const bool last = std::next(it) == buckets_.rend();
    b->landed = Enqueue([this, b, last, step = step_]() -> Status {
      TANDEM_RETURN_IF_ERROR(LandBucket(*b, step));
      // Every partition of the stage applied the step: its gradient is no
      // longer needed (unless the next step's gradient is already there).
      uint64_t expected = step;
      if (last) grads_step_.compare_exchange_strong(expected, 0);
      return Status::Ok();
    });
    if (complete == 0 && options_.overlap_parameter_landing) complete = Enqueue([this] { return ReduceLoss(); });
  }
  if (complete == 0) complete = Enqueue([this] { return ReduceLoss(); });
  return complete;
}

Status Runtime::Settle() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return queue_.empty() && running_ == 0; });
  Status status = std::move(step_status_);
  step_status_ = Status::Ok();
  comm_busy_ = 0;
  // After a failure, the tasks that would have let go of these were skipped.
  for (auto& b : buckets_) {
    b->pushes.clear();
    b->pulls.clear();
  }
  return status;
}

Result<StepResult> Runtime::EndStep(double loss_share, uint64_t samples, uint64_t tokens, std::span<float> more) {
  if (!in_step_) return FailedPrecondition("EndStep without BeginStep");
  if (more.size() > kMaxStepFigures) {
    return InvalidArgument("EndStep: {} more figures, at most {}", more.size(), kMaxStepFigures);
  }
  // Sharded: the gradient is handed back bucket by bucket as it is sent, so
  // there is none to push again.
  grads_step_ = sharded_ ? 0 : step_;
  grads_world_ = view_->rank.world_size();
  GradientsReady(0);
  grads_lr_ = step_lr_;
  loss_in_[0] = static_cast<float>(loss_share);
  loss_in_[1] = static_cast<float>(samples);
  loss_in_[2] = static_cast<float>(tokens);
  std::copy(more.begin(), more.end(), loss_in_.begin() + 3);
  figures_ = 3 + more.size();
  const uint64_t complete = EnqueueFinish();
  const auto waited = Clock::now();
  Status status;
  double busy = 0;
  {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return finished_ >= complete; });
    // A bucket landing after `complete` may have failed meanwhile: the step
    // is complete all the same; the next Acquire reports that failure.
    if (failed_ticket_ <= complete) status = step_status_;
    busy = comm_busy_;
    comm_busy_ = 0;
  }
  // A failed step: what is still queued is skipped, and the next step
  // starts from a clean status.
  if (!status.ok()) (void)Settle();
  in_step_ = false;
  StepResult result;
  result.step = step_;
  result.epoch = synced_epoch_;
  result.parameter_wait_seconds = parameter_wait_;
  result.exposed_seconds = Seconds(Clock::now() - waited) + parameter_wait_;
  result.comm_seconds = busy;
  parameter_wait_ = 0;
  if (!status.ok()) {
    failed_epoch_ = synced_epoch_;
    last_failure_ = status;
    synced_epoch_ = 0;  // the next step resynchronises
    return status;
  }
  if (options_.mode == TrainingMode::kAllReduce && options_.external_optimizer) {
    local_->set_updates(local_->updates() + 1);  // the caller applies it
  } else if (options_.mode == TrainingMode::kAllReduce) {
    const auto t0 = Clock::now();
    LocalOptimizer::NormCombiner combine;
    if (stages_ * tp_size_ > 1) {
      // Each worker holds one part: the whole model's norm and finiteness
      // are the parts' together. Every part's dp replicas hold the same
      // summed gradient, so the world's sum counts each part dp times.
      const auto dp = static_cast<float>(std::max<uint32_t>(1, view_->epoch.mesh().dp()));
      combine = [this, dp](const optim::GradScan& part) -> Result<optim::GradScan> {
        float mine[2] = {static_cast<float>(part.sum_squares), part.finite ? 0.0f : 1.0f};
        float all[2] = {0, 0};
        TANDEM_RETURN_IF_ERROR(world_->AllReduce(mine, all, 2, comm::DType::kFloat32, comm::ReduceOp::kSum)
                                   .WithContext("summing the parts' gradient norms"));
        return optim::GradScan{static_cast<double>(all[0]) / dp, all[1] == 0.0f};
      };
    }
    Status applied = local_->Step(params_, grads_, tensors_, &result.skipped, combine);
    result.optimizer_seconds = Seconds(Clock::now() - t0);
    if (!applied.ok()) {
      if (!Fatal(applied)) {  // the parts' norm could not be summed: resync as after a failed step
        failed_epoch_ = synced_epoch_;
        last_failure_ = applied;
        synced_epoch_ = 0;
      }
      return applied;
    }
  }
  NoteParameterBytes();
  result.parameter_bytes = parameter_bytes_;
  parameter_bytes_ = 0;
  result.loss = loss_out_[0];
  result.samples = static_cast<uint64_t>(loss_out_[1]);
  result.tokens = static_cast<uint64_t>(loss_out_[2]);
  std::copy_n(loss_out_.begin() + 3, more.size(), more.begin());
  completed_ = step_;
  plane_.ReportStep(completed_);
  return result;
}

Status Runtime::AllReduceBetweenSteps(float* values, size_t count) {
  if (in_step_) return FailedPrecondition("AllReduceBetweenSteps during a step");
  if (synced_epoch_ == 0 || world_ == nullptr) return FailedPrecondition("no synced epoch to reduce over");
  std::vector<float> sum(count);
  TANDEM_RETURN_IF_ERROR(world_->AllReduce(values, sum.data(), count, comm::DType::kFloat32, comm::ReduceOp::kSum));
  std::copy(sum.begin(), sum.end(), values);
  return Status::Ok();
}

void Runtime::AbandonStep(const Status& why) {
  if (in_step_) EndFailedStep(why);
}

void Runtime::EndFailedStep(const Status& why) {
  (void)Settle();
  parameter_wait_ = 0;
  in_step_ = false;
  failed_epoch_ = synced_epoch_;
  last_failure_ = why;
  synced_epoch_ = 0;
}

uint64_t Runtime::Enqueue(std::function<Status()> task) {
  std::lock_guard lock(mu_);
  queue_.push_back(std::move(task));
  cv_.notify_all();
  return ++enqueued_;
}

Status Runtime::WaitFor(uint64_t ticket) {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return finished_ >= ticket; });
  return step_status_;
}

// One gather of the sharded placement: the partitions that overlap a range
// of the stage, each from the worker that owns it (partition k of a bucket
// belongs to local rank k % L), packed by owner as the buckets are.
struct Runtime::GatherPlan {
  std::vector<std::pair<Bucket*, size_t>> parts;  // (bucket, k)
  std::vector<size_t> slot;                       // in its owner's block
  size_t block = 0;
  std::pair<size_t, size_t> span{0, 0};  // the stage's elements the gather writes
};

Runtime::GatherPlan& Runtime::PlanGather(std::pair<size_t, size_t> range) {
  auto& cached = gathers_[range];
  if (cached) return *cached;
  cached = std::make_unique<GatherPlan>();
  GatherPlan& plan = *cached;
  const int local = node_->size();
  std::vector<size_t> fill(static_cast<size_t>(local), 0);
  plan.span = {SIZE_MAX, 0};
  for (const PartitionPlace& place : places_) {
    if (place.bucket == nullptr) continue;
    const auto [from, to] = place.bucket->cuts[place.k];
    if (to <= range.first || from >= range.second) continue;
    const size_t owner = place.bucket->owner[place.k];
    plan.parts.emplace_back(place.bucket, place.k);
    plan.slot.push_back(fill[owner]);
    fill[owner] += place.bucket->ranges[place.k].second - place.bucket->ranges[place.k].first;
    plan.span = {std::min(plan.span.first, from), std::max(plan.span.second, to)};
  }
  plan.block = *std::max_element(fill.begin(), fill.end());
  if (plan.parts.empty()) plan.span = {0, 0};
  gather_send_.resize(std::max(gather_send_.size(), plan.block));
  gather_staging_.resize(std::max(gather_staging_.size(), plan.block * static_cast<size_t>(local)));
  return plan;
}

Status Runtime::Gather(GatherPlan& plan) {
  const int me = node_->rank();
  for (size_t j = 0; j < plan.parts.size(); ++j) {
    const auto [b, k] = plan.parts[j];
    if (static_cast<int>(b->owner[k]) != me) continue;
    std::memcpy(gather_send_.data() + plan.slot[j], b->pulled.data() + b->slot[k],
                (b->ranges[k].second - b->ranges[k].first) * sizeof(float));
  }
  TANDEM_RETURN_IF_ERROR(
      node_->AllGather(gather_send_.data(), gather_staging_.data(), plan.block, comm::DType::kFloat32)
          .WithContext("gathering parameters from the node's workers (sharded placement)"));
  for (size_t j = 0; j < plan.parts.size(); ++j) {
    const auto [b, k] = plan.parts[j];
    const size_t owner = b->owner[k];
    const auto [from, to] = b->cuts[k];
    std::memcpy(params_.data() + from, gather_staging_.data() + owner * plan.block + plan.slot[j] + b->cut_offset[k],
                (to - from) * sizeof(float));
  }
  return Status::Ok();
}

Status Runtime::Acquire(std::pair<size_t, size_t> now, std::pair<size_t, size_t> next) {
  if (now.first >= now.second) return Status::Ok();
  const auto start = Clock::now();
  Status status = sharded_ ? AcquireSharded(now, next) : AwaitLanding(now);
  parameter_wait_ += Seconds(Clock::now() - start);
  return status;
}

Status Runtime::WaitForParameters() {
  if (params_.empty()) return Status::Ok();
  return AwaitLanding({0, params_.size()});
}

Status Runtime::FinishRun() {
  if (options_.mode == TrainingMode::kAllReduce || synced_epoch_ == 0) return Status::Ok();
  if (Status landed = WaitForParameters(); !landed.ok()) {  // nothing of the last step lands after this
    EndFailedStep(landed);
    return landed;
  }
  if (!asynchronous()) {
    if (!options_.overlap_parameter_landing) return Status::Ok();
    float mine = 0, all = 0;
    Status s = world_->AllReduce(&mine, &all, 1, comm::DType::kFloat32, comm::ReduceOp::kSum)
                   .WithContext("waiting for every worker's final parameters");
    if (!s.ok()) EndFailedStep(s);
    return s;
  }
  Status s = WaitForEveryWorker();
  if (s.ok()) {
    // No push changes the servers' parameters any more.
    auto pulled = PullStage(view_->epoch.shard_map(), 0, nullptr);
    s = pulled.ok() ? Status::Ok() : pulled.status().WithContext("pulling the final parameters");
  }
  // As a failed step: the next BeginStep resynchronises in a newer epoch.
  if (!s.ok()) EndFailedStep(s);
  return s;
}

Status Runtime::WaitForEveryWorker() {
  // Through the coordinator's epoch values rather than a collective: the
  // slowest worker may be further behind than a communicator's timeout.
  const uint64_t epoch = synced_epoch_;
  std::unique_ptr<comm::Rendezvous> values = plane_.EpochValues(epoch);
  if (!values) return Aborted("epoch {} was superseded before the end of the run", epoch);
  const uint32_t world = view_->rank.world_size();
  TANDEM_RETURN_IF_ERROR(
      values->Put(fmt::format("runtime/finished/{}", view_->rank.global_rank()), std::to_string(completed_))
          .WithContext("telling the other workers that this one ended its last step"));
  const auto started = Clock::now();
  auto next_note = started + std::chrono::seconds(10);
  for (uint32_t r = 0; r < world; ++r) {
    while (true) {
      if (stopped_ || plane_.stopping()) return Cancelled("the worker is stopping");
      auto got = values->Get(fmt::format("runtime/finished/{}", r), std::chrono::milliseconds(1000));
      if (got.ok()) break;
      if (got.status().code() != StatusCode::kDeadlineExceeded) {
        return got.status().WithContext("waiting for the other workers to end their last step");
      }
      if (Clock::now() >= next_note) {
        spdlog::info(
            "step {} was this worker's last; waiting {:.0f} s so far for rank {} (and any after it) to end "
            "theirs",
            completed_, Seconds(Clock::now() - started), r);
        next_note = Clock::now() + std::chrono::seconds(30);
      }
    }
  }
  return Status::Ok();
}

Status Runtime::AwaitLanding(std::pair<size_t, size_t> range) {
  uint64_t ticket = 0;
  for (const auto& b : buckets_) {
    if (b->landed != 0 && b->begin < range.second && b->end > range.first) ticket = std::max(ticket, b->landed);
  }
  if (ticket == 0) return Status::Ok();
  return WaitFor(ticket).WithContext("waiting for the last step's parameters from the servers");
}

Status Runtime::AcquireSharded(std::pair<size_t, size_t> now, std::pair<size_t, size_t> next) {
  uint64_t ticket = 0;
  if (prefetch_ticket_ != 0 && prefetched_ == now) {
    ticket = prefetch_ticket_;
  } else {
    // A prefetch of something else finishes first: planning may grow the
    // buffers it uses.
    if (prefetch_ticket_ != 0) TANDEM_RETURN_IF_ERROR(WaitFor(prefetch_ticket_));
    GatherPlan* plan = &PlanGather(now);
    ticket = Enqueue([this, plan] { return Gather(*plan); });
  }
  prefetch_ticket_ = 0;
  prefetched_ = prefetched_span_ = {0, 0};
  Status status = WaitFor(ticket);
  if (!status.ok()) return status;
  if (next.first < next.second) {
    GatherPlan* plan = &PlanGather(next);
    prefetched_ = next;
    prefetched_span_ = plan->span;
    prefetch_ticket_ = Enqueue([this, plan] { return Gather(*plan); });
  }
  return Status::Ok();
}

void Runtime::NoteParameterBytes() {
  uint64_t bytes = param_pages_ != nullptr ? param_pages_->ResidentBytes() : params_.size_bytes();
  for (const auto& b : buckets_) bytes += b->share * sizeof(float);
  parameter_bytes_ = std::max(parameter_bytes_, bytes);
}

void Runtime::Release(std::pair<size_t, size_t> now) {
  if (!sharded_) return;
  NoteParameterBytes();  // the segment in use and the one being gathered
  // Everything `now`'s gather wrote (whole partitions, which may reach into
  // the neighbouring segments), but not the elements the prefetch writes.
  size_t from = now.first, to = now.second;
  if (auto it = gathers_.find(now); it != gathers_.end() && it->second->span.first < it->second->span.second) {
    from = std::min(from, it->second->span.first);
    to = std::max(to, it->second->span.second);
  }
  const auto [pb, pe] = prefetched_span_;
  if (pb < pe && pb < to && pe > from) {
    if (pb > from) param_pages_->Release(from, pb);
    if (pe < to) param_pages_->Release(pe, to);
    return;
  }
  param_pages_->Release(from, to);
}

void Runtime::CommLoop() {
  std::unique_lock lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return quit_ || !queue_.empty(); });
    if (queue_.empty()) return;
    auto task = std::move(queue_.front());
    queue_.pop_front();
    ++running_;
    const bool failed = !step_status_.ok();
    lock.unlock();
    Status s;
    const auto t0 = Clock::now();
    if (stopped_) {
      // Stop(): what is queued is not started (a pull could wait for its
      // whole timeout), and whoever waits for it learns why.
      if (!failed) s = Cancelled("the worker is stopping");
    } else if (!failed) {
      s = task();
    }
    const double dt = Seconds(Clock::now() - t0);
    lock.lock();
    comm_busy_ += dt;
    if (!s.ok() && step_status_.ok()) {
      step_status_ = std::move(s);
      failed_ticket_ = finished_ + 1;
    }
    --running_;
    ++finished_;
    cv_.notify_all();
  }
}

}  // namespace tandem::worker
