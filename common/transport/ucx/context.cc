// Set-up and shutdown of the Core: options, the UCX contexts and workers,
// the progress thread's start, and Teardown, which the thread runs last.
#include <pthread.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "common/logging.h"
#include "common/proc_stat.h"
#include "common/transport/ucx/core.h"
#include "common/transport/ucx/endpoint_info.h"
#include "common/transport/ucx/log.h"

namespace tandem::transport::ucx {
namespace {

std::string ReadSmallFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream buf;
  buf << in.rdbuf();
  return buf.str();
}

}  // namespace

Core::~Core() {
  if (thread_.joinable()) Shutdown();
  DestroyUcx();  // only what Init opened before it failed; Teardown releases the
                 // rest
}

Status Core::OpenContext(Context& ctx, const char* name, const std::string& tls, bool network, bool eager_only) {
  ctx.name = name;
  ucp_config_t* config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) return Unavailable("ucx: cannot read the UCX configuration: {}", ucs_status_string(st));
  Status status;
  auto set = [&](const char* key, const std::string& value, const char* option) {
    if (!status.ok()) return;
    const ucs_status_t s = ucp_config_modify(config, key, value.c_str());
    if (s != UCS_OK) {
      status = InvalidArgument("{}: UCX rejects UCX_{}='{}': {}", option, key, value, ucs_status_string(s));
    }
  };
  set("TLS", tls, "tls");
  set("WARN_UNUSED_ENV_VARS", "n", "tls");
  set("RCACHE_ENABLE", "try", "tls");
  if (network) {
    if (!options_.net_devices.empty()) set("NET_DEVICES", options_.net_devices, "net_devices");
    set("KEEPALIVE_INTERVAL", fmt::format("{}ms", options_.keepalive_interval.count()), "keepalive_interval");
  } else if (eager_only) {
    set("RNDV_THRESH", "inf", "prefer_copy_shm");
  }
  if (!status.ok()) {
    ucp_config_release(config);
    return status;
  }
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  st = ucp_init(&params, config, &ctx.context);
  ucp_config_release(config);
  if (st != UCS_OK) {
    ctx.context = nullptr;
    return Unavailable("ucx: cannot open the {} transports '{}'{}: {}", name, tls,
                       network && !options_.net_devices.empty() ? " on " + options_.net_devices : "",
                       ucs_status_string(st));
  }
  auto fail = [&](const char* what) {
    if (ctx.worker != nullptr) ucp_worker_destroy(ctx.worker);
    ucp_cleanup(ctx.context);
    ctx.worker = nullptr;
    ctx.context = nullptr;
    ctx.efd = -1;
    ctx.address.clear();
    return Unavailable("ucx: cannot {} of the {} transports: {}", what, name, ucs_status_string(st));
  };
  ucp_worker_params_t worker_params{};
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  // One thread at a time uses it (the holder of Core::role_mu_).
  worker_params.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  st = ucp_worker_create(ctx.context, &worker_params, &ctx.worker);
  if (st != UCS_OK) {
    ctx.worker = nullptr;
    return fail("create the worker");
  }
  ucp_address_t* address = nullptr;
  size_t length = 0;
  st = ucp_worker_get_address(ctx.worker, &address, &length);
  if (st != UCS_OK) return fail("get the worker address");
  ctx.address.assign(reinterpret_cast<const char*>(address), length);
  ucp_worker_release_address(ctx.worker, address);
  st = ucp_worker_get_efd(ctx.worker, &ctx.efd);
  if (st != UCS_OK) return fail("get the event descriptor");
  workers_.push_back(ctx.worker);
  return Status::Ok();
}

Status Core::Init() {
  TANDEM_RETURN_IF_ERROR(ValidateOptions(options_));
  TANDEM_ASSIGN_OR_RETURN(plan_, PlanTls(options_.tls, options_.prefer_copy_shm));
  TANDEM_RETURN_IF_ERROR(CheckNetDevices(options_.net_devices));
  InstallLogHandler();

  self_.pid = static_cast<uint32_t>(getpid());
  if (const auto stat = ReadProcStat()) self_.start_ticks = stat->start_ticks;
  struct stat ns {};
  if (stat("/proc/self/ns/pid", &ns) == 0) self_.pid_namespace = static_cast<uint64_t>(ns.st_ino);
  // UCX opens its sockets on this thread, in this thread's network namespace.
  if (stat("/proc/thread-self/ns/net", &ns) == 0 || stat("/proc/self/ns/net", &ns) == 0) {
    self_.net_namespace = static_cast<uint64_t>(ns.st_ino);
  }
  self_.boot_id = Trim(ReadSmallFile("/proc/sys/kernel/random/boot_id"));
  self_.hostname = options_.hostname;
  if (self_.hostname.empty()) {
    char name[256] = {};
    if (gethostname(name, sizeof(name) - 1) == 0) self_.hostname = name;
  }

  // Shared memory first; the network worker is optional unless named.
  if (!plan_.shm.empty()) {
    Status s = OpenContext(shm_, "shared-memory", plan_.shm, /*network=*/false, plan_.shm_eager_only);
    if (!s.ok()) {
      if (plan_.explicit_shm || s.code() == StatusCode::kInvalidArgument) return s;
      spdlog::warn(
          "ucx: no shared-memory transport ({}); peers on this host "
          "use the network",
          s.message());
    }
  }
  if (!plan_.net.empty()) {
    Status s = OpenContext(net_, "network", plan_.net, /*network=*/true, false);
    if (!s.ok()) {
      if (plan_.explicit_net || s.code() == StatusCode::kInvalidArgument || shm_.worker == nullptr) return s;
      spdlog::warn(
          "ucx: no network transport ({}); only peers on this host "
          "can be reached",
          s.message());
    }
    if (net_.context != nullptr) {
      std::istringstream in(ContextInfoText(net_.context));
      for (std::string line; std::getline(in, line);) {
        if (line.find("resource") == std::string::npos) continue;
        const std::string last = line.substr(line.find_last_of(' ') + 1);  // "rc_mlx5/mlx5_0:1"
        if (IsVerbs(last.substr(0, last.find('/')))) self_.has_verbs = true;
      }
    }
  }
  if (shm_.worker == nullptr && net_.worker == nullptr) {
    return Unavailable("ucx: no UCX transport could be opened (tls '{}', net_devices '{}')", options_.tls,
                       options_.net_devices);
  }
  self_.shm_address = shm_.address;
  self_.net_address = net_.address;
  address_ = EncodeIdentity(self_);

  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (epoll_fd_ < 0 || wake_fd_ < 0) return Unavailable("ucx: epoll/eventfd: {}", std::strerror(errno));
  for (int fd : {wake_fd_, shm_.efd, net_.efd}) {
    if (fd < 0) continue;
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) != 0) {
      return Unavailable("ucx: epoll_ctl: {}", std::strerror(errno));
    }
  }
  return Status::Ok();
}

void Core::Start() {
  // spdlog builds its registry on first use. Built here, before the progress
  // thread starts, it is never built by two ranks' progress threads at once
  // (their first log lines come together, from Connect), which
  // ThreadSanitizer reports since spdlog's library is not instrumented.
  (void)spdlog::default_logger_raw();
  thread_ = std::thread([this] {
    pthread_setname_np(pthread_self(), "tandem-ucx");
    t_progress_core = this;
    Run();
  });
}

void Core::Shutdown() {
  {
    MutexLock lock(&mu_);
    stopping_.store(true);
    WakeLocked();
  }
  started_cv_.NotifyAll();  // WaitPosted returns
  if (thread_.joinable()) thread_.join();
}

void Core::DestroyUcx() {
  for (Context* ctx : {&shm_, &net_}) {
    if (ctx->worker != nullptr) ucp_worker_destroy(ctx->worker);
    if (ctx->context != nullptr) ucp_cleanup(ctx->context);
    ctx->worker = nullptr;
    ctx->context = nullptr;
  }
  workers_.clear();
  if (epoll_fd_ >= 0) close(epoll_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
  epoll_fd_ = wake_fd_ = -1;
}

void Core::Teardown() {
  MutexLock role(&role_mu_);  // waits for a caller's round (Progress() does no more)
  t_quiet_ucx_warnings = true;
  const auto deadline = Clock::now() + options_.close_timeout;
  auto until = [&](const std::function<bool()>& done) TANDEM_REQUIRES(role_mu_) {
    while (!done() && Clock::now() < deadline) {
      RunQueued();
      ProgressAll();
      HandleFailures();
    }
  };
  // Operations posted but never started.
  {
    std::vector<std::shared_ptr<Op>> posted;
    {
      MutexLock lock(&mu_);
      posted.swap(posted_);
    }
    for (auto& op : posted) {
      Finish(*op, Cancelled("ucx: rank {} closed its transport before the {} "
                            "with rank {} started",
                            rank_.load(), Describe(*op), op->peer));
    }
  }
  // Operations started inside the last round's completions that ended at
  // once (nothing is posted while the transport stops).
  RunDeferred();
  // Say goodbye to the peers that are still there.
  const uint64_t bye = static_cast<uint64_t>(rank_.load());
  std::vector<std::shared_ptr<Op>> byes;
  for (auto& p : peers_) {
    if (!p || p->ep == nullptr) continue;
    {
      MutexLock lock(&mu_);
      if (p->dead) continue;
    }
    auto op = std::make_shared<Op>(Op::Kind::kSend, p->rank, kByeTag, true, const_cast<uint64_t*>(&bye), sizeof(bye));
    Start(op);
    byes.push_back(op);
  }
  until([&] {
    MutexLock lock(&mu_);
    return std::all_of(byes.begin(), byes.end(), [](const auto& op) { return op->done; });
  });
  // Cancel the receives, then close the endpoints.
  {
    std::vector<std::shared_ptr<Op>> ops;
    for (const auto& [raw, op] : inflight_) ops.push_back(op);
    for (const auto& op : ops) Cancel(op);
  }
  for (auto& p : peers_) {
    if (!p || p->ep == nullptr) continue;
    bool dead = false;
    {
      MutexLock lock(&mu_);
      dead = p->dead;
    }
    CloseEndpoint(*p, /*force=*/dead && !p->shm);
  }
  until([&]() TANDEM_REQUIRES(role_mu_) { return closing_.empty(); });
  for (void* r : closing_) ucp_request_free(r);  // released when UCX is done with it
  closing_.clear();
  // Whatever UCX still holds (operations with dead peers) ends with the
  // workers.
  for (const auto& [raw, op] : inflight_) {
    Finish(*op, Cancelled("ucx: rank {} closed its transport with a {} with "
                          "rank {} in flight",
                          rank_.load(), Describe(*op), op->peer));
  }
  while (RunDeferred()) {
  }
  DestroyUcx();
  inflight_.clear();
  for (auto& p : peers_) {
    if (p) p->bye_recv.reset();
  }
  t_quiet_ucx_warnings = false;
}

}  // namespace tandem::transport::ucx
