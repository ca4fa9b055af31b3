// tandem bench ps: parameter-server push and pull goodput over the real data
// path, beside ucx_perftest on the same UCX transports, measured in the same
// run.
//
// Two processes on this machine: this one is the worker, a forked child is
// the server. Both build the same synthetic membership epoch (worker member
// 1, server member 2, data-parallel size 1, a shard map of --partition-bytes
// partitions, all primary on the server, no backup) and the epoch's
// parameter-server group (common/transport/ps_group.h: UCX with its default
// options, i.e. shared memory copied through posix/sysv segments, every
// message eager) through a FileRendezvous in a temporary directory. The
// server runs a ParameterStore (server/ps_core.h), initialised in its own
// process (a real server gets this over gRPC), behind a FrameChannel that
// hands pushes and pulls to the store as PsNode does. The worker is a
// PsClient (worker/ps/ps_client.h): pushes from its gradient buffer, pulls
// straight into its parameter buffer. Each message size is its own job and
// epoch (a new store and group), since a store serves one tensor table.
//
// A size S is the gradient of one step on the wire: S / (2 or 4 bytes per
// --dtype element) parameters, in partitions of --partition-bytes / 4
// parameters (the coordinator's job.partition_size counts fp32 bytes).
// Sync mode with one contributor: a step's pushes complete it, the server
// applies the update (SGD by default: reads weights and gradient, writes
// weights) once every partition's push is in, and pulls of the step wait for
// it. Per size, --warmup untimed steps, then --rounds rounds, each: the
// ucx_perftest runs (tag_bw at S, and tag_lat below, unless --no-baseline),
// then --iters timed iterations of each of
//   push:  push every partition of step s+1 at once, wait for every reply,
//          with step s applied first (an untimed pull of step s, which the
//          server answers once its update is done): the push a training
//          step makes, since a worker pulls step s before it computes and
//          pushes step s+1;
//   pull:  pull every partition at the current step at once, wait for all;
//   step:  push every partition of step s+1 and pull every partition of
//          step s+1 at once (the pulls are answered once the update is
//          applied), wait for all: one training step's round trip;
//   push back to back: the push loop without the pulls: each push of step
//          s+1 follows the reply to step s's at once, so it also waits for
//          the server's update of step s (which runs after that reply).
// Figures are medians over all timed iterations of all rounds (ucx_perftest:
// median over rounds of its overall bandwidth). push_gbps = S / push time,
// push_b2b_gbps = S / back-to-back push time,
// pull_gbps = S / pull time, step_gbps = 2 S / step time (both directions);
// ratios are against ucx_perftest's tag_bw at S (UCX reports MiB/s,
// converted to GB/s), run with the environment the group's shared-memory
// worker gets (UCX_TLS=posix,sysv,self, UCX_RNDV_THRESH=inf) and pinned to
// the CPUs of the two bench processes (server to the first CPU this process
// may use, worker to the second, as --bind does for the bench).
//
// tag_bw streams messages back to back; a synchronous push or pull is one
// request and one reply. So where a size is one message, each round also
// runs tag_lat (ping-pong; its median is one leg) at S and at a frame
// header, and ucx_perftest_rtt_gbps = S / (leg at S + leg at a header): the
// goodput of one request/reply on UCX itself, with nothing on either side
// but UCX. push_rtt_ratio and pull_rtt_ratio compare against it.
//
// Verification: gradients are 2^-10 everywhere and weights start at 1, so
// after k SGD steps at lr 2^-10 every weight is exactly 1 - k 2^-20; the
// last step of each size pulls into a poisoned buffer and every element
// must equal that value (as --dtype) (adamw: all equal, finite, changed).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "cli/commands.h"
#include "common/config.h"
#include "common/cpus.h"
#include "common/logging.h"
#include "common/optimizer/gradient.h"
#include "common/process.h"
#include "common/rendezvous.h"
#include "common/transport/frame_channel.h"
#include "common/transport/ps_group.h"
#include "server/ps_core.h"
#include "server/ps_node.h"
#include "server/shard_loop.h"
#include "worker/ps/ps_client.h"

namespace tandem::cli {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kWorkerId = 1;
constexpr uint64_t kServerId = 2;
constexpr float kInitial = 1.0f;
constexpr float kGradient = 1.0f / 1024;  // exact in bf16
constexpr double kLr = 1.0 / 1024;
// The environment of the baseline: what UcxTransport gives its shared-memory
// worker with prefer_copy_shm (the default): posix and sysv, every message
// eager.
const std::vector<std::string> kPerftestEnv = {"UCX_TLS=posix,sysv,self", "UCX_RNDV_THRESH=inf",
                                               "UCX_WARN_UNUSED_ENV_VARS=n"};

struct BenchConfig {
  uint64_t min_bytes = 64ULL << 10;
  uint64_t max_bytes = 64ULL << 20;
  int64_t factor = 4;
  uint64_t partition_bytes = 4ULL << 20;
  std::string dtype = "fp32";
  std::string optimizer = "sgd";
  int64_t iters = 20;
  int64_t warmup = 5;
  int64_t rounds = 3;
  bool baseline = true;
  bool json = false;
  bool bind = true;
  int64_t server_threads = 1;
  std::string progress = "adaptive";
  std::chrono::milliseconds timeout{60000};
  std::string log_level = "warn";
  // Derived.
  std::string dir;        // rendezvous and scratch files
  std::vector<int> cpus;  // server, worker (when bound)
  std::vector<uint64_t> sizes;
  pid_t parent = 0;
};

v1::WireDType WireOf(const BenchConfig& c) {
  return c.dtype == "bf16" ? v1::WIRE_DTYPE_BF16 : v1::WIRE_DTYPE_FP32;
}
size_t ElementBytes(const BenchConfig& c) {
  return c.dtype == "bf16" ? 2 : 4;
}
uint64_t PartitionElements(const BenchConfig& c) {
  return c.partition_bytes / 4;
}
uint64_t ParamsOf(const BenchConfig& c, uint64_t size) {
  return size / ElementBytes(c);
}
uint32_t PartitionsOf(const BenchConfig& c, uint64_t size) {
  const uint64_t p = PartitionElements(c);
  return static_cast<uint32_t>((ParamsOf(c, size) + p - 1) / p);
}

// The synthetic epoch both processes build for message size `size`.
v1::MembershipEpoch MakeEpoch(const BenchConfig& c, uint64_t epoch, uint64_t size) {
  v1::MembershipEpoch e;
  e.set_epoch(epoch);
  e.set_job_id("bench-ps");
  e.set_state(v1::EPOCH_STATE_ACTIVE);
  e.mutable_mesh()->set_dp(1);
  e.mutable_mesh()->set_tp(1);
  e.mutable_mesh()->set_pp(1);
  e.set_worker_count(1);
  e.set_server_count(1);
  e.set_start_step(0);
  auto* worker = e.add_peers();
  worker->set_member_id(kWorkerId);
  worker->set_role(v1::ROLE_WORKER);
  worker->mutable_rank()->set_world_size(1);
  worker->mutable_rank()->set_local_world_size(1);
  worker->mutable_rank()->set_node_count(1);
  // Pushes and pulls: the worker is in the parameter-server group.
  worker->add_endpoints()->set_transport(transport::kPsEndpoint);
  auto* server = e.add_peers();
  server->set_member_id(kServerId);
  server->set_role(v1::ROLE_SERVER);
  // Never dialled: the bench initialises the store in the server process.
  server->set_control_address("127.0.0.1:1");
  const uint64_t params = ParamsOf(c, size);
  const uint64_t per = PartitionElements(c);
  auto* map = e.mutable_shard_map();
  map->set_partition_size(per);
  map->set_parameter_count(params);
  map->set_version(1);
  for (uint64_t i = 0; i * per < params; ++i) {
    auto* p = map->add_partitions();
    p->set_id(static_cast<uint32_t>(i));
    p->mutable_range()->set_begin(i * per);
    p->mutable_range()->set_end(std::min(params, (i + 1) * per));
    p->set_primary_member_id(kServerId);
    p->set_backup_member_id(0);
  }
  return e;
}

v1::OptimizerConfig MakeOptimizer(const BenchConfig& c) {
  v1::OptimizerConfig o;
  if (c.optimizer == "adamw") {
    auto* a = o.mutable_adam();
    a->set_lr(kLr);
    a->set_weight_decay(0.01);
    a->set_decoupled_weight_decay(true);
  } else {
    o.mutable_sgd()->set_lr(kLr);
  }
  return o;
}

transport::UcxOptions MakeUcxOptions(const BenchConfig& c) {
  transport::UcxOptions o;
  o.progress =
      c.progress == "busy-poll" ? transport::UcxProgressMode::kBusyPoll : transport::UcxProgressMode::kAdaptive;
  return o;
}

std::string DoneKey(uint64_t epoch) {
  return fmt::format("bench/done/{}", epoch);
}
std::string StatsKey(uint64_t epoch) {
  return fmt::format("bench/stats/{}", epoch);
}
std::string ReadyKey(uint64_t epoch) {
  return fmt::format("bench/ready/{}", epoch);
}

// ---------------------------------------------------------------------------
// The server process
// ---------------------------------------------------------------------------

// One server, no other servers and no backups: nothing is ever sent.
class NoLinks final : public server::ServerLinks {
 public:
  void SendShare(uint64_t, uint64_t, const std::vector<ps::ShareEntry>&) override {}
  void SendToBackup(uint64_t backup, const ps::Frame&, std::shared_ptr<const std::vector<float>>,
                    std::function<void(const Status&)> done) override {
    done(Unavailable("bench: there is no backup (member {})", backup));
  }
  void SendJob(uint64_t, std::shared_ptr<const std::string>) override {}
};

// What one epoch of the server holds. The channel's handler may run before
// the constructor that starts it has returned, so it waits for `channel`.
struct ServerEpoch {
  std::unique_ptr<server::ParameterStore> store;
  transport::PsGroup group;
  std::unique_ptr<server::PushLanding> landing;
  std::atomic<transport::FrameChannel*> channel{nullptr};
  std::unique_ptr<transport::FrameChannel> owned_channel;
  // The shard's loop, as in PsNode: the channel hands every frame to it.
  std::unique_ptr<server::ShardLoop> loop = std::make_unique<server::ShardLoop>("bench-shard");
};

transport::FrameChannel* WaitChannel(ServerEpoch& e) {
  transport::FrameChannel* ch = e.channel.load();
  while (ch == nullptr) {
    e.channel.wait(nullptr);
    ch = e.channel.load();
  }
  return ch;
}

// Replies to `rank` over the epoch's channel.
server::Reply ServerReply(ServerEpoch& e, int rank) {
  transport::FrameChannel* ch = WaitChannel(e);
  return
      [ch, rank](ps::Frame header, server::ReplyBody body) { server::SendReply(*ch, rank, header, std::move(body)); };
}

// Dispatches a frame to the store on the loop as PsNode::OnFrame does.
void OnServerFrame(ServerEpoch& e, int rank, const ps::Frame& h, std::shared_ptr<std::vector<float>> landed,
                   const std::vector<char>& bytes) {
  const uint64_t from = e.group.members[static_cast<size_t>(rank)];
  server::Reply reply = ServerReply(e, rank);
  switch (h.type) {
    case ps::FrameType::kPush:
      if (landed) return e.store->Push(from, h, std::move(landed), reply);
      return e.store->Push(from, h, bytes.empty() ? nullptr : bytes.data(), reply);
    case ps::FrameType::kPull:
      return e.store->Pull(from, h, reply);
    default: {
      ps::Frame r = ps::ReplyTo(h, h.type);
      auto body = ps::ErrorPayload(
          r, InvalidArgument("the bench's server takes pushes and pulls, not {} frames", ps::FrameTypeName(h.type)));
      reply(r, std::move(body));
    }
  }
}

Status InitializeStore(const BenchConfig& c, server::ParameterStore& store, uint64_t epoch, uint64_t size) {
  const uint64_t params = ParamsOf(c, size);
  v1::InitializeParametersRequest r;
  r.set_job_id("bench-ps");
  r.set_epoch(epoch);
  auto* t = r.add_tensors();
  t->set_name("w");
  t->add_shape(static_cast<int64_t>(params));
  t->set_dtype(v1::DTYPE_FLOAT32);
  *r.mutable_optimizer() = MakeOptimizer(c);
  auto* chunk = r.mutable_values()->add_chunks();
  chunk->mutable_range()->set_begin(0);
  chunk->mutable_range()->set_end(params);
  chunk->set_dtype(v1::DTYPE_FLOAT32);
  std::string* data = chunk->mutable_data();
  data->resize(params * sizeof(float));
  for (uint64_t i = 0; i < params; ++i) std::memcpy(data->data() + i * sizeof(float), &kInitial, sizeof(float));
  auto done = store.Initialize(r);
  return done.ok() ? Status::Ok() : done.status();
}

// Serves one size: returns once the worker says it is done with it.
Status ServeSize(const BenchConfig& c, comm::FileRendezvous& rendezvous, uint64_t epoch, uint64_t size) {
  const v1::MembershipEpoch membership = MakeEpoch(c, epoch, size);
  NoLinks links;
  ServerEpoch e;
  server::StoreOptions store_options;
  store_options.threads = static_cast<int>(c.server_threads);
  store_options.offload = [&e](std::function<void()> work) { e.loop->Offload(std::move(work)); };
  e.store = std::make_unique<server::ParameterStore>(std::move(store_options), &links);
  e.store->SetEpoch(epoch, kServerId, membership.shard_map(), 1, 0);
  TANDEM_RETURN_IF_ERROR(InitializeStore(c, *e.store, epoch, size));
  TANDEM_RETURN_IF_ERROR(rendezvous.Put(ReadyKey(epoch), "ready"));
  TANDEM_ASSIGN_OR_RETURN(e.group,
                          transport::BuildPsGroup(membership, kServerId, rendezvous, MakeUcxOptions(c), c.timeout));
  if (epoch == 1) {
    for (const auto& line : e.group.transport->PathSummary()) fmt::print(stderr, "bench ps: server: {}\n", line);
  }
  const auto worker_rank = e.group.rank_of.find(kWorkerId);
  if (worker_rank == e.group.rank_of.end()) {
    return Internal("the worker (member {}) is not in the parameter-server group of epoch {}", kWorkerId, epoch);
  }
  const int worker = worker_rank->second;
  e.landing = std::make_unique<server::PushLanding>(e.store.get(), e.group.members.size());
  transport::FrameChannel::Handler handler;
  handler.payload_buffer = [&e](int rank, const ps::Frame& h) { return e.landing->PayloadBuffer(rank, h); };
  // Hands a frame and its payload over to the loop, as PsNode::HandOver does.
  auto hand_over = [&e](int rank, const ps::Frame& h, void* payload, std::vector<char>& owned) {
    std::shared_ptr<std::vector<float>> landed = e.landing->Take(rank, payload);
    std::vector<char> bytes;
    if (!landed && payload != nullptr) bytes = std::move(owned);
    auto task = [&e, rank, h, landed = std::move(landed), bytes = std::move(bytes)]() mutable {
      OnServerFrame(e, rank, h, std::move(landed), bytes);
    };
    if (e.store->Light(h)) {
      e.loop->Defer(std::move(task));
    } else {
      e.loop->Post(std::move(task));
    }
  };
  handler.on_frame = hand_over;
  // The worker closes its group when it is done with a size, just before it
  // says so; the loop below tells that from a failure.
  handler.on_peer_failed = [](int, const Status&) {};
  handler.try_inline = [hand_over](int rank, const ps::Frame& h, void* payload, std::vector<char>& owned) mutable {
    hand_over(rank, h, payload, owned);
    return true;
  };
  e.owned_channel =
      std::make_unique<transport::FrameChannel>(e.group.transport.get(), std::vector<int>{worker}, std::move(handler));
  e.channel.store(e.owned_channel.get());
  e.channel.notify_all();
  e.store->LinksReady(epoch);
  // Wait for the worker to finish with this size (or die, or the bench to go).
  Status result;
  for (;;) {
    if (rendezvous.Get(DoneKey(epoch), std::chrono::milliseconds(100)).ok()) break;
    if (::getppid() != c.parent) {
      result = Aborted("the bench's worker process went away");
      break;
    }
    if (Status peer = e.owned_channel->PeerStatus(worker); !peer.ok()) {
      if (rendezvous.Get(DoneKey(epoch), std::chrono::seconds(5)).ok()) break;
      result = peer.WithContext("the worker");
      break;
    }
  }
  e.owned_channel->Stop();
  e.loop->Stop();
  const auto& counters = e.store->counters();
  const std::string stats = fmt::format("{} {:.9f} {} {}", counters.updates.load(), counters.update_seconds.load(),
                                        counters.pushes.load(), counters.pulls.load());
  if (result.ok()) (void)rendezvous.Put(StatsKey(epoch), stats);
  return result;
}

int ServerMain(const BenchConfig& c) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != c.parent) return 1;
  if (c.bind && !c.cpus.empty()) (void)BindProcess({c.cpus[0]});
  comm::FileRendezvous rendezvous(c.dir);
  for (size_t i = 0; i < c.sizes.size(); ++i) {
    Status s = ServeSize(c, rendezvous, i + 1, c.sizes[i]);
    if (!s.ok()) {
      fmt::print(stderr, "tandem bench ps: server: {} bytes: {}\n", c.sizes[i], s.ToString());
      return 1;
    }
  }
  return 0;
}

// ---------------------------------------------------------------------------
// The ucx_perftest baseline
// ---------------------------------------------------------------------------

std::string FindInPath(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path != nullptr ? path : "/usr/bin:/bin");
  std::string dir;
  while (std::getline(dirs, dir, ':')) {
    if (dir.empty()) continue;
    std::string candidate = dir + "/" + name;
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

Result<int> FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return Unavailable("socket: {}", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  const int e = errno;
  ::close(fd);
  if (!ok) return Unavailable("cannot find a free TCP port: {}", std::strerror(e));
  return static_cast<int>(ntohs(addr.sin_port));
}

// Whether something listens on TCP `port` (IPv4 or IPv6), from /proc/net.
bool Listening(int port) {
  const std::string hex = fmt::format(":{:04X}", port);
  for (const char* file : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(file);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string slot, local, remote, state;
      fields >> slot >> local >> remote >> state;
      if (state == "0A" && local.size() >= hex.size() &&
          local.compare(local.size() - hex.size(), hex.size(), hex) == 0) {
        return true;
      }
    }
  }
  return false;
}

std::string Tail(const std::string& path, size_t lines) {
  std::ifstream in(path);
  std::vector<std::string> all;
  std::string line;
  while (std::getline(in, line)) all.push_back(line);
  std::string out;
  for (size_t i = all.size() > lines ? all.size() - lines : 0; i < all.size(); ++i) out += "\n    " + all[i];
  return out;
}

class Perftest {
 public:
  Perftest(const BenchConfig& c, std::string binary) : c_(c), binary_(std::move(binary)) {}

  // GB/s of tag_bw at `size` bytes.
  Result<double> Bandwidth(uint64_t size) {
    TANDEM_ASSIGN_OR_RETURN(const Figures f,
                            Run("tag_bw", size, std::clamp<uint64_t>((512ULL << 20) / size, 20, 8192)));
    return f.mib_per_s * 1048576.0 / 1e9;
  }

  // Microseconds of one message of `size` bytes one way: tag_lat's median,
  // half of a ping-pong round trip with `size` bytes each way.
  Result<double> Latency(uint64_t size) {
    TANDEM_ASSIGN_OR_RETURN(const Figures f,
                            Run("tag_lat", size, std::clamp<uint64_t>((256ULL << 20) / size, 10, 10000)));
    return f.latency_us;
  }

 private:
  struct Figures {
    double latency_us = 0;  // median
    double mib_per_s = 0;   // overall
  };

  Result<Figures> Run(const std::string& test, uint64_t size, uint64_t n) {
    const uint64_t w = std::clamp<uint64_t>(n / 10, 2, 100);
    TANDEM_ASSIGN_OR_RETURN(const int port, FreePort());
    const std::string server_log = c_.dir + "/perftest-server.log";
    const std::string client_log = c_.dir + "/perftest-client.log";
    std::error_code ec;
    std::filesystem::remove(server_log, ec);
    std::filesystem::remove(client_log, ec);
    SpawnOptions so;
    so.argv = {binary_, "-p", std::to_string(port)};
    if (c_.bind && !c_.cpus.empty()) so.argv.insert(so.argv.end(), {"-c", std::to_string(c_.cpus[0])});
    so.extra_env = kPerftestEnv;
    so.output_file = server_log;
    TANDEM_ASSIGN_OR_RETURN(auto server, Subprocess::Spawn(so));
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    while (!Listening(port)) {
      if (!server->Running()) return Unavailable("ucx_perftest server exited at start:{}", Tail(server_log, 5));
      if (Clock::now() > deadline) {
        server->Stop(std::chrono::milliseconds(500));
        return DeadlineExceeded("ucx_perftest server did not listen on port {} within 10 s", port);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    SpawnOptions co;
    co.argv = {binary_, "127.0.0.1", "-p", std::to_string(port)};
    if (c_.bind && c_.cpus.size() > 1) co.argv.insert(co.argv.end(), {"-c", std::to_string(c_.cpus[1])});
    co.argv.insert(co.argv.end(),
                   {"-t", test, "-s", std::to_string(size), "-n", std::to_string(n), "-w", std::to_string(w), "-f"});
    co.extra_env = kPerftestEnv;
    co.output_file = client_log;
    auto client = Subprocess::Spawn(co);
    if (!client.ok()) {
      server->Stop(std::chrono::milliseconds(500));
      return client.status();
    }
    auto exit = (*client)->Wait(c_.timeout);
    if (!exit.ok()) {
      (*client)->Stop(std::chrono::milliseconds(500));
      server->Stop(std::chrono::milliseconds(500));
      return DeadlineExceeded("ucx_perftest {} {} bytes did not finish within {} ms", test, size, c_.timeout.count());
    }
    if (!server->Wait(std::chrono::seconds(5)).ok()) server->Stop(std::chrono::milliseconds(500));
    if (!exit->success()) {
      return Unavailable("ucx_perftest client: {}:{}", exit->ToString(), Tail(client_log, 5));
    }
    // The last row of 8 numbers: iterations, latency 50%/avg/overall (us),
    // bandwidth avg/overall (MiB/s), message rate avg/overall.
    std::ifstream in(client_log);
    std::string line;
    std::optional<Figures> figures;
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::vector<std::string> f;
      std::string word;
      while (fields >> word) f.push_back(word);
      if (f.size() != 8 || f[0].find_first_not_of("0123456789") != std::string::npos) continue;
      try {
        figures = Figures{std::stod(f[1]), std::stod(f[5])};
      } catch (const std::exception&) {
        figures.reset();
      }
    }
    if (!figures || !(figures->latency_us > 0) || !(figures->mib_per_s > 0)) {
      return Unavailable("no result line in ucx_perftest {}'s output:{}", test, Tail(client_log, 5));
    }
    return *figures;
  }

  const BenchConfig& c_;
  const std::string binary_;
};

// ---------------------------------------------------------------------------
// The worker (this process)
// ---------------------------------------------------------------------------

struct Row {
  uint64_t size = 0;
  uint32_t partitions = 0;
  std::vector<double> push, pull, step, push_b2b;  // seconds per timed iteration
  // Per round: the median push and pull time, and ucx_perftest's GB/s (NaN
  // when it failed), for the ratios of each round.
  std::vector<double> round_push, round_pull, round_push_b2b, round_ucx;
  uint64_t message = 0;             // the largest message: a partition's gradient (or the size)
  std::vector<double> ucx;          // GB/s per round
  std::vector<double> ucx_message;  // GB/s per round at `message` bytes, when smaller than the size
  // Per round (NaN when it failed), sizes of one message only: the goodput of
  // a request/reply on UCX itself, S / (tag_lat at S + tag_lat at a header).
  std::vector<double> round_rtt;
  std::string ucx_error;            // why there is no baseline
  std::optional<double> update_us;  // the server's optimizer time per step
  uint64_t wrong = 0;
};

class Worker {
 public:
  Worker(const BenchConfig& c, comm::FileRendezvous& rendezvous)
      : c_(c), rendezvous_(rendezvous), client_(Options(c)), elem_(ElementBytes(c)) {
    const size_t max = ParamsOf(c, c.sizes.back()) * elem_;
    grad_.resize(max);
    pulled_.resize(max);
    std::vector<float> g(ParamsOf(c, c.sizes.back()), kGradient);
    optim::EncodeWire(grad_.data(), g.data(), WireOf(c), g.size());
  }

  static worker::PsClientOptions Options(const BenchConfig& c) {
    worker::PsClientOptions o;
    o.job_id = "bench-ps";
    o.ucx = MakeUcxOptions(c);
    o.timeout = c.timeout;
    return o;
  }

  // Adopts the size's epoch (the group with the server).
  Status Start(uint64_t epoch, uint64_t size) {
    params_ = ParamsOf(c_, size);
    partitions_ = PartitionsOf(c_, size);
    step_ = 0;
    return client_.SetEpoch(MakeEpoch(c_, epoch, size), kWorkerId, rendezvous_);
  }

  void Stop() { client_.Stop(); }

  uint64_t Steps() const { return step_; }

  // One iteration: pushes of the next step (push), pulls of the current step
  // (pull), or both for the next step (step). Returns its seconds.
  Result<double> Iterate(bool push, bool pull) {
    const uint64_t step = push ? step_ + 1 : step_;
    const uint64_t per = PartitionElements(c_);
    std::vector<std::shared_ptr<worker::PsOp>> ops;
    ops.reserve(2 * static_cast<size_t>(partitions_));
    const auto t0 = Clock::now();
    if (push) {
      for (uint32_t p = 0; p < partitions_; ++p) {
        const uint64_t begin = p * per, count = std::min(params_, begin + per) - begin;
        ops.push_back(client_.Push(p, step, 0, 1, WireOf(c_), grad_.data() + begin * elem_, count * elem_));
      }
    }
    if (pull) {
      for (uint32_t p = 0; p < partitions_; ++p) {
        const uint64_t begin = p * per, count = std::min(params_, begin + per) - begin;
        ops.push_back(client_.Pull(p, step, WireOf(c_), pulled_.data() + begin * elem_, count * elem_));
      }
    }
    // One deadline for the whole iteration.
    const auto deadline = t0 + c_.timeout;
    for (auto& op : ops) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      TANDEM_RETURN_IF_ERROR(op->Wait(std::max(left, std::chrono::milliseconds(0))));
    }
    const auto t1 = Clock::now();
    for (auto& op : ops) {
      const ps::Frame& r = op->reply();
      if (r.type == ps::FrameType::kPushReply && (r.flags & ps::kFlagDuplicate) != 0) {
        return Internal("push of partition {} step {} was taken as a duplicate: the bench's steps are wrong",
                        r.partition, step);
      }
      if (r.type == ps::FrameType::kPullReply && r.step != step) {
        return Internal("pull of partition {} returned step {}, expected {}", r.partition, r.step, step);
      }
    }
    step_ = step;
    return std::chrono::duration<double>(t1 - t0).count();
  }

  // Poisons the parameter buffer (before a checked iteration).
  void Poison() { std::memset(pulled_.data(), 0xff, params_ * elem_); }

  // Wrong elements of the last pull after step_ updates.
  uint64_t Check() const {
    const uint8_t* got = pulled_.data();
    std::vector<uint8_t> want(elem_);
    if (c_.optimizer == "sgd") {
      // 1 - k 2^-20 is exact in fp32 for k < 2^20.
      const float w = static_cast<float>(1.0 - static_cast<double>(step_) * kLr * kGradient);
      optim::EncodeWire(want.data(), &w, WireOf(c_), 1);
    } else {
      std::memcpy(want.data(), got, elem_);
      float first = 0;
      optim::AccumulateWire(&first, got, WireOf(c_), 1, true);
      if (!std::isfinite(first) || (step_ > 0 && first == kInitial)) return params_;
    }
    uint64_t wrong = 0;
    for (uint64_t i = 0; i < params_; ++i) wrong += std::memcmp(got + i * elem_, want.data(), elem_) != 0;
    return wrong;
  }

 private:
  const BenchConfig& c_;
  comm::FileRendezvous& rendezvous_;
  worker::PsClient client_;
  const size_t elem_;
  std::vector<uint8_t> grad_;
  std::vector<uint8_t> pulled_;
  uint64_t params_ = 0;
  uint32_t partitions_ = 0;
  uint64_t step_ = 0;
};

std::string SizeName(uint64_t bytes) {
  if (bytes >= (1ULL << 20) && bytes % (1ULL << 20) == 0) return fmt::format("{} MiB", bytes >> 20);
  if (bytes >= (1ULL << 10) && bytes % (1ULL << 10) == 0) return fmt::format("{} KiB", bytes >> 10);
  return fmt::format("{} B", bytes);
}

Status MeasureSize(const BenchConfig& c, Worker& w, Perftest* perftest, comm::FileRendezvous& rendezvous,
                   const std::function<bool()>& server_exited, uint64_t epoch, Row& row) {
  // The server's store first (building it can take a while for large sizes),
  // watching that the server process is still there.
  const auto deadline = Clock::now() + c.timeout;
  while (!rendezvous.Get(ReadyKey(epoch), std::chrono::milliseconds(50)).ok()) {
    if (server_exited()) return Unavailable("the server process exited before it was ready");
    if (Clock::now() > deadline) {
      return DeadlineExceeded("the server was not ready within {} ms", c.timeout.count());
    }
  }
  TANDEM_RETURN_IF_ERROR(w.Start(epoch, row.size));
  for (int64_t i = 0; i < c.warmup; ++i) TANDEM_RETURN_IF_ERROR(w.Iterate(true, true).status());
  for (int64_t r = 0; r < c.rounds; ++r) {
    fmt::print(stderr, "bench ps: {} ({} partition{}): round {}/{}: {}push, pull, step x {}\n", SizeName(row.size),
               row.partitions, row.partitions == 1 ? "" : "s", r + 1, c.rounds, perftest ? "ucx_perftest, " : "",
               c.iters);
    if (perftest != nullptr) {
      // At the size, and at the size of the messages the bench sends.
      std::vector<uint64_t> sizes = {row.size};
      if (row.message != row.size) sizes.push_back(row.message);
      for (uint64_t bytes : sizes) {
        auto gbps = perftest->Bandwidth(bytes);
        if (gbps.ok()) {
          (bytes == row.size ? row.ucx : row.ucx_message).push_back(*gbps);
        } else {
          row.ucx_error = gbps.status().ToString();
          fmt::print(stderr, "bench ps: ucx_perftest failed: {}\n", row.ucx_error);
        }
        if (bytes == row.size) row.round_ucx.push_back(gbps.ok() ? *gbps : std::nan(""));
      }
      // A push is S bytes out and a header back, a pull a header out and S
      // bytes back: one ping-pong leg of each size.
      if (row.message == row.size) {
        auto out = perftest->Latency(row.size);
        auto back = perftest->Latency(sizeof(ps::Frame));
        if (out.ok() && back.ok()) {
          row.round_rtt.push_back(static_cast<double>(row.size) / ((*out + *back) * 1e-6) / 1e9);
        } else {
          row.round_rtt.push_back(std::nan(""));
          fmt::print(stderr, "bench ps: ucx_perftest tag_lat failed: {}\n",
                     (out.ok() ? back.status() : out.status()).ToString());
        }
      }
    }
    struct Phase {
      bool push, pull;
      bool settle;  // an untimed pull of the current step first: its update is applied
      std::vector<double>* out;
      std::vector<double>* round;
    };
    for (const Phase& phase :
         {Phase{true, false, true, &row.push, &row.round_push},
          Phase{true, false, false, &row.push_b2b, &row.round_push_b2b},
          Phase{false, true, false, &row.pull, &row.round_pull}, Phase{true, true, false, &row.step, nullptr}}) {
      std::vector<double> times;
      for (int64_t i = 0; i < c.iters; ++i) {
        const bool checked = phase.pull && phase.push && r == c.rounds - 1 && i == c.iters - 1;
        if (phase.settle) TANDEM_RETURN_IF_ERROR(w.Iterate(false, true).status());
        if (checked) w.Poison();
        TANDEM_ASSIGN_OR_RETURN(const double seconds, w.Iterate(phase.push, phase.pull));
        times.push_back(seconds);
        if (checked) row.wrong = w.Check();
      }
      phase.out->insert(phase.out->end(), times.begin(), times.end());
      if (phase.round != nullptr) phase.round->push_back(Median(times));
    }
  }
  const uint64_t steps = w.Steps();
  // Close this size's group, then let the server go on to the next size.
  w.Stop();
  TANDEM_RETURN_IF_ERROR(rendezvous.Put(DoneKey(epoch), "done"));
  // The server's optimizer time: "updates update_seconds pushes pulls".
  if (auto stats = rendezvous.Get(StatsKey(epoch), std::chrono::seconds(10)); stats.ok()) {
    std::istringstream in(*stats);
    uint64_t updates = 0;
    double seconds = 0;
    if (in >> updates >> seconds && updates > 0 && steps > 0) {
      row.update_us = seconds / static_cast<double>(steps) * 1e6;
    }
  }
  return Status::Ok();
}

void PrintHeader(const BenchConfig& c, const std::string& baseline) {
  fmt::print(
      "# tandem bench ps: 1 worker, 1 server (processes on this machine{}), {} on the wire, {} partitions of "
      "{} fp32 parameters, {} (sync, 1 contributor), server optimizer threads {}\n",
      c.bind && c.cpus.size() > 1 ? fmt::format(", server on cpu {}, worker on cpu {}", c.cpus[0], c.cpus[1]) : "",
      c.dtype, FormatBytes(c.partition_bytes), PartitionElements(c), c.optimizer == "sgd" ? "SGD" : "AdamW",
      c.server_threads);
  fmt::print(
      "# {} warm-up steps, then {} rounds of {} iterations of each: push (all partitions of step s+1, step s "
      "applied first, as in training), b2b push (back to back: also waits for the update of step s), pull (all "
      "partitions), step (push and pull of a step); median times\n",
      c.warmup, c.rounds, c.iters);
  fmt::print(
      "# push, pull GB/s = size / time; step GB/s = 2 x size / time; upd = the server's optimizer time per step\n");
  fmt::print("# ucx = {}\n", baseline);
  fmt::print(
      "# ucx@msg = the same at the size of one partition's message (sizes above it); ratio = Tandem / ucx, per "
      "round (ucx_perftest runs just before), median over rounds\n");
  fmt::print(
      "# ucx rtt = what one request/reply reaches on UCX itself (sizes of one message): size / (tag_lat at the size "
      "+ tag_lat at a {}-byte header), same settings and CPUs\n#\n",
      sizeof(ps::Frame));
  const std::string columns =
      "# {:>8} {:>5} {:>9} {:>7} {:>9} {:>7} {:>9} {:>7} {:>9} {:>7} {:>8} {:>7} {:>7} {:>6} {:>6} {:>6} {:>7} {:>6} "
      "{:>6} {:>6}\n";
  fmt::print(fmt::runtime(columns), "size", "parts", "push", "push", "b2b push", "b2b", "pull", "pull", "step", "step",
             "upd", "ucx", "ucx@msg", "push", "b2b", "pull", "ucx rtt", "push", "pull", "#wrong");
  fmt::print(fmt::runtime(columns), "(B)", "", "(us)", "(GB/s)", "(us)", "(GB/s)", "(us)", "(GB/s)", "(us)", "(GB/s)",
             "(us)", "(GB/s)", "(GB/s)", "/ucx", "/ucx", "/ucx", "(GB/s)", "/rtt", "/rtt", "");
}

void PrintRow(const BenchConfig& c, const Row& row, const std::string& baseline_env) {
  const double size = static_cast<double>(row.size);
  const double push_s = Median(row.push), pull_s = Median(row.pull), step_s = Median(row.step);
  const double b2b_s = Median(row.push_b2b);
  const double push = size / push_s / 1e9, pull = size / pull_s / 1e9, step = 2 * size / step_s / 1e9;
  const double b2b = size / b2b_s / 1e9;
  // Each round's Tandem figure against the ucx_perftest runs just before it
  // (the machine's state drifts between rounds), median over the rounds.
  struct Against {
    std::optional<double> baseline, push, pull, push_b2b;
  };
  auto against = [&](const std::vector<double>& rounds) {
    Against a;
    std::vector<double> baselines, push_ratios, pull_ratios, b2b_ratios;
    for (size_t r = 0;
         r < rounds.size() && r < row.round_push.size() && r < row.round_pull.size() && r < row.round_push_b2b.size();
         ++r) {
      if (!std::isfinite(rounds[r]) || rounds[r] <= 0) continue;
      baselines.push_back(rounds[r]);
      push_ratios.push_back(size / row.round_push[r] / 1e9 / rounds[r]);
      pull_ratios.push_back(size / row.round_pull[r] / 1e9 / rounds[r]);
      b2b_ratios.push_back(size / row.round_push_b2b[r] / 1e9 / rounds[r]);
    }
    if (!baselines.empty()) {
      a = Against{Median(baselines), Median(push_ratios), Median(pull_ratios), Median(b2b_ratios)};
    }
    return a;
  };
  std::optional<double> ucx, ucx_message, push_ratio, pull_ratio, b2b_ratio;
  if (!row.ucx.empty()) {
    ucx = Median(row.ucx);
    const Against bw = against(row.round_ucx);
    push_ratio = bw.push;
    pull_ratio = bw.pull;
    b2b_ratio = bw.push_b2b;
  }
  const Against rtt = against(row.round_rtt);
  if (row.message == row.size) {
    ucx_message = ucx;
  } else if (!row.ucx_message.empty()) {
    ucx_message = Median(row.ucx_message);
  }
  if (c.json) {
    std::string rounds_ucx;
    for (double g : row.round_ucx) rounds_ucx += (rounds_ucx.empty() ? "" : ", ") + JsonNumber(g, 5);
    std::string line = fmt::format(
        "{{\"bench\": \"ps\", \"size_bytes\": {}, \"dtype\": \"{}\", \"partition_bytes\": {}, \"partitions\": {}, "
        "\"message_bytes\": {}, \"optimizer\": \"{}\", ",
        row.size, c.dtype, c.partition_bytes, row.partitions, row.message, c.optimizer);
    line += fmt::format(
        "\"push_us\": {}, \"push_gbps\": {}, \"pull_us\": {}, \"pull_gbps\": {}, \"step_us\": {}, \"step_gbps\": {}, "
        "\"server_update_us\": {}, ",
        JsonNumber(push_s * 1e6, 6), JsonNumber(push, 5), JsonNumber(pull_s * 1e6, 6), JsonNumber(pull, 5),
        JsonNumber(step_s * 1e6, 6), JsonNumber(step, 5), JsonNumber(row.update_us, 5));
    line += fmt::format("\"push_b2b_us\": {}, \"push_b2b_gbps\": {}, \"push_b2b_ratio\": {}, ",
                        JsonNumber(b2b_s * 1e6, 6), JsonNumber(b2b, 5), JsonNumber(b2b_ratio, 4));
    line += fmt::format(
        "\"ucx_perftest_gbps\": {}, \"ucx_perftest_message_gbps\": {}, \"push_ratio\": {}, \"pull_ratio\": {}, "
        "\"ucx_perftest_rounds_gbps\": [{}], \"ucx_perftest_env\": {}, \"ucx_perftest_error\": {}, ",
        JsonNumber(ucx, 5), JsonNumber(ucx_message, 5), JsonNumber(push_ratio, 4), JsonNumber(pull_ratio, 4),
        rounds_ucx, ucx ? JsonQuote(baseline_env) : "null", ucx ? "null" : JsonQuote(row.ucx_error));
    line += fmt::format("\"ucx_perftest_rtt_gbps\": {}, \"push_rtt_ratio\": {}, \"pull_rtt_ratio\": {}, ",
                        JsonNumber(rtt.baseline, 5), JsonNumber(rtt.push, 4), JsonNumber(rtt.pull, 4));
    line += fmt::format("\"rounds\": {}, \"iters\": {}, \"bind\": {}, \"wrong\": {}}}", c.rounds, c.iters,
                        c.bind ? "true" : "false", row.wrong);
    fmt::print("{}\n", line);
    return;
  }
  auto opt = [](std::optional<double> v, int precision) {
    return v ? fmt::format("{:.{}f}", *v, precision) : std::string("n/a");
  };
  fmt::print(
      "  {:>8} {:>5} {:>9.1f} {:>7.2f} {:>9.1f} {:>7.2f} {:>9.1f} {:>7.2f} {:>9.1f} {:>7.2f} {:>8} {:>7} {:>7} {:>6} "
      "{:>6} {:>6} {:>7} {:>6} {:>6} {:>6}\n",
      SizeName(row.size), row.partitions, push_s * 1e6, push, b2b_s * 1e6, b2b, pull_s * 1e6, pull, step_s * 1e6, step,
      opt(row.update_us, 1), opt(ucx, 2), opt(ucx_message, 2), opt(push_ratio, 2), opt(b2b_ratio, 2),
      opt(pull_ratio, 2), opt(rtt.baseline, 2), opt(rtt.push, 2), opt(rtt.pull, 2), row.wrong);
}

// The server process, killed by PID on every way out of the bench.
class ServerProcess {
 public:
  explicit ServerProcess(pid_t pid) : pid_(pid) {}
  ~ServerProcess() {
    if (pid_ > 0) Finish(std::chrono::milliseconds(0));
  }
  // Waits up to `grace` for the server to exit, then kills it. Returns its
  // exit code (128 + signal when killed).
  int Finish(std::chrono::milliseconds grace) {
    if (pid_ <= 0) return code_;
    const auto deadline = Clock::now() + grace;
    int status = 0;
    for (;;) {
      const pid_t r = ::waitpid(pid_, &status, WNOHANG);
      if (r == pid_) break;
      if (r < 0 && errno != EINTR) {
        pid_ = -1;
        return code_ = 1;
      }
      if (Clock::now() >= deadline) {
        ::kill(pid_, SIGKILL);
        while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
        }
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    pid_ = -1;
    return code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  // Whether it has exited (reaps it).
  bool Exited() {
    if (pid_ <= 0) return true;
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) != pid_) return false;
    pid_ = -1;
    code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return true;
  }
  int Code() const { return code_; }

 private:
  pid_t pid_;
  int code_ = 0;
};

// Removes the scratch directory on every way out.
struct ScratchDir {
  std::string path;
  ~ScratchDir() {
    std::error_code ec;
    if (!path.empty()) std::filesystem::remove_all(path, ec);
  }
};

}  // namespace

int BenchPsCommand(int argc, char** argv) {
  BenchConfig c;
  bool no_baseline = false;
  OptionSet options(
      "tandem bench ps",
      "Measures parameter-server push and pull goodput over the real data path (a worker's PsClient and a server's "
      "ParameterStore in two processes on this machine, over the UCX parameter-server group) for a sweep of "
      "gradient sizes, beside ucx_perftest on the same transports (tag_bw, and tag_lat's request/reply where a size "
      "is one message), and prints one row per size.");
  options.Bytes("min_bytes", &c.min_bytes, "smallest gradient size (bytes on the wire per step)", 4096, 1ULL << 34);
  options.Bytes("max_bytes", &c.max_bytes, "largest gradient size", 4096, 1ULL << 34);
  options.Int("factor", &c.factor, "size multiplier between rows", 2, 1024);
  options.Bytes("partition_bytes", &c.partition_bytes,
                "partition size as the coordinator's job.partition_size counts it (fp32 bytes)", 4096, 1ULL << 32);
  options.Choice("dtype", &c.dtype, {"fp32", "bf16"}, "element type of pushes and pulls on the wire");
  options.Choice("optimizer", &c.optimizer, {"sgd", "adamw"},
                 "the server's update rule (sgd: plain, exact results checked; adamw: weight decay 0.01)");
  options.Int("iters", &c.iters, "timed iterations of each kind (push, back-to-back push, pull, step) per round", 1,
              100000);
  options.Int("warmup", &c.warmup, "untimed steps per size", 0, 100000);
  options.Int("rounds", &c.rounds, "rounds per size, each with its own ucx_perftest runs", 1, 1000);
  options.Bool("no_baseline", &no_baseline, "skip the ucx_perftest baseline");
  options.Bool("json", &c.json, "print one JSON object per size instead of the table");
  options.Bool("bind", &c.bind,
               "pin the server (and ucx_perftest's server) to the first CPU this process may use, the worker (and "
               "ucx_perftest's client) to the second");
  options.Int("server_threads", &c.server_threads, "the server's optimizer threads", 1, 1024);
  options.Choice("progress", &c.progress, {"adaptive", "busy-poll"},
                 "UCX progress thread of both processes: poll then sleep (the default), or always poll");
  options.Duration("timeout", &c.timeout, "longest wait for a reply, the group or ucx_perftest",
                   std::chrono::milliseconds(100), std::chrono::hours(1));
  options.Choice("log_level", &c.log_level, LogLevels(), "log level of both processes (stderr)");
  if (const int rc = ParseOrExit(options, argc, argv); rc >= 0) return rc;
  c.baseline = !no_baseline;
  if (c.min_bytes > c.max_bytes) {
    fmt::print(stderr, "tandem bench ps: --min-bytes ({}) exceeds --max-bytes ({})\n", c.min_bytes, c.max_bytes);
    return 2;
  }
  if (c.partition_bytes % 4 != 0) {
    fmt::print(stderr, "tandem bench ps: --partition-bytes ({}) must be a multiple of 4\n", c.partition_bytes);
    return 2;
  }
  const size_t elem = ElementBytes(c);
  for (uint64_t b = c.min_bytes; b <= c.max_bytes; b = std::max<uint64_t>(b + 1, b * static_cast<uint64_t>(c.factor))) {
    const uint64_t size = b - b % elem;
    if (c.sizes.empty() || c.sizes.back() != size) c.sizes.push_back(size);
  }
  if (PartitionsOf(c, c.sizes.back()) > (1u << 20)) {
    fmt::print(stderr, "tandem bench ps: {} partitions of {} at {} bytes: at most 2^20; raise --partition-bytes\n",
               PartitionsOf(c, c.sizes.back()), FormatBytes(c.partition_bytes), c.sizes.back());
    return 2;
  }
  if (Status s = SetupLogging("bench-ps", c.log_level); !s.ok()) {
    fmt::print(stderr, "tandem bench ps: {}\n", s.ToString());
    return 2;
  }
  c.cpus = AllowedCpus();
  if (c.bind && c.cpus.size() < 2) {
    fmt::print(stderr, "bench ps: only {} CPU available: both processes share it\n", c.cpus.size());
  }
  std::string perftest_binary;
  std::string no_perftest;
  if (c.baseline) {
    perftest_binary = FindInPath("ucx_perftest");
    if (perftest_binary.empty()) {
      no_perftest = "ucx_perftest is not installed (Debian package ucx-utils; `make bench` installs it)";
      fmt::print(stderr, "bench ps: {}: the baseline is reported as null\n", no_perftest);
    }
  } else {
    no_perftest = "skipped (--no-baseline)";
  }
  std::string baseline_env;
  for (const auto& e : kPerftestEnv) {
    if (e.rfind("UCX_WARN", 0) == 0) continue;
    baseline_env += (baseline_env.empty() ? "" : " ") + e;
  }
  std::random_device random;
  ScratchDir scratch;
  scratch.path =
      (std::filesystem::temp_directory_path() / fmt::format("tandem-bench-ps-{}-{:08x}", ::getpid(), random()))
          .string();
  std::error_code ec;
  std::filesystem::create_directories(scratch.path, ec);
  if (ec) {
    fmt::print(stderr, "tandem bench ps: cannot create {}: {}\n", scratch.path, ec.message());
    return 1;
  }
  c.dir = scratch.path;
  c.parent = ::getpid();

  // The server, forked before this process starts any thread.
  (void)std::fflush(stdout);
  (void)std::fflush(stderr);
  const pid_t pid = ::fork();
  if (pid < 0) {
    fmt::print(stderr, "tandem bench ps: fork failed: {}\n", std::strerror(errno));
    return 1;
  }
  if (pid == 0) {
    const int code = ServerMain(c);
    (void)std::fflush(stdout);
    (void)std::fflush(stderr);
    ::_exit(code);
  }
  ServerProcess server(pid);
  if (c.bind && c.cpus.size() > 1) (void)BindProcess({c.cpus[1]});

  if (!c.json) {
    PrintHeader(c, perftest_binary.empty() ? fmt::format("n/a: {}", no_perftest)
                                           : fmt::format("ucx_perftest tag_bw at the same size, {} (the group's "
                                                         "shared-memory settings), same CPUs; median of the rounds",
                                                         baseline_env));
  }
  comm::FileRendezvous rendezvous(c.dir);
  int exit_code = 0;
  uint64_t total_wrong = 0;
  {
    Worker worker(c, rendezvous);
    std::optional<Perftest> perftest;
    if (!perftest_binary.empty()) perftest.emplace(c, perftest_binary);
    for (size_t i = 0; i < c.sizes.size(); ++i) {
      Row row;
      row.size = c.sizes[i];
      row.partitions = PartitionsOf(c, row.size);
      row.message = std::min<uint64_t>(row.size, PartitionElements(c) * elem);
      row.ucx_error = no_perftest;
      Status s = MeasureSize(
          c, worker, perftest ? &*perftest : nullptr, rendezvous, [&server] { return server.Exited(); }, i + 1, row);
      if (!s.ok()) {
        // A killed server may take a moment to be reapable (its threads exit first).
        bool exited = server.Exited();
        for (int t = 0; t < 50 && !exited; ++t) {
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
          exited = server.Exited();
        }
        if (exited) {
          fmt::print(stderr, "tandem bench ps: {}: {} (the server process exited with status {})\n", SizeName(row.size),
                     s.ToString(), server.Code());
        } else {
          fmt::print(stderr, "tandem bench ps: {}: {}\n", SizeName(row.size), s.ToString());
        }
        exit_code = 1;
        break;
      }
      total_wrong += row.wrong;
      PrintRow(c, row, baseline_env);
      (void)std::fflush(stdout);
    }
    worker.Stop();
  }
  // The server exits once the last size is done; on an error it is killed.
  const int server_code =
      server.Finish(exit_code == 0 ? std::chrono::milliseconds(10000) : std::chrono::milliseconds(0));
  if (exit_code == 0 && server_code != 0) {
    fmt::print(stderr, "tandem bench ps: the server process exited with status {}\n", server_code);
    exit_code = 1;
  }
  if (exit_code == 0 && !c.json) fmt::print("# {} wrong elements in total\n", total_wrong);
  if (exit_code == 0 && total_wrong > 0) exit_code = 3;
  return exit_code;
}

}  // namespace tandem::cli
