// Tandem's implementation of the standard gRPC health service
// (grpc.health.v1.Health, proto/grpc/health/v1/health.proto), served by every
// daemon. Kubernetes' native gRPC probes and `tandem health` ask it.
//
// Service "" is the process as a whole (liveness); other names are set by the
// daemon ("tandem.ready" for readiness, each registered gRPC service). After
// Shutdown() every name reports NOT_SERVING and later changes are ignored.
//
// Thread safety: thread-safe.
#pragma once

#include <map>
#include <string>

#include "common/mutex.h"
#include "common/thread_annotations.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace tandem {

class HealthService final : public grpc::health::v1::Health::Service {
 public:
  using ServingStatus = grpc::health::v1::HealthCheckResponse::ServingStatus;

  void Set(const std::string& service, bool serving) TANDEM_EXCLUDES(mu_);
  // Reports NOT_SERVING for every name from now on and ends Watch streams.
  void Shutdown() TANDEM_EXCLUDES(mu_);

  grpc::Status Check(grpc::ServerContext* context, const grpc::health::v1::HealthCheckRequest* request,
                     grpc::health::v1::HealthCheckResponse* response) override;
  grpc::Status Watch(grpc::ServerContext* context, const grpc::health::v1::HealthCheckRequest* request,
                     grpc::ServerWriter<grpc::health::v1::HealthCheckResponse>* writer) override;

 private:
  Mutex mu_;
  CondVar changed_;
  std::map<std::string, ServingStatus> status_ TANDEM_GUARDED_BY(mu_);
  uint64_t version_ TANDEM_GUARDED_BY(mu_) = 0;  // bumped on every change
  bool shut_down_ TANDEM_GUARDED_BY(mu_) = false;
};

}  // namespace tandem
