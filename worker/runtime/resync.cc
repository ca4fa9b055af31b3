// Joining an epoch (runtime.h, "Membership changes"): the communicators
// and the bound part for the epoch, who contributes to each part's
// partitions, and each mode's resync: from the parameter servers (pulls,
// with a decided step pushed again where it is not applied everywhere) or,
// in allreduce mode, broadcast from a worker that holds the state.
#include <algorithm>
#include <climits>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <regex>
#include <set>

#include <spdlog/spdlog.h>

#include "worker/runtime/buckets.h"
#include "worker/runtime/step.h"

namespace tandem::worker {

using runtime_internal::Clock;
using runtime_internal::PartName;

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
  TANDEM_RETURN_IF_ERROR(strategy_->CountContributors(view));
  sharded_ = options_.placement == Placement::kSharded;
  gathers_.plans.clear();  // no gather is queued: a failed step drained the queue
  gathers_.prefetched = gathers_.prefetched_span = {0, 0};
  gathers_.prefetch_ticket = 0;
  TANDEM_RETURN_IF_ERROR(strategy_->PlanBuckets(view));
  const uint64_t before = completed_;
  TANDEM_RETURN_IF_ERROR(strategy_->Resync(view));
  synced_epoch_ = epoch;
  spdlog::info("epoch {}: rank {} of {} (node {} of {}){}, {} mode, {} placement, {} buckets; resuming after step {}{}",
               epoch, view.rank.global_rank(), view.rank.world_size(), view.rank.node_rank(), view.rank.node_count(),
               split ? ", " + PartName(stage_, stages_, tp_rank_, tp_size_) : "", ModeName(options_.mode),
               PlacementName(options_.placement), buckets_.size(), completed_,
               completed_ != before ? fmt::format(" (this worker had completed {})", before) : "");
  plane_.ReportStep(completed_);
  return Status::Ok();
}

Status Runtime::HybridStep::CountContributors(const DataPlane::EpochView& view) {
  // One contribution per node-dp group (a node's workers of the part);
  // contributors are numbered part after part, and node by node within a
  // part.
  const auto& mesh = view.epoch.mesh();
  const uint32_t tp = std::max<uint32_t>(1, mesh.tp());
  const uint32_t parts = std::max<uint32_t>(1, mesh.pp()) * tp;
  const uint32_t part = view.rank.mesh().pp() * tp + view.rank.mesh().tp();
  stage_contributors_.assign(parts, 0);
  contributor_ = 0;
  std::vector<std::set<uint32_t>> part_nodes(parts);
  for (const auto& p : view.epoch.peers()) {
    if (p.role() != v1::ROLE_WORKER || !p.has_rank()) continue;
    const uint32_t q = p.rank().mesh().pp() * tp + p.rank().mesh().tp();
    if (q < part_nodes.size()) part_nodes[q].insert(p.rank().node_rank());
  }
  for (uint32_t q = 0; q < parts; ++q) stage_contributors_[q] = static_cast<uint32_t>(part_nodes[q].size());
  const auto& mine = part_nodes[part];
  contributor_ = static_cast<uint32_t>(std::distance(mine.begin(), mine.find(view.rank.node_rank())));
  if (stage_contributors_[part] == 0 || contributor_ >= mine.size()) {
    return FailedPrecondition("epoch {}: this worker's node is not among its part's in the peer table",
                              view.epoch.epoch());
  }
  return Status::Ok();
}

Status Runtime::PsStep::CountContributors(const DataPlane::EpochView& view) {
  // One contribution per worker: the part's dp group, numbered part after part.
  const auto& mesh = view.epoch.mesh();
  const uint32_t tp = std::max<uint32_t>(1, mesh.tp()), dp = std::max<uint32_t>(1, mesh.dp());
  const uint32_t parts = std::max<uint32_t>(1, mesh.pp()) * tp;
  stage_contributors_.assign(parts, dp);
  contributor_ = view.rank.mesh().dp();
  return Status::Ok();
}

Status Runtime::ServerStep::InitializeServers(const DataPlane::EpochView& view) {
  PsClient* ps = rt_.plane_.ps_client();
  const size_t lo = rt_.base_, hi = rt_.base_ + rt_.params_.size();  // this stage's elements
  // The stage's partitions; the parts of a straddling partition outside
  // the stage come from the model's initial values.
  const std::vector<v1::TensorSpec> table = rt_.model_.tensors(rt_.stages_, rt_.tp_size_);
  google::protobuf::RepeatedPtrField<v1::TensorSpec> tensors(table.begin(), table.end());
  v1::ConsistencyConfig consistency = rt_.options_.consistency;
  if (consistency.mode() == v1::CONSISTENCY_MODE_UNSPECIFIED) consistency.set_mode(v1::CONSISTENCY_MODE_SYNC);
  const PsClient::ValueSource values = [&](uint64_t b, uint64_t e, float* out) {
    if (rt_.sharded_) {  // the model's buffer was never filled
      rt_.model_.initial(b, e, out);
      return;
    }
    if (b < lo) rt_.model_.initial(b, std::min<uint64_t>(e, lo), out);
    if (e > hi) rt_.model_.initial(std::max<uint64_t>(b, hi), e, out + (std::max<uint64_t>(b, hi) - b));
    const uint64_t from = std::max<uint64_t>(b, lo), to = std::min<uint64_t>(e, hi);
    if (from < to) std::memcpy(out + (from - b), rt_.params_.data() + (from - lo), (to - from) * sizeof(float));
  };
  // A server of the epoch may not answer yet (its gRPC channel still
  // connecting, a loaded host): UNAVAILABLE is retried with backoff while
  // the epoch lasts, up to train.epoch_wait. Initialising is idempotent
  // (a server takes the first values it gets), and nothing collective has
  // run yet, so a retry repeats nothing the other workers wait for. A
  // server that is really gone ends the epoch, which ends the retries.
  const auto initialize = [&] {
    if (!rt_.options_.resume_from.empty()) {
      return ps->InitializeFromCheckpoint(tensors, rt_.OptimizerFor(rt_.tp_size_), consistency,
                                          rt_.options_.resume_from);
    }
    return ps->Initialize(tensors, rt_.OptimizerFor(rt_.tp_size_), consistency, lo, hi, values);
  };
  auto initialized = initialize();
  const auto give_up = Clock::now() + rt_.options_.epoch_wait;
  auto backoff = std::chrono::milliseconds(100);
  while (!initialized.ok() && initialized.status().code() == StatusCode::kUnavailable &&
         Clock::now() + backoff < give_up && !rt_.stopped_ && !rt_.plane_.stopping()) {
    spdlog::warn("epoch {}: initialising the parameter servers: {}; retrying in {} ms", view.epoch.epoch(),
                 initialized.status().ToString(), backoff.count());
    if (rt_.plane_.WaitNewer(view.epoch.epoch(), backoff) || ps->epoch() != view.epoch.epoch()) {
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
    if (!rt_.options_.resume_from.empty() && checkpoint_fault && ps->epoch() == view.epoch.epoch()) {
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
                 rt_.options_.resume_from.empty() ? "" : " from checkpoint " + rt_.options_.resume_from);
    if (view.epoch.start_step() > 0) {
      // The job trained, yet these partitions had no state on any server:
      // both their copies were lost, and the values just given are not
      // the job's.
      recreated_ = true;
      spdlog::error("epoch {}: {} partition(s) had lost both their primary and their backup (the job is past step {})",
                    view.epoch.epoch(), *initialized, view.epoch.start_step());
    }
  }
  rt_.servers_initialized_ = true;
  return Status::Ok();
}

Status Runtime::ServerStep::Resync(const DataPlane::EpochView& view) {
  PsClient* ps = rt_.plane_.ps_client();
  if (ps == nullptr || ps->epoch() != view.epoch.epoch()) {
    return Aborted("epoch {} was superseded while joining its parameter-server group", view.epoch.epoch());
  }
  if (!rt_.servers_initialized_) TANDEM_RETURN_IF_ERROR(InitializeServers(view));
  // The stage's partitions as the servers hold them now, then agree on the
  // last step they applied: a step decided before the membership change is
  // complete even where its pull was cut off.
  const auto& map = view.epoch.shard_map();
  if (rt_.asynchronous() && recreated_) {
    // No consistent cut to roll back to: each worker's steps are its own.
    return DataLoss(
        "partitions lost both their primary and their backup (the servers holding both copies died together), "
        "and the asynchronous modes do not roll back to a checkpoint: the job cannot go on (restart it with "
        "train.resume_from)");
  }
  if (rt_.asynchronous()) {
    // Steps are each worker's own: go on from the highest any worker
    // completed, and past the epoch's start_step, at or below which the
    // servers' clocks count pushes as duplicates. The pulls name the step
    // this worker computes next, which moves its clocks there (and, with
    // bounded staleness, waits until every contributor's pull did).
    // A step of which this worker sent any push counts as done (its pushes
    // were applied, or lost with the old epoch): pushing it again could
    // apply it twice.
    int64_t mine = static_cast<int64_t>(std::max({rt_.completed_, sent_step_.load(), view.epoch.start_step()}));
    int64_t agreed = 0;
    TANDEM_RETURN_IF_ERROR(rt_.world_->AllReduce(&mine, &agreed, 1, comm::DType::kInt64, comm::ReduceOp::kMax)
                               .WithContext("agreeing on the step to go on from"));
    auto pulled = rt_.PullStage(map, static_cast<uint64_t>(agreed) + 1, nullptr, contributor_, stage_contributors_[0]);
    if (!pulled.ok()) return pulled.status();
    rt_.completed_ = static_cast<uint64_t>(agreed);
    return Status::Ok();
  }
  auto steps = rt_.PullStage(map, 0, nullptr);
  if (!steps.ok() && steps.status().code() == StatusCode::kFailedPrecondition &&
      steps.status().message().find("has not been initialised") != std::string::npos) {
    // A server came back empty (restarted): initialise it, which finds
    // out whether partitions it now holds lost both copies.
    rt_.servers_initialized_ = false;
    TANDEM_RETURN_IF_ERROR(InitializeServers(view));
    steps = rt_.PullStage(map, 0, nullptr);
  }
  if (!steps.ok()) return steps.status();
  int64_t recreated = recreated_ ? 1 : 0;
  int64_t any_recreated = 0;
  recreated_ = false;
  TANDEM_RETURN_IF_ERROR(rt_.world_->AllReduce(&recreated, &any_recreated, 1, comm::DType::kInt64, comm::ReduceOp::kMax)
                             .WithContext("agreeing on whether partitions were lost"));
  if (any_recreated != 0) {
    TANDEM_RETURN_IF_ERROR(RollBack(view));
    steps = rt_.PullStage(map, 0, nullptr);
    if (!steps.ok()) return steps.status().WithContext("pulling the parameters after the rollback");
  }
  int64_t mine = 0;
  for (int64_t step : *steps) {
    if (step != INT64_MAX) mine = std::max(mine, step);
  }
  int64_t agreed = 0;
  TANDEM_RETURN_IF_ERROR(rt_.world_->AllReduce(&mine, &agreed, 1, comm::DType::kInt64, comm::ReduceOp::kMax)
                             .WithContext("agreeing on the servers' last step"));
  // Each partition's step, the lowest any rank saw: every rank decides alike.
  std::vector<int64_t> seen(steps->begin(), steps->end());
  std::vector<int64_t> lowest(seen.size());
  TANDEM_RETURN_IF_ERROR(
      rt_.world_->AllReduce(seen.data(), lowest.data(), seen.size(), comm::DType::kInt64, comm::ReduceOp::kMin)
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
      // Only the old epoch's aggregation can complete the step now. Held by
      // the server that was the partition's primary when the step was
      // pushed: if that server is gone too (it died in the same membership
      // change as the workers), nothing can, and the job rolls back to its
      // latest checkpoint (or ends saying why) instead of waiting forever.
      std::set<uint64_t> servers_now;
      for (const auto& p : map.partitions()) {
        servers_now.insert(p.primary_member_id());
        servers_now.insert(p.backup_member_id());
      }
      int64_t gone = 0, any_gone = 0;
      for (size_t p = 0; p < behind.size(); ++p) {
        const uint32_t id = map.partitions(static_cast<int>(p)).id();
        if (behind[p] && id < rt_.pushed_primaries_.size() && rt_.pushed_primaries_[id] != 0 &&
            !servers_now.contains(rt_.pushed_primaries_[id])) {
          gone = 1;
        }
      }
      TANDEM_RETURN_IF_ERROR(rt_.world_->AllReduce(&gone, &any_gone, 1, comm::DType::kInt64, comm::ReduceOp::kMax)
                                 .WithContext("agreeing on whether the step's servers are gone"));
      if (any_gone != 0) {
        spdlog::error(
            "step {}: partitions {} never applied it, and the server that decided it died with workers that pushed "
            "it: no server holds the step's whole gradient",
            agreed, lagging);
        TANDEM_RETURN_IF_ERROR(RollBack(view));
        auto restored = rt_.PullStage(map, 0, nullptr);
        if (!restored.ok()) return restored.status().WithContext("pulling the parameters after the rollback");
        int64_t at = 0, everyone = 0;
        for (int64_t s : *restored) {
          if (s != INT64_MAX) at = std::max(at, s);
        }
        TANDEM_RETURN_IF_ERROR(rt_.world_->AllReduce(&at, &everyone, 1, comm::DType::kInt64, comm::ReduceOp::kMax)
                                   .WithContext("agreeing on the servers' step after the rollback"));
        rt_.completed_ = static_cast<uint64_t>(everyone);
        return Status::Ok();
      }
      auto again = rt_.PullStage(map, static_cast<uint64_t>(agreed), &behind);
      if (!again.ok()) {
        return again.status().WithContext(fmt::format(
            "waiting for partitions {} to apply step {} (if their server died in the same membership change as a "
            "worker, no server holds the step's whole gradient any more: restore the job from a checkpoint)",
            lagging, agreed));
      }
    }
  }
  rt_.completed_ = static_cast<uint64_t>(agreed);
  return Status::Ok();
}

namespace {

// The checkpoints in `dir` the runtime writes (step-NNNNNNNNNN), newest
// first: (step, path).
std::vector<std::pair<uint64_t, std::string>> CheckpointsNewestFirst(const std::string& dir) {
  static const std::regex kName(R"(step-(\d{1,19}))");
  std::vector<std::pair<uint64_t, std::string>> found;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    if (entry.is_directory(ec) && std::regex_match(name, m, kName)) {
      found.emplace_back(std::stoull(m[1].str()), entry.path().string());
    }
  }
  std::sort(found.begin(), found.end(), std::greater<>());
  return found;
}

}  // namespace

Status Runtime::ServerStep::RollBack(const DataPlane::EpochView& view) {
  // Global rank 0 restores every server of the epoch (primaries and
  // backups) from the newest checkpoint that restores; the others learn
  // its step. A checkpoint that is incomplete (a save cut short) is refused
  // by the servers, and the one before it is tried.
  PsClient* ps = rt_.plane_.ps_client();
  const std::string& dir = rt_.options_.checkpoint_dir;
  // The last step any rank completed (a rank restarted since knows none:
  // the epoch's start step then says how far the job had come).
  int64_t mine = static_cast<int64_t>(rt_.completed_), from = 0;
  TANDEM_RETURN_IF_ERROR(rt_.world_->AllReduce(&mine, &from, 1, comm::DType::kInt64, comm::ReduceOp::kMax)
                             .WithContext("agreeing on the last step before the rollback"));
  from = std::max<int64_t>(from, static_cast<int64_t>(view.epoch.start_step()));
  int64_t restored = -1;  // the checkpoint's step; -1: none restored
  std::string path;
  if (rt_.world_->rank() == 0 && !dir.empty()) {
    for (const auto& [step, candidate] : CheckpointsNewestFirst(dir)) {
      // One past the job's progress is another run's, not this one's.
      if (static_cast<int64_t>(step) > from) continue;
      Status s = ps->RestoreCheckpoint(candidate, /*skip_optimizer_state=*/false);
      if (s.ok()) {
        restored = static_cast<int64_t>(step);
        path = candidate;
        break;
      }
      spdlog::warn("epoch {}: checkpoint {} does not restore the job: {}", view.epoch.epoch(), candidate, s.ToString());
    }
  }
  int64_t agreed = -1;
  TANDEM_RETURN_IF_ERROR(rt_.world_->AllReduce(&restored, &agreed, 1, comm::DType::kInt64, comm::ReduceOp::kMax)
                             .WithContext("agreeing on the checkpoint restored"));
  if (agreed < 0) {
    return DataLoss(
        "partitions lost both their primary and their backup (the servers holding both copies died together) "
        "after step {}, and {}: the job cannot go on",
        from,
        dir.empty() ? std::string("no checkpoint directory is set (train.checkpoint_dir), so there is no checkpoint to "
                                  "restore them from")
                    : fmt::format("no checkpoint in train.checkpoint_dir {} restores them{}", dir,
                                  rt_.world_->rank() == 0 ? "" : " (see global rank 0's log)"));
  }
  Rollback r;
  r.from = static_cast<uint64_t>(from);
  r.to = static_cast<uint64_t>(agreed);
  r.checkpoint = path;
  spdlog::warn(
      "epoch {}: rolled the job back from step {} to checkpoint step {}{}: partitions had lost both copies; steps {} "
      "to {} are trained again",
      view.epoch.epoch(), r.from, r.to, path.empty() ? "" : " (" + path + ")", r.to + 1, r.from);
  rt_.rollback_ = std::move(r);
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

Result<bool> Runtime::ServerStep::PushStepAgainIfWhole(uint64_t step, size_t lagging, const std::string& which) {
  // The servers wait for every contributor of this epoch; the sums are the
  // old ones only if the workers are the same: none joined (each holds the
  // gradient) and none left (as many as before). Counting workers, not
  // contributors: in hybrid mode a node that lost a worker still contributes.
  int64_t whole = rt_.grads_step_ == step && rt_.grads_world_ == rt_.view_->rank.world_size() ? 1 : 0;
  int64_t everyone = 0;
  TANDEM_RETURN_IF_ERROR(rt_.world_->AllReduce(&whole, &everyone, 1, comm::DType::kInt64, comm::ReduceOp::kMin)
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
  rt_.step_ = step;
  rt_.step_lr_ = rt_.grads_lr_;  // the learning rate the step was pushed with
  pulls_posted_ = false;
  for (auto& b : rt_.buckets_) {
    b->pushes.clear();
    b->pulls.clear();
  }
  for (auto& b : rt_.buckets_) {
    TANDEM_RETURN_IF_ERROR(RunBucket(*b).WithContext(fmt::format("pushing step {} again", step)));
  }
  TANDEM_RETURN_IF_ERROR(FinishPushes().WithContext(fmt::format("pushing step {} again", step)));
  for (auto it = rt_.buckets_.rbegin(); it != rt_.buckets_.rend(); ++it) {
    TANDEM_RETURN_IF_ERROR(LandBucket(**it, step).WithContext(fmt::format("pushing step {} again", step)));
  }
  return true;
}

Status Runtime::AllReduceStep::BroadcastExternalState(int root) {
  const auto& external = *rt_.options_.external_optimizer;
  const bool sender = rt_.dp_->rank() == root;
  std::string state;
  if (sender) {
    auto saved = external.save();
    // Fatal (INVALID_ARGUMENT): the others would wait for a state that never comes; they fail with the broadcast.
    if (!saved.ok()) return InvalidArgument("saving the optimizer's state to send it: {}", saved.status().message());
    state = std::move(*saved);
  }
  int64_t bytes = static_cast<int64_t>(state.size());
  TANDEM_RETURN_IF_ERROR(
      rt_.dp_->Broadcast(&bytes, 1, comm::DType::kInt64, root).WithContext("broadcasting the optimizer state's size"));
  if (bytes < 0 || bytes > (int64_t{1} << 40)) return DataLoss("the optimizer state sent is {} bytes", bytes);
  // Whole 4-byte words: the collectives move typed elements.
  std::vector<int32_t> words((static_cast<size_t>(bytes) + 3) / 4, 0);
  if (sender && bytes > 0) std::memcpy(words.data(), state.data(), state.size());
  if (!words.empty()) {
    TANDEM_RETURN_IF_ERROR(rt_.dp_->Broadcast(words.data(), words.size(), comm::DType::kInt32, root)
                               .WithContext("broadcasting the optimizer state"));
  }
  if (sender) return Status::Ok();
  Status loaded =
      external.load(std::string_view(reinterpret_cast<const char*>(words.data()), static_cast<size_t>(bytes)));
  if (!loaded.ok()) return InvalidArgument("loading the optimizer state received: {}", loaded.message());
  return Status::Ok();
}

Status Runtime::AllReduceStep::Resync(const DataPlane::EpochView&) {
  int64_t mine = static_cast<int64_t>(rt_.completed_);
  int64_t agreed = 0;
  TANDEM_RETURN_IF_ERROR(rt_.world_->AllReduce(&mine, &agreed, 1, comm::DType::kInt64, comm::ReduceOp::kMax)
                             .WithContext("agreeing on the last completed step"));
  // The lowest rank of the stage's data-parallel group that holds the
  // stage's state after that step sends it to the others.
  int64_t candidate = mine == agreed && rt_.stage_valid_ ? rt_.dp_->rank() : INT64_MAX;
  int64_t root = 0;
  TANDEM_RETURN_IF_ERROR(rt_.dp_->AllReduce(&candidate, &root, 1, comm::DType::kInt64, comm::ReduceOp::kMin)
                             .WithContext("choosing the rank that broadcasts the parameters"));
  if (root == INT64_MAX) {
    // Fatal: waiting for another epoch brings nothing back.
    return DataLoss(
        "{}: no worker holds its parameters after step {} (in allreduce mode only the workers hold them, and every "
        "worker that trained this part of the model is gone or moved): restart from a checkpoint, or train in hybrid "
        "or ps mode, where the servers keep every part",
        PartName(rt_.stage_, rt_.stages_, rt_.tp_rank_, rt_.tp_size_), agreed);
  }
  const int r = static_cast<int>(root);
  TANDEM_RETURN_IF_ERROR(rt_.dp_->Broadcast(rt_.params_.data(), rt_.params_.size(), comm::DType::kFloat32, r)
                             .WithContext("broadcasting the parameters"));
  for (auto* state : {&local_->state0(), &local_->state1()}) {
    if (state->empty()) continue;
    TANDEM_RETURN_IF_ERROR(rt_.dp_->Broadcast(state->data(), state->size(), comm::DType::kFloat32, r)
                               .WithContext("broadcasting the optimizer state"));
  }
  int64_t updates = static_cast<int64_t>(local_->updates());
  TANDEM_RETURN_IF_ERROR(
      rt_.dp_->Broadcast(&updates, 1, comm::DType::kInt64, r).WithContext("broadcasting the optimizer's update count"));
  local_->set_updates(static_cast<uint64_t>(updates));
  if (rt_.options_.external_optimizer) TANDEM_RETURN_IF_ERROR(BroadcastExternalState(r));
  rt_.completed_ = static_cast<uint64_t>(agreed);
  rt_.stage_valid_ = true;
  return Status::Ok();
}

}  // namespace tandem::worker
