#include "common/health_service.h"

#include <chrono>

namespace tandem {

using grpc::health::v1::HealthCheckResponse;

void HealthService::Set(const std::string& service, bool serving) {
  MutexLock lock(&mu_);
  if (shut_down_) return;
  status_[service] = serving ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING;
  ++version_;
  changed_.NotifyAll();
}

void HealthService::Shutdown() {
  MutexLock lock(&mu_);
  for (auto& [name, status] : status_) status = HealthCheckResponse::NOT_SERVING;
  shut_down_ = true;
  ++version_;
  changed_.NotifyAll();
}

grpc::Status HealthService::Check(grpc::ServerContext* /*context*/, const grpc::health::v1::HealthCheckRequest* request,
                                  HealthCheckResponse* response) {
  MutexLock lock(&mu_);
  const auto it = status_.find(request->service());
  if (it == status_.end()) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown service '" + request->service() + "'");
  }
  response->set_status(it->second);
  return grpc::Status::OK;
}

grpc::Status HealthService::Watch(grpc::ServerContext* context, const grpc::health::v1::HealthCheckRequest* request,
                                  grpc::ServerWriter<HealthCheckResponse>* writer) {
  MutexLock lock(&mu_);
  uint64_t seen = 0;
  ServingStatus last = HealthCheckResponse::UNKNOWN;
  bool first = true;
  while (!context->IsCancelled()) {
    if (first || version_ != seen) {
      seen = version_;
      const auto it = status_.find(request->service());
      const ServingStatus now = it == status_.end() ? HealthCheckResponse::SERVICE_UNKNOWN : it->second;
      // Shutdown may happen while the lock is released for Write below; end the
      // stream only after the status read under shutdown has been sent.
      const bool final_status = shut_down_;
      if (first || now != last) {
        HealthCheckResponse response;
        response.set_status(now);
        lock.Unlock();
        const bool ok = writer->Write(response);
        lock.Lock();
        if (!ok) break;
        last = now;
        first = false;
      }
      if (final_status) break;
    }
    // Wake up now and then to notice a cancelled call.
    changed_.WaitFor(lock, std::chrono::milliseconds(200), [&]() TANDEM_REQUIRES(mu_) { return version_ != seen; });
  }
  return grpc::Status::OK;
}

}  // namespace tandem
