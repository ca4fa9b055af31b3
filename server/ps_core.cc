#include "server/ps_core.h"

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

namespace tandem::server {

using optim::AccumulateWire;
using optim::EncodeWire;
using optim::GradScan;
using optim::GroupParams;
using optim::Optimizer;
using optim::ScanGradient;
using optim::ThreadPool;
using optim::WireBytes;

namespace {

constexpr uint32_t kMaxContributors = 1u << 16;
constexpr size_t kMaxTensors = 1'000'000;
constexpr size_t kApplyGrain = 1u << 15;  // elements per optimizer task
// Released gradient buffers kept for reuse (ParameterStore::Buffer).
constexpr size_t kMaxSpareBytes = size_t{128} << 20;
constexpr size_t kMaxSpares = 64;

// fp32 on the wire (UNSPECIFIED means fp32): bytes the store can use as floats.
bool Fp32Wire(uint16_t dtype) {
  return dtype == v1::WIRE_DTYPE_FP32 || dtype == v1::WIRE_DTYPE_UNSPECIFIED;
}

// Whether a push's payload `data` (of `dtype`, n elements) sits in `buffer`
// (from PushBuffer), so that the store may keep the buffer instead of copying.
bool Keepable(const std::shared_ptr<std::vector<float>>& buffer, const void* data, uint16_t dtype, size_t n) {
  return buffer && buffer->data() == data && buffer->size() == n && Fp32Wire(dtype);
}

// Takes `lock` (over its mutex, not yet held): waits for it when `wait`,
// else only tries. Returns whether it holds it.
bool Acquire(std::unique_lock<std::mutex>& lock, bool wait) {
  if (!wait) return lock.try_lock();
  lock.lock();
  return true;
}

// Appends `work` to what `later` holds.
void Defer(std::function<void()>* later, std::function<void()> work) {
  if (*later) {
    *later = [first = std::move(*later), second = std::move(work)] {
      first();
      second();
    };
  } else {
    *later = std::move(work);
  }
}

bool ValidWireDType(uint16_t dtype) {
  return dtype <= v1::WIRE_DTYPE_FP16;
}

v1::WireDType Wire(uint16_t dtype) {
  return static_cast<v1::WireDType>(dtype);
}

const char* ModeName(v1::ConsistencyMode mode) {
  switch (mode) {
    case v1::CONSISTENCY_MODE_ASYNC:
      return "async";
    case v1::CONSISTENCY_MODE_BOUNDED_STALENESS:
      return "bounded-staleness";
    default:
      return "sync";
  }
}

bool IsSync(const v1::ConsistencyConfig& c) {
  return c.mode() == v1::CONSISTENCY_MODE_SYNC || c.mode() == v1::CONSISTENCY_MODE_UNSPECIFIED;
}

uint64_t TensorElements(const v1::TensorSpec& t) {
  uint64_t n = 1;
  for (int64_t d : t.shape()) n *= static_cast<uint64_t>(d);
  return n;
}

// Widens initial values of `dtype` to fp32.
void WidenValues(v1::DType dtype, const char* src, float* dst, size_t n) {
  switch (dtype) {
    case v1::DTYPE_BFLOAT16:
      AccumulateWire(dst, src, v1::WIRE_DTYPE_BF16, n, /*overwrite=*/true);
      break;
    case v1::DTYPE_FLOAT16:
      AccumulateWire(dst, src, v1::WIRE_DTYPE_FP16, n, /*overwrite=*/true);
      break;
    default:
      std::memcpy(dst, src, n * sizeof(float));
  }
}

size_t ValueBytes(v1::DType dtype) {
  return dtype == v1::DTYPE_FLOAT32 ? 4 : 2;
}

}  // namespace

ParameterStore::ParameterStore(StoreOptions options, ServerLinks* links) : options_(options), links_(links) {
  int threads = options_.threads > 0 ? options_.threads : static_cast<int>(std::thread::hardware_concurrency());
  pool_ = std::make_unique<ThreadPool>(std::max(1, threads));
}

ParameterStore::~ParameterStore() = default;

uint64_t ParameterStore::Fingerprint(const google::protobuf::RepeatedPtrField<v1::TensorSpec>& tensors) {
  return TensorTableFingerprint(tensors);
}

std::vector<char> ReplyBody::Take() && {
  if (borrowed == nullptr) return std::move(owned);
  const char* bytes = static_cast<const char*>(borrowed);
  return std::vector<char>(bytes, bytes + borrowed_bytes);
}

void ParameterStore::Run(Actions& actions) {
  for (auto& action : actions) action();
  actions.clear();
}

ps::Frame ParameterStore::Refusal(const ps::Frame& request, const Status& status, std::vector<char>* payload) {
  const bool push = request.type == ps::FrameType::kPush;
  return ErrorReply(request, push ? ps::FrameType::kPushReply : ps::FrameType::kPullReply,
                    status.WithContext(fmt::format("{} of partition {} step {}", push ? "push" : "pull",
                                                   request.partition, request.step)),
                    payload);
}

ps::Frame ParameterStore::ErrorReply(const ps::Frame& request, ps::FrameType type, const Status& status,
                                     std::vector<char>* payload) {
  ps::Frame reply = ps::ReplyTo(request, type);
  *payload = ps::ErrorPayload(reply, status);
  return reply;
}

std::shared_ptr<ParameterStore::Part> ParameterStore::Find(uint32_t partition) const {
  std::lock_guard lock(mu_);
  auto it = parts_.find(partition);
  return it == parts_.end() ? nullptr : it->second;
}

uint64_t ParameterStore::epoch() const {
  std::lock_guard lock(mu_);
  return epoch_;
}

bool ParameterStore::configured() const {
  std::lock_guard lock(mu_);
  return configured_;
}

// ---------------------------------------------------------------------------
// Membership
// ---------------------------------------------------------------------------

std::vector<ParameterStore::Segment> ParameterStore::SegmentsFor(uint64_t begin, uint64_t end) const {
  std::vector<Segment> segments;
  if (!configured_) return segments;
  // The first tensor that ends after `begin`.
  auto it = std::upper_bound(tensor_offsets_.begin(), tensor_offsets_.end(), begin);
  size_t t = static_cast<size_t>(it - tensor_offsets_.begin());
  t = t == 0 ? 0 : t - 1;
  uint64_t at = begin;
  while (at < end && t < static_cast<size_t>(tensors_.size())) {
    const uint64_t t_end = tensor_offsets_[t] + TensorElements(tensors_[static_cast<int>(t)]);
    const uint64_t seg_end = std::min(end, t_end);
    if (seg_end > at) {
      GroupParams group = optimizer_->Group(tensors_[static_cast<int>(t)].group());
      if (!segments.empty() && segments.back().group.lr_scale == group.lr_scale &&
          segments.back().group.weight_decay == group.weight_decay &&
          segments.back().group.in_grad_norm == group.in_grad_norm &&
          segments.back().offset + segments.back().count == at - begin) {
        segments.back().count += seg_end - at;
      } else {
        segments.push_back(Segment{at - begin, seg_end - at, group});
      }
      at = seg_end;
    }
    ++t;
  }
  return segments;
}

optim::GradScan ParameterStore::ScanForNorm(const float* g, size_t n, const std::vector<Segment>& segments) {
  GradScan scan = ScanGradient(g, n);
  if (std::all_of(segments.begin(), segments.end(), [](const Segment& s) { return s.group.in_grad_norm; })) {
    return scan;
  }
  scan.sum_squares = 0;
  for (const Segment& s : segments) {
    if (s.group.in_grad_norm) scan.sum_squares += ScanGradient(g + s.offset, s.count).sum_squares;
  }
  return scan;
}

void ParameterStore::SetEpoch(uint64_t epoch, uint64_t member_id, const v1::ShardMap& map, uint32_t dp_size,
                              uint64_t start_step) {
  Actions actions;
  {
    std::lock_guard lock(mu_);
    if (epoch <= epoch_) return;
    const uint64_t previous = epoch_;
    epoch_ = epoch;
    member_id_ = member_id;
    map_ = map;
    dp_size_ = std::max<uint32_t>(1, dp_size);
    start_step_ = start_step;
    // A round this server shared may have been decided by another server
    // before the change: keep it until it decides here too.
    for (auto it = rounds_.begin(); it != rounds_.end();) {
      const bool kept = it->second.shared && !it->second.decided;
      it = it->first.first < epoch && !kept ? rounds_.erase(it) : std::next(it);
    }
    primaries_ = 0;
    other_servers_ = false;
    const Status superseded = Aborted("epoch {} was superseded by epoch {}; push the step again", previous, epoch);
    std::set<uint32_t> held;
    for (const auto& p : map.partitions()) {
      v1::ReplicaRole role = v1::REPLICA_ROLE_UNSPECIFIED;
      if (p.primary_member_id() == member_id) role = v1::REPLICA_ROLE_PRIMARY;
      if (p.backup_member_id() == member_id) role = v1::REPLICA_ROLE_BACKUP;
      if (p.primary_member_id() != member_id) other_servers_ = true;
      if (role == v1::REPLICA_ROLE_UNSPECIFIED) continue;
      held.insert(p.id());
      if (role == v1::REPLICA_ROLE_PRIMARY) ++primaries_;
      auto& slot = parts_[p.id()];
      if (!slot) {
        slot = std::make_shared<Part>();
        std::lock_guard plock(slot->mu);
        slot->state.id = p.id();
        slot->state.begin = p.range().begin();
        slot->state.end = p.range().end();
        slot->elements.store(slot->state.size(), std::memory_order_relaxed);
        slot->segments = SegmentsFor(p.range().begin(), p.range().end());
      }
      Part& part = *slot;
      std::lock_guard plock(part.mu);
      if (part.state.begin != p.range().begin() || part.state.end != p.range().end()) {
        // A different partitioning (not produced by the coordinator, which
        // never moves boundaries): start the partition over.
        spdlog::error("partition {} changed its range from [{}, {}) to [{}, {}); its state is dropped", p.id(),
                      part.state.begin, part.state.end, p.range().begin(), p.range().end());
        UnlendLocked(part, /*keep_values=*/false);
        part.state = PartitionState{};
        part.state.id = p.id();
        part.state.begin = p.range().begin();
        part.state.end = p.range().end();
        part.elements.store(part.state.size(), std::memory_order_relaxed);
        part.segments = SegmentsFor(p.range().begin(), p.range().end());
      }
      const bool was_primary = part.role == v1::REPLICA_ROLE_PRIMARY;
      const uint64_t old_backup = part.backup;
      if (role == v1::REPLICA_ROLE_PRIMARY && !was_primary && part.role == v1::REPLICA_ROLE_BACKUP) {
        spdlog::info("partition {}: promoted to primary in epoch {} (version {}, step {})", p.id(), epoch,
                     part.state.version, part.state.step);
      }
      part.role = role;
      part.primary = p.primary_member_id();
      part.backup = p.backup_member_id();
      // A new backup needs the whole state; so does the same backup when an
      // update it was sent in the old epoch is still unacknowledged: the ack
      // (or the update itself) died with the old epoch's links, and pulls
      // wait for the backup to cover the primary's step.
      part.needs_transfer = role == v1::REPLICA_ROLE_PRIMARY && part.backup != 0 && part.state.version > 0 &&
                            (!was_primary || part.backup != old_backup || part.safe_step < part.state.step);
      part.links_ready = false;
      // A finished aggregation stays while the partition stays here as
      // primary: its step may be decided (or already be, with the update
      // not yet applied) from the old epoch's shares. New pushes of the step
      // replace it.
      if (!(part.ready && role == v1::REPLICA_ROLE_PRIMARY && was_primary)) {
        part.agg_epoch = 0;
        part.ready = false;
      }
      SetScanPending(part, false);
      part.early.clear();
      part.clocks.clear();
      if (role == v1::REPLICA_ROLE_PRIMARY && part.backup == 0) part.safe_step = part.state.step;
      if (role == v1::REPLICA_ROLE_BACKUP) part.safe_step = part.state.step;
      for (auto& pull : part.pulls) {
        std::vector<char> payload;
        ps::Frame reply = ErrorReply(pull.header, ps::FrameType::kPullReply, superseded, &payload);
        actions.push_back([r = std::move(pull.reply), reply, payload = std::move(payload)]() mutable {
          r(reply, std::move(payload));
        });
      }
      part.pulls.clear();
      for (auto& [target, ack] : part.push_acks) {
        ps::Frame request;
        request.step = target;
        request.partition = p.id();
        std::vector<char> payload;
        ps::Frame reply = ErrorReply(request, ps::FrameType::kPushReply, superseded, &payload);
        actions.push_back(
            [r = std::move(ack), reply, payload = std::move(payload)]() mutable { r(reply, std::move(payload)); });
      }
      part.push_acks.clear();
    }
    for (auto it = parts_.begin(); it != parts_.end();) {
      if (held.count(it->first) == 0) {
        // Kept past the erase: the partition dies (if it does) after its lock is released.
        std::shared_ptr<Part> gone = it->second;
        std::lock_guard plock(gone->mu);
        SetScanPending(*gone, false);
        for (auto& pull : gone->pulls) {
          std::vector<char> payload;
          ps::Frame reply = ErrorReply(
              pull.header, ps::FrameType::kPullReply,
              FailedPrecondition("partition {} moved to another server in epoch {}", it->first, epoch), &payload);
          actions.push_back([r = std::move(pull.reply), reply, payload = std::move(payload)]() mutable {
            r(reply, std::move(payload));
          });
        }
        it = parts_.erase(it);
      } else {
        ++it;
      }
    }
    for (auto& capture : captures_) {
      capture->failed = Aborted("epoch {} was superseded by epoch {} before the checkpoint's step", previous, epoch);
    }
    captures_.clear();
    spdlog::info("epoch {}: this server (member {}) holds {} partition(s), {} as primary", epoch, member_id,
                 held.size(), primaries_);
  }
  changed_.notify_all();
  Run(actions);
}

void ParameterStore::LinksReady(uint64_t epoch) {
  Actions actions;
  std::vector<std::shared_ptr<Part>> parts;
  {
    std::lock_guard lock(mu_);
    if (epoch != epoch_) return;
    for (auto& [id, part] : parts_) parts.push_back(part);
    // The last share of the old epoch may have died with its links while a
    // server that had not decided the step yet still waits for it.
    if (other_servers_ && last_shared_.epoch != 0 && last_shared_.epoch < epoch) {
      actions.push_back([this, sent = last_shared_] { links_->SendShare(sent.epoch, sent.step, sent.entries); });
    }
  }
  for (auto& part : parts) {
    std::lock_guard plock(part->mu);
    if (part->role != v1::REPLICA_ROLE_PRIMARY) continue;
    part->links_ready = true;
    if (part->needs_transfer) SendTransferLocked(*part, actions);
  }
  Run(actions);
}

std::vector<uint32_t> ParameterStore::Held(bool primary_only) const {
  std::vector<uint32_t> ids;
  std::lock_guard lock(mu_);
  for (const auto& p : map_.partitions()) {
    if (p.primary_member_id() == member_id_ || (!primary_only && p.backup_member_id() == member_id_)) {
      ids.push_back(p.id());
    }
  }
  return ids;
}

Result<std::pair<uint64_t, uint64_t>> ParameterStore::RangeOf(uint32_t partition) const {
  std::lock_guard lock(mu_);
  if (partition >= static_cast<uint32_t>(map_.partitions_size())) {
    return NotFound("partition {} does not exist (the shard map of epoch {} has {})", partition, epoch_,
                    map_.partitions_size());
  }
  const auto& r = map_.partitions(static_cast<int>(partition)).range();
  return std::make_pair(r.begin(), r.end());
}

// ---------------------------------------------------------------------------
// Control
// ---------------------------------------------------------------------------

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

  std::lock_guard lock(mu_);
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
    std::lock_guard plock(part->mu);
    part->segments = SegmentsFor(part->state.begin, part->state.end);
  }
  spdlog::info("job '{}': {} tensors, {} elements, optimizer {}, {} mode", job_id, tensors.size(), total,
               optimizer_->name(), ModeName(consistency_.mode()));
  return Status::Ok();
}

Result<ParameterStore::JobIdentity> ParameterStore::Identity() const {
  std::lock_guard lock(mu_);
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
    std::lock_guard lock(mu_);
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
        std::lock_guard lock(mu_);
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
    std::lock_guard lock(mu_);
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
      std::lock_guard plock(part->mu);
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
    std::lock_guard plock(part->mu);
    out->set_version(part->state.version);
    out->set_step(part->state.step);
  }
  for (auto& s : fresh) {
    auto part = Find(s.id);
    if (!part) return FailedPrecondition("partition {} is no longer held by this server", s.id);
    auto* out = response.add_partitions();
    out->set_partition_id(s.id);
    std::lock_guard plock(part->mu);
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
    std::lock_guard lock(mu_);
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
    std::lock_guard plock(part->mu);
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
      const PartitionState& st = part->state;
      uint32_t crc = Crc32c(st.weights.data(), st.weights.size() * sizeof(float));
      crc = Crc32c(st.state0.data(), st.state0.size() * sizeof(float), crc);
      s->set_state_crc32c(Crc32c(st.state1.data(), st.state1.size() * sizeof(float), crc));
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
    std::lock_guard lock(mu_);
    for (auto& [id, part] : parts_) parts.push_back(part);
  }
  uint64_t lag = 0;
  for (auto& part : parts) {
    std::lock_guard plock(part->mu);
    if (part->role == v1::REPLICA_ROLE_PRIMARY && part->state.step > part->safe_step) {
      lag += part->state.step - part->safe_step;
    }
  }
  return lag;
}

void ParameterStore::StopCaptures() {
  {
    std::lock_guard lock(mu_);
    captures_stopped_ = true;
    for (auto& capture : captures_) capture->failed = Unavailable("the server is shutting down");
    captures_.clear();
  }
  changed_.notify_all();
}

Result<Capture> ParameterStore::CaptureAt(uint64_t step, std::chrono::milliseconds timeout) {
  auto request = std::make_shared<CaptureRequest>();
  std::vector<std::shared_ptr<Part>> parts;
  std::unique_lock lock(mu_);
  if (captures_stopped_) return Unavailable("the server is shutting down");
  if (!configured_) return FailedPrecondition("the job has not been initialised on this server");
  for (auto& [id, part] : parts_) {
    std::lock_guard plock(part->mu);
    if (part->role == v1::REPLICA_ROLE_PRIMARY) parts.push_back(part);
  }
  if (parts.empty()) return Capture{step, {}};
  uint64_t lo = UINT64_MAX, hi = 0;
  for (auto& part : parts) {
    std::lock_guard plock(part->mu);
    if (part->state.version == 0) {
      return FailedPrecondition("partition {} has no state (it was never initialised or was lost)", part->state.id);
    }
    lo = std::min(lo, part->state.step);
    hi = std::max(hi, part->state.step);
  }
  if (step == 0) {
    if (lo != hi) {
      return FailedPrecondition(
          "step: 0 asks for the current step, but this server's partitions are between steps "
          "{} and {}; name a step (or pause training)",
          lo, hi);
    }
    step = lo;
  }
  if (hi > step) {
    return FailedPrecondition("step: this server has already completed step {}, past the requested step {}", hi, step);
  }
  request->step = step;
  request->result.step = step;
  for (auto& part : parts) {
    std::lock_guard plock(part->mu);
    request->expected.insert(part->state.id);
    if (part->state.step == step) request->result.partitions.push_back(part->state);
  }
  if (!request->done()) {
    captures_.push_back(request);
    const bool ok = changed_.wait_for(lock, timeout, [&] { return request->done(); });
    captures_.erase(std::remove(captures_.begin(), captures_.end(), request), captures_.end());
    if (!ok) {
      return DeadlineExceeded("step {} was not reached within {} ms ({} of {} partitions there)", step, timeout.count(),
                              request->result.partitions.size(), request->expected.size());
    }
  }
  if (!request->failed.ok()) return request->failed;
  std::sort(request->result.partitions.begin(), request->result.partitions.end(),
            [](const PartitionState& a, const PartitionState& b) { return a.id < b.id; });
  return std::move(request->result);
}

void ParameterStore::StepCompleted(uint32_t partition, uint64_t step, Then* later) {
  // Called without part locks held; copies state for waiting captures.
  std::shared_ptr<Part> part;
  {
    std::unique_lock lock(mu_, std::defer_lock);
    const bool held = Acquire(lock, later == nullptr);
    bool wanted = false;
    for (size_t i = 0; held && i < captures_.size(); ++i) {
      wanted = wanted || (captures_[i]->step == step && captures_[i]->expected.count(partition) > 0);
    }
    if (!held || (wanted && later != nullptr)) {
      // Busy, or a checkpoint waits for the step (copying the partition's
      // state): on the thread that may block.
      if (held) lock.unlock();
      Defer(later, [this, partition, step] { StepCompleted(partition, step, nullptr); });
      return;
    }
    if (wanted) {
      auto it = parts_.find(partition);
      if (it != parts_.end()) part = it->second;
      if (part) {
        std::lock_guard plock(part->mu);
        for (auto& c : captures_) {
          if (c->step != step || c->expected.count(partition) == 0 || !c->failed.ok()) continue;
          if (part->state.step == step) {
            c->result.partitions.push_back(part->state);
          } else {
            c->failed =
                FailedPrecondition("partition {} moved past step {} before it could be captured", partition, step);
          }
        }
      }
    }
  }
  changed_.notify_all();
}

Status ParameterStore::Replace(std::vector<PartitionState> states, bool skip_optimizer_state) {
  int buffers = 0;
  {
    std::lock_guard lock(mu_);
    if (!configured_) return FailedPrecondition("the job has not been initialised on this server");
    buffers = optimizer_->state_buffers();
  }
  std::vector<std::shared_ptr<Part>> parts;
  for (auto& s : states) {
    auto part = Find(s.id);
    if (!part) return FailedPrecondition("partition {} is not held by this server", s.id);
    std::lock_guard plock(part->mu);
    if (part->state.begin != s.begin || part->state.end != s.end || s.weights.size() != s.size()) {
      return InvalidArgument("partition {}: restored range [{}, {}) does not match [{}, {})", s.id, s.begin, s.end,
                             part->state.begin, part->state.end);
    }
    parts.push_back(part);
  }
  Actions actions;
  for (size_t i = 0; i < states.size(); ++i) {
    auto& s = states[i];
    Part& part = *parts[i];
    std::lock_guard plock(part.mu);
    if (skip_optimizer_state || s.state0.size() != (buffers >= 1 ? s.size() : 0) ||
        s.state1.size() != (buffers >= 2 ? s.size() : 0)) {
      s.state0.assign(buffers >= 1 ? s.size() : 0, 0.0f);
      s.state1.assign(buffers >= 2 ? s.size() : 0, 0.0f);
    }
    UnlendLocked(part, /*keep_values=*/false);
    part.state.weights = std::move(s.weights);
    part.state.state0 = std::move(s.state0);
    part.state.state1 = std::move(s.state1);
    part.state.version = std::max<uint64_t>(1, s.version);
    part.state.step = s.step;
    part.safe_step = s.step;
    part.agg_epoch = 0;
    part.ready = false;
    SetScanPending(part, false);
    part.early.clear();
    for (auto& pull : part.pulls) {
      std::vector<char> payload;
      ps::Frame reply =
          ErrorReply(pull.header, ps::FrameType::kPullReply,
                     Aborted("partition {} was restored from a checkpoint (step {})", s.id, s.step), &payload);
      actions.push_back(
          [r = std::move(pull.reply), reply, payload = std::move(payload)]() mutable { r(reply, std::move(payload)); });
    }
    part.pulls.clear();
  }
  Run(actions);
  return Status::Ok();
}

// ---------------------------------------------------------------------------
// Data plane
// ---------------------------------------------------------------------------

Result<std::shared_ptr<ParameterStore::Part>> ParameterStore::CheckDataFrame(const ps::Frame& h, bool primary,
                                                                             bool* busy) const {
  const auto declined = [busy] {
    *busy = true;
    return Unavailable("the partition is busy");
  };
  std::unique_lock lock(mu_, std::defer_lock);
  if (!Acquire(lock, busy == nullptr)) return declined();
  if (!configured_) return FailedPrecondition("the job has not been initialised on this server (InitializeParameters)");
  if (h.epoch < epoch_) {
    return FailedPrecondition("epoch {} is stale: this server is at epoch {}; rebuild with the current shard map",
                              h.epoch, epoch_);
  }
  if (h.epoch > epoch_)
    return Unavailable("this server has not reached epoch {} yet (it is at {}); retry", h.epoch, epoch_);
  auto it = parts_.find(h.partition);
  if (it == parts_.end()) {
    if (h.partition >= static_cast<uint32_t>(map_.partitions_size())) {
      return NotFound("partition {} does not exist (the job has {})", h.partition, map_.partitions_size());
    }
    return FailedPrecondition("partition {} is not held by this server (member {}) in epoch {}", h.partition,
                              member_id_, epoch_);
  }
  std::unique_lock plock(it->second->mu, std::defer_lock);
  if (!Acquire(plock, busy == nullptr)) return declined();
  const Part& part = *it->second;
  if (primary && part.role != v1::REPLICA_ROLE_PRIMARY) {
    return FailedPrecondition("this server (member {}) is not the primary of partition {} in epoch {} (member {} is)",
                              member_id_, h.partition, epoch_, part.primary);
  }
  if (part.state.version == 0) {
    return FailedPrecondition(
        "partition {} has no state on this server: it was never initialised, or its primary and backup were both "
        "lost (restore it from a checkpoint)",
        h.partition);
  }
  return it->second;
}

std::shared_ptr<std::vector<float>> ParameterStore::Buffer(size_t n) {
  std::unique_ptr<std::vector<float>> v;
  {
    std::lock_guard lock(spares_->mu);
    auto& free = spares_->free;
    auto it = std::find_if(free.begin(), free.end(), [n](const auto& b) { return b->size() == n; });
    if (it != free.end()) {
      v = std::move(*it);
      free.erase(it);
      spares_->bytes -= n * sizeof(float);
    }
  }
  if (!v) v = std::make_unique<std::vector<float>>(n);
  return std::shared_ptr<std::vector<float>>(v.release(), [home = std::weak_ptr<Spares>(spares_)](auto* p) {
    std::unique_ptr<std::vector<float>> buffer(p);
    auto spares = home.lock();
    if (!spares) return;
    const size_t bytes = buffer->size() * sizeof(float);
    std::lock_guard lock(spares->mu);
    if (spares->bytes + bytes > kMaxSpareBytes || spares->free.size() >= kMaxSpares) return;
    spares->bytes += bytes;
    spares->free.push_back(std::move(buffer));
  });
}

std::shared_ptr<std::vector<float>> ParameterStore::PushBuffer(const ps::Frame& h) {
  if (h.type != ps::FrameType::kPush) return nullptr;
  if (!Fp32Wire(h.dtype)) return nullptr;
  // Called on the transport's completion thread: never waits for the store's
  // lock (a step being shared holds it while it waits for partitions that
  // updates hold); without a buffer the push is received and copied.
  std::shared_ptr<Part> part;
  {
    std::unique_lock lock(mu_, std::try_to_lock);
    if (!lock.owns_lock()) return nullptr;
    auto it = parts_.find(h.partition);
    if (it != parts_.end()) part = it->second;
  }
  if (!part) return nullptr;
  // Without the partition's lock: an update may hold it for a while, and
  // the payload should arrive meanwhile.
  const uint64_t n = part->elements.load(std::memory_order_relaxed);
  if (n == 0 || h.payload_bytes != n * sizeof(float)) return nullptr;
  return Buffer(n);
}

void ParameterStore::FoldLocked(Part& part, uint16_t dtype, const void* data,
                                std::shared_ptr<std::vector<float>>& buffer) {
  if (part.folded == 0 && Keepable(buffer, data, dtype, part.state.size())) {
    part.acc = std::move(buffer);  // the gradient is already where it belongs
  } else {
    AccumulateWire(part.acc->data(), data, Wire(dtype), part.acc->size(), part.folded == 0);
  }
  ++part.folded;
  while (!part.early.empty() && part.early.begin()->first == part.folded) {
    auto node = part.early.extract(part.early.begin());
    AccumulateWire(part.acc->data(), node.mapped().second.data(), Wire(node.mapped().first), part.acc->size(), false);
    ++part.folded;
  }
}

void ParameterStore::Push(uint64_t from, const ps::Frame& h, const void* payload, Reply reply) {
  std::shared_ptr<std::vector<float>> none;
  PushImpl(from, h, payload, none, reply, nullptr);
}

void ParameterStore::Push(uint64_t from, const ps::Frame& h, std::shared_ptr<std::vector<float>> buffer, Reply reply) {
  const void* payload = buffer ? buffer->data() : nullptr;
  PushImpl(from, h, payload, buffer, reply, nullptr);
}

bool ParameterStore::TryPush(uint64_t from, const ps::Frame& h, const void* payload,
                             std::shared_ptr<std::vector<float>>& buffer, Reply& reply, Then& later) {
  return PushImpl(from, h, payload, buffer, reply, &later);
}

void ParameterStore::ShareStep(uint64_t epoch, uint64_t step, Then* later) {
  Actions actions;
  if (MaybeShare(epoch, step, actions, later)) return Run(actions);
  // Busy, or too much to apply here: all of it on the thread that may block.
  Defer(later, [this, epoch, step] {
    Actions all;
    MaybeShare(epoch, step, all, nullptr);
    Run(all);
  });
}

bool ParameterStore::PushImpl(uint64_t from, const ps::Frame& h, const void* payload,
                              std::shared_ptr<std::vector<float>>& buffer, Reply& reply, Then* later) {
  const bool try_only = later != nullptr;
  // Scanning a large gradient would hold up every peer's messages.
  if (try_only && h.payload_bytes > kInlinePushBytes) return false;
  bool busy = false;
  auto checked = CheckDataFrame(h, /*primary=*/true, try_only ? &busy : nullptr);
  if (busy) return false;
  v1::ConsistencyConfig consistency;
  v1::NonFinitePolicy policy;
  uint32_t dp;
  uint64_t epoch, start_step;
  {
    std::unique_lock lock(mu_, std::defer_lock);
    if (!Acquire(lock, !try_only)) return false;
    consistency = consistency_;
    policy = optimizer_->non_finite_policy();
    dp = dp_size_;
    epoch = epoch_;
    start_step = start_step_;
  }
  // The asynchronous modes apply the update right away.
  if (try_only && !IsSync(consistency)) return false;
  std::shared_ptr<Part> part = checked.ok() ? *checked : nullptr;
  std::unique_lock<std::mutex> plock;
  if (part) {
    plock = std::unique_lock(part->mu, std::defer_lock);
    if (!Acquire(plock, !try_only)) return false;
  }
  counters_.pushes.fetch_add(1);
  counters_.push_bytes.fetch_add(h.payload_bytes);
  auto refuse = [&](const Status& status) {
    if (plock.owns_lock()) plock.unlock();
    counters_.rejected_pushes.fetch_add(1);
    std::vector<char> body;
    ps::Frame r = Refusal(h, status, &body);
    reply(r, std::move(body));
    return true;
  };
  if (!checked.ok()) return refuse(checked.status());
  if (!ValidWireDType(h.dtype)) return refuse(InvalidArgument("dtype {} is not a wire dtype", h.dtype));
  if (h.contributors == 0 || h.contributors > kMaxContributors) {
    return refuse(InvalidArgument("contributors: {} must be 1 to {}", h.contributors, kMaxContributors));
  }
  if (h.contributor >= h.contributors) {
    return refuse(InvalidArgument("contributor {} is not below contributors ({})", h.contributor, h.contributors));
  }
  if (h.step == 0) return refuse(InvalidArgument("step: must be >= 1 (step 1 is the first update)"));
  if (Status lr = Optimizer::CheckStepLearningRate(h.value); !lr.ok()) return refuse(lr);

  Actions actions;
  ps::Frame ok = ps::ReplyTo(h, ps::FrameType::kPushReply);
  const size_t n = part->state.size();
  if (h.payload_bytes != WireBytes(Wire(h.dtype), n)) {
    return refuse(InvalidArgument("payload is {} bytes, partition {} needs {} ({} elements of {})", h.payload_bytes,
                                  h.partition, WireBytes(Wire(h.dtype), n), n, v1::WireDType_Name(Wire(h.dtype))));
  }
  part->pushes++;
  part->bytes_pushed += h.payload_bytes;

  if (IsSync(consistency)) {
    if (h.step <= part->state.step) {
      counters_.duplicate_pushes.fetch_add(1);
      ok.flags = ps::kFlagDuplicate;
      const bool retried = h.step == part->state.step;
      plock.unlock();
      reply(ok, {});
      // A step retried in a new epoch that this partition already applied:
      // its share is still needed by the servers that did not.
      if (retried) ShareStep(epoch, h.step, later);
      return true;
    }
    if (h.step > part->state.step + 1) {
      return refuse(FailedPrecondition("step {} is from the future: partition {} has completed step {}, the next is {}",
                                       h.step, h.partition, part->state.step, part->state.step + 1));
    }
    if (part->agg_epoch != epoch || part->agg_step != h.step) {
      part->agg_epoch = epoch;
      part->agg_step = h.step;
      part->contributors = h.contributors;
      part->folded = 0;
      part->seen.assign(h.contributors, false);
      part->early.clear();
      part->ready = false;
      SetScanPending(*part, false);
      // Still read by a replication in flight: the next step gets its own.
      // (The first contribution overwrites it, or becomes it.)
      if (!part->acc || part->acc.use_count() > 1 || part->acc->size() != n) part->acc = Buffer(n);
      part->first_push = std::chrono::steady_clock::now();
    }
    if (h.contributors != part->contributors) {
      return refuse(InvalidArgument("contributors: this push says {}, earlier pushes of the step said {}",
                                    h.contributors, part->contributors));
    }
    // The step's learning rate is the first taken push's; every other push
    // of the step (a contributor's second one too) must carry it.
    if (part->folded == 0 && part->early.empty()) {
      part->agg_lr = h.value;
    } else if (h.value != part->agg_lr) {
      return refuse(InvalidArgument("push of step {} carries learning rate {}, but the step's other pushes carry {}",
                                    h.step, h.value, part->agg_lr));
    }
    if (part->seen[h.contributor]) {
      counters_.duplicate_pushes.fetch_add(1);
      ok.flags = ps::kFlagDuplicate;
      plock.unlock();
      reply(ok, {});
      return true;
    }
    if (policy == v1::NON_FINITE_POLICY_FAIL) {
      std::vector<float> widened(n);
      AccumulateWire(widened.data(), payload, Wire(h.dtype), n, true);
      if (!ScanGradient(widened.data(), n).finite) {
        spdlog::error(
            "partition {} step {}: contributor {} (member {}) pushed NaN or Inf; the step is refused "
            "(non_finite_policy FAIL): training stops until an operator intervenes",
            h.partition, h.step, h.contributor, from);
        return refuse(InvalidArgument("the gradient contains NaN or Inf (non_finite_policy FAIL refuses the step)"));
      }
    }
    part->seen[h.contributor] = true;
    if (h.contributor == part->folded) {
      FoldLocked(*part, h.dtype, payload, buffer);
    } else {
      const auto* bytes = static_cast<const char*>(payload);
      part->early.emplace(h.contributor, std::make_pair(h.dtype, std::vector<char>(bytes, bytes + h.payload_bytes)));
    }
    const bool complete = part->folded == part->contributors;
    // A small push taken in on the completion thread finishes the step
    // there: its scan and update cost less than handing them over. It is
    // acknowledged first (the reply leaves before the scan: SendReply).
    if (complete && later != nullptr && h.payload_bytes <= kInlineFinishBytes) {
      const std::shared_ptr<std::vector<float>> acc = part->acc;
      plock.unlock();
      reply(ok, {});
      if (!plock.try_lock()) {  // held (a pull, a snapshot, another partition's scan): not waited for here
        Defer(later, [this, part, acc, epoch, step = h.step] { FinishAggregation(*part, acc, epoch, step); });
        return true;
      }
      // Replaced meanwhile: a new epoch dropped the step's pushes.
      if (!Complete(*part, epoch, h.step) || part->acc != acc) return true;
      part->ready = true;
      const GradScan scan = ScanForNorm(acc->data(), n, part->segments);
      part->last_share = ps::ShareEntry{h.partition, scan.finite ? 1u : 0u, scan.sum_squares};
      plock.unlock();
      ShareStep(epoch, h.step, later);
      // Larger partitions here may be waiting for this one to scan.
      if (scans_pending_.load() > 0) Defer(later, [this, epoch, step = h.step] { ScanStep(epoch, step); });
      return true;
    }
    if (!complete) {
      plock.unlock();
      reply(ok, {});
      return true;
    }
    // The push is in: it is acknowledged before the step's scan and update,
    // which follow on this thread (or on the receiver thread, for a larger
    // push taken in on the completion thread, which would hold up every
    // peer's messages). The scans wait until every partition here has the step
    // (ScanStep), so that they do not hold up the pushes of the others;
    // until its scan is done a partition is not ready, so nothing shares or
    // decides the step.
    auto finish = [this, part, acc = part->acc, epoch, step = h.step] { FinishAggregation(*part, acc, epoch, step); };
    plock.unlock();
    reply(ok, {});
    if (later != nullptr) {
      Defer(later, std::move(finish));
    } else {
      finish();
    }
    return true;
  }

  // Asynchronous and bounded staleness: apply now. The contributors'
  // clocks start with the epoch's first push or pull; a push that names
  // another count is refused rather than restarting them (which would let
  // duplicates in again and lose the staleness bound).
  const bool first_clocks = part->clocks.empty();
  if (first_clocks) part->clocks.assign(h.contributors, start_step);
  if (part->clocks.size() != h.contributors) {
    return refuse(InvalidArgument("contributors: this push says {}, earlier pushes and pulls of epoch {} said {}",
                                  h.contributors, epoch, part->clocks.size()));
  }
  // A refused push leaves no clocks behind, so it cannot fix the epoch's
  // contributor count either.
  auto refuse_async = [&](const Status& status) {
    if (first_clocks) part->clocks.clear();
    return refuse(status);
  };
  if (h.step <= part->clocks[h.contributor]) {
    counters_.duplicate_pushes.fetch_add(1);
    ok.flags = ps::kFlagDuplicate;
    plock.unlock();
    reply(ok, {});
    return true;
  }
  const uint64_t slowest = *std::min_element(part->clocks.begin(), part->clocks.end());
  if (consistency.mode() == v1::CONSISTENCY_MODE_BOUNDED_STALENESS &&
      h.step > slowest + consistency.staleness_bound() + 1) {
    return refuse_async(FailedPrecondition(
        "step {} is from the future: the slowest contributor has pushed step {} and the staleness bound is {}", h.step,
        slowest, consistency.staleness_bound()));
  }
  std::shared_ptr<std::vector<float>> grad;
  if (Keepable(buffer, payload, h.dtype, n)) {
    grad = std::move(buffer);
  } else {
    grad = Buffer(n);
    AccumulateWire(grad->data(), payload, Wire(h.dtype), n, true);
  }
  const uint64_t clock_before = part->clocks[h.contributor];
  part->clocks[h.contributor] = h.step;
  counters_.staleness_last.store(part->state.step > h.step - 1 ? part->state.step - (h.step - 1) : 0);
  const GradScan scan = ScanForNorm(grad->data(), n, part->segments);
  ps::Frame rep;
  rep.type = ps::FrameType::kReplica;
  rep.partition = h.partition;
  rep.epoch = epoch;
  rep.version = part->state.version;
  if (!scan.finite) {
    if (policy == v1::NON_FINITE_POLICY_FAIL) {
      part->clocks[h.contributor] = clock_before;  // refused: as if it never came
      return refuse_async(InvalidArgument("the gradient contains NaN or Inf (non_finite_policy FAIL refuses it)"));
    }
    counters_.skipped_steps.fetch_add(1);
    rep.flags = ps::kFlagSkip;
    part->state.step += 1;
    grad.reset();
    ok.flags = ps::kFlagSkip;
  } else {
    rep.value = opt_.load()->reduction() == v1::GRADIENT_REDUCTION_SUM ? 1.0 : 1.0 / dp;
    ps::SetReplicaLearningRate(rep, h.value);
    ApplyLocked(*part, grad->data(), rep.value, h.value);
    part->state.step += 1;
  }
  rep.step = part->state.step;
  ok.step = part->state.step;
  ok.version = part->state.version;
  part->push_acks.emplace_back(part->state.step, [reply, ok](ps::Frame r, ReplyBody body) {
    if (r.status == 0) r = ok;
    reply(r, std::move(body));
  });
  ReplicateLocked(*part, rep, grad, actions);
  ServePullsLocked(*part, actions);
  const uint64_t completed = part->state.step;
  plock.unlock();
  Run(actions);
  StepCompleted(h.partition, completed);
  return true;
}

void ParameterStore::FinishAggregation(Part& part, const std::shared_ptr<std::vector<float>>& acc, uint64_t epoch,
                                       uint64_t step) {
  {
    std::lock_guard plock(part.mu);
    // Replaced meanwhile (a new epoch dropped the step's pushes: its
    // contributors retry the step there).
    if (!Complete(part, epoch, step) || part.acc != acc) return;
    SetScanPending(part, true);
  }
  ScanStep(epoch, step);
}

void ParameterStore::SetScanPending(Part& part, bool pending) {
  if (part.scan_pending == pending) return;
  part.scan_pending = pending;
  scans_pending_.fetch_add(pending ? 1 : -1);
}

bool ParameterStore::Complete(const Part& part, uint64_t epoch, uint64_t step) {
  return part.agg_epoch == epoch && part.agg_step == step && !part.ready && part.folded == part.contributors &&
         part.acc != nullptr;
}

void ParameterStore::ScanStep(uint64_t epoch, uint64_t step) {
  struct Claim {
    std::shared_ptr<Part> part;
    std::shared_ptr<std::vector<float>> acc;
    std::vector<Segment> segments;
    GradScan scan;
  };
  std::vector<Claim> claims;
  {
    std::lock_guard lock(mu_);
    if (epoch != epoch_) return;
    // Once every primary partition here has the step (or applied it
    // before), whoever gets here first claims the scans.
    for (auto& [id, part] : parts_) {
      std::lock_guard plock(part->mu);
      if (part->role != v1::REPLICA_ROLE_PRIMARY) continue;
      const bool has_step = part->state.step >= step || (part->agg_epoch == epoch && part->agg_step == step &&
                                                         (part->ready || Complete(*part, epoch, step)));
      if (!has_step) return;  // the push that completes the last one scans
    }
    for (auto& [id, part] : parts_) {
      std::lock_guard plock(part->mu);
      if (part->role != v1::REPLICA_ROLE_PRIMARY || !part->scan_pending || !Complete(*part, epoch, step)) continue;
      SetScanPending(*part, false);
      claims.push_back(Claim{part, part->acc, part->segments, {}});
    }
  }
  if (claims.empty()) return;  // claimed by another thread, which shares the step
  // Nothing writes a complete aggregation's buffer (a new aggregation gets a
  // buffer of its own while this one is held), so it is read unlocked.
  for (Claim& c : claims) c.scan = ScanForNorm(c.acc->data(), c.acc->size(), c.segments);
  for (Claim& c : claims) {
    std::lock_guard plock(c.part->mu);
    if (!Complete(*c.part, epoch, step) || c.part->acc != c.acc) continue;  // a new epoch dropped it
    c.part->ready = true;
    c.part->last_share = ps::ShareEntry{c.part->state.id, c.scan.finite ? 1u : 0u, c.scan.sum_squares};
  }
  ShareStep(epoch, step, nullptr);
}

void ParameterStore::ApplyLocked(Part& part, const float* grad, double grad_scale, double lr) {
  const auto start = std::chrono::steady_clock::now();
  UnlendLocked(part, /*keep_values=*/true);
  const uint64_t update_index = part.state.version - 1;
  float* w = part.state.weights.data();
  float* s0 = part.state.state0.empty() ? nullptr : part.state.state0.data();
  float* s1 = part.state.state1.empty() ? nullptr : part.state.state1.data();
  const Optimizer* opt = opt_.load();
  for (const Segment& seg : part.segments) {
    pool_->ParallelFor(seg.count, kApplyGrain, [&](size_t b, size_t e) {
      const size_t o = seg.offset + b;
      opt->Apply(w + o, s0 ? s0 + o : nullptr, s1 ? s1 + o : nullptr, grad + o, e - b, update_index, seg.group,
                 grad_scale, lr);
    });
  }
  part.state.version += 1;
  counters_.updates.fetch_add(1);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  counters_.update_seconds.fetch_add(seconds);
}

bool ParameterStore::MaybeShare(uint64_t epoch, uint64_t step, Actions& actions, Then* later) {
  std::unique_lock lock(mu_, std::defer_lock);
  if (!Acquire(lock, later == nullptr)) return false;
  if (epoch != epoch_) return true;
  auto found = rounds_.find({epoch, step});
  if (found != rounds_.end() && found->second.shared) return true;
  std::vector<ps::ShareEntry> entries;
  // Without waiting (`later`), every partition stays locked until the
  // decision has read them (Decide).
  std::vector<std::unique_lock<std::mutex>> held;
  for (auto& [id, part] : parts_) {
    std::unique_lock plock(part->mu, std::defer_lock);
    if (!Acquire(plock, later == nullptr)) return false;
    if (later != nullptr) held.push_back(std::move(plock));
    if (part->role != v1::REPLICA_ROLE_PRIMARY) continue;
    const bool decided_before = part->state.step == step;  // share it again
    const bool aggregated =
        part->state.step + 1 == step && part->agg_epoch == epoch && part->agg_step == step && part->ready;
    if (!decided_before && !aggregated) return true;  // still aggregating
    entries.push_back(part->last_share);
  }
  if (later != nullptr) {
    // Only a small server updates on a thread that must not block: its
    // partitions' locks are then only ever held for small work.
    uint64_t elements = 0;
    for (const auto& [id, part] : parts_) elements += part->elements.load(std::memory_order_relaxed);
    if (elements * sizeof(float) > kInlinePushBytes) return false;
  }
  Round& round = rounds_[{epoch, step}];
  round.shared = true;
  round.dp = dp_size_;
  for (const auto& e : entries) round.entries.emplace(e.partition, e);
  last_shared_ = SentShare{epoch, step, entries};
  if (other_servers_) {
    actions.push_back([this, epoch, step, entries = std::move(entries)] { links_->SendShare(epoch, step, entries); });
  }
  MaybeDecide(epoch, step, actions, later);
  return true;
}

void ParameterStore::Share(uint64_t from, const ps::Frame& h, const void* payload) {
  const size_t n = h.contributors;
  if (h.payload_bytes != n * sizeof(ps::ShareEntry)) {
    spdlog::warn("member {} sent a step share of {} bytes for {} entries; ignored", from, h.payload_bytes, n);
    return;
  }
  std::vector<ps::ShareEntry> entries(n);
  if (n > 0) std::memcpy(entries.data(), payload, n * sizeof(ps::ShareEntry));
  Actions actions;
  {
    std::lock_guard lock(mu_);
    if (h.epoch < epoch_) {
      // Only a round kept from an old epoch still takes its shares.
      auto it = rounds_.find({h.epoch, h.step});
      if (it == rounds_.end() || it->second.decided) return;
      for (const auto& e : entries) it->second.entries.emplace(e.partition, e);
      MaybeDecide(h.epoch, h.step, actions, nullptr);
    } else {
      Round& round = rounds_[{h.epoch, h.step}];
      for (const auto& e : entries) round.entries.emplace(e.partition, e);
      if (h.epoch == epoch_) MaybeDecide(h.epoch, h.step, actions, nullptr);
    }
  }
  Run(actions);
}

void ParameterStore::MaybeDecide(uint64_t epoch, uint64_t step, Actions& actions, Then* later) {
  auto it = rounds_.find({epoch, step});
  if (it == rounds_.end() || it->second.decided || !it->second.shared) return;
  if (it->second.entries.size() < static_cast<size_t>(map_.partitions_size())) return;
  it->second.decided = true;
  Decide(epoch, step, it->second, actions, later);
  rounds_.erase(it);
  // Older rounds of this epoch can no longer matter.
  for (auto r = rounds_.begin(); r != rounds_.end();) {
    r = (r->first.first == epoch && r->first.second < step) ? rounds_.erase(r) : std::next(r);
  }
}

void ParameterStore::Decide(uint64_t epoch, uint64_t step, const Round& round, Actions& actions, Then* later) {
  double total = 0;
  bool finite = true;
  for (const auto& [id, e] : round.entries) {
    total += e.sum_squares;
    finite = finite && e.finite != 0;
  }
  finite = finite && std::isfinite(total);
  const double divisor = optimizer_->reduction() == v1::GRADIENT_REDUCTION_SUM
                             ? 1.0
                             : static_cast<double>(std::max<uint32_t>(1, round.dp));
  double coef = 1.0;
  const double max_norm = optimizer_->max_grad_norm();
  const double norm = std::sqrt(total) / divisor;
  if (finite && max_norm > 0 && norm > max_norm) coef = max_norm / (norm + 1e-6);
  const bool skip = !finite;
  if (skip) {
    counters_.skipped_steps.fetch_add(1);
    spdlog::warn(
        "step {}: the gradient holds NaN or Inf; the step is skipped on every server (non_finite_policy "
        "SKIP_STEP)",
        step);
  }
  std::vector<std::shared_ptr<Part>> parts;
  for (auto& [id, part] : parts_) {
    // With `later`, MaybeShare holds every partition's lock.
    std::unique_lock plock(part->mu, std::defer_lock);
    if (later == nullptr) plock.lock();
    if (part->role == v1::REPLICA_ROLE_PRIMARY && part->agg_epoch == epoch && part->agg_step == step && part->ready &&
        part->state.step + 1 == step) {
      parts.push_back(part);
      counters_.aggregation_seconds.fetch_add(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - part->first_push).count());
    }
  }
  const double grad_scale = coef / divisor;
  actions.push_back([this, parts = std::move(parts), epoch, step, skip, grad_scale, later]() mutable {
    ApplyDecision(std::move(parts), epoch, step, skip, grad_scale, later);
  });
}

void ParameterStore::ApplyDecision(std::vector<std::shared_ptr<Part>> parts, uint64_t epoch, uint64_t step, bool skip,
                                   double grad_scale, Then* later) {
  const auto crash_primary_of = FailpointNumber("ps.crash_on_decide_primary_of");
  // With crash_on_decide_primary_of, only in epoch 1: the server that
  // takes the partition over must not die of the same failpoint.
  const bool crash_here = !crash_primary_of.has_value() ||
                          (epoch == 1 && std::any_of(parts.begin(), parts.end(), [&](const std::shared_ptr<Part>& p) {
                             return p->state.id == *crash_primary_of;
                           }));
  if (!parts.empty() && FailpointNumber("ps.crash_on_decide") == step && crash_here) {
    // The other servers have this server's share, so they decide the step
    // and apply it; this server's partitions are neither applied nor
    // replicated, and their promoted backups are one step behind.
    FailpointCrashSoon(fmt::format("ps.crash_on_decide: step {} is decided; this server dies before applying it to "
                                   "its {} primary partition(s) and replicating them",
                                   step, parts.size()),
                       300);
    return;
  }
  // Partition by partition, in id order (the order of the parameter space,
  // which is the order the workers' next forward reads it): each one's
  // replication and waiting pulls go out as soon as it is applied, while the
  // next one is.
  Actions actions;
  Actions replication;  // with `later`: the sends to backups
  std::vector<uint32_t> completed;
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::shared_ptr<Part>& part = parts[i];
    Run(actions);
    // A step decided in an old epoch replicates in the current one.
    std::unique_lock lock(mu_, std::defer_lock);  // before the partition's lock (lock order)
    const bool known = Acquire(lock, later == nullptr);
    const uint64_t current = known ? epoch_ : 0;
    if (known) lock.unlock();
    std::unique_lock plock(part->mu, std::defer_lock);
    if (!known || !Acquire(plock, later == nullptr)) {
      // This partition and the rest on the thread that may block.
      std::vector<std::shared_ptr<Part>> rest(parts.begin() + static_cast<std::ptrdiff_t>(i), parts.end());
      Defer(later, [this, rest = std::move(rest), epoch, step, skip, grad_scale]() mutable {
        ApplyDecision(std::move(rest), epoch, step, skip, grad_scale, nullptr);
      });
      break;
    }
    if (part->agg_epoch != epoch || part->agg_step != step || !part->ready || part->state.step + 1 != step) continue;
    ps::Frame rep;
    rep.type = ps::FrameType::kReplica;
    rep.partition = part->state.id;
    rep.epoch = current;
    rep.step = step;
    rep.version = part->state.version;
    rep.value = grad_scale;
    ps::SetReplicaLearningRate(rep, part->agg_lr);
    std::shared_ptr<const std::vector<float>> grad;
    if (skip) {
      rep.flags = ps::kFlagSkip;
    } else {
      ApplyLocked(*part, part->acc->data(), grad_scale, part->agg_lr);
      grad = part->acc;
    }
    part->state.step = step;
    part->ready = false;
    part->agg_epoch = 0;
    // Without a backup this answers the step's waiting pulls (here, also
    // inline); sends to a backup wait for `later` when there is one (a
    // refused send's handling takes locks).
    ReplicateLocked(*part, rep, grad, later != nullptr && part->backup != 0 ? replication : actions);
    completed.push_back(part->state.id);
  }
  Run(actions);
  if (!replication.empty()) {
    Defer(later, [this, replication = std::move(replication)]() mutable { Run(replication); });
  }
  for (uint32_t id : completed) StepCompleted(id, step, later);
}

void ParameterStore::ReplicateLocked(Part& part, ps::Frame header, std::shared_ptr<const std::vector<float>> grad,
                                     Actions& actions) {
  if (part.backup == 0) {
    part.safe_step = part.state.step;
    ServePullsLocked(part, actions);
    return;
  }
  if (part.needs_transfer || !part.links_ready) {
    // The backup has not got the state yet, or this epoch's links are not up
    // (an update decided as the epoch changed): the transfer, sent when the
    // links are ready, carries this update.
    part.needs_transfer = true;
    if (part.links_ready) SendTransferLocked(part, actions);
    return;
  }
  ++part.replicating;
  const uint32_t id = part.state.id;
  const uint64_t step = header.step;
  const uint64_t epoch = header.epoch;
  const uint64_t backup = part.backup;
  actions.push_back([this, backup, header, grad = std::move(grad), id, step, epoch] {
    links_->SendToBackup(backup, header, grad, [this, id, step, epoch](const Status& status) {
      OnReplicated(id, step, epoch, status, false);
    });
  });
}

void ParameterStore::SendTransferLocked(Part& part, Actions& actions) {
  part.needs_transfer = false;
  auto blob = std::make_shared<std::vector<float>>();
  blob->reserve(part.state.size() * 3);
  blob->insert(blob->end(), part.state.weights.begin(), part.state.weights.end());
  blob->insert(blob->end(), part.state.state0.begin(), part.state.state0.end());
  blob->insert(blob->end(), part.state.state1.begin(), part.state.state1.end());
  ps::Frame header;
  header.type = ps::FrameType::kTransfer;
  header.partition = part.state.id;
  header.step = part.state.step;
  header.version = part.state.version;
  header.contributors =
      static_cast<uint32_t>((part.state.state0.empty() ? 0 : 1) + (part.state.state1.empty() ? 0 : 1));
  ++part.replicating;
  counters_.transfers_sent.fetch_add(1);
  const uint32_t id = part.state.id;
  const uint64_t step = part.state.step;
  const uint64_t backup = part.backup;
  spdlog::info("partition {}: sending its state (version {}, step {}) to its new backup, member {}", id,
               part.state.version, step, backup);
  actions.push_back([this, backup, header, blob = std::move(blob), id, step]() mutable {
    uint64_t epoch;
    auto job = std::make_shared<std::string>();
    {
      std::lock_guard lock(mu_);
      epoch = epoch_;
      v1::InitializeParametersRequest request;
      request.set_job_id(job_id_);
      request.set_epoch(epoch_);
      *request.mutable_tensors() = tensors_;
      *request.mutable_optimizer() = optimizer_config_;
      *request.mutable_consistency() = consistency_;
      request.SerializeToString(job.get());
    }
    links_->SendJob(backup, std::move(job));
    header.epoch = epoch;
    links_->SendToBackup(backup, header, std::move(blob), [this, id, step, epoch](const Status& status) {
      OnReplicated(id, step, epoch, status, true);
    });
  });
}

void ParameterStore::OnReplicated(uint32_t partition, uint64_t step, uint64_t epoch, const Status& status,
                                  bool transfer) {
  auto part = Find(partition);
  if (!part) return;
  const bool current = epoch == this->epoch();  // before the partition's lock (lock order)
  Actions actions;
  {
    std::lock_guard plock(part->mu);
    if (part->replicating > 0) --part->replicating;
    if (status.ok()) {
      counters_.replicas_applied.fetch_add(1);
      part->safe_step = std::max(part->safe_step, step);
      ServePullsLocked(*part, actions);
    } else if (!transfer && part->role == v1::REPLICA_ROLE_PRIMARY && part->backup != 0 &&
               part->safe_step < part->state.step) {
      // The backup refused the update (it diverged), or the update did not
      // reach it as the epoch changed: it gets the whole state, now or on
      // the new epoch's links.
      if (status.code() == StatusCode::kFailedPrecondition && current) {
        spdlog::warn("partition {}: the backup refused an update ({}); sending it the whole state", partition,
                     status.message());
      } else {
        spdlog::info("partition {}: step {} did not reach the backup ({}); sending it the whole state", partition, step,
                     status.message());
      }
      part->needs_transfer = true;
      if (part->links_ready) SendTransferLocked(*part, actions);
    } else {
      spdlog::warn("partition {}: replicating step {} failed: {} (waiting for the next epoch)", partition, step,
                   status.ToString());
    }
  }
  Run(actions);
}

void ParameterStore::UnlendLocked(Part& part, bool keep_values) {
  if (!part.lent) return;
  // Acquire: pairs with a reply's release when it is done reading, so the
  // writes that follow come after its reads.
  if (part.lent->readers.load(std::memory_order_acquire) > 0) {
    part.lent->buffer = std::move(part.state.weights);
    part.state.weights.clear();
    if (keep_values) part.state.weights = part.lent->buffer;
  }
  part.lent.reset();
}

void ParameterStore::AnswerPullLocked(Part& part, const PendingPull& pull, Actions& actions) {
  const size_t n = part.state.size();
  const v1::WireDType dtype = Wire(pull.header.dtype);
  ReplyBody body;
  if (Fp32Wire(pull.header.dtype)) {
    // Sent from the weights themselves: no copy. The next update finds the
    // buffer lent and, if a reply still reads it, works on a copy.
    if (!part.lent) part.lent = std::make_shared<Lent>();
    part.lent->readers.fetch_add(1, std::memory_order_relaxed);
    body.borrowed = part.state.weights.data();
    body.borrowed_bytes = n * sizeof(float);
    body.keep = std::shared_ptr<const void>(
        part.lent.get(), [lent = part.lent](const void*) { lent->readers.fetch_sub(1, std::memory_order_release); });
  } else {
    body.owned.resize(WireBytes(dtype, n));
    EncodeWire(body.owned.data(), part.state.weights.data(), dtype, n);
  }
  ps::Frame reply = ps::ReplyTo(pull.header, ps::FrameType::kPullReply);
  reply.dtype = pull.header.dtype;
  reply.step = part.state.step;
  reply.version = part.state.version;
  reply.payload_bytes = body.size();
  part.bytes_pulled += body.size();
  part.pulls_served++;
  counters_.pull_bytes.fetch_add(body.size());
  actions.push_back([r = pull.reply, reply, body = std::move(body)]() mutable { r(reply, std::move(body)); });
}

void ParameterStore::ServePullsLocked(Part& part, Actions& actions) {
  // Deferred push acknowledgements (async modes): once the update is safe.
  for (auto it = part.push_acks.begin(); it != part.push_acks.end();) {
    if (part.safe_step >= it->first) {
      actions.push_back([r = std::move(it->second)]() mutable { r(ps::Frame{}, {}); });
      it = part.push_acks.erase(it);
    } else {
      ++it;
    }
  }
  if (part.pulls.empty()) return;
  uint64_t slowest = 0;
  const bool bounded = mode_.load() == v1::CONSISTENCY_MODE_BOUNDED_STALENESS;
  const uint32_t bound = bound_.load();
  if (bounded && !part.clocks.empty()) slowest = *std::min_element(part.clocks.begin(), part.clocks.end());
  for (auto it = part.pulls.begin(); it != part.pulls.end();) {
    bool ready = part.safe_step >= it->target && part.state.step >= it->target && part.safe_step >= part.state.step;
    if (bounded && !part.clocks.empty() && it->header.step > slowest + bound + 1) ready = false;
    if (ready) {
      AnswerPullLocked(part, *it, actions);
      it = part.pulls.erase(it);
    } else {
      ++it;
    }
  }
}

void ParameterStore::Pull(uint64_t from, const ps::Frame& h, Reply reply) {
  PullImpl(from, h, reply, /*try_only=*/false);
}

bool ParameterStore::TryPull(uint64_t from, const ps::Frame& h, Reply& reply) {
  return PullImpl(from, h, reply, /*try_only=*/true);
}

bool ParameterStore::PullImpl(uint64_t from, const ps::Frame& h, Reply& reply, bool try_only) {
  auto refuse = [&](const Status& status) {
    counters_.pulls.fetch_add(1);
    std::vector<char> body;
    ps::Frame r = Refusal(h, status, &body);
    reply(r, std::move(body));
    return true;
  };
  bool busy = false;
  auto checked = CheckDataFrame(h, /*primary=*/true, try_only ? &busy : nullptr);
  if (busy) return false;
  if (!checked.ok()) return refuse(checked.status());
  if (h.dtype != v1::WIRE_DTYPE_UNSPECIFIED && h.dtype != v1::WIRE_DTYPE_FP32 && h.dtype != v1::WIRE_DTYPE_BF16) {
    return refuse(InvalidArgument("dtype {}: pulls return FP32 or BF16", h.dtype));
  }
  bool sync;
  uint64_t start_step;
  {
    std::unique_lock lock(mu_, std::defer_lock);
    if (!Acquire(lock, !try_only)) return false;
    sync = IsSync(consistency_);
    start_step = start_step_;
  }
  std::shared_ptr<Part> part = *checked;
  Actions actions;
  {
    std::unique_lock plock(part->mu, std::defer_lock);
    if (!Acquire(plock, !try_only)) return false;
    counters_.pulls.fetch_add(1);
    PendingPull pull{from, h, 0, std::move(reply)};
    bool refused = false;
    auto refuse_pull = [&](const Status& status) {
      std::vector<char> body;
      ps::Frame r = Refusal(h, status, &body);
      actions.push_back(
          [rep = std::move(pull.reply), r, body = std::move(body)]() mutable { rep(r, std::move(body)); });
      refused = true;
    };
    if (sync) {
      if (h.step > part->state.step + 1) {
        // It could only be reached after a step this puller has not pushed.
        refuse_pull(FailedPrecondition("step {} is from the future: partition {} has completed step {}, the next is {}",
                                       h.step, h.partition, part->state.step, part->state.step + 1));
      }
      pull.target = h.step;
    } else {
      pull.target = part->state.step;
      if (h.contributors > 0 && h.contributors <= kMaxContributors) {
        // The contributor is checked first: a refused pull starts no clocks
        // (which would fix the epoch's contributor count).
        if (h.contributor >= h.contributors) {
          refuse_pull(InvalidArgument("contributor {} is not below contributors ({})", h.contributor, h.contributors));
        } else {
          if (part->clocks.empty()) part->clocks.assign(h.contributors, start_step);
          if (part->clocks.size() != h.contributors) {
            refuse_pull(InvalidArgument("contributors: this pull says {}, the pushes and pulls of this epoch said {}",
                                        h.contributors, part->clocks.size()));
          } else if (h.step > 0) {
            // The puller computes step h.step next: it is done with the
            // steps before (pushed, or left behind by a membership change
            // after which the workers go on from a later step than the
            // epoch's start_step), and pushes of them are duplicates from
            // now on.
            part->clocks[h.contributor] = std::max(part->clocks[h.contributor], h.step - 1);
          }
        }
      }
    }
    if (!refused) {
      part->pulls.push_back(std::move(pull));
      ServePullsLocked(*part, actions);
    }
  }
  Run(actions);
  return true;
}

void ParameterStore::Replica(uint64_t from, const ps::Frame& h, const void* payload, Reply reply) {
  auto answer = [&](const Status& status) {
    std::vector<char> body;
    ps::Frame r = ps::ReplyTo(h, ps::FrameType::kReplicaReply);
    if (!status.ok()) body = ps::ErrorPayload(r, status);
    reply(r, std::move(body));
  };
  std::shared_ptr<Part> part;
  {
    std::lock_guard lock(mu_);
    if (h.epoch != epoch_) return answer(Aborted("update from epoch {}, this backup is at epoch {}", h.epoch, epoch_));
    auto it = parts_.find(h.partition);
    if (it == parts_.end()) return answer(NotFound("partition {} is not held here", h.partition));
    part = it->second;
  }
  std::unique_lock plock(part->mu);
  if (part->role != v1::REPLICA_ROLE_BACKUP || part->primary != from) {
    plock.unlock();
    return answer(FailedPrecondition("this server is not the backup of partition {} for member {}", h.partition, from));
  }
  if (part->state.version == 0 || part->state.version != h.version || part->state.step + 1 != h.step) {
    const Status diverged = FailedPrecondition(
        "backup of partition {} is at version {} step {}, the update follows version {} and makes step {}", h.partition,
        part->state.version, part->state.step, h.version, h.step);
    plock.unlock();
    return answer(diverged);
  }
  if ((h.flags & ps::kFlagSkip) == 0) {
    if (h.payload_bytes != part->state.size() * sizeof(float)) {
      plock.unlock();
      return answer(InvalidArgument("update of partition {} is {} bytes, expected {}", h.partition, h.payload_bytes,
                                    part->state.size() * sizeof(float)));
    }
    const double lr = ps::ReplicaLearningRate(h);
    if (Status valid = Optimizer::CheckStepLearningRate(lr); !valid.ok()) {
      plock.unlock();
      return answer(valid.WithContext(fmt::format("update of partition {} step {}", h.partition, h.step)));
    }
    ApplyLocked(*part, static_cast<const float*>(payload), h.value, lr);
  }
  part->state.step = h.step;
  part->safe_step = h.step;
  plock.unlock();
  answer(Status::Ok());
}

void ParameterStore::Transfer(uint64_t from, const ps::Frame& h, const void* payload, Reply reply) {
  auto answer = [&](const Status& status) {
    std::vector<char> body;
    ps::Frame r = ps::ReplyTo(h, ps::FrameType::kTransferReply);
    if (!status.ok()) body = ps::ErrorPayload(r, status);
    reply(r, std::move(body));
  };
  std::shared_ptr<Part> part;
  int buffers = 0;
  {
    std::lock_guard lock(mu_);
    if (h.epoch != epoch_) return answer(Aborted("state from epoch {}, this backup is at epoch {}", h.epoch, epoch_));
    if (!configured_) return answer(FailedPrecondition("the job is not configured on this backup yet"));
    buffers = optimizer_->state_buffers();
    auto it = parts_.find(h.partition);
    if (it == parts_.end()) return answer(NotFound("partition {} is not held here", h.partition));
    part = it->second;
  }
  std::unique_lock plock(part->mu);
  if (part->role != v1::REPLICA_ROLE_BACKUP || part->primary != from) {
    plock.unlock();
    return answer(FailedPrecondition("this server is not the backup of partition {} for member {}", h.partition, from));
  }
  const size_t n = part->state.size();
  if (static_cast<int>(h.contributors) != buffers || h.payload_bytes != n * (1 + buffers) * sizeof(float)) {
    plock.unlock();
    return answer(InvalidArgument("state of partition {} is {} bytes with {} buffers, expected {} with {}", h.partition,
                                  h.payload_bytes, h.contributors, n * (1 + buffers) * sizeof(float), buffers));
  }
  const float* src = static_cast<const float*>(payload);
  UnlendLocked(*part, /*keep_values=*/false);
  part->state.weights.assign(src, src + n);
  part->state.state0.assign(buffers >= 1 ? src + n : src, buffers >= 1 ? src + 2 * n : src);
  part->state.state1.assign(buffers >= 2 ? src + 2 * n : src, buffers >= 2 ? src + 3 * n : src);
  part->state.version = h.version;
  part->state.step = h.step;
  part->safe_step = h.step;
  counters_.transfers_received.fetch_add(1);
  spdlog::info("partition {}: received its state from member {} (version {}, step {})", h.partition, from,
               part->state.version, h.step);
  plock.unlock();
  answer(Status::Ok());
}

}  // namespace tandem::server

namespace tandem::server {

void ParameterStore::Job(uint64_t from, const void* payload, size_t bytes) {
  v1::InitializeParametersRequest request;
  if (!request.ParseFromArray(payload, static_cast<int>(bytes))) {
    spdlog::warn("member {} sent a job configuration that does not parse; ignored", from);
    return;
  }
  Status status = Configure(request.job_id(), request.tensors(), request.optimizer(), request.consistency());
  if (!status.ok()) spdlog::warn("member {} sent a job configuration this server refuses: {}", from, status.ToString());
}

void* PushLanding::PayloadBuffer(int peer, const ps::Frame& header) {
  if (peer < 0 || static_cast<size_t>(peer) >= slots_.size()) return nullptr;
  auto& slot = slots_[static_cast<size_t>(peer)];
  slot = store_->PushBuffer(header);
  return slot ? slot->data() : nullptr;
}

bool PushLanding::TryPush(int peer, uint64_t from, const ps::Frame& header, const void* payload, Reply& reply,
                          ParameterStore::Then& then) {
  std::shared_ptr<std::vector<float>> none;
  const bool landed = peer >= 0 && static_cast<size_t>(peer) < slots_.size() && slots_[static_cast<size_t>(peer)] &&
                      slots_[static_cast<size_t>(peer)]->data() == payload;
  auto& buffer = landed ? slots_[static_cast<size_t>(peer)] : none;
  if (!store_->TryPush(from, header, payload, buffer, reply, then)) return false;
  if (landed) buffer.reset();  // kept by the store, or no longer needed
  return true;
}

void PushLanding::Push(int peer, uint64_t from, const ps::Frame& header, const void* payload, Reply reply) {
  std::shared_ptr<std::vector<float>> buffer;
  if (peer >= 0 && static_cast<size_t>(peer) < slots_.size()) buffer = std::move(slots_[static_cast<size_t>(peer)]);
  if (buffer && buffer->data() == payload) return store_->Push(from, header, std::move(buffer), std::move(reply));
  store_->Push(from, header, payload, std::move(reply));
}

}  // namespace tandem::server
