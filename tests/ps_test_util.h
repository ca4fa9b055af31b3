// What the parameter-server process tests share: a worker in the test
// process (a member session whose epochs a PsClient adopts, registered with
// the "ps" endpoint so the servers include it), deterministic gradients, and
// reading a daemon's metrics.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <random>
#include <regex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "cli/launcher.h"
#include "common/coordinator_rendezvous.h"
#include "common/health.h"
#include "common/member_session.h"
#include "common/mutex.h"
#include "test_util.h"
#include "worker/ps/ps_client.h"

namespace tandem::testing {

// The value of an unlabelled metric on a daemon's /metrics page, or -1.
inline double Metric(const cli::LaunchedDaemon& daemon, const std::string& name) {
  auto body = HttpGet(daemon.ready.metrics_address, "/metrics", std::chrono::milliseconds(2000));
  if (!body.ok()) return -1;
  std::smatch m;
  if (std::regex_search(*body, m, std::regex("\n" + name + " ([0-9.e+-]+)"))) return std::stod(m[1].str());
  return -1;
}

// Polls `pred` every 20 ms until it holds or `timeout` passes.
inline bool WaitUntil(const std::function<bool()>& pred, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return pred();
}

// Waits until a member daemon has registered with its coordinator (so that
// it is part of the rendezvous that workers started afterwards close).
inline bool WaitRegistered(const cli::LaunchedDaemon& daemon, std::chrono::milliseconds timeout) {
  return WaitUntil(
      [&] { return ReadFile(daemon.log_file).find("registered with the coordinator") != std::string::npos; }, timeout);
}

// A deterministic gradient of elements [begin, end) for (step, contributor).
inline std::vector<float> Gradient(uint64_t step, uint32_t contributor, uint64_t begin, uint64_t end) {
  std::vector<float> g(end - begin);
  std::mt19937 rng(static_cast<uint32_t>(step * 7919 + contributor * 104729 + begin));
  std::normal_distribution<float> dist(0.0f, 0.5f);
  for (auto& x : g) x = dist(rng);
  return g;
}

// One flat fp32 tensor of `elements`.
inline google::protobuf::RepeatedPtrField<v1::TensorSpec> FlatTensors(uint64_t elements) {
  google::protobuf::RepeatedPtrField<v1::TensorSpec> tensors;
  auto* t = tensors.Add();
  t->set_name("weights");
  t->add_shape(static_cast<int64_t>(elements));
  t->set_dtype(v1::DTYPE_FLOAT32);
  return tensors;
}

// A worker of `job` in this process: contributor `index` of `contributors`.
class PsWorker {
 public:
  PsWorker(const std::string& coordinator, const std::string& job, uint32_t index, uint32_t contributors)
      : job_(job), index_(index), contributors_(contributors) {
    worker::PsClientOptions options;
    options.job_id = job;
    options.timeout = std::chrono::milliseconds(20000);
    options.ucx.net_devices = kTestNetDevices;
    options.on_answered = [this](bool pull, uint32_t server, uint64_t bytes, double seconds) {
      MutexLock lock(&answered_mu_);
      auto& a = pull ? pulls_ : pushes_;
      ++a.count;
      a.bytes += bytes;
      a.servers.insert(server);
      if (seconds < 0) ++a.negative_seconds;
    };
    client_ = std::make_unique<worker::PsClient>(options);
    MemberSessionOptions so;
    so.job_id = job;
    so.role = v1::ROLE_WORKER;
    so.node.set_hostname("localhost");
    so.node.set_node_id("node-w");
    so.peer_view = v1::PEER_VIEW_FULL;
    v1::Endpoint ps;
    ps.set_transport(transport::kPsEndpoint);
    so.endpoints.push_back(ps);
    so.on_epoch = [this](const v1::MembershipEpoch& epoch) -> Status {
      while (session_.load() == nullptr) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      MemberSession& s = *session_.load();
      comm::CoordinatorRendezvousOptions rv;
      rv.job_id = job_;
      rv.member_id = s.member_id();
      rv.session_id = s.session_id();
      rv.epoch = epoch.epoch();
      comm::CoordinatorRendezvous rendezvous(s.channel(), rv);
      return client_->SetEpoch(epoch, s.member_id(), rendezvous);
    };
    owned_ = std::make_unique<MemberSession>(grpc::CreateChannel(coordinator, grpc::InsecureChannelCredentials()),
                                             std::move(so));
    session_.store(owned_.get());
  }
  ~PsWorker() {
    client_->Stop();
    if (owned_) (void)owned_->Leave("test done", std::chrono::milliseconds(1000));
  }
  PsWorker(const PsWorker&) = delete;
  PsWorker& operator=(const PsWorker&) = delete;

  worker::PsClient& client() { return *client_; }
  int retries() const { return retries_; }

  // What the client's on_answered saw (the workers' push and pull metrics).
  struct Answered {
    uint64_t count = 0;
    uint64_t bytes = 0;
    std::set<uint32_t> servers;
    uint64_t negative_seconds = 0;
  };
  Answered pushes() const {
    MutexLock lock(&answered_mu_);
    return pushes_;
  }
  Answered pulls() const {
    MutexLock lock(&answered_mu_);
    return pulls_;
  }

  // Waits until the client works in an epoch newer than `epoch`.
  bool WaitEpochAfter(uint64_t epoch, std::chrono::milliseconds timeout) {
    return WaitUntil([&] { return client_->epoch() > epoch; }, timeout);
  }

  // The parameters after `step` (0: now) into `params` (the whole space).
  // All the partitions' pulls share one deadline, so a server that never
  // answers fails the caller's test with a message (naming the partition)
  // inside the test's own time limit.
  Status Pull(uint64_t step, std::vector<float>& params,
              std::chrono::milliseconds timeout = std::chrono::milliseconds(30000)) {
    const v1::ShardMap map = client_->shard_map();
    std::vector<std::pair<uint32_t, std::shared_ptr<worker::PsOp>>> ops;
    for (const auto& p : map.partitions()) {
      ops.emplace_back(p.id(), client_->Pull(p.id(), step, v1::WIRE_DTYPE_FP32, params.data() + p.range().begin(),
                                             (p.range().end() - p.range().begin()) * sizeof(float)));
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    Status failed;
    for (auto& [id, op] : ops) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      Status s = op->Wait(std::max(left, std::chrono::milliseconds(0)));
      if (!s.ok() && failed.ok()) failed = s.WithContext(fmt::format("pull of partition {} at step {}", id, step));
    }
    return failed;
  }

  // Pushes this worker's Gradient of every partition for `step`, each push
  // carrying the learning rate `lr` (0: the servers' schedule), runs
  // `after_push` (first attempt only), then pulls the parameters after the
  // step. A failure caused by a membership change (ABORTED, UNAVAILABLE,
  // FAILED_PRECONDITION) waits for the next epoch and does the step again,
  // with the same rate.
  Status Step(uint64_t step, std::vector<float>& params, const std::function<void()>& after_push = nullptr,
              double lr = 0) {
    for (int attempt = 0; attempt < 5; ++attempt) {
      const uint64_t epoch = client_->epoch();
      const v1::ShardMap map = client_->shard_map();
      std::vector<std::vector<float>> grads;
      std::vector<std::shared_ptr<worker::PsOp>> ops;
      for (const auto& p : map.partitions()) {
        grads.push_back(Gradient(step, index_, p.range().begin(), p.range().end()));
        ops.push_back(client_->Push(p.id(), step, index_, contributors_, v1::WIRE_DTYPE_FP32, grads.back().data(),
                                    grads.back().size() * sizeof(float), lr));
      }
      Status failed;
      for (auto& op : ops) {
        Status s = op->Wait(std::chrono::milliseconds(30000));
        if (!s.ok() && failed.ok()) failed = s;
      }
      if (after_push && attempt == 0) after_push();
      if (failed.ok()) failed = Pull(step, params);
      if (failed.ok()) return Status::Ok();
      if (failed.code() != StatusCode::kAborted && failed.code() != StatusCode::kUnavailable &&
          failed.code() != StatusCode::kFailedPrecondition) {
        return failed;
      }
      ++retries_;
      if (!WaitEpochAfter(epoch, std::chrono::milliseconds(30000))) {
        return DeadlineExceeded("step {}: no new epoch after {}", step, failed.ToString());
      }
    }
    return Aborted("step {}: gave up after 5 attempts", step);
  }

 private:
  const std::string job_;
  const uint32_t index_;
  const uint32_t contributors_;
  mutable Mutex answered_mu_;  // before client_, whose callbacks use it
  Answered pushes_ TANDEM_GUARDED_BY(answered_mu_);
  Answered pulls_ TANDEM_GUARDED_BY(answered_mu_);
  std::unique_ptr<worker::PsClient> client_;
  std::atomic<MemberSession*> session_{nullptr};
  std::unique_ptr<MemberSession> owned_;
  std::atomic<int> retries_{0};
};

}  // namespace tandem::testing
