#include "worker/ps/ps_client.h"

#include <algorithm>
#include <cstring>
#include <set>
#include <thread>

#include <spdlog/spdlog.h>

#include "common/member_session.h"
#include "common/trace.h"

namespace tandem::worker {
namespace {

// Initial values per InitializeParameters call (the gRPC message limit is
// 16 MiB by default).
constexpr size_t kInitBytesPerCall = 8u << 20;

}  // namespace

// ---------------------------------------------------------------------------
// PsOp
// ---------------------------------------------------------------------------

Status PsOp::Wait(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  transport::DriveWhileWaiting(
      std::max(bytes_, dst_bytes_), progress_, [this] { return done(); }, deadline);
  MutexLock lock(&mu_);
  if (!cv_.WaitUntil(lock, deadline, [this]() TANDEM_REQUIRES(mu_) { return done_; })) {
    return DeadlineExceeded("{} of partition {} (step {}) not answered within {} ms", ps::FrameTypeName(reply_.type),
                            reply_.partition, reply_.step, timeout.count());
  }
  return status_;
}

bool PsOp::done() const {
  MutexLock lock(&mu_);
  return done_;
}

void PsOp::Complete(const ps::Frame& reply, Status status) {
  {
    MutexLock lock(&mu_);
    if (done_) return;
    reply_ = reply;
    status_ = std::move(status);
    done_ = true;
  }
  cv_.NotifyAll();
}

// ---------------------------------------------------------------------------
// PsClient
// ---------------------------------------------------------------------------

PsClient::PsClient(PsClientOptions options) : options_(std::move(options)) {}

PsClient::~PsClient() {
  Stop();
}

std::shared_ptr<PsClient::Group> PsClient::Current() const {
  MutexLock lock(&mu_);
  return group_;
}

uint64_t PsClient::epoch() const {
  MutexLock lock(&mu_);
  return epoch_.epoch();
}

v1::ShardMap PsClient::shard_map() const {
  MutexLock lock(&mu_);
  return epoch_.shard_map();
}

void PsClient::FailAll(const std::shared_ptr<Group>& group, const Status& status) {
  std::map<uint64_t, std::shared_ptr<PsOp>> ops;
  {
    MutexLock lock(&group->mu);
    ops.swap(group->ops);
  }
  for (auto& [id, op] : ops) op->Complete(op->reply_, status);
}

void PsClient::Stop() {
  std::shared_ptr<Group> group;
  {
    MutexLock lock(&mu_);
    group = std::move(group_);
  }
  if (!group) return;
  group->channel->Stop();
  FailAll(group, Cancelled("the parameter-server client stopped"));
}

Status PsClient::SetEpoch(const v1::MembershipEpoch& epoch, uint64_t self, comm::Rendezvous& rendezvous) {
  std::shared_ptr<Group> old;
  uint64_t previous = 0;
  {
    MutexLock lock(&mu_);
    // The same epoch again (activated, or re-sent after a reconnection).
    if (epoch.epoch() <= epoch_.epoch()) return Status::Ok();
    old = std::move(group_);
    previous = epoch_.epoch();
    // Control channels to the servers of this epoch (kept across epochs).
    std::map<uint64_t, std::shared_ptr<Server>> servers;
    for (const auto& peer : epoch.peers()) {
      if (peer.role() != v1::ROLE_SERVER) continue;
      auto it = servers_.find(peer.member_id());
      if (it != servers_.end() && it->second->address == peer.control_address()) {
        servers[peer.member_id()] = it->second;
        continue;
      }
      auto server = std::make_shared<Server>();
      server->member_id = peer.member_id();
      server->address = peer.control_address();
      std::shared_ptr<grpc::Channel> channel;
      if (options_.make_channel) {
        auto made = options_.make_channel(peer.control_address());
        if (!made.ok()) return made.status().WithContext(fmt::format("server {}", peer.member_id()));
        channel = *made;
      } else {
        channel = grpc::CreateChannel(peer.control_address(), grpc::InsecureChannelCredentials());
      }
      server->stub = v1::ParameterServer::NewStub(channel);
      servers[peer.member_id()] = std::move(server);
    }
    servers_ = std::move(servers);
  }
  if (old) {
    old->channel->Stop();
    FailAll(old, Aborted("epoch {} was superseded by epoch {}; push the step again", previous, epoch.epoch()));
  }
  old.reset();
  if (epoch.shard_map().partitions_size() == 0 || epoch.server_count() == 0) {
    MutexLock lock(&mu_);
    if (epoch.epoch() > epoch_.epoch()) epoch_ = epoch;
    return Status::Ok();
  }
  std::string hostname;
  for (const auto& peer : epoch.peers()) {
    if (peer.member_id() == self) hostname = peer.node().hostname();
  }
  transport::UcxOptions ucx = options_.ucx;
  if (ucx.hostname.empty()) ucx.hostname = hostname;
  TANDEM_ASSIGN_OR_RETURN(auto ps_group, transport::BuildPsGroup(epoch, self, rendezvous, ucx, options_.timeout));
  auto group = std::make_shared<Group>();
  group->epoch = epoch.epoch();
  group->map = epoch.shard_map();
  group->group = std::move(ps_group);
  for (const auto& peer : epoch.peers()) {
    if (peer.role() != v1::ROLE_SERVER) continue;
    if (auto rank = ServerRank(epoch, peer.member_id())) group->server_rank[peer.member_id()] = *rank;
  }
  std::vector<int> servers = group->group.Ranks(v1::ROLE_SERVER);
  std::weak_ptr<Group> weak = group;
  transport::FrameChannel::Handler handler;
  handler.payload_buffer = [this, weak](int, const ps::Frame& h) -> void* {
    auto g = weak.lock();
    return g ? PayloadBuffer(g, h) : nullptr;
  };
  handler.on_frame = [this, weak](int rank, const ps::Frame& h, void* payload, std::vector<char>&) {
    if (auto g = weak.lock()) OnFrame(g, rank, h, payload);
  };
  handler.on_peer_failed = [this, weak](int rank, const Status& status) {
    if (auto g = weak.lock()) OnPeerFailed(g, rank, status);
  };
  // Replies only complete the request waiting for them (and call
  // on_answered): handled where they arrive, on the transport's completion
  // thread, so the thread waiting for one is the only one woken.
  handler.try_inline = [this, weak](int rank, const ps::Frame& h, void* payload, std::vector<char>&) {
    if (auto g = weak.lock()) OnFrame(g, rank, h, payload);
    return true;
  };
  group->channel = std::make_unique<transport::FrameChannel>(group->group.transport.get(), servers, std::move(handler),
                                                             /*start=*/false);
  {
    MutexLock lock(&mu_);
    // The epoch is adopted once its group is ready, so a caller that saw it
    // change can use it at once.
    if (epoch.epoch() <= epoch_.epoch()) return Status::Ok();
    epoch_ = epoch;
    group_ = group;
  }
  group->channel->Start();
  return Status::Ok();
}

std::shared_ptr<PsOp> PsClient::Start(ps::Frame header, const void* data, size_t bytes, void* dst, size_t dst_bytes) {
  auto op = std::make_shared<PsOp>();
  op->reply_ = header;
  op->dst_ = dst;
  op->dst_bytes_ = dst_bytes;
  auto group = Current();
  if (!group) {
    op->Complete(header, Unavailable("no parameter-server group: this worker is not in an epoch with servers"));
    return op;
  }
  header.epoch = group->epoch;
  op->reply_.epoch = group->epoch;
  const v1::ShardMap& map = group->map;
  if (header.partition >= static_cast<uint32_t>(map.partitions_size())) {
    op->Complete(header,
                 NotFound("partition {} does not exist (the job has {})", header.partition, map.partitions_size()));
    return op;
  }
  const auto& partition = map.partitions(static_cast<int>(header.partition));
  auto rank = group->group.rank_of.find(partition.primary_member_id());
  if (rank == group->group.rank_of.end()) {
    op->Complete(header, Unavailable("the primary of partition {} (member {}) is not in epoch {}", header.partition,
                                     partition.primary_member_id(), group->epoch));
    return op;
  }
  op->rank_ = rank->second;
  if (auto server = group->server_rank.find(partition.primary_member_id()); server != group->server_rank.end()) {
    op->server_ = server->second;
  }
  op->bytes_ = bytes;
  op->sent_ = std::chrono::steady_clock::now();
  header.request_id = next_request_.fetch_add(1);
  // Traced: the request carries a correlation id, and its posting is a span.
  const bool traced = trace::StepOn(header.step);
  const int64_t trace_start = traced ? trace::Now() : 0;
  if (traced) {
    op->corr_ = trace::NewCorrelation();
    ps::SetCorrelation(header, op->corr_);
  }
  {
    MutexLock lock(&group->mu);
    group->ops[header.request_id] = op;
  }
  std::weak_ptr<Group> weak = group;
  op->progress_ = [weak] {
    auto g = weak.lock();
    return g ? g->channel->Progress() : transport::Transport::Progressed::kBusy;
  };
  const uint64_t id = header.request_id;
  group->channel->Send(rank->second, header, data, bytes, [weak, id](const Status& sent) {
    if (sent.ok()) return;
    auto g = weak.lock();
    if (!g) return;
    std::shared_ptr<PsOp> failed;
    {
      MutexLock lock(&g->mu);
      auto it = g->ops.find(id);
      if (it != g->ops.end()) {
        failed = it->second;
        g->ops.erase(it);
      }
    }
    if (failed) failed->Complete(failed->reply_, sent);
  });
  if (traced) {
    trace::Complete(header.type == ps::FrameType::kPush ? "push" : "pull", "ps", trace_start, trace::Now(), header.step,
                    {{"partition", header.partition},
                     {"server", op->server_},
                     {"corr", static_cast<int64_t>(op->corr_)},
                     {"bytes", static_cast<int64_t>(header.type == ps::FrameType::kPush ? bytes : dst_bytes)}});
  }
  return op;
}

std::shared_ptr<PsOp> PsClient::Push(uint32_t partition, uint64_t step, uint32_t contributor, uint32_t contributors,
                                     v1::WireDType dtype, const void* data, size_t bytes, double lr) {
  ps::Frame h;
  h.type = ps::FrameType::kPush;
  h.partition = partition;
  h.step = step;
  h.contributor = contributor;
  h.contributors = contributors;
  h.dtype = static_cast<uint16_t>(dtype);
  h.value = lr;
  return Start(h, data, bytes, nullptr, 0);
}

std::shared_ptr<PsOp> PsClient::Pull(uint32_t partition, uint64_t step, v1::WireDType dtype, void* dst, size_t bytes,
                                     uint32_t contributor, uint32_t contributors) {
  ps::Frame h;
  h.type = ps::FrameType::kPull;
  h.partition = partition;
  h.step = step;
  h.contributor = contributor;
  h.contributors = contributors;
  h.dtype = static_cast<uint16_t>(dtype);
  return Start(h, nullptr, 0, dst, bytes);
}

void* PsClient::PayloadBuffer(const std::shared_ptr<Group>& group, const ps::Frame& h) {
  if (h.type != ps::FrameType::kPullReply || h.status != 0) return nullptr;
  MutexLock lock(&group->mu);
  auto it = group->ops.find(h.request_id);
  if (it == group->ops.end()) return nullptr;
  // Only straight into the caller's buffer when the sizes agree; otherwise
  // the channel keeps the bytes and the op reports the mismatch.
  return it->second->dst_bytes_ == h.payload_bytes ? it->second->dst_ : nullptr;
}

void PsClient::OnFrame(const std::shared_ptr<Group>& group, int rank, const ps::Frame& h, void* payload) {
  (void)rank;
  std::shared_ptr<PsOp> op;
  {
    MutexLock lock(&group->mu);
    auto it = group->ops.find(h.request_id);
    if (it == group->ops.end()) return;  // a reply to something dropped
    op = it->second;
    group->ops.erase(it);
  }
  if (op->corr_ != 0) {  // the reply's arrival, on this worker's timeline
    const int64_t now = trace::Now();
    trace::Complete(
        h.type == ps::FrameType::kPushReply ? "push_reply" : "pull_reply", "ps", now, now, h.step,
        {{"partition", h.partition},
         {"corr", static_cast<int64_t>(op->corr_)},
         {"status", h.status},
         {"round_trip_ns",
          std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - op->sent_).count()}});
  }
  Status status = ps::ReplyStatus(h, payload);
  if (status.ok() && h.type == ps::FrameType::kPullReply && payload != op->dst_) {
    status = InvalidArgument("pull of partition {}: the server sent {} bytes, the buffer holds {}", h.partition,
                             h.payload_bytes, op->dst_bytes_);
  }
  if (status.ok() && options_.on_answered) {
    const bool pull = h.type == ps::FrameType::kPullReply;
    options_.on_answered(pull, op->server_, pull ? h.payload_bytes : op->bytes_,
                         std::chrono::duration<double>(std::chrono::steady_clock::now() - op->sent_).count());
  }
  op->Complete(h, std::move(status));
}

void PsClient::OnPeerFailed(const std::shared_ptr<Group>& group, int rank, const Status& status) {
  const uint64_t member = group->group.members[static_cast<size_t>(rank)];
  spdlog::warn("epoch {}: parameter server {} failed: {}", group->epoch, member, status.ToString());
  std::vector<std::shared_ptr<PsOp>> failed;
  {
    MutexLock lock(&group->mu);
    for (auto it = group->ops.begin(); it != group->ops.end();) {
      if (it->second->rank_ == rank) {
        failed.push_back(it->second);
        it = group->ops.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& op : failed) {
    op->Complete(op->reply_, Unavailable("parameter server {} failed: {}", member, status.message()));
  }
}

// ---------------------------------------------------------------------------
// Control
// ---------------------------------------------------------------------------

std::unique_ptr<grpc::ClientContext> PsClient::Context() const {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(std::chrono::system_clock::now() + options_.timeout);
  return context;
}

Result<int> PsClient::InitializeWith(const v1::InitializeParametersRequest& base, uint64_t begin, uint64_t end,
                                     const ValueSource* values) {
  v1::MembershipEpoch epoch;
  std::map<uint64_t, std::shared_ptr<Server>> servers;
  {
    MutexLock lock(&mu_);
    epoch = epoch_;
    servers = servers_;
  }
  if (epoch.shard_map().partitions_size() == 0) return FailedPrecondition("the job has no parameter servers");
  // Each partition's primary first, then its backup. A server keeps the
  // first values it gets, so a backup gets values only from the worker whose
  // values its primary kept: the two copies agree even when workers
  // initialise at once with different values. A worker that lost a
  // partition at its primary leaves the backup to the winner; a backup the
  // winner never reached (it died) refuses the primary's first update and
  // gets the whole state from it. Read from a checkpoint, every copy gets
  // the same values, so every backup is asked.
  std::map<uint64_t, std::vector<const v1::Partition*>> primaries, backups;
  for (const auto& p : epoch.shard_map().partitions()) {
    if (p.range().end() <= begin || p.range().begin() >= end) continue;
    primaries[p.primary_member_id()].push_back(&p);
    if (p.backup_member_id() != 0) backups[p.backup_member_id()].push_back(&p);
  }
  int initialized = 0;
  // Partitions whose primary took this client's values, kept across calls
  // in the epoch: a call that failed after the primaries (a server not
  // answering yet) and is retried still initialises their backups.
  std::set<uint32_t> won;
  {
    MutexLock lock(&mu_);
    if (init_won_epoch_ == epoch.epoch()) won = init_won_;
  }
  const auto send = [&](const std::map<uint64_t, std::vector<const v1::Partition*>>& held, bool primary) -> Status {
    for (const auto& [member, parts] : held) {
      auto server = servers.find(member);
      if (server == servers.end())
        return Unavailable("server {} of the shard map is not in epoch {}", member, epoch.epoch());
      size_t i = 0;
      while (i < parts.size()) {
        v1::InitializeParametersRequest request = base;
        request.set_job_id(options_.job_id);
        request.set_token(options_.token);
        request.set_epoch(epoch.epoch());
        size_t bytes = 0;
        do {
          const v1::Partition* p = parts[i++];
          if (!primary && values != nullptr && !won.contains(p->id())) continue;
          request.add_partition_ids(p->id());
          if (values == nullptr) {
            // Read from the checkpoint by the server: the same cap on what one call reads.
            bytes += (p->range().end() - p->range().begin()) * sizeof(float);
          } else {
            auto* chunk = request.mutable_values()->add_chunks();
            *chunk->mutable_range() = p->range();
            chunk->set_dtype(v1::DTYPE_FLOAT32);
            const size_t n = p->range().end() - p->range().begin();
            std::string* data = chunk->mutable_data();
            data->resize(n * sizeof(float));
            (*values)(p->range().begin(), p->range().end(), reinterpret_cast<float*>(data->data()));
            bytes += n * sizeof(float);
          }
        } while (i < parts.size() && bytes < kInitBytesPerCall && request.partition_ids_size() < 4096);
        if (request.partition_ids_size() == 0) continue;  // none of these is this call's to initialise
        v1::InitializeParametersResponse response;
        auto context = Context();
        Status status = Status::FromGrpc(server->second->stub->InitializeParameters(context.get(), request, &response));
        if (!status.ok()) {
          return status.WithContext(fmt::format("initialising server {} ({}) as {}", member, server->second->address,
                                                primary ? "primary" : "backup"));
        }
        for (const auto& r : response.partitions()) {
          if (!r.newly_initialized()) continue;
          ++initialized;
          if (primary) won.insert(r.partition_id());
        }
      }
    }
    return Status::Ok();
  };
  Status primaries_done = send(primaries, true);
  {
    MutexLock lock(&mu_);
    if (init_won_epoch_ != epoch.epoch()) init_won_.clear();
    init_won_epoch_ = epoch.epoch();
    init_won_.insert(won.begin(), won.end());
  }
  TANDEM_RETURN_IF_ERROR(primaries_done);
  TANDEM_RETURN_IF_ERROR(send(backups, false));
  return initialized;
}

Result<int> PsClient::Initialize(const google::protobuf::RepeatedPtrField<v1::TensorSpec>& tensors,
                                 const v1::OptimizerConfig& optimizer, const v1::ConsistencyConfig& consistency,
                                 const float* params) {
  v1::InitializeParametersRequest base;
  *base.mutable_tensors() = tensors;
  *base.mutable_optimizer() = optimizer;
  *base.mutable_consistency() = consistency;
  base.mutable_values();
  const ValueSource copy = [params](uint64_t b, uint64_t e, float* out) {
    std::memcpy(out, params + b, (e - b) * sizeof(float));
  };
  return InitializeWith(base, 0, UINT64_MAX, &copy);
}

Result<int> PsClient::Initialize(const google::protobuf::RepeatedPtrField<v1::TensorSpec>& tensors,
                                 const v1::OptimizerConfig& optimizer, const v1::ConsistencyConfig& consistency,
                                 uint64_t begin, uint64_t end, const ValueSource& values) {
  v1::InitializeParametersRequest base;
  *base.mutable_tensors() = tensors;
  *base.mutable_optimizer() = optimizer;
  *base.mutable_consistency() = consistency;
  base.mutable_values();
  return InitializeWith(base, begin, end, &values);
}

Result<int> PsClient::InitializeFromCheckpoint(const google::protobuf::RepeatedPtrField<v1::TensorSpec>& tensors,
                                               const v1::OptimizerConfig& optimizer,
                                               const v1::ConsistencyConfig& consistency, const std::string& path) {
  v1::InitializeParametersRequest base;
  *base.mutable_tensors() = tensors;
  *base.mutable_optimizer() = optimizer;
  *base.mutable_consistency() = consistency;
  base.set_checkpoint_path(path);
  return InitializeWith(base, 0, UINT64_MAX, nullptr);
}

Result<std::vector<v1::CheckpointInfo>> PsClient::SaveCheckpoint(const std::string& directory, uint64_t step,
                                                                 const std::string& id, bool async) {
  std::map<uint64_t, std::shared_ptr<Server>> servers;
  uint64_t epoch;
  {
    MutexLock lock(&mu_);
    servers = servers_;
    epoch = epoch_.epoch();
  }
  // Every server at once: each captures its partitions exactly when they
  // complete `step`, so all of them must be asked before training gets
  // there.
  struct Call {
    uint64_t member = 0;
    std::shared_ptr<Server> server;
    v1::SaveCheckpointResponse response;
    Status status;
  };
  std::vector<Call> calls;
  for (auto& [member, server] : servers) calls.push_back(Call{member, server, {}, {}});
  std::vector<std::thread> threads;
  for (auto& call : calls) {
    threads.emplace_back([&, c = &call] {
      v1::SaveCheckpointRequest request;
      request.set_job_id(options_.job_id);
      request.set_token(options_.token);
      request.set_step(step);
      request.set_directory(directory);
      request.set_async(async);
      request.set_checkpoint_id(id);
      request.set_epoch(epoch);
      auto context = Context();
      c->status = Status::FromGrpc(c->server->stub->SaveCheckpoint(context.get(), request, &c->response));
    });
  }
  for (auto& t : threads) t.join();
  std::vector<v1::CheckpointInfo> infos;
  for (auto& call : calls) {
    if (!call.status.ok()) return call.status.WithContext(fmt::format("checkpoint on server {}", call.member));
    infos.push_back(call.response.checkpoint());
  }
  return infos;
}

Status PsClient::RestoreCheckpoint(const std::string& path, bool skip_optimizer_state) {
  std::map<uint64_t, std::shared_ptr<Server>> servers;
  uint64_t epoch;
  {
    MutexLock lock(&mu_);
    servers = servers_;
    epoch = epoch_.epoch();
  }
  for (auto& [member, server] : servers) {
    v1::RestoreCheckpointRequest request;
    request.set_job_id(options_.job_id);
    request.set_token(options_.token);
    request.set_epoch(epoch);
    request.set_path(path);
    request.set_skip_optimizer_state(skip_optimizer_state);
    v1::RestoreCheckpointResponse response;
    auto context = Context();
    Status status = Status::FromGrpc(server->stub->RestoreCheckpoint(context.get(), request, &response));
    if (!status.ok()) return status.WithContext(fmt::format("restore on server {}", member));
  }
  return Status::Ok();
}

Result<std::map<uint64_t, v1::GetStatsResponse>> PsClient::Stats(bool checksums) {
  std::map<uint64_t, std::shared_ptr<Server>> servers;
  {
    MutexLock lock(&mu_);
    servers = servers_;
  }
  std::map<uint64_t, v1::GetStatsResponse> out;
  for (auto& [member, server] : servers) {
    v1::GetStatsRequest request;
    request.set_job_id(options_.job_id);
    request.set_token(options_.token);
    request.set_checksums(checksums);
    auto context = Context();
    Status status = Status::FromGrpc(server->stub->GetStats(context.get(), request, &out[member]));
    if (!status.ok()) return status.WithContext(fmt::format("statistics of server {}", member));
  }
  return out;
}

}  // namespace tandem::worker
