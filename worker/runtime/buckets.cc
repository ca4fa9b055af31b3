// The runtime's buckets (buckets.h): each mode's plan of them at a resync,
// and the communication thread's work on them during a step: sending a
// bucket whose gradients are final (an all-reduce, or the node's
// reduce-scatter and the pushes) and landing the parameters pulled back.
#include "worker/runtime/buckets.h"

#include <algorithm>
#include <cstring>

#include "common/optimizer/gradient.h"
#include "worker/runtime/step.h"
#include "worker/runtime/trace_spans.h"

namespace tandem::worker {

Status Runtime::AllReduceStep::PlanBuckets(const DataPlane::EpochView&) {
  rt_.buckets_.clear();
  const size_t n = rt_.params_.size();
  const size_t per_bucket = std::max<size_t>(1, rt_.options_.bucket_bytes / sizeof(float));
  for (size_t end = n; end > 0;) {
    auto b = std::make_unique<Bucket>();
    b->end = end;
    b->begin = end > per_bucket ? end - per_bucket : 0;
    if (rt_.options_.gradient_wire == v1::WIRE_DTYPE_BF16) b->wire_out.resize(b->end - b->begin);
    end = b->begin;
    rt_.buckets_.push_back(std::move(b));
  }
  return Status::Ok();
}

Status Runtime::ServerStep::PlanBuckets(const DataPlane::EpochView& view) {
  rt_.buckets_.clear();
  const size_t n = rt_.params_.size();
  const size_t per_bucket = std::max<size_t>(1, rt_.options_.bucket_bytes / sizeof(float));
  const auto& map = view.epoch.shard_map();
  if (view.epoch.server_count() == 0 || map.partitions_size() == 0) {
    return FailedPrecondition(
        "{} mode needs parameter servers, but epoch {} has none (start servers and give the coordinator "
        "job.parameter_count)",
        ModeName(rt_.options_.mode), view.epoch.epoch());
  }
  const size_t total = rt_.bounds_.back();
  if (map.parameter_count() != total) {
    return InvalidArgument(
        "the shard map covers {} parameters, but the model has {} (set the coordinator's "
        "job.parameter_count to {})",
        map.parameter_count(), total, total);
  }
  const int local = LocalRanks();
  const int me = LocalRank();
  const bool bf16_out = rt_.options_.gradient_wire == v1::WIRE_DTYPE_BF16;
  const bool bf16_in = rt_.options_.parameter_wire == v1::WIRE_DTYPE_BF16;
  const size_t lo = rt_.base_, hi = rt_.base_ + n;  // this stage's elements
  rt_.places_.assign(static_cast<size_t>(map.partitions_size()), PartitionPlace{});
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
      rt_.places_[static_cast<size_t>(p)] = PartitionPlace{b.get(), b->partitions.size()};
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
    const bool packed = local > 1 || rt_.sharded_;
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
        o.grad = rt_.grads_.data() + b->cuts[k].first;
        o.param = rt_.params_.data() + b->cuts[k].first;
      } else {
        o.edge_grad.assign(o.count, 0.0f);
        o.edge_param.assign(o.count, 0.0f);
        o.grad = o.edge_grad.data();
        o.param = o.edge_param.data();
      }
      // The partition's contributors: those of every part it overlaps,
      // numbered part after part.
      for (size_t q = 0; q + 1 < rt_.bounds_.size(); ++q) {
        if (rt_.bounds_[q + 1] <= b->ranges[k].first || rt_.bounds_[q] >= b->ranges[k].second) continue;
        if (q == static_cast<size_t>(rt_.stage_ * rt_.tp_size_ + rt_.tp_rank_))
          o.contributor = o.contributors + contributor_;
        o.contributors += stage_contributors_[q];
      }
      o.wire_offset = wire;
      wire += o.count;
      b->owned.push_back(std::move(o));
    }
    if (bf16_out) b->wire_out.resize(wire);
    if (bf16_in) b->wire_in.resize(wire);
    rt_.buckets_.push_back(std::move(b));
    last = first - 1;
  }
  staging_.assign(largest, 0.0f);
  block_scratch_.assign(largest_block, 0.0f);
  return Status::Ok();
}

Status Runtime::AllReduceStep::RunBucket(Bucket& b) {
  const size_t count = b.end - b.begin;
  float* g = rt_.grads_.data() + b.begin;
  const int64_t start = TraceStart(rt_.step_);
  if (rt_.options_.gradient_wire == v1::WIRE_DTYPE_BF16) {
    optim::EncodeWire(b.wire_out.data(), g, v1::WIRE_DTYPE_BF16, count);
    Status reduced =
        rt_.dp_->AllReduce(b.wire_out.data(), b.wire_out.data(), count, comm::DType::kBFloat16, comm::ReduceOp::kSum);
    TraceCollective("allreduce", *rt_.dp_, rt_.step_, start, count * sizeof(uint16_t), reduced.ok());
    TANDEM_RETURN_IF_ERROR(reduced);
    rt_.NoteWait(*rt_.dp_);
    optim::AccumulateWire(g, b.wire_out.data(), v1::WIRE_DTYPE_BF16, count, /*overwrite=*/true);
    return Status::Ok();
  }
  Status reduced = rt_.dp_->AllReduce(g, g, count, comm::DType::kFloat32, comm::ReduceOp::kSum);
  TraceCollective("allreduce", *rt_.dp_, rt_.step_, start, count * sizeof(float), reduced.ok());
  if (reduced.ok()) rt_.NoteWait(*rt_.dp_);
  return reduced;
}

Status Runtime::ServerStep::RunBucket(Bucket& b) {
  trace::Span span("bucket", "step", rt_.step_);
  span.Add("elements", static_cast<int64_t>(b.end - b.begin));
  span.Add("partitions", static_cast<int64_t>(b.partitions.size()));
  const int local = LocalRanks();
  if (local > 1 || rt_.sharded_) {
    // Pack: local rank j's partitions side by side in block j (a partition
    // only partly in this stage with zeros around its part).
    for (size_t k = 0; k < b.partitions.size(); ++k) {
      const size_t owner = b.owner[k];
      float* slot = staging_.data() + owner * b.block + b.slot[k];
      const size_t whole = b.ranges[k].second - b.ranges[k].first;
      const size_t part = b.cuts[k].second - b.cuts[k].first;
      if (part != whole) std::fill(slot, slot + whole, 0.0f);
      std::memcpy(slot + b.cut_offset[k], rt_.grads_.data() + b.cuts[k].first, part * sizeof(float));
    }
    if (rt_.sharded_) rt_.grad_pages_->Release(b.begin, b.end);  // packed: this worker's copy is no longer needed
    // Straight into this rank's share when it fills the block (no copy);
    // through one block of scratch when its share is smaller.
    float* out = b.share == b.block ? b.mine.data() : block_scratch_.data();
    const int64_t start = TraceStart(rt_.step_);
    Status reduced =
        rt_.node_->ReduceScatter(staging_.data(), out, b.block, comm::DType::kFloat32, comm::ReduceOp::kSum);
    TraceCollective("reduce_scatter", *rt_.node_, rt_.step_, start, b.block * local * sizeof(float), reduced.ok());
    TANDEM_RETURN_IF_ERROR(reduced);
    rt_.NoteWait(*rt_.node_);
    if (out != b.mine.data()) std::copy_n(out, b.share, b.mine.begin());
  }
  for (auto& o : b.owned) {
    if (o.edge_grad.empty()) continue;
    const auto [from, to] = b.cuts[o.cut];
    std::memcpy(o.edge_grad.data() + b.cut_offset[o.cut], rt_.grads_.data() + from, (to - from) * sizeof(float));
  }
  PsClient* ps = rt_.plane_.ps_client();
  const bool bf16_out = rt_.options_.gradient_wire == v1::WIRE_DTYPE_BF16;
  for (const auto& o : b.owned) {
    const void* src = o.grad;
    size_t bytes = o.count * sizeof(float);
    if (bf16_out) {
      optim::EncodeWire(b.wire_out.data() + o.wire_offset, o.grad, v1::WIRE_DTYPE_BF16, o.count);
      src = b.wire_out.data() + o.wire_offset;
      bytes = o.count * sizeof(uint16_t);
    }
    b.pushes.push_back(ps->Push(o.partition, rt_.step_, o.contributor, o.contributors, rt_.options_.gradient_wire, src,
                                bytes, rt_.step_lr_));
  }
  if (!b.owned.empty()) sent_step_ = std::max(sent_step_.load(), rt_.step_);
  if (!pulls_posted_ && !rt_.asynchronous()) {  // asynchronous: after the pushes are applied (EnqueueFinish)
    PostPulls();
    pulls_posted_ = true;
  }
  return Status::Ok();
}

void Runtime::ServerStep::PostPulls() {
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
  // pull names the step this worker computes next, s = rt_.step_ + 1, and the
  // servers answer it once every contributor's updates up to s - k - 1 are
  // in, the condition on which they take this worker's push of s.
  PsClient* ps = rt_.plane_.ps_client();
  const bool bf16_in = rt_.options_.parameter_wire == v1::WIRE_DTYPE_BF16;
  const bool async = rt_.asynchronous();
  const uint64_t step = async ? rt_.step_ + 1 : rt_.step_;
  for (auto it = rt_.buckets_.rbegin(); it != rt_.buckets_.rend(); ++it) {
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

Status Runtime::ServerStep::FinishPushes() {
  for (auto& bp : rt_.buckets_) {
    Bucket& b = *bp;
    for (size_t i = 0; i < b.pushes.size(); ++i) {
      trace::Span wait("push_wait", "ps", rt_.step_);
      wait.Add("partition", b.owned[i].partition);
      wait.Add("corr", static_cast<int64_t>(b.pushes[i]->correlation()));
      Status pushed = b.pushes[i]->Wait(rt_.options_.timeout);
      if (!pushed.ok())
        return pushed.WithContext(fmt::format("step {}: pushing partition {}", rt_.step_, b.owned[i].partition));
    }
    b.pushes.clear();
  }
  return Status::Ok();
}

Status Runtime::ServerStep::LandBucket(Bucket& b, uint64_t step) {
  trace::Span span("land", "step", step);
  span.Add("elements", static_cast<int64_t>(b.end - b.begin));
  for (size_t i = 0; i < b.pulls.size(); ++i) {
    const auto& o = b.owned[i];
    trace::Span wait("pull_wait", "ps", step);
    wait.Add("partition", o.partition);
    wait.Add("corr", static_cast<int64_t>(b.pulls[i]->correlation()));
    Status pulled = b.pulls[i]->Wait(rt_.options_.timeout);
    wait.End();
    if (!pulled.ok()) return pulled.WithContext(fmt::format("step {}: pulling partition {}", step, o.partition));
    if (rt_.options_.parameter_wire == v1::WIRE_DTYPE_BF16) {
      optim::AccumulateWire(o.param, b.wire_in.data() + o.wire_offset, v1::WIRE_DTYPE_BF16, o.count, true);
    }
    if (!o.edge_param.empty()) {
      const auto [from, to] = b.cuts[o.cut];
      std::memcpy(rt_.params_.data() + from, o.edge_param.data() + b.cut_offset[o.cut], (to - from) * sizeof(float));
    }
  }
  b.pulls.clear();
  if (LocalRanks() > 1 && !rt_.sharded_) {  // sharded: the pulled partitions stay the shard
    const float* in = b.pulled.data();
    if (b.share != b.block) {
      std::copy(b.pulled.begin(), b.pulled.end(), block_scratch_.begin());
      in = block_scratch_.data();
    }
    const int64_t start = TraceStart(step);
    Status gathered = rt_.node_->AllGather(in, staging_.data(), b.block, comm::DType::kFloat32);
    TraceCollective("all_gather", *rt_.node_, step, start, b.block * LocalRanks() * sizeof(float), gathered.ok());
    TANDEM_RETURN_IF_ERROR(gathered);
    for (size_t k = 0; k < b.partitions.size(); ++k) {
      const size_t owner = b.owner[k];
      std::memcpy(rt_.params_.data() + b.cuts[k].first, staging_.data() + owner * b.block + b.slot[k] + b.cut_offset[k],
                  (b.cuts[k].second - b.cuts[k].first) * sizeof(float));
    }
  }
  return Status::Ok();
}

}  // namespace tandem::worker
