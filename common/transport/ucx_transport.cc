#include "common/transport/ucx_transport.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdarg>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string_view>
#include <thread>
#include <unordered_map>

#include <net/if.h>
#include <ucp/api/ucp.h>
#include <ucs/debug/log_def.h>

#include "common/logging.h"
#include "common/proc_stat.h"
#include "common/thread_annotations.h"

namespace tandem::transport {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::microseconds;
using std::chrono::milliseconds;

// ---------------------------------------------------------------------------
// Tags: [63: user tag bit 63][62: internal][61..40: sender rank][39..0: user tag bits 39..0].

constexpr uint64_t kInternalBit = uint64_t{1} << 62;
constexpr int kRankShift = UcxTransport::kUserTagBits;
static_assert(UcxTransport::kMaxRanks <= (1 << (62 - kRankShift)));
constexpr uint64_t kFullMask = ~uint64_t{0};
// Internal messages (the user-tag field of an internal tag).
constexpr uint64_t kHelloTag = 1;
constexpr uint64_t kByeTag = 2;
constexpr uint32_t kHelloMagic = 0x54554358;  // "TUCX"
constexpr char kClosedReason[] = "it closed its transport";

uint64_t UcxTag(int sender, uint64_t tag, bool internal) {
  return (tag & UcxTransport::kTagHighBit) | (internal ? kInternalBit : 0) |
         (static_cast<uint64_t>(sender) << kRankShift) | (tag & UcxTransport::kMaxUserTag);
}

// UCS_PTR_IS_ERR and UCS_PTR_STATUS without their C casts.
bool IsUcsError(const void* ptr) {
  return reinterpret_cast<uintptr_t>(ptr) >= static_cast<uintptr_t>(UCS_ERR_LAST);
}
ucs_status_t UcsStatusOf(const void* ptr) {
  return static_cast<ucs_status_t>(reinterpret_cast<intptr_t>(ptr));
}

// Longest wait a condition variable is given (larger ones overflow the clock).
constexpr milliseconds kMaxWait = std::chrono::hours(24 * 365);

// ---------------------------------------------------------------------------
// UCX's log messages go to spdlog.

// Set on the progress thread while it tears UCX down: UCX's warnings about
// requests still held for dead peers are expected then.
thread_local bool t_quiet_ucx_warnings = false;
// The transport whose progress role this thread holds (its progress thread,
// or a caller inside Progress()): completions run there, and a Request of
// that transport dropped there must not wait for them.
thread_local const void* t_progress_core = nullptr;
// The transport that is starting operations inside a completion
// (Core::WaitPosted there): what ends at once is finished later, not inside
// the completion that posted it.
thread_local const void* t_deferring_core = nullptr;

__attribute__((format(printf, 6, 0))) ucs_log_func_rc_t LogToSpdlog(const char* file, unsigned line,
                                                                    const char* /*function*/, ucs_log_level_t level,
                                                                    const ucs_log_component_config_t* component,
                                                                    const char* format, va_list ap) {
  if (component != nullptr && level > component->log_level) return UCS_LOG_FUNC_RC_CONTINUE;
  if (level > UCS_LOG_LEVEL_TRACE_POLL) return UCS_LOG_FUNC_RC_CONTINUE;  // explicit prints (ucs_print) stay UCX's
  char text[1024];
  va_list copy;
  va_copy(copy, ap);
  if (vsnprintf(text, sizeof(text), format, copy) < 0) {
    text[0] = '\0';
  }
  va_end(copy);
  spdlog::level::level_enum out = spdlog::level::trace;
  switch (level) {
    case UCS_LOG_LEVEL_FATAL:
      out = spdlog::level::err;
      break;
    case UCS_LOG_LEVEL_ERROR:  // Tandem reports failures to its callers; UCX's view of them is a warning
      out = spdlog::level::warn;
      break;
    case UCS_LOG_LEVEL_WARN:
      out = t_quiet_ucx_warnings ? spdlog::level::debug : spdlog::level::warn;
      break;
    case UCS_LOG_LEVEL_DIAG:
    case UCS_LOG_LEVEL_INFO:
      out = spdlog::level::debug;
      break;
    default:
      break;
  }
  const char* base = std::strrchr(file, '/');
  spdlog::log(out, "ucx: {} ({}:{})", text, base != nullptr ? base + 1 : file, line);
  return UCS_LOG_FUNC_RC_STOP;
}

void InstallLogHandler() {
  static std::once_flag once;
  std::call_once(once, [] { ucs_log_push_handler(&LogToSpdlog); });
}

// ---------------------------------------------------------------------------
// This process and its peers: identity, liveness.

std::string ReadSmallFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream buf;
  buf << in.rdbuf();
  return buf.str();
}

std::string Trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  return s.substr(i);
}

// Why process `pid` (started at `start_ticks`) is no longer the peer, or empty while it is alive.
std::string ProcessGone(uint32_t pid, uint64_t start_ticks, const std::string& host) {
  const std::string why = tandem::ProcessGone(static_cast<pid_t>(pid), start_ticks);
  return why.empty() ? "" : fmt::format("its process {} on {} {}", pid, host, why);
}

// What a rank publishes: who it is and its UCX worker addresses.
struct Identity {
  uint32_t pid = 0;
  uint64_t start_ticks = 0;
  uint64_t pid_namespace = 0;  // inode of /proc/self/ns/pid, 0 if unknown
  uint64_t net_namespace = 0;  // inode of the network namespace UCX's sockets are in, 0 if unknown
  std::string hostname;
  std::string boot_id;
  bool has_verbs = false;
  std::string shm_address;  // empty: no shared-memory worker
  std::string net_address;  // empty: no network worker
};

constexpr char kMagic[4] = {'T', 'U', 'C', 'X'};
constexpr uint8_t kAddressVersion = 2;

class Writer {
 public:
  void U8(uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void U16(uint16_t v) { Raw(&v, sizeof(v)); }
  void U32(uint32_t v) { Raw(&v, sizeof(v)); }
  void U64(uint64_t v) { Raw(&v, sizeof(v)); }
  void Bytes(const std::string& s) {
    U32(static_cast<uint32_t>(s.size()));
    out_ += s;
  }
  void Raw(const void* p, size_t n) { out_.append(static_cast<const char*>(p), n); }
  std::string Take() { return std::move(out_); }

 private:
  std::string out_;
};

class Reader {
 public:
  explicit Reader(std::string_view in) : in_(in) {}
  bool Valid() const { return ok_; }
  template <typename T>
  T Get() {
    T v{};
    if (!Need(sizeof(T))) return v;
    std::memcpy(&v, in_.data(), sizeof(T));
    in_.remove_prefix(sizeof(T));
    return v;
  }
  std::string Bytes(size_t max) {
    const uint32_t n = Get<uint32_t>();
    if (n > max) ok_ = false;
    if (!ok_ || !Need(n)) return "";
    std::string s(in_.substr(0, n));
    in_.remove_prefix(n);
    return s;
  }
  bool AtEnd() const { return in_.empty(); }

 private:
  bool Need(size_t n) {
    if (in_.size() < n) ok_ = false;
    return ok_;
  }
  std::string_view in_;
  bool ok_ = true;
};

std::string EncodeIdentity(const Identity& id) {
  Writer w;
  w.Raw(kMagic, sizeof(kMagic));
  w.U8(kAddressVersion);
  w.U8(id.has_verbs ? 1 : 0);
  w.U32(id.pid);
  w.U64(id.start_ticks);
  w.U64(id.pid_namespace);
  w.U64(id.net_namespace);
  w.Bytes(id.hostname);
  w.Bytes(id.boot_id);
  w.Bytes(id.shm_address);
  w.Bytes(id.net_address);
  return w.Take();
}

// Empty error on success.
std::string DecodeIdentity(std::string_view in, Identity* id) {
  if (in.size() < sizeof(kMagic) || std::memcmp(in.data(), kMagic, sizeof(kMagic)) != 0) {
    return fmt::format("it does not start with the Tandem UCX marker ({} bytes)", in.size());
  }
  Reader r(in.substr(sizeof(kMagic)));
  const auto version = r.Get<uint8_t>();
  if (r.Valid() && version != kAddressVersion) {
    return fmt::format("address version {}, this build speaks version {}", version, kAddressVersion);
  }
  id->has_verbs = (r.Get<uint8_t>() & 1) != 0;
  id->pid = r.Get<uint32_t>();
  id->start_ticks = r.Get<uint64_t>();
  id->pid_namespace = r.Get<uint64_t>();
  id->net_namespace = r.Get<uint64_t>();
  id->hostname = r.Bytes(255);
  id->boot_id = r.Bytes(64);
  id->shm_address = r.Bytes(1 << 16);
  id->net_address = r.Bytes(1 << 16);
  if (!r.Valid() || !r.AtEnd()) return "it is truncated or has trailing bytes";
  if (id->shm_address.empty() && id->net_address.empty()) return "it has no UCX worker address";
  return "";
}

// ---------------------------------------------------------------------------
// Options.

const std::set<std::string>& ShmTransports() {
  static const std::set<std::string> names = {"posix", "sysv", "mm", "cma", "knem", "xpmem", "sm", "shm"};
  return names;
}
const std::set<std::string>& NetTransports() {
  static const std::set<std::string> names = {"tcp",  "ib",      "rc", "rc_v", "rc_verbs",
                                              "rc_x", "rc_mlx5", "ud", "ud_v", "ud_verbs",
                                              "ud_x", "ud_mlx5", "dc", "dc_x", "dc_mlx5"};
  return names;
}
// GPU memory transports serve both workers.
const std::set<std::string>& GpuTransports() {
  static const std::set<std::string> names = {"cuda", "cuda_copy", "cuda_ipc", "gdr_copy",
                                              "rocm", "rocm_copy", "rocm_ipc", "rocm_gdr"};
  return names;
}
// Shared-memory transports that copy once, by rendezvous (the rest copy through segments).
bool SingleCopy(const std::string& name) {
  return name == "cma" || name == "knem" || name == "xpmem" || name == "sm" || name == "shm";
}

std::vector<std::string> SplitList(const std::string& s) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : s) {
    if (c == ',') {
      out.push_back(Trim(cur));
      cur.clear();
    } else {
      cur.push_back(c);
    }
  }
  out.push_back(Trim(cur));
  return out;
}

std::string Join(const std::vector<std::string>& v, const char* sep = ",") {
  std::string out;
  for (const auto& s : v) {
    if (!out.empty()) out += sep;
    out += s;
  }
  return out;
}

// What each worker is opened with. Empty: no such worker.
struct TlsPlan {
  std::string shm;
  std::string net;
  bool shm_eager_only = false;  // no single-copy transport: copy through segments, eagerly
  bool explicit_shm = false;    // the caller named shared-memory transports
  bool explicit_net = false;    // the caller named network transports
};

Result<TlsPlan> PlanTls(const std::string& tls, bool prefer_copy_shm) {
  // cma is built into Linux; knem and xpmem are kernel modules UCX uses only where they are loaded.
  std::vector<std::string> default_shm = {"posix", "sysv"};
  if (!prefer_copy_shm) {
    default_shm.push_back("cma");
    if (access("/dev/knem", F_OK) == 0) default_shm.push_back("knem");
    if (access("/dev/xpmem", F_OK) == 0) default_shm.push_back("xpmem");
  }
  TlsPlan plan;
  const std::string trimmed = Trim(tls);
  const bool exclude = !trimmed.empty() && trimmed[0] == '^';
  std::vector<std::string> names;
  if (!trimmed.empty() && trimmed != "all") {
    names = SplitList(exclude ? trimmed.substr(1) : trimmed);
    for (const auto& n : names) {
      const bool known = ShmTransports().count(n) > 0 || NetTransports().count(n) > 0 || GpuTransports().count(n) > 0 ||
                         n == "self" || n == "all";
      if (!known) {
        std::vector<std::string> all(ShmTransports().begin(), ShmTransports().end());
        all.insert(all.end(), NetTransports().begin(), NetTransports().end());
        all.insert(all.end(), GpuTransports().begin(), GpuTransports().end());
        all.push_back("self");
        return InvalidArgument("tls: unknown UCX transport '{}' in '{}' (known: {})", n, tls, Join(all, ", "));
      }
    }
  }
  std::vector<std::string> shm, net;
  if (trimmed.empty() || trimmed == "all") {
    shm = default_shm;
    net = {"^sm", "self"};
  } else if (exclude) {
    std::set<std::string> excluded(names.begin(), names.end());
    const bool all_shm = excluded.count("sm") > 0 || excluded.count("shm") > 0;
    for (const auto& n : default_shm) {
      const bool mm = (n == "posix" || n == "sysv" || n == "xpmem") && excluded.count("mm") > 0;
      if (!all_shm && !mm && excluded.count(n) == 0) shm.push_back(n);
    }
    net = {"^sm", "self"};
    for (const auto& n : names) {
      if (NetTransports().count(n) > 0 || GpuTransports().count(n) > 0) net.push_back(n);
    }
  } else {
    std::vector<std::string> gpu;
    for (const auto& n : names) {
      if (n == "all") return InvalidArgument("tls: 'all' cannot be combined with other transports ('{}')", tls);
      if (ShmTransports().count(n) > 0) shm.push_back(n);
      if (NetTransports().count(n) > 0) net.push_back(n);
      if (GpuTransports().count(n) > 0) gpu.push_back(n);
    }
    plan.explicit_shm = !shm.empty();
    plan.explicit_net = !net.empty();
    if (!shm.empty()) shm.insert(shm.end(), gpu.begin(), gpu.end());
    if (!net.empty()) net.insert(net.end(), gpu.begin(), gpu.end());
  }
  plan.shm = Join(shm);
  plan.net = Join(net);
  plan.shm_eager_only = !shm.empty() && std::none_of(shm.begin(), shm.end(), SingleCopy);
  return plan;
}

Status CheckNetDevices(const std::string& devices) {
  if (devices.empty() || devices == "all") return Status::Ok();
  std::vector<std::string> have;
  if (struct if_nameindex* list = if_nameindex(); list != nullptr) {
    for (auto* i = list; i->if_index != 0; ++i) have.emplace_back(i->if_name);
    if_freenameindex(list);
  }
  for (const auto& d : SplitList(devices)) {
    const bool charset_ok = !d.empty() && std::all_of(d.begin(), d.end(), [](char c) {
      return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.' || c == ':';
    });
    if (!charset_ok) return InvalidArgument("net_devices: '{}' is not a device name (in '{}')", d, devices);
    const std::string name = d.substr(0, d.find(':'));  // "mlx5_0:1" names port 1 of mlx5_0
    if (if_nametoindex(name.c_str()) != 0) continue;
    if (access(("/sys/class/infiniband/" + name).c_str(), F_OK) == 0) continue;
    return InvalidArgument("net_devices: this host has no network device '{}' (it has: {})", d, Join(have, ", "));
  }
  return Status::Ok();
}

Status ValidateOptions(const UcxOptions& o) {
  if (o.progress != UcxProgressMode::kAdaptive && o.progress != UcxProgressMode::kBusyPoll) {
    return InvalidArgument("progress: unknown mode {}", static_cast<int>(o.progress));
  }
  if (o.spin < microseconds(0) || o.spin > milliseconds(10)) {
    return InvalidArgument("spin: {} us is out of range (0 to 10000 us)", o.spin.count());
  }
  if (o.liveness_interval < milliseconds(1) || o.liveness_interval > milliseconds(10000)) {
    return InvalidArgument("liveness_interval: {} ms is out of range (1 to 10000 ms)", o.liveness_interval.count());
  }
  if (o.keepalive_interval < milliseconds(10) || o.keepalive_interval > std::chrono::hours(1)) {
    return InvalidArgument("keepalive_interval: {} ms is out of range (10 ms to 1 h)", o.keepalive_interval.count());
  }
  if (o.close_timeout < milliseconds(0) || o.close_timeout > milliseconds(60000)) {
    return InvalidArgument("close_timeout: {} ms is out of range (0 to 60000 ms)", o.close_timeout.count());
  }
  if (o.abandon_timeout < milliseconds(1) || o.abandon_timeout > std::chrono::hours(1)) {
    return InvalidArgument("abandon_timeout: {} ms is out of range (1 ms to 1 h)", o.abandon_timeout.count());
  }
  if (o.hostname.size() > 255 || std::any_of(o.hostname.begin(), o.hostname.end(), [](char c) {
        return std::isspace(static_cast<unsigned char>(c)) || std::iscntrl(static_cast<unsigned char>(c));
      })) {
    return InvalidArgument("hostname: '{}' is not a host name (at most 255 bytes, no spaces)", o.hostname);
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------
// What an endpoint uses, from ucp_ep_print_info.

// What `print` writes to a FILE, as a string.
std::string PrintToString(const std::function<void(FILE*)>& print) {
  char* buf = nullptr;
  size_t len = 0;
  FILE* f = open_memstream(&buf, &len);
  if (f == nullptr) return "";
  print(f);
  const bool closed = fclose(f) == 0;
  std::string out(closed && buf != nullptr ? buf : "", closed ? len : 0);
  free(buf);
  return out;
}

std::string EndpointInfoText(ucp_ep_h ep) {
  return PrintToString([ep](FILE* f) { ucp_ep_print_info(ep, f); });
}

std::string ContextInfoText(ucp_context_h context) {
  return PrintToString([context](FILE* f) { ucp_context_print_info(context, f); });
}

bool IsVerbs(const std::string& tl) {
  return tl.rfind("rc", 0) == 0 || tl.rfind("ud", 0) == 0 || tl.rfind("dc", 0) == 0;
}

// "posix/memory" -> "shared memory".
std::string TransportKind(const std::string& tl) {
  if (tl == "posix" || tl == "sysv" || tl == "xpmem") return "shared memory";
  if (tl == "cma" || tl == "knem") return "single-copy shared memory";
  if (tl == "tcp") return "TCP";
  if (IsVerbs(tl)) return "verbs";
  if (tl == "self") return "loopback";
  if (tl.rfind("cuda", 0) == 0 || tl.rfind("rocm", 0) == 0 || tl == "gdr_copy") return "GPU";
  return tl;
}

struct Lane {
  std::string transport;  // "sysv"
  std::string device;     // "memory"
  std::set<std::string> roles;
  std::string Name() const { return fmt::format("{}/{} ({})", transport, device, TransportKind(transport)); }
};

struct EndpointPaths {
  std::vector<Lane> lanes;
  bool rendezvous = false;
  uint64_t rendezvous_from = 0;  // bytes

  bool Any(const std::function<bool(const Lane&)>& f) const { return std::any_of(lanes.begin(), lanes.end(), f); }
  bool OnlyTcp() const {
    return !lanes.empty() &&
           std::all_of(lanes.begin(), lanes.end(), [](const Lane& l) { return l.transport == "tcp"; });
  }
  bool HasNetworkLane() const {
    return Any([](const Lane& l) { return l.transport == "tcp" || IsVerbs(l.transport); });
  }
  std::string Lanes(const char* role1, const char* role2 = nullptr) const {
    std::vector<std::string> names;
    for (const auto& l : lanes) {
      if (l.roles.count(role1) > 0 || (role2 != nullptr && l.roles.count(role2) > 0)) {
        if (std::find(names.begin(), names.end(), l.Name()) == names.end()) names.push_back(l.Name());
      }
    }
    return names.empty() ? "no lane" : Join(names, " + ");
  }
  std::string Describe() const {
    if (lanes.empty()) return "UCX did not describe the endpoint";
    const std::string eager = Lanes("am", "am_bw");
    if (!rendezvous) return fmt::format("eager via {} at every size", eager);
    const bool zero_copy = Any([](const Lane& l) { return l.roles.count("rma_bw") > 0; });
    return fmt::format("eager via {} up to {} B, rendezvous above via {}{}", eager, rendezvous_from,
                       zero_copy ? Lanes("rma_bw") : Lanes("am_bw", "am"),
                       zero_copy ? " (zero-copy)" : " (copied through active messages)");
  }
};

// Parses lines like
//   lane[0]:  2:sysv/memory.0 md[2]  -> md[2]/sysv/sysdev[255] am am_bw#0
//   tag_send: 0..<egr/short>..8185..<egr/zcopy>..20553..<rndv>..(inf)
EndpointPaths ParseEndpointInfo(const std::string& text) {
  EndpointPaths out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (const size_t lane = line.find("lane["); lane != std::string::npos) {
      const size_t colon = line.find("]:", lane);
      if (colon == std::string::npos) continue;
      std::istringstream words(line.substr(colon + 2));
      std::string first;
      words >> first;  // "2:sysv/memory.0"
      if (const size_t c = first.find(':'); c != std::string::npos) first = first.substr(c + 1);
      if (const size_t dot = first.rfind('.'); dot != std::string::npos) first = first.substr(0, dot);
      Lane l;
      const size_t slash = first.find('/');
      l.transport = first.substr(0, slash);
      l.device = slash == std::string::npos ? "" : first.substr(slash + 1);
      bool after_arrow = false;
      bool skipped_remote = false;
      for (std::string w; words >> w;) {
        if (w == "->") {
          after_arrow = true;
        } else if (after_arrow && !skipped_remote) {
          skipped_remote = true;  // "md[2]/sysv/sysdev[255]"
        } else if (after_arrow) {
          l.roles.insert(w.substr(0, w.find('#')));
        }
      }
      out.lanes.push_back(std::move(l));
    } else if (const size_t tag = line.find("tag_send:"); tag != std::string::npos) {
      const size_t rndv = line.find("..<rndv>", tag);
      if (rndv == std::string::npos) continue;
      const size_t start = line.rfind("..", rndv - 1);
      if (start == std::string::npos || start < tag) continue;
      out.rendezvous = true;
      out.rendezvous_from = std::strtoull(line.substr(start + 2, rndv - start - 2).c_str(), nullptr, 10);
    }
  }
  return out;
}

// ---------------------------------------------------------------------------
// Operations.

struct Op : std::enable_shared_from_this<Op> {
  enum class Kind { kSend, kRecv };
  Op(Kind k, int p, uint64_t t, bool in, void* d, size_t b)
      : kind(k), peer(p), tag(t), internal(in), data(d), bytes(b) {}

  const Kind kind;
  const int peer;
  const uint64_t tag;   // the user tag (or kHelloTag/kByeTag when internal)
  const bool internal;  // handshake and goodbye messages
  void* const data;
  const size_t bytes;
  std::condition_variable cv;
  Transport::Completion callback;  // moved out by Finish, which runs it
  Status refused;                  // set at Submit: Start finishes the op with it

  // Guarded by Core::mu_.
  bool done = false;
  bool in_callback = false;  // done, and its callback is running
  Status status;
  bool dropped = false;  // its Request was destroyed while in flight

  // Progress thread only.
  UcxTransport::Core* core = nullptr;
  void* request = nullptr;  // the UCX request, while UCX holds it
  bool ucx_done = false;    // UCX's callback ran
  bool polled = false;      // counted in Core::polled_sends_
  ucs_status_t ucx_status = UCS_OK;
  size_t length = 0;  // the sender's length, for receives
};

std::string Describe(const Op& op) {
  const char* what = op.kind == Op::Kind::kSend ? "send" : "receive";
  if (op.internal) return fmt::format("{} {}", op.tag == kHelloTag ? "handshake" : "goodbye", what);
  return fmt::format("{} of {} bytes with tag {}", what, op.bytes, op.tag);
}

struct Peer {
  int rank = 0;
  Identity id;
  bool same_host = false;            // same host name and boot id
  bool pid_check = false;            // same host and PID namespace: liveness through /proc
  bool shm = false;                  // reached through the shared-memory worker
  bool shm_expected = false;         // both ranks have shared-memory workers and share the host and network namespace
  bool shm_without_wakeups = false;  // shared memory across network namespaces: nothing else reaches it
  std::string network_reason;        // why a peer on this host is not reached through shared memory

  // Progress thread only (set before the peer is published).
  ucp_worker_h worker = nullptr;
  ucp_ep_h ep = nullptr;
  struct ErrorArg {
    UcxTransport::Core* core;
    int rank;
  } error_arg{nullptr, 0};
  uint64_t bye_buffer = 0;
  std::shared_ptr<Op> bye_recv;

  // Guarded by Core::mu_.
  bool dead = false;
  std::string reason;  // why it is gone
};

}  // namespace

Status CheckUcxOptions(const UcxOptions& options) {
  TANDEM_RETURN_IF_ERROR(ValidateOptions(options));
  TANDEM_RETURN_IF_ERROR(PlanTls(options.tls, options.prefer_copy_shm).status());
  return CheckNetDevices(options.net_devices);
}

// ---------------------------------------------------------------------------

class UcxTransport::Core : public std::enable_shared_from_this<UcxTransport::Core> {
 public:
  explicit Core(UcxOptions options) : options_(std::move(options)) {}
  ~Core();
  Core(const Core&) = delete;
  Core& operator=(const Core&) = delete;

  Status Init();
  void Start();
  void Shutdown();

  const std::string& Address() const { return address_; }
  Status Connect(int rank, int size, const std::vector<std::string>& addresses, milliseconds timeout,
                 const std::function<bool()>& cancelled);
  std::vector<std::string> PathSummary() const;
  int Rank() const { return rank_.load(); }
  int Size() const { return size_.load(); }

  // `done`, when set, is called on the progress thread when the operation
  // ends (transport.h); an operation refused at once is refused there too.
  std::unique_ptr<Request> Submit(Op::Kind kind, int peer, uint64_t tag, bool internal, void* data, size_t bytes,
                                  Transport::Completion done = nullptr);
  Status Wait(Op& op, milliseconds timeout);
  void WaitPosted();
  Transport::Progressed Progress();
  void Drop(const std::shared_ptr<Op>& op);

  // UCX callbacks (progress thread).
  void OnUcxDone(Op* op, void* request, ucs_status_t status, size_t length);
  void OnEndpointError(int rank, ucs_status_t status);

 private:
  struct Context {
    const char* name = "";  // "shared-memory", "network"
    ucp_context_h context = nullptr;
    ucp_worker_h worker = nullptr;
    std::string address;
    int efd = -1;
  };

  Status OpenContext(Context& ctx, const char* name, const std::string& tls, bool network, bool eager_only);
  void DestroyUcx();
  template <typename F>
  auto OnProgressThread(F&& fn) -> decltype(fn());
  void WakeLocked() TANDEM_REQUIRES(mu_);

  // Progress thread.
  void Run();
  bool RunQueued();
  // Takes what was posted into starting_ and starts it in order; with
  // `defer`, operations that end at once are finished later (deferred_).
  // Returns whether it took anything.
  bool StartPosted(bool defer);
  // Finishes the operations deferred_ holds.
  bool RunDeferred();
  bool ProgressAll();
  void Drain();
  // Releases the role while it sleeps.
  void Sleep(std::unique_lock<std::mutex>& role, Clock::duration max);
  void Start(const std::shared_ptr<Op>& op);
  void Cancel(const std::shared_ptr<Op>& op);
  void Complete(Op& op);
  void Finish(Op& op, Status status);
  Status ErrorStatus(const Op& op, ucs_status_t status);
  Status GoneStatus(const Op& op, const std::string& reason) const;
  void FailPeer(int rank, const std::string& reason);
  void HandleFailures();
  void CheckPeers();
  void CloseEndpoint(Peer& peer, bool force);
  Status CreateEndpoints(std::vector<std::unique_ptr<Peer>> peers);
  void SelfCheck();
  void Teardown();

  const UcxOptions options_;
  TlsPlan plan_;
  Identity self_;
  std::string address_;
  Context shm_;
  Context net_;
  std::vector<ucp_worker_h> workers_;  // the open ones
  int epoll_fd_ = -1;
  int wake_fd_ = -1;
  std::thread thread_;
  // Held by the thread that makes UCX calls and runs completions: the
  // progress thread for each round of its loop, or a caller in Progress().
  // What is marked "progress thread only" belongs to the holder.
  std::mutex role_mu_;
  std::atomic<int> rank_{-1};
  std::atomic<int> size_{0};
  std::atomic<bool> connect_called_{false};
  std::atomic<bool> work_{false};
  std::atomic<bool> stopping_{false};

  mutable std::mutex mu_;
  bool sleeping_ TANDEM_GUARDED_BY(mu_) = false;
  bool connected_ TANDEM_GUARDED_BY(mu_) = false;
  std::vector<std::shared_ptr<Op>> posted_ TANDEM_GUARDED_BY(mu_);
  // Batches of posted_ the progress thread took, and started (WaitPosted).
  uint64_t batches_taken_ TANDEM_GUARDED_BY(mu_) = 0;
  uint64_t batches_started_ TANDEM_GUARDED_BY(mu_) = 0;
  int posted_waiters_ TANDEM_GUARDED_BY(mu_) = 0;
  std::condition_variable started_cv_;
  std::vector<std::shared_ptr<Op>> cancels_ TANDEM_GUARDED_BY(mu_);
  std::vector<std::function<void()>> tasks_ TANDEM_GUARDED_BY(mu_);
  std::vector<std::string> summaries_ TANDEM_GUARDED_BY(mu_);
  // Written once by the progress thread (under mu_) in CreateEndpoints; the
  // Peer objects' own fields say who guards them.
  std::vector<std::unique_ptr<Peer>> peers_;

  // Progress thread only.
  std::unordered_map<Op*, std::shared_ptr<Op>> inflight_;  // ops whose UCX request is alive
  std::deque<std::pair<int, std::string>> failures_;       // from UCX callbacks, handled after progress
  std::vector<void*> closing_;                             // endpoint close requests
  // Taken from posted_ and not yet started, in posting order: a completion
  // that starts operations itself (WaitPosted) starts these first.
  std::deque<std::shared_ptr<Op>> starting_;
  // Operations that ended while they were started inside a completion.
  std::vector<std::pair<std::shared_ptr<Op>, Status>> deferred_;
  // Eager shared-memory sends in flight to live peers. Such a send waits for
  // room in the peer's FIFO, which raises no event: the thread polls while
  // there are any.
  int polled_sends_ = 0;
};

namespace {

class UcxRequest final : public Request {
 public:
  UcxRequest(std::shared_ptr<UcxTransport::Core> core, std::shared_ptr<Op> op)
      : core_(std::move(core)), op_(std::move(op)) {}
  ~UcxRequest() override { core_->Drop(op_); }
  Status Wait(std::chrono::milliseconds timeout) override { return core_->Wait(*op_, timeout); }

 private:
  std::shared_ptr<UcxTransport::Core> core_;
  std::shared_ptr<Op> op_;
};

void OnSendDone(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<Op*>(user_data);
  op->core->OnUcxDone(op, request, status, 0);
}

void OnRecvDone(void* request, ucs_status_t status, const ucp_tag_recv_info_t* info, void* user_data) {
  auto* op = static_cast<Op*>(user_data);
  op->core->OnUcxDone(op, request, status, info != nullptr ? info->length : 0);
}

void OnEpError(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* a = static_cast<Peer::ErrorArg*>(arg);
  a->core->OnEndpointError(a->rank, status);
}

}  // namespace

// ---------------------------------------------------------------------------
// Set-up and shutdown.

UcxTransport::Core::~Core() {
  if (thread_.joinable()) Shutdown();
  DestroyUcx();  // only what Init opened before it failed; Teardown releases the rest
}

Status UcxTransport::Core::OpenContext(Context& ctx, const char* name, const std::string& tls, bool network,
                                       bool eager_only) {
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

Status UcxTransport::Core::Init() {
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
      spdlog::warn("ucx: no shared-memory transport ({}); peers on this host use the network", s.message());
    }
  }
  if (!plan_.net.empty()) {
    Status s = OpenContext(net_, "network", plan_.net, /*network=*/true, false);
    if (!s.ok()) {
      if (plan_.explicit_net || s.code() == StatusCode::kInvalidArgument || shm_.worker == nullptr) return s;
      spdlog::warn("ucx: no network transport ({}); only peers on this host can be reached", s.message());
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

void UcxTransport::Core::Start() {
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

void UcxTransport::Core::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_.store(true);
    WakeLocked();
  }
  started_cv_.notify_all();  // WaitPosted returns
  if (thread_.joinable()) thread_.join();
}

void UcxTransport::Core::DestroyUcx() {
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

template <typename F>
auto UcxTransport::Core::OnProgressThread(F&& fn) -> decltype(fn()) {
  using R = decltype(fn());
  auto task = std::make_shared<std::packaged_task<R()>>(std::forward<F>(fn));
  auto result = task->get_future();
  {
    std::lock_guard<std::mutex> lock(mu_);
    tasks_.push_back([task] { (*task)(); });
    WakeLocked();
  }
  return result.get();
}

void UcxTransport::Core::WaitPosted() {
  if (t_progress_core == this) {
    // A completion (this thread holds the role): start what was posted now,
    // rather than when the completion returns, so that a reply does not
    // wait for the work its sender goes on with.
    StartPosted(/*defer=*/true);
    return;
  }
  std::unique_lock<std::mutex> lock(mu_);
  // What is queued goes with the next batch; a batch taken but not started
  // yet may hold this thread's operations too.
  const uint64_t target = batches_taken_ + (posted_.empty() ? 0 : 1);
  if (batches_started_ >= target || stopping_.load()) return;
  ++posted_waiters_;
  started_cv_.wait_for(lock, std::chrono::seconds(1), [&] { return batches_started_ >= target || stopping_.load(); });
  --posted_waiters_;
}

Transport::Progressed UcxTransport::Core::Progress() {
  using P = Transport::Progressed;
  if (t_progress_core == this) return P::kBusy;  // a completion: the round that runs it goes on when it returns
  std::unique_lock<std::mutex> role(role_mu_, std::try_to_lock);
  if (!role || stopping_.load()) return P::kBusy;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!connected_) return P::kBusy;
  }
  // This thread may be another transport's progress thread, in one of its
  // completions: it gets that role back.
  const void* const outer = t_progress_core;
  t_progress_core = this;
  bool active = RunQueued();
  active = ProgressAll() || active;
  HandleFailures();
  t_progress_core = outer;
  if (polled_sends_ > 0) {
    // Sends waiting for room in a FIFO raise no event: the progress thread
    // must not sleep through them once this caller stops.
    std::lock_guard<std::mutex> lock(mu_);
    if (sleeping_) WakeLocked();
  }
  return active ? P::kActive : P::kIdle;
}

void UcxTransport::Core::WakeLocked() {
  work_.store(true, std::memory_order_release);
  if (sleeping_) {
    const uint64_t one = 1;
    [[maybe_unused]] const ssize_t n = write(wake_fd_, &one, sizeof(one));
  }
}

// ---------------------------------------------------------------------------
// Connect.

Status UcxTransport::Core::Connect(int rank, int size, const std::vector<std::string>& addresses, milliseconds timeout,
                                   const std::function<bool()>& cancelled) {
  if (connect_called_.exchange(true)) return FailedPrecondition("ucx: Connect was already called");
  if (size < 1 || size > kMaxRanks) {
    return InvalidArgument("ucx: group size {} is out of range (1 to {})", size, kMaxRanks);
  }
  if (rank < 0 || rank >= size) return InvalidArgument("ucx: rank {} is out of range for a group of {}", rank, size);
  if (addresses.size() != static_cast<size_t>(size)) {
    return InvalidArgument("ucx: {} peer addresses for a group of {}", addresses.size(), size);
  }
  const auto deadline = Clock::now() + std::min(timeout, kMaxWait);

  std::vector<std::unique_ptr<Peer>> peers(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    auto p = std::make_unique<Peer>();
    p->rank = r;
    if (const std::string error = DecodeIdentity(addresses[static_cast<size_t>(r)], &p->id); !error.empty()) {
      return InvalidArgument("ucx: the address of rank {} is not a Tandem UCX address: {}", r, error);
    }
    p->same_host = p->id.hostname == self_.hostname && p->id.boot_id == self_.boot_id;
    p->pid_check =
        p->same_host && self_.pid_namespace != 0 && p->id.pid_namespace == self_.pid_namespace && p->id.pid != 0;
    // UCX's shared-memory transports wake a sleeping receiver through an
    // abstract Unix socket, and those exist per network namespace: across
    // namespaces every wake-up is lost (sendto fails with ECONNREFUSED, which
    // UCX ignores), so the receiver would only see its data when the progress
    // thread next woke on its own. Such a peer is another (simulated) node.
    const bool same_net_namespace =
        self_.net_namespace == 0 || p->id.net_namespace == 0 || p->id.net_namespace == self_.net_namespace;
    const bool shm_possible = p->same_host && !self_.shm_address.empty() && !p->id.shm_address.empty();
    const bool net_possible = !self_.net_address.empty() && !p->id.net_address.empty();
    p->shm_expected = shm_possible && same_net_namespace;
    if (shm_possible && p->pid_check && (same_net_namespace || !net_possible)) {
      p->shm = true;
      p->shm_without_wakeups = !same_net_namespace;  // no other way: works, slowly (warned in SelfCheck)
    } else if (p->same_host) {
      if (self_.shm_address.empty()) {
        p->network_reason = "this rank has no shared-memory transport";
      } else if (p->id.shm_address.empty()) {
        p->network_reason = fmt::format("rank {} has no shared-memory transport", r);
      } else if (!same_net_namespace) {
        p->network_reason = "it runs in another network namespace (UCX's shared-memory wake-ups do not cross it)";
      } else {
        p->network_reason = "it runs in another PID namespace, where its death could not be detected";
      }
    }
    if (!p->shm && !net_possible) {
      return Unavailable(
          "ucx: cannot reach rank {} on host {}: {}", r, p->id.hostname,
          p->same_host ? p->network_reason + ", and there is no common network transport"
          : self_.net_address.empty()
              ? fmt::format("it is on another host and this rank has no network transport (tls '{}')", options_.tls)
              : std::string("it is on another host and has no network transport"));
    }
    peers[static_cast<size_t>(r)] = std::move(p);
  }

  TANDEM_RETURN_IF_ERROR(OnProgressThread([&] { return CreateEndpoints(std::move(peers)); }));
  {
    std::lock_guard<std::mutex> lock(mu_);
    rank_.store(rank);
    size_.store(size);
    connected_ = true;
  }
  // Goodbye receives: a peer that closes its transport says so.
  OnProgressThread([&] {
    for (auto& p : peers_) {
      if (!p) continue;
      p->bye_recv = std::make_shared<Op>(Op::Kind::kRecv, p->rank, kByeTag, true, &p->bye_buffer, sizeof(uint64_t));
      Start(p->bye_recv);
    }
  });

  // Handshake: every rank sends (magic, rank, size, pid) to every peer and waits for theirs.
  struct Hello {
    uint32_t magic, rank, size, pid;
  };
  const Hello mine{kHelloMagic, static_cast<uint32_t>(rank), static_cast<uint32_t>(size), self_.pid};
  std::vector<Hello> theirs(static_cast<size_t>(size));
  std::vector<std::unique_ptr<Request>> recvs(static_cast<size_t>(size));
  std::vector<std::unique_ptr<Request>> sends(static_cast<size_t>(size));
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    recvs[static_cast<size_t>(r)] =
        Submit(Op::Kind::kRecv, r, kHelloTag, true, &theirs[static_cast<size_t>(r)], sizeof(Hello));
    sends[static_cast<size_t>(r)] =
        Submit(Op::Kind::kSend, r, kHelloTag, true, const_cast<Hello*>(&mine), sizeof(Hello));
  }
  auto remaining = [&] {
    return std::max(milliseconds(0), std::chrono::duration_cast<milliseconds>(deadline - Clock::now()));
  };
  // On failure the transport is unusable: fail every peer, so that the handshake
  // requests still in flight are released at once.
  auto abandon = [&](Status error) {
    OnProgressThread([&] {
      for (auto& p : peers_) {
        if (p) FailPeer(p->rank, fmt::format("the handshake of rank {} failed", rank));
      }
    });
    return error;
  };
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    const auto i = static_cast<size_t>(r);
    for (auto* req : {&recvs[i], &sends[i]}) {
      Status s;
      if (cancelled) {
        // In slices, so that a stopping process does not wait out the timeout.
        while (true) {
          s = (*req)->Wait(std::min(remaining(), milliseconds(50)));
          if (s.code() != StatusCode::kDeadlineExceeded || remaining() <= milliseconds(0)) break;
          if (cancelled()) {
            return abandon(Cancelled("ucx: the handshake of rank {} with rank {} was cancelled", rank, r));
          }
        }
      } else {
        s = (*req)->Wait(remaining());
      }
      if (s.code() == StatusCode::kDeadlineExceeded) {
        return abandon(DeadlineExceeded(
            "ucx: rank {} did not complete the handshake with rank {} within {} ms (is rank {} running and "
            "connecting to the same group?)",
            rank, r, timeout.count(), r));
      }
      if (!s.ok()) {
        return abandon(
            Status(s.code(), fmt::format("ucx: handshake of rank {} with rank {}: {}", rank, r, s.message())));
      }
    }
    const Hello& h = theirs[i];
    if (h.magic != kHelloMagic || h.rank != static_cast<uint32_t>(r) || h.size != static_cast<uint32_t>(size)) {
      return abandon(InvalidArgument(
          "ucx: rank {} answered the handshake as rank {} of a group of {}; rank {} expected rank {} of {} (do all "
          "ranks use the same address list?)",
          r, h.rank, h.size, rank, r, size));
    }
  }

  OnProgressThread([&] { SelfCheck(); });
  return Status::Ok();
}

Status UcxTransport::Core::CreateEndpoints(std::vector<std::unique_ptr<Peer>> peers) {
  for (auto& p : peers) {
    if (!p) continue;
    p->error_arg = {this, p->rank};
    auto create = [&](bool shm) -> ucs_status_t {
      ucp_ep_params_t params{};
      params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
      const std::string& address = shm ? p->id.shm_address : p->id.net_address;
      params.address = reinterpret_cast<const ucp_address_t*>(address.data());
      if (shm) {
        // posix/sysv have no peer-failure handling in UCX 1.13; the pid check covers these peers.
        params.err_mode = UCP_ERR_HANDLING_MODE_NONE;
      } else {
        params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
        params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
        params.err_handler.cb = &OnEpError;
        params.err_handler.arg = &p->error_arg;
      }
      p->worker = shm ? shm_.worker : net_.worker;
      return ucp_ep_create(p->worker, &params, &p->ep);
    };
    ucs_status_t st = create(p->shm);
    if (st != UCS_OK && p->shm && !self_.net_address.empty() && !p->id.net_address.empty()) {
      p->shm = false;
      p->network_reason = fmt::format("shared memory is unreachable (UCX: {})", ucs_status_string(st));
      st = create(false);
    }
    if (st != UCS_OK) {
      p->ep = nullptr;
      Status error = Unavailable("ucx: cannot create an endpoint to rank {} on host {}: {}", p->rank, p->id.hostname,
                                 ucs_status_string(st));
      for (auto& q : peers) {
        if (q && q->ep != nullptr) CloseEndpoint(*q, /*force=*/!q->shm);
      }
      std::lock_guard<std::mutex> lock(mu_);
      peers_ = std::move(peers);  // kept: UCX may still call back with their error arguments
      return error;
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  peers_ = std::move(peers);
  return Status::Ok();
}

void UcxTransport::Core::SelfCheck() {
  std::vector<std::string> lines;
  const int self = rank_.load();
  for (auto& p : peers_) {
    if (!p || p->ep == nullptr) continue;
    const EndpointPaths paths = ParseEndpointInfo(EndpointInfoText(p->ep));
    const std::string where = p->shm         ? "same host, shared memory"
                              : p->same_host ? "same host, network: " + p->network_reason
                                             : "host " + p->id.hostname;
    const std::string death =
        p->shm ? fmt::format("pid check every {} ms", options_.liveness_interval.count())
               : fmt::format("UCX error handling, keepalive every {} ms{}", options_.keepalive_interval.count(),
                             p->pid_check ? ", and pid check" : "");
    lines.push_back(
        fmt::format("rank {} -> rank {} ({}): {}; peer death: {}", self, p->rank, where, paths.Describe(), death));
    spdlog::info("ucx: {}", lines.back());
    if (p->same_host && !p->shm && p->shm_expected) {
      spdlog::warn("ucx: rank {} -> rank {} is on this host but uses {} instead of shared memory: {}", self, p->rank,
                   paths.Lanes("am", "am_bw"), p->network_reason);
    }
    if (p->shm_without_wakeups) {
      spdlog::warn(
          "ucx: rank {} -> rank {} runs in another network namespace and the two have no common network transport: "
          "shared memory, whose wake-ups do not cross network namespaces, so a message may wait up to {} ms",
          self, p->rank, options_.liveness_interval.count());
    }
    if (p->shm && paths.HasNetworkLane()) {
      spdlog::warn("ucx: rank {} -> rank {} is on this host but UCX gave its endpoint a network lane ({})", self,
                   p->rank, paths.Describe());
    }
    if (!p->same_host && paths.OnlyTcp() && self_.has_verbs && p->id.has_verbs) {
      spdlog::warn(
          "ucx: rank {} -> rank {} (host {}) uses TCP although both hosts have verbs devices (check tls "
          "and net_devices)",
          self, p->rank, p->id.hostname);
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  summaries_ = std::move(lines);
}

std::vector<std::string> UcxTransport::Core::PathSummary() const {
  std::lock_guard<std::mutex> lock(mu_);
  return summaries_;
}

// ---------------------------------------------------------------------------
// Operations: caller side.

std::unique_ptr<Request> UcxTransport::Core::Submit(Op::Kind kind, int peer, uint64_t tag, bool internal, void* data,
                                                    size_t bytes, Transport::Completion done) {
  const char* what = kind == Op::Kind::kSend ? "send" : "receive";
  const int self = rank_.load();
  const int n = size_.load();
  auto op = std::make_shared<Op>(kind, peer, tag, internal, data, bytes);
  op->callback = std::move(done);
  Status refused;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!connected_) {
      refused = FailedPrecondition("ucx: {} before Connect", what);
    } else if (peer < 0 || peer >= n || peer == self) {
      refused = InvalidArgument("ucx: rank {} cannot {} rank {} (the group has ranks 0 to {})", self,
                                kind == Op::Kind::kSend ? "send to" : "receive from", peer, n - 1);
    } else if (!internal && !TagFits(tag)) {
      refused = InvalidArgument(
          "ucx: tag {:#x} does not fit: a UCX tag may use bit 63 and bits 0 to {} (at most {:#x} without bit 63)", tag,
          kUserTagBits - 1, kMaxUserTag);
    } else if (bytes > 0 && data == nullptr) {
      refused = InvalidArgument("ucx: {} of {} bytes with a null buffer", what, bytes);
    } else if (stopping_.load()) {
      refused = Cancelled("ucx: the transport of rank {} is closing", self);
    } else if (const Peer& p = *peers_[static_cast<size_t>(peer)]; p.dead && kind == Op::Kind::kSend) {
      refused = GoneStatus(*op, p.reason);
    }
    if (refused.ok() || (op->callback && !stopping_.load())) {
      // A refused operation with a completion is finished by the progress
      // thread, so the completion never runs inside this call.
      op->refused = refused;
      posted_.push_back(op);
      WakeLocked();
      return std::make_unique<UcxRequest>(shared_from_this(), std::move(op));
    }
  }
  if (!op->callback) return Completed(std::move(refused));
  op->refused = refused;  // a Drop before it finishes must not look at its peer
  // A closing transport (its destructor runs: nothing should post now) may
  // have no progress thread left to run the completion on. It runs on a
  // thread of its own, never inside this call (the caller may hold locks the
  // completion takes); dropping the request waits for it, as ever.
  std::thread([core = shared_from_this(), op, refused] { core->Finish(*op, refused); }).detach();
  return std::make_unique<UcxRequest>(shared_from_this(), std::move(op));
}

Status UcxTransport::Core::Wait(Op& op, milliseconds timeout) {
  timeout = std::clamp(timeout, milliseconds(0), kMaxWait);
  const auto deadline = Clock::now() + timeout;
  DriveWhileWaiting(
      op.bytes, [this] { return Progress(); },
      [&] {
        std::lock_guard<std::mutex> lock(mu_);
        return op.done;
      },
      deadline);
  std::unique_lock<std::mutex> lock(mu_);
  if (!op.cv.wait_until(lock, deadline, [&] { return op.done; })) {
    return DeadlineExceeded("rank {} waited {} ms for rank {} ({}); the request is still pending", rank_.load(),
                            timeout.count(), op.peer, Describe(op));
  }
  return op.status;
}

void UcxTransport::Core::Drop(const std::shared_ptr<Op>& op) {
  std::unique_lock<std::mutex> lock(mu_);
  // On the progress thread nothing is waited for: the completion that runs
  // there (perhaps the caller itself) runs later or is running now.
  if (op->done) {
    if (t_progress_core != this) op->cv.wait(lock, [&] { return !op->in_callback; });
    return;
  }
  op->dropped = true;
  cancels_.push_back(op);
  WakeLocked();
  if (t_progress_core == this) return;
  const bool network_send =
      op->kind == Op::Kind::kSend && op->refused.ok() && !peers_[static_cast<size_t>(op->peer)]->shm;
  while (!op->cv.wait_for(lock, options_.abandon_timeout, [&] { return op->done && !op->in_callback; })) {
    if (op->done) {
      spdlog::warn("ucx: rank {} is still waiting for the completion of a dropped {} with rank {} to return",
                   rank_.load(), Describe(*op), op->peer);
    } else if (network_send) {
      const std::string reason =
          fmt::format("it did not take a dropped {} within {} ms, so rank {} closed the connection", Describe(*op),
                      options_.abandon_timeout.count(), rank_.load());
      tasks_.push_back([this, peer = op->peer, reason] { FailPeer(peer, reason); });
      WakeLocked();
    } else {
      spdlog::warn("ucx: rank {} is still waiting for rank {} to take a dropped {} (UCX holds its buffer)",
                   rank_.load(), op->peer, Describe(*op));
    }
  }
}

// ---------------------------------------------------------------------------
// Operations: progress thread.

void UcxTransport::Core::Start(const std::shared_ptr<Op>& op) {
  if (!op->refused.ok()) {  // its peer may not exist
    Finish(*op, op->refused);
    return;
  }
  Peer& p = *peers_[static_cast<size_t>(op->peer)];
  bool dead = false;
  bool dropped = false;
  std::string reason;
  {
    std::lock_guard<std::mutex> lock(mu_);
    dead = p.dead;
    reason = p.reason;
    dropped = op->dropped && !op->done;  // dropped before it was posted
  }
  if (dropped) {
    Finish(*op, Cancelled("ucx: the {} with rank {} was dropped before it started", Describe(*op), op->peer));
    return;
  }
  if (op->kind == Op::Kind::kSend && (dead || p.ep == nullptr)) {
    Finish(*op, GoneStatus(*op, reason.empty() ? "its endpoint is closed" : reason));
    return;
  }
  op->core = this;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.user_data = op.get();
  void* request = nullptr;
  if (op->kind == Op::Kind::kSend) {
    param.cb.send = &OnSendDone;
    request = ucp_tag_send_nbx(p.ep, op->data, op->bytes, UcxTag(rank_.load(), op->tag, op->internal), &param);
    if (request == nullptr) {  // done at once (eager, data copied out)
      Finish(*op, Status::Ok());
      return;
    }
  } else {
    // Never complete at once: only the callback reports the sender's length.
    param.op_attr_mask |= UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    param.cb.recv = &OnRecvDone;
    request =
        ucp_tag_recv_nbx(p.worker, op->data, op->bytes, UcxTag(op->peer, op->tag, op->internal), kFullMask, &param);
  }
  if (IsUcsError(request)) {
    Finish(*op, ErrorStatus(*op, UcsStatusOf(request)));
    return;
  }
  if (op->ucx_done) {  // the callback ran inside the call
    ucp_request_free(request);
    Complete(*op);
    return;
  }
  op->request = request;
  inflight_.emplace(op.get(), op);
  if (op->kind == Op::Kind::kSend && p.shm && plan_.shm_eager_only && !dead) {
    op->polled = true;
    ++polled_sends_;
  }
  if (dead && op->kind == Op::Kind::kRecv) {
    // The peer is gone: only data it sent before dying (already delivered) can match.
    ucp_request_cancel(p.worker, request);
    Finish(*op, GoneStatus(*op, reason));
  }
}

void UcxTransport::Core::Cancel(const std::shared_ptr<Op>& op) {
  if (op->kind == Op::Kind::kRecv && op->request != nullptr) {
    ucp_request_cancel(peers_[static_cast<size_t>(op->peer)]->worker, op->request);
  }
  // Sends cannot be cancelled in UCX: they complete, or fail with their peer.
}

void UcxTransport::Core::OnUcxDone(Op* op, void* request, ucs_status_t status, size_t length) {
  if (op->polled) {
    op->polled = false;
    --polled_sends_;
  }
  op->ucx_done = true;
  op->ucx_status = status;
  op->length = length;
  if (op->request == nullptr) return;  // completed inside the posting call: Start() frees the request
  op->request = nullptr;
  ucp_request_free(request);
  Complete(*op);
  inflight_.erase(op);  // may destroy *op
}

void UcxTransport::Core::Complete(Op& op) {
  Status status;
  if (op.kind == Op::Kind::kRecv && (op.ucx_status == UCS_OK || op.ucx_status == UCS_ERR_MESSAGE_TRUNCATED)) {
    if (op.ucx_status == UCS_ERR_MESSAGE_TRUNCATED || op.length != op.bytes) {
      status = InvalidArgument(
          "rank {} sent {} bytes with tag {}, rank {} expected {} (do the ranks agree on count "
          "and dtype?)",
          op.peer, op.length, op.tag, rank_.load(), op.bytes);
    }
  } else if (op.ucx_status != UCS_OK) {
    status = ErrorStatus(op, op.ucx_status);
  }
  if (op.internal && op.tag == kByeTag && op.kind == Op::Kind::kRecv && status.ok()) {
    failures_.emplace_back(op.peer, kClosedReason);
  }
  Finish(op, std::move(status));
}

void UcxTransport::Core::Finish(Op& op, Status status) {
  // The waiter is woken after the lock is released: woken under it, it would
  // run only to block on mu_ and be woken a second time (two context
  // switches more per operation, on every hand-off of the data path). The
  // reference keeps the op, and so its cv, alive until the notification,
  // even if the waiter returns and drops its request at once.
  // A completion runs after the op is done (so Wait returns) but before a
  // thread dropping its Request returns (in_callback).
  const std::shared_ptr<Op> keep = op.shared_from_this();
  if (t_deferring_core == this) {
    // Started inside a completion: its own completion runs after that one
    // returns, at the start of the next round.
    deferred_.emplace_back(keep, std::move(status));
    return;
  }
  Transport::Completion callback;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (op.done) return;
    op.done = true;
    op.status = status;
    callback = std::move(op.callback);
    op.in_callback = static_cast<bool>(callback);
  }
  if (callback) {
    callback(status);
    std::lock_guard<std::mutex> lock(mu_);
    op.in_callback = false;
  }
  op.cv.notify_all();
  // `callback` (and what it holds) is released here, after the op is
  // complete: what it releases may drop Requests, which then return at once.
}

Status UcxTransport::Core::GoneStatus(const Op& op, const std::string& reason) const {
  return Unavailable("rank {} is gone ({} by rank {}): {}", op.peer, Describe(op), rank_.load(), reason);
}

Status UcxTransport::Core::ErrorStatus(const Op& op, ucs_status_t status) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    const Peer& p = *peers_[static_cast<size_t>(op.peer)];
    if (p.dead) return GoneStatus(op, p.reason);
  }
  if (status == UCS_ERR_CANCELED) {
    if (stopping_.load()) {
      return Cancelled("ucx: rank {} closed its transport with a {} with rank {} in flight", rank_.load(), Describe(op),
                       op.peer);
    }
    return Cancelled("ucx: the {} with rank {} was cancelled (its request was dropped)", Describe(op), op.peer);
  }
  return Unavailable("rank {} is unreachable ({} by rank {}): UCX reported '{}'", op.peer, Describe(op), rank_.load(),
                     ucs_status_string(status));
}

void UcxTransport::Core::OnEndpointError(int rank, ucs_status_t status) {
  failures_.emplace_back(rank, fmt::format("UCX reported '{}' on its endpoint", ucs_status_string(status)));
}

void UcxTransport::Core::HandleFailures() {
  while (!failures_.empty()) {
    auto [rank, reason] = std::move(failures_.front());
    failures_.pop_front();
    const Peer& p = *peers_[static_cast<size_t>(rank)];
    if (reason != kClosedReason && p.pid_check && p.id.pid != self_.pid) {
      // A connection that broke on this host: say why if the process is gone.
      if (const std::string why = ProcessGone(p.id.pid, p.id.start_ticks, p.id.hostname); !why.empty()) {
        reason = fmt::format("{} ({})", why, reason);
      }
    }
    FailPeer(rank, reason);
  }
}

void UcxTransport::Core::FailPeer(int rank, const std::string& reason) {
  Peer& p = *peers_[static_cast<size_t>(rank)];
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (p.dead) return;
    p.dead = true;
    p.reason = reason;
  }
  if (stopping_.load()) {
  } else if (reason == kClosedReason) {
    spdlog::info("ucx: rank {} -> rank {}: {}", rank_.load(), rank, reason);
  } else {
    spdlog::warn("ucx: rank {} lost rank {}: {}", rank_.load(), rank, reason);
  }
  // Deliver what the peer sent before it went away; after this nothing more can arrive from it.
  Drain();
  std::vector<std::shared_ptr<Op>> ops;
  for (const auto& [raw, op] : inflight_) {
    if (op->peer == rank) ops.push_back(op);
  }
  for (const auto& op : ops) {
    if (op->kind == Op::Kind::kRecv && op->request != nullptr) ucp_request_cancel(p.worker, op->request);
  }
  if (!p.shm && p.ep != nullptr) CloseEndpoint(p, /*force=*/true);  // releases its sends
  for (const auto& op : ops) {
    if (op->polled) {
      op->polled = false;
      --polled_sends_;
    }
    Finish(*op, GoneStatus(*op, reason));
  }
}

void UcxTransport::Core::CloseEndpoint(Peer& p, bool force) {
  ucp_request_param_t param{};
  if (force) {
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  }
  void* request = ucp_ep_close_nbx(p.ep, &param);
  p.ep = nullptr;
  if (request != nullptr && !IsUcsError(request)) closing_.push_back(request);
}

void UcxTransport::Core::CheckPeers() {
  for (auto& p : peers_) {
    if (!p || !p->pid_check || p->id.pid == self_.pid) continue;  // ranks in this process live as long as it does
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (p->dead) continue;
    }
    const std::string why = ProcessGone(p->id.pid, p->id.start_ticks, p->id.hostname);
    if (!why.empty()) FailPeer(p->rank, why);
  }
}

// ---------------------------------------------------------------------------
// The progress thread.

bool UcxTransport::Core::RunQueued() {
  bool active = RunDeferred();
  if (!work_.load(std::memory_order_acquire)) return active;
  std::vector<std::shared_ptr<Op>> cancels;
  std::vector<std::function<void()>> tasks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    cancels.swap(cancels_);
    tasks.swap(tasks_);
    work_.store(false, std::memory_order_relaxed);
  }
  active = StartPosted(/*defer=*/false) || active;
  for (auto& op : cancels) Cancel(op);
  for (auto& task : tasks) task();
  return active || !cancels.empty() || !tasks.empty();
}

bool UcxTransport::Core::StartPosted(bool defer) {
  uint64_t batch = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!posted_.empty()) {
      batch = ++batches_taken_;
      for (auto& op : posted_) starting_.push_back(std::move(op));
      posted_.clear();
    }
  }
  {
    // Restores the outer value however the loop ends.
    struct Deferring {
      const void* outer = t_deferring_core;
      ~Deferring() { t_deferring_core = outer; }
    } deferring;
    if (defer) t_deferring_core = this;
    // A completion run by a Start below may start operations itself
    // (WaitPosted): it takes them from starting_ in the same order.
    while (!starting_.empty()) {
      std::shared_ptr<Op> op = std::move(starting_.front());
      starting_.pop_front();
      Start(op);
    }
  }
  // Deferred completions: a caller's round may be the last for a while.
  const bool wake = defer && !deferred_.empty();
  if (batch != 0 || wake) {
    bool waiters = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (batch != 0) batches_started_ = std::max(batches_started_, batch);
      waiters = batch != 0 && posted_waiters_ > 0;
      if (wake) WakeLocked();
    }
    if (waiters) started_cv_.notify_all();
  }
  return batch != 0;
}

bool UcxTransport::Core::RunDeferred() {
  if (deferred_.empty()) return false;
  std::vector<std::pair<std::shared_ptr<Op>, Status>> ended;
  ended.swap(deferred_);
  for (auto& [op, status] : ended) Finish(*op, std::move(status));
  return true;
}

bool UcxTransport::Core::ProgressAll() {
  unsigned events = 0;
  for (ucp_worker_h w : workers_) {
    for (int i = 0; i < 64; ++i) {
      const unsigned n = ucp_worker_progress(w);
      if (n == 0) break;
      events += n;
    }
  }
  if (!closing_.empty()) {
    std::erase_if(closing_, [](void* r) {
      if (ucp_request_check_status(r) == UCS_INPROGRESS) return false;
      ucp_request_free(r);
      return true;
    });
  }
  return events > 0;
}

void UcxTransport::Core::Drain() {
  for (int i = 0; i < 1000 && ProgressAll(); ++i) {
  }
}

void UcxTransport::Core::Sleep(std::unique_lock<std::mutex>& role, Clock::duration max) {
  for (ucp_worker_h w : workers_) {
    const ucs_status_t st = ucp_worker_arm(w);
    if (st == UCS_ERR_BUSY) return;  // events pending: progress first
    if (st != UCS_OK) {              // no wake-up support: poll gently
      std::this_thread::sleep_for(microseconds(100));
      return;
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (work_.load() || stopping_.load()) return;
    sleeping_ = true;
  }
  role.unlock();  // a caller may make progress meanwhile
  const auto ms = std::chrono::duration_cast<milliseconds>(max).count() + 1;
  epoll_event events[4];
  epoll_wait(epoll_fd_, events, 4, static_cast<int>(std::clamp<int64_t>(ms, 1, 1000)));
  {
    std::lock_guard<std::mutex> lock(mu_);
    sleeping_ = false;
  }
  uint64_t value = 0;
  while (read(wake_fd_, &value, sizeof(value)) > 0) {
  }
}

void UcxTransport::Core::Run() {
  auto last_activity = Clock::now();
  auto next_check = last_activity + options_.liveness_interval;
  while (!stopping_.load()) {
    std::unique_lock<std::mutex> role(role_mu_, std::try_to_lock);
    if (!role) {
      // A caller is making progress (Progress()) and stops once its own
      // operation is done: stay awake to take over.
      last_activity = Clock::now();
      std::this_thread::yield();
      continue;
    }
    bool active = RunQueued();
    active = ProgressAll() || active;
    HandleFailures();
    const auto now = Clock::now();
    if (now >= next_check) {
      CheckPeers();
      next_check = now + options_.liveness_interval;
    }
    if (active) {
      last_activity = now;
      continue;
    }
    if (options_.progress == UcxProgressMode::kBusyPoll || polled_sends_ > 0 || now - last_activity < options_.spin) {
      // Nothing this round: let a thread waiting for this core run (on a
      // busy host it is often the one that consumes what arrives). Costs
      // one system call when no other thread is runnable.
      role.unlock();
      std::this_thread::yield();
      continue;
    }
    Sleep(role, next_check - now);
    last_activity = Clock::now();
  }
  Teardown();
}

void UcxTransport::Core::Teardown() {
  const std::lock_guard<std::mutex> role(role_mu_);  // waits for a caller's round (Progress() does no more)
  t_quiet_ucx_warnings = true;
  const auto deadline = Clock::now() + options_.close_timeout;
  auto until = [&](const std::function<bool()>& done) {
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
      std::lock_guard<std::mutex> lock(mu_);
      posted.swap(posted_);
    }
    for (auto& op : posted) {
      Finish(*op, Cancelled("ucx: rank {} closed its transport before the {} with rank {} started", rank_.load(),
                            Describe(*op), op->peer));
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
      std::lock_guard<std::mutex> lock(mu_);
      if (p->dead) continue;
    }
    auto op = std::make_shared<Op>(Op::Kind::kSend, p->rank, kByeTag, true, const_cast<uint64_t*>(&bye), sizeof(bye));
    Start(op);
    byes.push_back(op);
  }
  until([&] {
    std::lock_guard<std::mutex> lock(mu_);
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
      std::lock_guard<std::mutex> lock(mu_);
      dead = p->dead;
    }
    CloseEndpoint(*p, /*force=*/dead && !p->shm);
  }
  until([&] { return closing_.empty(); });
  for (void* r : closing_) ucp_request_free(r);  // released when UCX is done with it
  closing_.clear();
  // Whatever UCX still holds (operations with dead peers) ends with the workers.
  for (const auto& [raw, op] : inflight_) {
    Finish(*op, Cancelled("ucx: rank {} closed its transport with a {} with rank {} in flight", rank_.load(),
                          Describe(*op), op->peer));
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

// ---------------------------------------------------------------------------
// UcxTransport.

Result<std::unique_ptr<UcxTransport>> UcxTransport::Create(const UcxOptions& options) {
  auto core = std::make_shared<Core>(options);
  TANDEM_RETURN_IF_ERROR(core->Init());
  core->Start();
  return std::unique_ptr<UcxTransport>(new UcxTransport(std::move(core)));
}

UcxTransport::~UcxTransport() {
  core_->Shutdown();
}

std::string UcxTransport::address() const {
  return core_->Address();
}

Status UcxTransport::Connect(int rank, int size, const std::vector<std::string>& peer_addresses,
                             std::chrono::milliseconds timeout, std::function<bool()> cancelled) {
  return core_->Connect(rank, size, peer_addresses, timeout, cancelled);
}

std::vector<std::string> UcxTransport::PathSummary() const {
  return core_->PathSummary();
}

int UcxTransport::rank() const {
  return core_->Rank();
}
int UcxTransport::size() const {
  return core_->Size();
}

std::unique_ptr<Request> UcxTransport::Send(int peer, uint64_t tag, const void* data, size_t bytes) {
  return core_->Submit(Op::Kind::kSend, peer, tag, false, const_cast<void*>(data), bytes);
}

std::unique_ptr<Request> UcxTransport::Recv(int peer, uint64_t tag, void* data, size_t bytes) {
  return core_->Submit(Op::Kind::kRecv, peer, tag, false, data, bytes);
}

std::unique_ptr<Request> UcxTransport::SendAsync(int peer, uint64_t tag, const void* data, size_t bytes,
                                                 Completion done) {
  return core_->Submit(Op::Kind::kSend, peer, tag, false, const_cast<void*>(data), bytes, std::move(done));
}

std::unique_ptr<Request> UcxTransport::RecvAsync(int peer, uint64_t tag, void* data, size_t bytes, Completion done) {
  return core_->Submit(Op::Kind::kRecv, peer, tag, false, data, bytes, std::move(done));
}

void UcxTransport::WaitPosted() {
  core_->WaitPosted();
}

Transport::Progressed UcxTransport::Progress() {
  return core_->Progress();
}

}  // namespace tandem::transport
