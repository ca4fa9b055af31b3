// The coordinator's gRPC services (tandem.v1.Coordinator and
// tandem.v1.CoordinatorAdmin) over a CoordinatorCore.
//
// Threads: the services use gRPC's callback API, so thousands of membership
// streams cost no thread each. A durability thread finishes the replies that
// must wait for the store (group commit: many replies per fsync) and wakes
// watchers once a new epoch is durable; a ticker thread runs the core's timers
// every `tick` and publishes metrics.
//
// Thread safety: thread-safe. Start() once; Stop() before the gRPC server shuts
// down (it ends the streams, which would otherwise hold the server open).
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "common/mutex.h"
#include "common/thread_annotations.h"
#include "coordinator/coordinator_core.h"
#include "tandem/v1/coordinator.grpc.pb.h"

namespace tandem::coordinator {

class WatchReactor;

class CoordinatorService final : public v1::Coordinator::CallbackService, public v1::CoordinatorAdmin::CallbackService {
 public:
  // `core` and `store` must outlive the service.
  CoordinatorService(CoordinatorCore* core, Store* store, prometheus::Registry& registry,
                     std::chrono::milliseconds tick = std::chrono::milliseconds(20));
  ~CoordinatorService() override;

  void Start();
  void Stop();

  v1::Coordinator::CallbackService* coordinator() { return this; }
  v1::CoordinatorAdmin::CallbackService* admin() { return this; }

  // tandem.v1.Coordinator
  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* context, const v1::RegisterRequest* request,
                                     v1::RegisterResponse* response) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* context, const v1::HeartbeatRequest* request,
                                      v1::HeartbeatResponse* response) override;
  grpc::ServerWriteReactor<v1::WatchMembershipResponse>* WatchMembership(
      grpc::CallbackServerContext* context, const v1::WatchMembershipRequest* request) override;
  grpc::ServerUnaryReactor* AckEpoch(grpc::CallbackServerContext* context, const v1::AckEpochRequest* request,
                                     v1::AckEpochResponse* response) override;
  grpc::ServerUnaryReactor* Leave(grpc::CallbackServerContext* context, const v1::LeaveRequest* request,
                                  v1::LeaveResponse* response) override;
  grpc::ServerUnaryReactor* PutEpochValue(grpc::CallbackServerContext* context, const v1::PutEpochValueRequest* request,
                                          v1::PutEpochValueResponse* response) override;
  grpc::ServerUnaryReactor* GetEpochValues(grpc::CallbackServerContext* context,
                                           const v1::GetEpochValuesRequest* request,
                                           v1::GetEpochValuesResponse* response) override;
  // tandem.v1.CoordinatorAdmin
  grpc::ServerUnaryReactor* GetStatus(grpc::CallbackServerContext* context, const v1::GetStatusRequest* request,
                                      v1::GetStatusResponse* response) override;
  grpc::ServerUnaryReactor* Drain(grpc::CallbackServerContext* context, const v1::DrainRequest* request,
                                  v1::DrainResponse* response) override;
  grpc::ServerUnaryReactor* Scale(grpc::CallbackServerContext* context, const v1::ScaleRequest* request,
                                  v1::ScaleResponse* response) override;

 private:
  friend class WatchReactor;
  struct PendingReply {
    uint64_t sequence;
    grpc::ServerUnaryReactor* reactor;
  };
  struct PendingGet {
    grpc::ServerUnaryReactor* reactor;
    v1::GetEpochValuesRequest request;
    v1::GetEpochValuesResponse* response;
    std::chrono::steady_clock::time_point deadline;
  };

  template <typename T>
  grpc::ServerUnaryReactor* Respond(grpc::CallbackServerContext* context, Result<CoordinatorCore::Reply<T>> result,
                                    T* response);
  void FinishWhenDurable(grpc::ServerUnaryReactor* reactor, uint64_t sequence);
  void DurabilityLoop();
  void TickLoop();
  void WakeWatchers();
  void RetryGets(bool expire_all);
  void UpdateMetrics();
  void RemoveWatcher(WatchReactor* watcher);

  CoordinatorCore* const core_;  // outlives the service (constructor contract)
  Store* const store_;           // outlives the service (constructor contract)
  const std::chrono::milliseconds tick_;

  Mutex mu_;
  CondVar cv_;
  std::vector<PendingReply> pending_ TANDEM_GUARDED_BY(mu_);
  std::vector<PendingGet> gets_ TANDEM_GUARDED_BY(mu_);
  std::set<WatchReactor*> watchers_ TANDEM_GUARDED_BY(mu_);
  bool stopping_ TANDEM_GUARDED_BY(mu_) = false;
  bool store_failed_ TANDEM_GUARDED_BY(mu_) = false;
  uint64_t woken_sequence_ = 0;  // durability thread only
  std::thread durability_;
  std::thread ticker_;

  prometheus::Family<prometheus::Gauge>& members_;
  prometheus::Gauge& epoch_;
  prometheus::Gauge& watch_streams_;
  prometheus::Counter& heartbeats_;
  prometheus::Counter& failures_;
  prometheus::Family<prometheus::Counter>& member_failures_;  // by job_id, kind, node_id
  prometheus::Counter& epochs_;
  prometheus::Counter& records_;
  prometheus::Histogram& rendezvous_seconds_;
  prometheus::Histogram& failure_to_epoch_seconds_;
  // The workers' straggler scores and who is named, by job_id, node_id and
  // rank; series of ranks that are gone are removed.
  prometheus::Family<prometheus::Gauge>& straggler_score_;
  prometheus::Family<prometheus::Gauge>& straggler_named_;
  prometheus::Counter& stragglers_drained_;
  std::map<std::tuple<std::string, std::string, uint32_t>, std::pair<prometheus::Gauge*, prometheus::Gauge*>>
      straggler_series_;
  CoreStats last_stats_;
};

}  // namespace tandem::coordinator
