#include "coordinator/coordinator_service.h"

#include <spdlog/spdlog.h>

namespace tandem::coordinator {

// One membership stream. Writes one update at a time: Pump() starts a write
// when none is in flight and the core has something newer for this member.
class WatchReactor final : public grpc::ServerWriteReactor<v1::WatchMembershipResponse> {
 public:
  WatchReactor(CoordinatorService* service, const v1::WatchMembershipRequest& request)
      : service_(service), request_(request) {
    position_.epoch = request.last_epoch_seen();
  }

  void Pump() {
    MutexLock lock(&mu_);
    if (writing_ || finished_) return;
    auto next = service_->core_->NextUpdate(request_, position_);
    if (!next.ok()) {
      FinishLocked(next.status().ToGrpc());
      return;
    }
    if (!next->has_value()) return;
    message_ = std::move(**next);
    writing_ = true;
    StartWrite(&message_);
  }

  void End(const grpc::Status& status) {
    MutexLock lock(&mu_);
    FinishLocked(status);
  }

  void OnWriteDone(bool ok) override {
    {
      MutexLock lock(&mu_);
      writing_ = false;
      if (!ok) {
        FinishLocked(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the stream broke"));
        return;
      }
    }
    Pump();
  }

  void OnCancel() override { End(grpc::Status::CANCELLED); }

  void set_generation(uint64_t generation) { generation_ = generation; }

  void OnDone() override {
    if (generation_ != 0) {
      service_->core_->DetachStream(request_.job_id(), request_.member_id(), request_.session_id(), generation_);
    }
    service_->RemoveWatcher(this);
    delete this;
  }

 private:
  void FinishLocked(const grpc::Status& status) TANDEM_REQUIRES(mu_) {
    if (finished_) return;
    finished_ = true;
    Finish(status);
  }

  CoordinatorService* const service_;  // outlives every stream (Stop ends them first)
  const v1::WatchMembershipRequest request_;
  Mutex mu_;
  WatchPosition position_ TANDEM_GUARDED_BY(mu_);
  v1::WatchMembershipResponse message_ TANDEM_GUARDED_BY(mu_);  // read by gRPC until OnWriteDone
  bool writing_ TANDEM_GUARDED_BY(mu_) = false;
  bool finished_ TANDEM_GUARDED_BY(mu_) = false;
  uint64_t generation_ = 0;  // set before the first Pump, read in OnDone
};

namespace {

prometheus::Histogram::BucketBoundaries SecondsBuckets() {
  return {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300};
}

}  // namespace

CoordinatorService::CoordinatorService(CoordinatorCore* core, Store* store, prometheus::Registry& registry,
                                       std::chrono::milliseconds tick)
    : core_(core),
      store_(store),
      tick_(tick),
      members_(prometheus::BuildGauge()
                   .Name("tandem_coordinator_members")
                   .Help("Members known to the coordinator, by kind (worker, server) and state.")
                   .Register(registry)),
      epoch_(prometheus::BuildGauge()
                 .Name("tandem_coordinator_epoch")
                 .Help("Newest membership epoch published (over all jobs).")
                 .Register(registry)
                 .Add({})),
      watch_streams_(prometheus::BuildGauge()
                         .Name("tandem_coordinator_watch_streams")
                         .Help("Open membership watch streams.")
                         .Register(registry)
                         .Add({})),
      heartbeats_(prometheus::BuildCounter()
                      .Name("tandem_coordinator_heartbeats_total")
                      .Help("Heartbeats accepted.")
                      .Register(registry)
                      .Add({})),
      failures_(prometheus::BuildCounter()
                    .Name("tandem_coordinator_failures_detected_total")
                    .Help("Members declared dead (missed heartbeats, broken streams, failed epochs, restarts that "
                          "replaced them).")
                    .Register(registry)
                    .Add({})),
      member_failures_(prometheus::BuildCounter()
                           .Name("tandem_coordinator_member_failures_total")
                           .Help("Members declared dead, by job, kind (worker, server) and node.")
                           .Register(registry)),
      epochs_(prometheus::BuildCounter()
                  .Name("tandem_coordinator_epochs_published_total")
                  .Help("Membership epochs published.")
                  .Register(registry)
                  .Add({})),
      records_(prometheus::BuildCounter()
                   .Name("tandem_coordinator_store_records_total")
                   .Help("Records appended to the coordinator's durable log.")
                   .Register(registry)
                   .Add({})),
      rendezvous_seconds_(prometheus::BuildHistogram()
                              .Name("tandem_coordinator_rendezvous_seconds")
                              .Help("From a job's first registration to its first epoch being active.")
                              .Register(registry)
                              .Add({}, SecondsBuckets())),
      failure_to_epoch_seconds_(prometheus::BuildHistogram()
                                    .Name("tandem_coordinator_failure_to_epoch_seconds")
                                    .Help("From a failure being detected to the next epoch being active.")
                                    .Register(registry)
                                    .Add({}, SecondsBuckets())),
      straggler_score_(prometheus::BuildGauge()
                           .Name("tandem_coordinator_straggler_score")
                           .Help("Share of the job's step time spent waiting for this worker over the last steps "
                                 "(0 to 1), by job, node and rank.")
                           .Register(registry)),
      straggler_named_(prometheus::BuildGauge()
                           .Name("tandem_coordinator_straggler")
                           .Help("1 while the coordinator names this worker a straggler, else 0.")
                           .Register(registry)),
      stragglers_drained_(prometheus::BuildCounter()
                              .Name("tandem_coordinator_stragglers_drained_total")
                              .Help("Workers the coordinator drained as persistent stragglers.")
                              .Register(registry)
                              .Add({})) {
  core_->SetChangeListener([this](bool epochs) {
    if (epochs) {
      WakeWatchers();
      cv_.NotifyAll();  // a new epoch may be waiting for durability before watchers get it
    }
    RetryGets(false);
  });
}

CoordinatorService::~CoordinatorService() {
  Stop();
}

void CoordinatorService::Start() {
  durability_ = std::thread([this] { DurabilityLoop(); });
  ticker_ = std::thread([this] { TickLoop(); });
}

void CoordinatorService::Stop() {
  std::vector<WatchReactor*> watchers;
  {
    MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    watchers.assign(watchers_.begin(), watchers_.end());
    for (auto* w : watchers) w->End(grpc::Status(grpc::StatusCode::UNAVAILABLE, "the coordinator is shutting down"));
  }
  cv_.NotifyAll();
  if (ticker_.joinable()) ticker_.join();
  if (durability_.joinable()) durability_.join();
  RetryGets(true);
}

void CoordinatorService::RemoveWatcher(WatchReactor* watcher) {
  MutexLock lock(&mu_);
  watchers_.erase(watcher);
}

void CoordinatorService::WakeWatchers() {
  MutexLock lock(&mu_);
  for (auto* w : watchers_) w->Pump();
}

void CoordinatorService::FinishWhenDurable(grpc::ServerUnaryReactor* reactor, uint64_t sequence) {
  if (store_->durable_sequence() >= sequence) {
    reactor->Finish(grpc::Status::OK);
    return;
  }
  {
    MutexLock lock(&mu_);
    if (!stopping_ && !store_failed_) {
      pending_.push_back({sequence, reactor});
      cv_.NotifyAll();
      return;
    }
  }
  // No durability thread to hand this to (stopping, or the store failed):
  // wait here, briefly, and answer with what the store says.
  const Status s = store_->WaitDurable(sequence);
  reactor->Finish(
      s.ok() ? grpc::Status::OK
             : grpc::Status(grpc::StatusCode::UNAVAILABLE, "the coordinator cannot store its state: " + s.message()));
}

void CoordinatorService::DurabilityLoop() {
  MutexLock lock(&mu_);
  while (true) {
    cv_.Wait(lock, [this]() TANDEM_REQUIRES(mu_) {
      return stopping_ || !pending_.empty() || core_->epoch_sequence() > woken_sequence_;
    });
    uint64_t target = core_->epoch_sequence();
    for (const auto& p : pending_) target = std::max(target, p.sequence);
    const bool stopping = stopping_;
    lock.Unlock();
    const Status durable = store_->WaitDurable(target);
    if (!durable.ok()) spdlog::error("the coordinator's store failed: {}", durable.message());
    const uint64_t done = store_->durable_sequence();
    lock.Lock();
    std::vector<PendingReply> ready;
    auto split = std::partition(pending_.begin(), pending_.end(),
                                [&](const PendingReply& p) { return p.sequence > done && durable.ok(); });
    ready.assign(split, pending_.end());
    pending_.erase(split, pending_.end());
    lock.Unlock();
    for (const auto& p : ready) {
      p.reactor->Finish(durable.ok() ? grpc::Status::OK
                                     : grpc::Status(grpc::StatusCode::UNAVAILABLE,
                                                    "the coordinator cannot store its state: " + durable.message()));
    }
    const uint64_t epochs = core_->epoch_sequence();
    if (epochs <= done && epochs > woken_sequence_) {
      woken_sequence_ = epochs;
      WakeWatchers();
    }
    lock.Lock();
    if (stopping && pending_.empty()) return;
    if (!durable.ok()) {
      // Nothing more can become durable: later replies fail at once (see
      // FinishWhenDurable); let Stop() end this thread.
      store_failed_ = true;
      cv_.Wait(lock, [this]() TANDEM_REQUIRES(mu_) { return stopping_; });
      return;
    }
  }
}

void CoordinatorService::TickLoop() {
  MutexLock lock(&mu_);
  auto next_metrics = std::chrono::steady_clock::now();
  while (!stopping_) {
    cv_.WaitFor(lock, tick_, [this]() TANDEM_REQUIRES(mu_) { return stopping_; });
    if (stopping_) break;
    lock.Unlock();
    core_->Tick();
    RetryGets(false);
    if (std::chrono::steady_clock::now() >= next_metrics) {
      UpdateMetrics();
      next_metrics = std::chrono::steady_clock::now() + std::chrono::milliseconds(250);
    }
    lock.Lock();
  }
}

void CoordinatorService::UpdateMetrics() {
  CoreStats stats = core_->TakeStats();
  heartbeats_.Increment(static_cast<double>(stats.heartbeats - last_stats_.heartbeats));
  failures_.Increment(static_cast<double>(stats.failures_detected - last_stats_.failures_detected));
  for (const auto& [key, count] : stats.failures_by_node) {
    const auto& [job, kind, node] = key;
    auto before = last_stats_.failures_by_node.find(key);
    const uint64_t delta = count - (before == last_stats_.failures_by_node.end() ? 0 : before->second);
    // Added at 0 as soon as a member of the node is known, so that the first failure is an increase.
    member_failures_.Add({{"job_id", job}, {"kind", kind}, {"node_id", node}}).Increment(static_cast<double>(delta));
  }
  epochs_.Increment(static_cast<double>(stats.epochs_published - last_stats_.epochs_published));
  records_.Increment(static_cast<double>(stats.records_appended - last_stats_.records_appended));
  epoch_.Set(static_cast<double>(stats.max_epoch));
  for (double s : stats.rendezvous_seconds) rendezvous_seconds_.Observe(s);
  for (double s : stats.failure_to_epoch_seconds) failure_to_epoch_seconds_.Observe(s);
  for (const char* kind : {"worker", "server"}) {
    for (const char* state : {"joining", "active", "draining", "left", "dead"}) {
      auto it = stats.members.find({kind, state});
      members_.Add({{"kind", kind}, {"state", state}}).Set(it == stats.members.end() ? 0 : it->second);
    }
  }
  {
    MutexLock lock(&mu_);
    watch_streams_.Set(static_cast<double>(watchers_.size()));
  }
  stragglers_drained_.Increment(static_cast<double>(stats.stragglers_drained - last_stats_.stragglers_drained));
  auto stale = std::move(straggler_series_);
  straggler_series_.clear();
  for (const auto& s : stats.stragglers) {
    const auto key = std::make_tuple(s.job_id, s.node_id, s.rank);
    auto it = stale.find(key);
    std::pair<prometheus::Gauge*, prometheus::Gauge*> series;
    if (it != stale.end()) {
      series = it->second;
      stale.erase(it);
    } else {
      const std::map<std::string, std::string> labels = {
          {"job_id", s.job_id}, {"node_id", s.node_id}, {"rank", std::to_string(s.rank)}};
      series = {&straggler_score_.Add(labels), &straggler_named_.Add(labels)};
    }
    series.first->Set(s.score);
    series.second->Set(s.named ? 1 : 0);
    straggler_series_[key] = series;
  }
  for (const auto& [key, series] : stale) {
    straggler_score_.Remove(series.first);
    straggler_named_.Remove(series.second);
  }
  last_stats_ = std::move(stats);
}

template <typename T>
grpc::ServerUnaryReactor* CoordinatorService::Respond(grpc::CallbackServerContext* context,
                                                      Result<CoordinatorCore::Reply<T>> result, T* response) {
  auto* reactor = context->DefaultReactor();
  if (!result.ok()) {
    reactor->Finish(result.status().ToGrpc());
    return reactor;
  }
  *response = std::move(result->response);
  FinishWhenDurable(reactor, result->durable_after);
  return reactor;
}

grpc::ServerUnaryReactor* CoordinatorService::Register(grpc::CallbackServerContext* context,
                                                       const v1::RegisterRequest* request,
                                                       v1::RegisterResponse* response) {
  return Respond(context, core_->Register(*request), response);
}

grpc::ServerUnaryReactor* CoordinatorService::Heartbeat(grpc::CallbackServerContext* context,
                                                        const v1::HeartbeatRequest* request,
                                                        v1::HeartbeatResponse* response) {
  auto* reactor = context->DefaultReactor();
  auto result = core_->Heartbeat(*request);
  if (result.ok()) *response = std::move(*result);
  reactor->Finish(result.status().ToGrpc());
  return reactor;
}

grpc::ServerWriteReactor<v1::WatchMembershipResponse>* CoordinatorService::WatchMembership(
    grpc::CallbackServerContext* /*context*/, const v1::WatchMembershipRequest* request) {
  auto* watcher = new WatchReactor(this, *request);  // deletes itself in OnDone
  auto generation = core_->AttachStream(*request);
  Status attached = generation.status();
  if (generation.ok()) watcher->set_generation(*generation);
  {
    MutexLock lock(&mu_);
    if (stopping_ && attached.ok()) attached = Unavailable("the coordinator is shutting down");
    if (attached.ok()) watchers_.insert(watcher);
  }
  if (!attached.ok()) {
    watcher->End(attached.ToGrpc());
    return watcher;
  }
  watcher->Pump();
  return watcher;
}

grpc::ServerUnaryReactor* CoordinatorService::AckEpoch(grpc::CallbackServerContext* context,
                                                       const v1::AckEpochRequest* request,
                                                       v1::AckEpochResponse* response) {
  return Respond(context, core_->AckEpoch(*request), response);
}

grpc::ServerUnaryReactor* CoordinatorService::Leave(grpc::CallbackServerContext* context,
                                                    const v1::LeaveRequest* request, v1::LeaveResponse* response) {
  return Respond(context, core_->Leave(*request), response);
}

grpc::ServerUnaryReactor* CoordinatorService::PutEpochValue(grpc::CallbackServerContext* context,
                                                            const v1::PutEpochValueRequest* request,
                                                            v1::PutEpochValueResponse* /*response*/) {
  auto* reactor = context->DefaultReactor();
  reactor->Finish(core_->PutEpochValue(*request).ToGrpc());
  return reactor;
}

grpc::ServerUnaryReactor* CoordinatorService::GetEpochValues(grpc::CallbackServerContext* context,
                                                             const v1::GetEpochValuesRequest* request,
                                                             v1::GetEpochValuesResponse* response) {
  auto* reactor = context->DefaultReactor();
  auto result = core_->GetEpochValues(*request);
  if (!result.ok()) {
    reactor->Finish(result.status().ToGrpc());
    return reactor;
  }
  const int64_t wait_ms =
      std::min<int64_t>(request->wait().seconds() * 1000 + request->wait().nanos() / 1000000, 60000);
  if (result->missing_keys_size() == 0 || wait_ms <= 0) {
    *response = std::move(*result);
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }
  {
    MutexLock lock(&mu_);
    if (!stopping_) {
      gets_.push_back(
          {reactor, *request, response, std::chrono::steady_clock::now() + std::chrono::milliseconds(wait_ms)});
      return reactor;
    }
  }
  *response = std::move(*result);
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

void CoordinatorService::RetryGets(bool expire_all) {
  std::vector<PendingGet> gets;
  {
    MutexLock lock(&mu_);
    gets.swap(gets_);
  }
  std::vector<PendingGet> keep;
  const auto now = std::chrono::steady_clock::now();
  for (auto& g : gets) {
    auto result = core_->GetEpochValues(g.request);
    if (!result.ok()) {
      g.reactor->Finish(result.status().ToGrpc());
    } else if (result->missing_keys_size() == 0 || expire_all || now >= g.deadline) {
      *g.response = std::move(*result);
      g.reactor->Finish(grpc::Status::OK);
    } else {
      keep.push_back(std::move(g));
    }
  }
  MutexLock lock(&mu_);
  if (!stopping_) {
    for (auto& g : keep) gets_.push_back(std::move(g));
    return;
  }
  lock.Unlock();
  // Shutting down: answer with what is there rather than leave the call open.
  for (auto& g : keep) {
    auto result = core_->GetEpochValues(g.request);
    if (result.ok()) *g.response = std::move(*result);
    g.reactor->Finish(result.status().ToGrpc());
  }
}

grpc::ServerUnaryReactor* CoordinatorService::GetStatus(grpc::CallbackServerContext* context,
                                                        const v1::GetStatusRequest* request,
                                                        v1::GetStatusResponse* response) {
  auto* reactor = context->DefaultReactor();
  auto result = core_->GetStatus(*request);
  if (result.ok()) *response = std::move(*result);
  reactor->Finish(result.status().ToGrpc());
  return reactor;
}

grpc::ServerUnaryReactor* CoordinatorService::Drain(grpc::CallbackServerContext* context,
                                                    const v1::DrainRequest* request, v1::DrainResponse* response) {
  return Respond(context, core_->Drain(*request), response);
}

grpc::ServerUnaryReactor* CoordinatorService::Scale(grpc::CallbackServerContext* context,
                                                    const v1::ScaleRequest* request, v1::ScaleResponse* response) {
  return Respond(context, core_->Scale(*request), response);
}

}  // namespace tandem::coordinator
