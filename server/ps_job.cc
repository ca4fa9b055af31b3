// ParameterStore, the job: configuration, initialisation, identity and
// statistics (the gRPC control plane), and a job sent by a primary.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>

#include <google/protobuf/util/message_differencer.h>
#include <spdlog/spdlog.h>

#include "common/crc32c.h"
#include "common/failpoint.h"
#include "common/optimizer/gradient.h"
#include "server/checkpoint/checkpoint.h"
#include "server/ps_core.h"
#include "server/ps_core_internal.h"

namespace tandem::server {

using namespace store_internal;  // NOLINT(google-build-using-namespace)

Status ParameterStore::Configure(const std::string& job_id,
                                 const google::protobuf::RepeatedPtrField<v1::TensorSpec>& tensors,
                                 const v1::OptimizerConfig& optimizer, const v1::ConsistencyConfig& consistency) {
  if (job_id.empty() || job_id.size() > 128) return InvalidArgument("job_id: must be 1 to 128 bytes");
  if (tensors.empty()) return InvalidArgument("tensors: the job declares no tensors");
  if (static_cast<size_t>(tensors.size()) > kMaxTensors) {
    return InvalidArgument("tensors: {} entries, at most {}", tensors.size(), kMaxTensors);
  }
  uint64_t total = 0;
  std::set<std::string> names;
  for (int i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    if (t.name().empty() || t.name().size() > 512) {
      return InvalidArgument("tensors[{}].name: must be 1 to 512 bytes", i);
    }
    if (!names.insert(t.name()).second) return InvalidArgument("tensors[{}].name: '{}' is declared twice", i, t.name());
    if (t.shape_size() > 8)
      return InvalidArgument("tensors[{}] ('{}'): {} dimensions, at most 8", i, t.name(), t.shape_size());
    uint64_t n = 1;
    for (int64_t d : t.shape()) {
      if (d < 0) return InvalidArgument("tensors[{}] ('{}'): dimension {} is negative", i, t.name(), d);
      if (d > 0 && n > (uint64_t{1} << 40) / static_cast<uint64_t>(d)) {
        return InvalidArgument("tensors[{}] ('{}'): more than 2^40 elements", i, t.name());
      }
      n *= static_cast<uint64_t>(d);
    }
    if (t.dtype() != v1::DTYPE_FLOAT32 && t.dtype() != v1::DTYPE_FLOAT16 && t.dtype() != v1::DTYPE_BFLOAT16) {
      return InvalidArgument("tensors[{}] ('{}'): dtype {} is not FLOAT32, FLOAT16 or BFLOAT16", i, t.name(),
                             v1::DType_Name(t.dtype()));
    }
    if (t.group().size() > 128) return InvalidArgument("tensors[{}] ('{}'): group longer than 128 bytes", i, t.name());
    total += n;
  }
  if (total > (uint64_t{1} << 40)) return InvalidArgument("tensors: {} elements, more than 2^40", total);
  auto opt = Optimizer::Create(optimizer);
  if (!opt.ok()) return opt.status();
  v1::ConsistencyConfig normal = consistency;
  if (normal.mode() == v1::CONSISTENCY_MODE_UNSPECIFIED) normal.set_mode(v1::CONSISTENCY_MODE_SYNC);
  if (!v1::ConsistencyMode_IsValid(normal.mode())) {
    return InvalidArgument("consistency.mode: {} is not a known mode", static_cast<int>(normal.mode()));
  }
  if (normal.mode() == v1::CONSISTENCY_MODE_BOUNDED_STALENESS &&
      (normal.staleness_bound() < 1 || normal.staleness_bound() > 1'000'000)) {
    return InvalidArgument("consistency.staleness_bound: {} must be 1 to 1,000,000 in bounded-staleness mode",
                           normal.staleness_bound());
  }
  if (!IsSync(normal)) {
    normal.set_staleness_bound(normal.mode() == v1::CONSISTENCY_MODE_ASYNC ? 0 : normal.staleness_bound());
    if (opt->max_grad_norm() > 0) {
      return InvalidArgument(
          "optimizer.max_grad_norm: global gradient-norm clipping needs whole steps, so it works only in "
          "CONSISTENCY_MODE_SYNC (the job asks for {} mode)",
          ModeName(normal.mode()));
    }
  } else {
    normal.set_staleness_bound(0);
  }

  MutexLock lock(&mu_);
  if (map_.parameter_count() != 0 && total != map_.parameter_count()) {
    return InvalidArgument("tensors: {} elements in all, but the job's parameter space has {}", total,
                           map_.parameter_count());
  }
  if (configured_) {
    if (job_id != job_id_) return FailedPrecondition("this server serves job '{}', not '{}'", job_id_, job_id);
    if (Fingerprint(tensors) != fingerprint_ || tensors.size() != tensors_.size()) {
      return FailedPrecondition("tensors: the tensor table differs from the one the job was initialised with");
    }
    // Compared field by field: the serialised form of a map (group_overrides)
    // has no fixed order, so equal configurations can serialise apart.
    if (!google::protobuf::util::MessageDifferencer::Equals(optimizer, optimizer_config_)) {
      return FailedPrecondition("optimizer: differs from the configuration the job was initialised with");
    }
    if (!google::protobuf::util::MessageDifferencer::Equals(normal, consistency_)) {
      return FailedPrecondition("consistency: differs from the mode the job was initialised with ({})",
                                ModeName(consistency_.mode()));
    }
    return Status::Ok();
  }
  configured_ = true;
  job_id_ = job_id;
  tensors_ = tensors;
  tensor_offsets_.clear();
  uint64_t offset = 0;
  for (const auto& t : tensors_) {
    tensor_offsets_.push_back(offset);
    offset += TensorElements(t);
  }
  fingerprint_ = Fingerprint(tensors);
  optimizer_.emplace(std::move(opt).value());
  optimizer_config_ = optimizer;
  consistency_ = normal;
  opt_.store(&*optimizer_);
  mode_.store(normal.mode());
  bound_.store(normal.staleness_bound());
  for (auto& [id, part] : parts_) {
    MutexLock plock(&part->mu);
    part->segments = SegmentsFor(part->state.begin, part->state.end);
  }
  spdlog::info("job '{}': {} tensors, {} elements, optimizer {}, {} mode", job_id, tensors.size(), total,
               optimizer_->name(), ModeName(consistency_.mode()));
  return Status::Ok();
}

Result<ParameterStore::JobIdentity> ParameterStore::Identity() const {
  MutexLock lock(&mu_);
  if (!configured_) return FailedPrecondition("the job has not been initialised on this server");
  JobIdentity id;
  id.job_id = job_id_;
  id.parameter_count = map_.parameter_count();
  id.partition_size = map_.partition_size();
  id.fingerprint = fingerprint_;
  id.optimizer = std::string(optimizer_->name());
  id.state_buffers = optimizer_->state_buffers();
  return id;
}

Result<v1::InitializeParametersResponse> ParameterStore::Initialize(const v1::InitializeParametersRequest& request) {
  if (request.epoch() == 0) return InvalidArgument("epoch: must be >= 1");
  {
    MutexLock lock(&mu_);
    if (request.epoch() < epoch_) {
      return FailedPrecondition("epoch: {} is stale, this server is at epoch {}; use the current shard map",
                                request.epoch(), epoch_);
    }
    if (request.epoch() > epoch_) {
      return Unavailable("epoch: this server has not reached epoch {} yet (it is at {}); retry", request.epoch(),
                         epoch_);
    }
  }
  TANDEM_RETURN_IF_ERROR(Configure(request.job_id(), request.tensors(), request.optimizer(), request.consistency()));

  // Which partitions.
  std::vector<uint32_t> held = Held(false);
  std::vector<uint32_t> ids;
  if (request.partition_ids().empty()) {
    ids = held;
  } else {
    for (uint32_t id : request.partition_ids()) {
      if (!std::binary_search(held.begin(), held.end(), id)) {
        MutexLock lock(&mu_);
        if (id >= static_cast<uint32_t>(map_.partitions_size())) {
          return NotFound("partition_ids: partition {} does not exist (the job has {})", id, map_.partitions_size());
        }
        return FailedPrecondition("partition_ids: partition {} is not held by this server (member {}) in epoch {}", id,
                                  member_id_, epoch_);
      }
      ids.push_back(id);
    }
    std::sort(ids.begin(), ids.end());
    ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  }

  int buffers = 0;
  uint64_t parameter_count = 0;
  {
    MutexLock lock(&mu_);
    buffers = optimizer_->state_buffers();
    parameter_count = map_.parameter_count();
  }
  // From a checkpoint, partitions that hold state already keep it (the first
  // initialisation wins) and are not read again: a later worker (one that
  // joins, or changes stage) does not depend on the files still being there.
  std::vector<uint32_t> kept;
  if (request.source_case() == v1::InitializeParametersRequest::kCheckpointPath) {
    std::erase_if(ids, [&](uint32_t id) {
      auto part = Find(id);
      if (!part) return false;  // reported below
      MutexLock plock(&part->mu);
      if (part->state.version == 0) return false;
      kept.push_back(id);
      return true;
    });
  }
  // Build every partition's initial state before touching any.
  std::vector<PartitionState> fresh;
  fresh.reserve(ids.size());
  for (uint32_t id : ids) {
    TANDEM_ASSIGN_OR_RETURN(auto range, RangeOf(id));
    PartitionState s;
    s.id = id;
    s.begin = range.first;
    s.end = range.second;
    fresh.push_back(std::move(s));
  }
  if (request.source_case() == v1::InitializeParametersRequest::kValues) {
    const auto& chunks = request.values().chunks();
    if (chunks.size() > 4096) return InvalidArgument("values.chunks: {} chunks, at most 4096", chunks.size());
    // Coverage per partition, checked for overlaps.
    std::vector<std::vector<std::pair<uint64_t, uint64_t>>> covered(fresh.size());
    for (auto& s : fresh) s.weights.assign(s.size(), 0.0f);
    for (int c = 0; c < chunks.size(); ++c) {
      const auto& chunk = chunks[c];
      const uint64_t b = chunk.range().begin(), e = chunk.range().end();
      if (e < b || e > parameter_count) {
        return InvalidArgument("values.chunks[{}].range: [{}, {}) is not within the parameter space [0, {})", c, b, e,
                               parameter_count);
      }
      if (chunk.dtype() != v1::DTYPE_FLOAT32 && chunk.dtype() != v1::DTYPE_FLOAT16 &&
          chunk.dtype() != v1::DTYPE_BFLOAT16) {
        return InvalidArgument("values.chunks[{}].dtype: {} is not FLOAT32, FLOAT16 or BFLOAT16", c,
                               v1::DType_Name(chunk.dtype()));
      }
      const size_t width = ValueBytes(chunk.dtype());
      if (chunk.data().size() != (e - b) * width) {
        return InvalidArgument("values.chunks[{}].data: {} bytes, expected {} ({} elements of {} bytes)", c,
                               chunk.data().size(), (e - b) * width, e - b, width);
      }
      for (size_t i = 0; i < fresh.size(); ++i) {
        auto& s = fresh[i];
        const uint64_t lo = std::max(b, s.begin), hi = std::min(e, s.end);
        if (lo >= hi) continue;
        for (auto [cb, ce] : covered[i]) {
          if (lo < ce && cb < hi) {
            return InvalidArgument("values.chunks[{}]: elements [{}, {}) are covered twice", c, std::max(lo, cb),
                                   std::min(hi, ce));
          }
        }
        covered[i].emplace_back(lo, hi);
        WidenValues(chunk.dtype(), chunk.data().data() + (lo - b) * width, s.weights.data() + (lo - s.begin), hi - lo);
      }
    }
    for (size_t i = 0; i < fresh.size(); ++i) {
      uint64_t n = 0;
      for (auto [cb, ce] : covered[i]) n += ce - cb;
      if (n != fresh[i].size()) {
        return InvalidArgument("values: partition {} ([{}, {})) is not fully covered: {} of {} elements given",
                               fresh[i].id, fresh[i].begin, fresh[i].end, n, fresh[i].size());
      }
      fresh[i].version = 1;
      fresh[i].step = 0;
      if (buffers >= 1) fresh[i].state0.assign(fresh[i].size(), 0.0f);
      if (buffers >= 2) fresh[i].state1.assign(fresh[i].size(), 0.0f);
    }
  } else if (request.source_case() == v1::InitializeParametersRequest::kCheckpointPath) {
    const std::string& path = request.checkpoint_path();
    if (path.empty() || path.size() > 4096) return InvalidArgument("checkpoint_path: must be 1 to 4096 bytes");
  } else {
    return InvalidArgument("source: set either values or checkpoint_path");
  }
  if (request.source_case() == v1::InitializeParametersRequest::kCheckpointPath && !fresh.empty()) {
    const std::string& path = request.checkpoint_path();
    TANDEM_ASSIGN_OR_RETURN(auto reader, CheckpointReader::Open(path));
    TANDEM_ASSIGN_OR_RETURN(auto identity, Identity());
    const auto& meta = reader.meta();
    if (meta.tensor_fingerprint != identity.fingerprint || meta.parameter_count != identity.parameter_count) {
      return FailedPrecondition("checkpoint_path: {} holds a different parameter space ({} elements) than the job ({})",
                                path, meta.parameter_count, identity.parameter_count);
    }
    const bool with_state =
        meta.optimizer == identity.optimizer && static_cast<int>(meta.state_buffers) == identity.state_buffers;
    if (!with_state) {
      spdlog::warn("checkpoint {} was written with optimizer {}, the job uses {}: weights only, fresh optimizer state",
                   path, meta.optimizer, identity.optimizer);
    }
    for (auto& s : fresh) {
      TANDEM_ASSIGN_OR_RETURN(PartitionState loaded, reader.Read(s.id, s.begin, s.end, with_state));
      s = std::move(loaded);
      if (s.version == 0) s.version = 1;
      if (!with_state) {
        s.state0.assign(buffers >= 1 ? s.size() : 0, 0.0f);
        s.state1.assign(buffers >= 2 ? s.size() : 0, 0.0f);
      }
    }
  }

  v1::InitializeParametersResponse response;
  for (uint32_t id : kept) {
    auto part = Find(id);
    if (!part) return FailedPrecondition("partition {} is no longer held by this server", id);
    auto* out = response.add_partitions();
    out->set_partition_id(id);
    MutexLock plock(&part->mu);
    out->set_version(part->state.version);
    out->set_step(part->state.step);
  }
  for (auto& s : fresh) {
    auto part = Find(s.id);
    if (!part) return FailedPrecondition("partition {} is no longer held by this server", s.id);
    auto* out = response.add_partitions();
    out->set_partition_id(s.id);
    MutexLock plock(&part->mu);
    if (part->state.version == 0) {
      UnlendLocked(*part, /*keep_values=*/false);
      part->state.weights = std::move(s.weights);
      part->state.state0 = std::move(s.state0);
      part->state.state1 = std::move(s.state1);
      part->state.version = s.version;
      part->state.step = s.step;
      part->safe_step = s.step;
      out->set_newly_initialized(true);
    }
    out->set_version(part->state.version);
    out->set_step(part->state.step);
  }
  return response;
}

v1::GetStatsResponse ParameterStore::Stats(const std::vector<uint32_t>& partition_ids, bool checksums) const {
  v1::GetStatsResponse response;
  std::vector<std::shared_ptr<Part>> parts;
  {
    MutexLock lock(&mu_);
    response.set_member_id(member_id_);
    response.set_epoch(epoch_);
    if (configured_) {
      response.set_optimizer(std::string(optimizer_->name()));
      *response.mutable_consistency() = consistency_;
    }
    for (auto& [id, part] : parts_) {
      if (partition_ids.empty() || std::find(partition_ids.begin(), partition_ids.end(), id) != partition_ids.end()) {
        parts.push_back(part);
      }
    }
  }
  uint64_t min_step = UINT64_MAX;
  uint64_t bytes = 0;
  for (auto& part : parts) {
    MutexLock plock(&part->mu);
    auto* s = response.add_partitions();
    s->set_partition_id(part->state.id);
    s->mutable_range()->set_begin(part->state.begin);
    s->mutable_range()->set_end(part->state.end);
    s->set_role(part->role);
    s->set_version(part->state.version);
    s->set_step(part->state.step);
    s->set_bytes_pushed(part->bytes_pushed);
    s->set_bytes_pulled(part->bytes_pulled);
    s->set_pushes(part->pushes);
    s->set_pulls(part->pulls_served);
    s->set_replication_lag(part->role == v1::REPLICA_ROLE_PRIMARY && part->state.step > part->safe_step
                               ? part->state.step - part->safe_step
                               : 0);
    if (checksums) {
      uint32_t crc = Crc32c(part->state.weights.data(), part->state.weights.size() * sizeof(float));
      crc = Crc32c(part->state.state0.data(), part->state.state0.size() * sizeof(float), crc);
      s->set_state_crc32c(Crc32c(part->state.state1.data(), part->state.state1.size() * sizeof(float), crc));
    }
    if (part->role == v1::REPLICA_ROLE_PRIMARY) min_step = std::min(min_step, part->state.step);
    bytes += (part->state.weights.size() + part->state.state0.size() + part->state.state1.size()) * sizeof(float);
  }
  response.set_step(min_step == UINT64_MAX ? 0 : min_step);
  response.set_skipped_steps(counters_.skipped_steps.load());
  response.set_state_bytes(bytes);
  return response;
}

uint64_t ParameterStore::ReplicationLag() const {
  std::vector<std::shared_ptr<Part>> parts;
  {
    MutexLock lock(&mu_);
    for (auto& [id, part] : parts_) parts.push_back(part);
  }
  uint64_t lag = 0;
  for (auto& part : parts) {
    MutexLock plock(&part->mu);
    if (part->role == v1::REPLICA_ROLE_PRIMARY && part->state.step > part->safe_step) {
      lag += part->state.step - part->safe_step;
    }
  }
  return lag;
}

void ParameterStore::Job(uint64_t from, const void* payload, size_t bytes) {
  v1::InitializeParametersRequest request;
  if (!request.ParseFromArray(payload, static_cast<int>(bytes))) {
    spdlog::warn("member {} sent a job configuration that does not parse; ignored", from);
    return;
  }
  Status status = Configure(request.job_id(), request.tensors(), request.optimizer(), request.consistency());
  if (!status.ok()) spdlog::warn("member {} sent a job configuration this server refuses: {}", from, status.ToString());
}

}  // namespace tandem::server
