#include "common/trace_clock.h"

#include <grpcpp/client_context.h>
#include <spdlog/spdlog.h>

#include "common/trace.h"

namespace tandem::trace {

grpc::ServerUnaryReactor* TraceClockService::Sample(grpc::CallbackServerContext* context, const v1::TraceClockRequest*,
                                                    v1::TraceClockResponse* response) {
  response->set_receive_ns(Now());
  response->set_clock_id(ClockId());
  auto* reactor = context->DefaultReactor();
  response->set_send_ns(Now());
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

TraceClockService* TraceClockService::Get() {
  static auto* service = new TraceClockService();
  return service;
}

ClockSampler::ClockSampler(std::shared_ptr<grpc::Channel> channel, ClockSamplerOptions options)
    : stub_(v1::TraceClock::NewStub(std::move(channel))), options_(options) {
  thread_ = std::thread([this] { Loop(); });
}

ClockSampler::~ClockSampler() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    quit_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

int ClockSampler::samples() const {
  std::lock_guard<std::mutex> lock(mu_);
  return samples_;
}

void ClockSampler::Loop() {
  SetThreadName("trace-clock");
  bool first = true, failed = false, warned = false;
  int ok = 0;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      const auto gap = ok < options_.burst && !failed ? options_.burst_gap : options_.interval;
      if (!first && cv_.wait_for(lock, gap, [this] { return quit_; })) return;
      if (quit_) return;
    }
    first = false;
    if (!On()) continue;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + options_.timeout);
    v1::TraceClockRequest request;
    v1::TraceClockResponse response;
    const int64_t t0 = Now();
    const grpc::Status status = stub_->Sample(&context, request, &response);
    const int64_t t3 = Now();
    failed = !status.ok();
    if (failed) {
      if (!warned) {
        spdlog::debug("trace clock: no sample from the reference yet ({})", status.error_message());
        warned = true;
      }
      continue;
    }
    RecordClockSample(response.clock_id(), t0, response.receive_ns(), response.send_ns(), t3);
    ++ok;
    std::lock_guard<std::mutex> lock(mu_);
    ++samples_;
  }
}

}  // namespace tandem::trace
