// Measuring a process's trace clock against a reference's (common/trace.h):
// every daemon serves tandem.v1.TraceClock (TraceClockService, registered by
// RunningDaemon), and a traced member samples its coordinator's
// (ClockSampler, started by the coordinator link): a burst of round trips at
// start, then one a second, each written to the trace as a "clock" line.
// `tandem trace merge` estimates each process's offset from them
// (trace::EstimateOffset) and puts every process on the reference's clock.
//
// Thread safety: TraceClockService is thread-safe; a ClockSampler is made and
// destroyed on one thread and samples on its own.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <grpcpp/channel.h>

#include "tandem/v1/trace.grpc.pb.h"

namespace tandem::trace {

class TraceClockService final : public v1::TraceClock::CallbackService {
 public:
  grpc::ServerUnaryReactor* Sample(grpc::CallbackServerContext* context, const v1::TraceClockRequest* request,
                                   v1::TraceClockResponse* response) override;
  // The process's instance (the daemon registers it).
  static TraceClockService* Get();
};

struct ClockSamplerOptions {
  int burst = 16;  // round trips at start, `burst_gap` apart
  std::chrono::milliseconds burst_gap{20};
  std::chrono::milliseconds interval{1000};  // then one every `interval`
  std::chrono::milliseconds timeout{1000};   // of one round trip
};

// Samples the TraceClock of `channel`'s server while tracing is on, from a
// thread of its own, until destroyed.
class ClockSampler {
 public:
  ClockSampler(std::shared_ptr<grpc::Channel> channel, ClockSamplerOptions options = {});
  ~ClockSampler();
  ClockSampler(const ClockSampler&) = delete;
  ClockSampler& operator=(const ClockSampler&) = delete;
  // Round trips that succeeded so far.
  int samples() const;

 private:
  void Loop();
  std::unique_ptr<v1::TraceClock::Stub> stub_;
  ClockSamplerOptions options_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool quit_ = false;  // guarded by mu_
  int samples_ = 0;    // guarded by mu_
  std::thread thread_;
};

}  // namespace tandem::trace
