#include "worker/comm/shm_communicator.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "common/proc_stat.h"
#include "worker/collectives/collectives.h"
#include "worker/collectives/kernels.h"

namespace tandem::comm {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kMagic = 0x54414e44454d5348ULL;  // "TANDEMSH"
constexpr uint32_t kVersion = 2;                    // 2: Descriptor.entered_ns
constexpr uint64_t kSets = 2;                       // staging slot sets (D)
constexpr size_t kDescriptors = 8;                  // descriptor ring per rank (> kSets)
constexpr size_t kFailureBytes = 512;               // the first failure's message
constexpr uint32_t kFailureWriting = 1U << 31;

enum class RankState : uint32_t { kEmpty = 0, kAlive = 1, kClosed = 2, kDead = 3 };

struct alignas(64) PaddedCounter {
  std::atomic<uint64_t> value{0};
};

struct Descriptor {
  uint64_t seq;
  uint64_t count;
  uint8_t kind;
  uint8_t dtype;
  uint8_t op;
  uint8_t pad;
  int32_t root;
  int64_t entered_ns;  // when the rank entered the collective (steady clock: one clock for the node)
};

struct alignas(64) RankControl {
  PaddedCounter post;
  PaddedCounter reduced;
  PaddedCounter consumed;
  PaddedCounter entered;  // sequence number of the last collective entered
  alignas(64) std::atomic<uint32_t> state;
  int32_t pid;
  uint64_t start_ticks;  // /proc/<pid>/stat field 22, against pid reuse
  Descriptor descriptors[kDescriptors];
};

struct alignas(64) ChannelControl {
  PaddedCounter head;      // chunks written by the sender
  PaddedCounter tail;      // chunks read by the receiver
  PaddedCounter mismatch;  // 0, or 1 + the bytes the receiver expected
  struct {
    uint64_t total;  // bytes of the whole message
    uint64_t bytes;  // bytes of this chunk
  } slots[2];
};

struct alignas(64) Header {
  uint64_t magic;
  uint32_t version;
  uint32_t size;
  uint64_t epoch;
  uint64_t round_bytes;
  uint64_t p2p_slot_bytes;
  uint64_t total_bytes;
  std::atomic<uint32_t> attached;
  std::atomic<uint32_t> failed;  // 0, or 1 + the rank that failed first
  uint32_t failure_code;         // its StatusCode
  char failure[kFailureBytes];   // its message
  // Waiters that gave up spinning sleep on `bell` (a futex shared between the
  // processes); whoever publishes progress rings it when `sleepers` > 0.
  alignas(64) std::atomic<uint32_t> bell;
  std::atomic<uint32_t> sleepers;
};

static_assert(std::atomic<uint64_t>::is_always_lock_free);
static_assert(std::atomic<uint32_t>::is_always_lock_free);

size_t AlignUp(size_t n, size_t a) {
  return (n + a - 1) / a * a;
}

struct Layout {
  size_t controls;  // offset of RankControl[size]
  size_t channels;  // offset of ChannelControl[size * size]
  size_t p2p;       // offset of the channels' data: 2 slots each
  size_t slots;     // offset of the staging slots: size * kSets * 2 * round_bytes
  size_t total;
};

Layout LayoutFor(int size, size_t round_bytes, size_t p2p_slot_bytes) {
  const auto n = static_cast<size_t>(size);
  Layout l{};
  l.controls = AlignUp(sizeof(Header), 4096);
  l.channels = AlignUp(l.controls + n * sizeof(RankControl), 64);
  l.p2p = AlignUp(l.channels + n * n * sizeof(ChannelControl), 4096);
  l.slots = AlignUp(l.p2p + n * n * 2 * p2p_slot_bytes, 4096);
  l.total = l.slots + n * kSets * 2 * round_bytes;
  return l;
}

void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Sleeps while *word == expected, at most `timeout`; cross-process (not private).
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, std::chrono::nanoseconds timeout) {
  struct timespec ts {};
  ts.tv_sec = static_cast<time_t>(timeout.count() / 1000000000);
  ts.tv_nsec = static_cast<long>(timeout.count() % 1000000000);
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void FutexWakeAll(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

// Whether this process may use at least `ranks` CPUs: if not, ranks share
// cores and a waiting rank must give its core up at once.
bool EnoughCores(int ranks) {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return false;
  return CPU_COUNT(&set) >= ranks;
}

std::string RankList(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size(); ++i) out += (i ? ", " : "") + std::to_string(ranks[i]);
  return out;
}

}  // namespace

// The mapped segment and the views into it.
struct ShmSegment {
  std::string name;
  void* base = nullptr;
  size_t bytes = 0;
  Layout layout{};
  int size = 0;
  size_t round_bytes = 0;
  size_t p2p_slot_bytes = 0;

  ~ShmSegment() {
    if (base != nullptr) ::munmap(base, bytes);
  }
  Header* header() const { return static_cast<Header*>(base); }
  RankControl* control(int rank) const {
    return reinterpret_cast<RankControl*>(static_cast<char*>(base) + layout.controls) + rank;
  }
  ChannelControl* channel(int from, int to) const {
    return reinterpret_cast<ChannelControl*>(static_cast<char*>(base) + layout.channels) + from * size + to;
  }
  char* channel_slot(int from, int to, uint64_t k) const {
    const auto index = (static_cast<size_t>(from) * static_cast<size_t>(size) + static_cast<size_t>(to)) * 2 + (k % 2);
    return static_cast<char*>(base) + layout.p2p + index * p2p_slot_bytes;
  }
  char* slot(int rank, uint64_t set, int which) const {
    const auto index = (static_cast<size_t>(rank) * kSets + set) * 2 + static_cast<size_t>(which);
    return static_cast<char*>(base) + layout.slots + index * round_bytes;
  }
};

struct ShmCommunicator::Op {
  Kind kind;
  uint64_t seq;
  size_t count;
  DType dtype;
  ReduceOp op;
  int root;
};

namespace {

Result<std::unique_ptr<ShmSegment>> MapSegment(const std::string& name, int fd, size_t bytes, int size,
                                               const ShmOptions& options) {
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) return Unavailable("cannot map shared-memory segment {}: {}", name, std::strerror(errno));
  auto segment = std::make_unique<ShmSegment>();
  segment->name = name;
  segment->base = base;
  segment->bytes = bytes;
  segment->size = size;
  segment->round_bytes = options.round_bytes;
  segment->p2p_slot_bytes = options.p2p_slot_bytes;
  segment->layout = LayoutFor(size, options.round_bytes, options.p2p_slot_bytes);
  return segment;
}

Status CheckOptions(const ShmOptions& o, int size) {
  if (o.round_bytes < 4096 || o.round_bytes % 64 != 0 || o.round_bytes > (1ULL << 30)) {
    return InvalidArgument("shm round_bytes must be a multiple of 64 from 4096 to 1 GiB, got {}", o.round_bytes);
  }
  if (o.small_bytes > o.round_bytes) {
    return InvalidArgument("shm small_bytes ({}) must not exceed round_bytes ({})", o.small_bytes, o.round_bytes);
  }
  if (o.p2p_slot_bytes < 64 || o.p2p_slot_bytes % 64 != 0 || o.p2p_slot_bytes > (64ULL << 20)) {
    return InvalidArgument("shm p2p_slot_bytes must be a multiple of 64 from 64 to 64 MiB, got {}", o.p2p_slot_bytes);
  }
  if (size < 1 || size > 4096) return InvalidArgument("shm communicator size must be 1 to 4096, got {}", size);
  // Every rank needs at least one element of the largest dtype per round.
  if (o.round_bytes / static_cast<size_t>(size) < 8) {
    return InvalidArgument("shm round_bytes {} is too small for {} ranks", o.round_bytes, size);
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<ShmCommunicator>> ShmCommunicator::Create(CommInfo info, Rendezvous& rendezvous,
                                                                 const ShmOptions& options) {
  TANDEM_RETURN_IF_ERROR(CheckOptions(options, info.size));
  if (info.rank < 0 || info.rank >= info.size) {
    return InvalidArgument("rank {} is not in a communicator of {}", info.rank, info.size);
  }
  const Layout layout = LayoutFor(info.size, options.round_bytes, options.p2p_slot_bytes);
  const std::string key = fmt::format("shm/{}/{}", info.name, info.epoch);
  const auto deadline = Clock::now() + info.timeout;
  std::unique_ptr<ShmSegment> segment;
  std::string name;
  if (info.rank == 0) {
    std::random_device random;
    name = fmt::format("/tandem-{}-{:08x}{:08x}", ::getpid(), random(), random());
    const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) return Unavailable("cannot create shared-memory segment {}: {}", name, std::strerror(errno));
    // Reserve the pages now: running out of /dev/shm later would kill the
    // process with SIGBUS in the middle of a collective.
    int rc = ::ftruncate(fd, static_cast<off_t>(layout.total));
    if (rc == 0)
      rc = ::posix_fallocate(fd, 0, static_cast<off_t>(layout.total));
    else
      rc = errno;
    if (rc != 0) {
      ::close(fd);
      ::shm_unlink(name.c_str());
      return ResourceExhausted(
          "communicator \"{}\" needs {} MiB of shared memory for {} ranks and /dev/shm cannot hold it ({}); give the "
          "node or container a larger /dev/shm (in Kubernetes: an emptyDir volume with medium Memory mounted at "
          "/dev/shm) or lower shm round_bytes",
          info.name, layout.total >> 20, info.size, std::strerror(rc));
    }
    auto mapped = MapSegment(name, fd, layout.total, info.size, options);
    ::close(fd);
    if (!mapped.ok()) {
      ::shm_unlink(name.c_str());
      return mapped.status();
    }
    segment = std::move(mapped).value();
    Header* h = segment->header();
    h->version = kVersion;
    h->size = static_cast<uint32_t>(info.size);
    h->epoch = info.epoch;
    h->round_bytes = options.round_bytes;
    h->p2p_slot_bytes = options.p2p_slot_bytes;
    h->total_bytes = layout.total;
    std::atomic_thread_fence(std::memory_order_release);
    std::atomic_ref<uint64_t>(h->magic).store(kMagic, std::memory_order_release);
    if (Status put = rendezvous.Put(key, name); !put.ok()) {
      ::shm_unlink(name.c_str());
      return put.WithContext("publishing the shared-memory segment");
    }
  } else {
    TANDEM_ASSIGN_OR_RETURN(name, rendezvous.Get(key, info.timeout));
    const int fd = ::shm_open(name.c_str(), O_RDWR, 0);
    if (fd < 0) {
      return Unavailable(
          "rank {} of communicator \"{}\" cannot open shared-memory segment {} made by rank 0: {} (are all its ranks "
          "on one node?)",
          info.rank, info.name, name, std::strerror(errno));
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != layout.total) {
      ::close(fd);
      return InvalidArgument(
          "shared-memory segment {} is {} bytes but rank {} expects {}: ranks disagree on the size or shm options of "
          "communicator \"{}\"",
          name, static_cast<long long>(st.st_size), info.rank, layout.total, info.name);
    }
    auto mapped = MapSegment(name, fd, layout.total, info.size, options);
    ::close(fd);
    TANDEM_RETURN_IF_ERROR(mapped.status());
    segment = std::move(mapped).value();
    Header* h = segment->header();
    if (std::atomic_ref<uint64_t>(h->magic).load(std::memory_order_acquire) != kMagic || h->version != kVersion ||
        h->size != static_cast<uint32_t>(info.size) || h->epoch != info.epoch ||
        h->round_bytes != options.round_bytes || h->p2p_slot_bytes != options.p2p_slot_bytes) {
      return InvalidArgument(
          "shared-memory segment {} does not match rank {}: it was made for {} ranks, epoch {}, round {} B, p2p slot "
          "{} "
          "B; this rank expects {} ranks, epoch {}, round {} B, p2p slot {} B",
          name, info.rank, h->size, h->epoch, h->round_bytes, h->p2p_slot_bytes, info.size, info.epoch,
          options.round_bytes, options.p2p_slot_bytes);
    }
  }
  RankControl* me = segment->control(info.rank);
  me->pid = static_cast<int32_t>(::getpid());
  const auto self = ReadProcStat();
  me->start_ticks = self ? self->start_ticks : 0;
  me->state.store(static_cast<uint32_t>(RankState::kAlive), std::memory_order_release);
  segment->header()->attached.fetch_add(1, std::memory_order_acq_rel);

  // Wait for everyone: rank 0 then removes the name, so nothing is left
  // behind in /dev/shm however the processes end.
  const auto n = static_cast<uint32_t>(info.size);
  auto pause = std::chrono::microseconds(50);
  while (segment->header()->attached.load(std::memory_order_acquire) < n) {
    if (rendezvous.cancelled()) {  // the process is stopping
      if (info.rank == 0) ::shm_unlink(name.c_str());
      return Cancelled("communicator \"{}\" (epoch {}): cancelled while waiting for the other ranks to attach",
                       info.name, info.epoch);
    }
    if (Clock::now() >= deadline) {
      std::vector<int> missing;
      for (int r = 0; r < info.size; ++r) {
        if (segment->control(r)->state.load() == static_cast<uint32_t>(RankState::kEmpty)) missing.push_back(r);
      }
      if (info.rank == 0) ::shm_unlink(name.c_str());
      return DeadlineExceeded(
          "communicator \"{}\" (epoch {}): rank{} {} did not attach to the shared segment within {} ms", info.name,
          info.epoch, missing.size() == 1 ? "" : "s", RankList(missing), info.timeout.count());
    }
    std::this_thread::sleep_for(pause);
    pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::milliseconds(5));
  }
  if (info.rank == 0) ::shm_unlink(name.c_str());
  return std::unique_ptr<ShmCommunicator>(new ShmCommunicator(std::move(info), options, std::move(segment)));
}

ShmCommunicator::ShmCommunicator(CommInfo info, const ShmOptions& options, std::unique_ptr<ShmSegment> segment)
    : Communicator(std::move(info)),
      options_(options),
      segment_(std::move(segment)),
      sent_(static_cast<size_t>(size()), 0),
      received_(static_cast<size_t>(size()), 0),
      oversubscribed_(!EnoughCores(size())),
      spin_limit_(oversubscribed_ ? std::chrono::nanoseconds(1000) : std::chrono::nanoseconds(options.spin)),
      spin_budget_(spin_limit_) {}

ShmCommunicator::~ShmCommunicator() {
  RankControl* me = segment_->control(rank());
  uint32_t alive = static_cast<uint32_t>(RankState::kAlive);
  me->state.compare_exchange_strong(alive, static_cast<uint32_t>(RankState::kClosed));
  Ring();
}

void ShmCommunicator::KillForTesting() {
  segment_->control(rank())->state.store(static_cast<uint32_t>(RankState::kDead), std::memory_order_release);
  Ring();
}

void ShmCommunicator::OnAbort() {
  (void)Fail(health());
  Ring();
}

Status ShmCommunicator::Fail(Status status) {
  // Claim the failure slot (marked "being written"), write the code and the
  // message, then publish: readers ignore a claim until it is published.
  Header* h = segment_->header();
  uint32_t none = 0;
  const uint32_t me = static_cast<uint32_t>(rank()) + 1;
  if (h->failed.compare_exchange_strong(none, me | kFailureWriting, std::memory_order_acq_rel)) {
    h->failure_code = static_cast<uint32_t>(status.code());
    std::snprintf(h->failure, sizeof(h->failure), "%s", status.message().c_str());
    h->failed.store(me, std::memory_order_release);
    Ring();
  }
  return status;
}

Status ShmCommunicator::PeerFailure() const {
  const Header* h = segment_->header();
  const uint32_t failed = h->failed.load(std::memory_order_acquire);
  if (failed == 0 || (failed & kFailureWriting) != 0 || static_cast<int>(failed) - 1 == rank()) return Status::Ok();
  char text[kFailureBytes];
  std::memcpy(text, h->failure, sizeof(text));
  text[sizeof(text) - 1] = '\0';
  // The peers fail with the same code as the rank that saw the problem, so
  // every rank reports a dead peer as UNAVAILABLE, a disagreement as
  // INVALID_ARGUMENT, and so on.
  const auto code = h->failure_code != 0 ? static_cast<StatusCode>(h->failure_code) : StatusCode::kAborted;
  return Status(code,
                fmt::format("rank {} reports: {}", failed - 1, text[0] != '\0' ? text : "(no reason recorded yet)"));
}

char* ShmCommunicator::InSlot(int r, uint64_t t) const {
  return segment_->slot(r, t % kSets, 0);
}

char* ShmCommunicator::ResultSlot(int r, uint64_t t) const {
  return segment_->slot(r, t % kSets, 1);
}

namespace {

std::atomic<uint64_t>& CounterOf(RankControl* c, int which) {
  switch (which) {
    case 0:
      return c->post.value;
    case 1:
      return c->reduced.value;
    default:
      return c->consumed.value;
  }
}

const char* CounterName(int which) {
  switch (which) {
    case 0:
      return "posting its data";
    case 1:
      return "reducing its block";
    default:
      return "reading its peers' data";
  }
}

}  // namespace

std::string ShmCommunicator::Laggards(const Op& op, Counter which, uint64_t t, int only_rank) const {
  std::vector<int> never;
  std::vector<int> stuck;
  for (int j = 0; j < size(); ++j) {
    if (j == rank() || (only_rank >= 0 && j != only_rank)) continue;
    RankControl* c = segment_->control(j);
    if (CounterOf(c, static_cast<int>(which)).load(std::memory_order_acquire) >= t) continue;
    (c->entered.value.load(std::memory_order_acquire) < op.seq ? never : stuck).push_back(j);
  }
  std::string out;
  if (!never.empty()) {
    out += fmt::format("rank{} {} never entered this collective within {} ms", never.size() > 1 ? "s" : "",
                       RankList(never), timeout().count());
  }
  if (!stuck.empty()) {
    out += fmt::format("{}rank{} {} entered it but did not finish {}", out.empty() ? "" : "; ",
                       stuck.size() > 1 ? "s" : "", RankList(stuck), CounterName(static_cast<int>(which)));
  }
  return out;
}

Status ShmCommunicator::WaitAll(const Op& op, Counter which, uint64_t t, int only_rank) {
  const int w = static_cast<int>(which);
  auto behind = [&](int j) {
    return j != rank() && (only_rank < 0 || j == only_rank) &&
           CounterOf(segment_->control(j), w).load(std::memory_order_acquire) < t;
  };
  return WaitFor(
      op,
      [&] {
        for (int j = 0; j < size(); ++j) {
          if (behind(j)) return false;
        }
        return true;
      },
      [&] {
        std::vector<int> ranks;
        for (int j = 0; j < size(); ++j) {
          if (behind(j)) ranks.push_back(j);
        }
        return ranks;
      },
      [&] { return Laggards(op, which, t, only_rank); });
}

Status ShmCommunicator::WaitFor(const Op& op, const std::function<bool()>& ready,
                                const std::function<std::vector<int>()>& waiting_on,
                                const std::function<std::string()>& explain) {
  // Spin while the peers are likely running on cores of their own. The
  // budget adapts: it doubles (up to `spin`) when spinning pays off and halves
  // when the wait ends in sleep anyway (the peer was not running: another
  // process has its core), so ranks that share cores hand them over at once.
  if (ready()) return Status::Ok();
  const auto start = Clock::now();
  const auto spin_until = start + spin_budget_;
  for (uint32_t i = 1;; ++i) {
    if (ready()) {
      spin_budget_ = std::min(spin_limit_, spin_budget_ * 2 + std::chrono::nanoseconds(500));
      return Status::Ok();
    }
    CpuRelax();
    if (i % 64 == 0 && Clock::now() >= spin_until) break;
  }
  spin_budget_ /= 2;
  // Ranks that share cores: hand the core to a runnable peer directly a few
  // times before sleeping (a futex wake-up costs a scheduling round trip).
  if (oversubscribed_) {
    for (int i = 0; i < 16; ++i) {
      sched_yield();
      if (ready()) return Status::Ok();
    }
  }
  const auto deadline = start + timeout();
  auto next_liveness = start;
  auto what = [&] {
    return op.kind == Kind::kSend || op.kind == Kind::kRecv
               ? fmt::format("{} of {} bytes with rank {}", KindName(op.kind), op.count, op.root)
               : fmt::format("{} seq {}", KindName(op.kind), op.seq);
  };
  Header* h = segment_->header();
  while (true) {
    if (ready()) return Status::Ok();
    if (aborted()) return health();
    TANDEM_RETURN_IF_ERROR(PeerFailure());
    const auto now = Clock::now();
    if (now >= next_liveness) {
      next_liveness = now + std::chrono::milliseconds(5);
      for (int j : waiting_on()) {
        RankControl* c = segment_->control(j);
        const auto state = static_cast<RankState>(c->state.load(std::memory_order_acquire));
        const bool alive = state == RankState::kAlive && ProcessGone(c->pid, c->start_ticks).empty();
        if (!alive && !ready()) {
          return Fail(Unavailable("communicator \"{}\" (epoch {}): rank {} {} during {} (seen from rank {})", name(),
                                  epoch(), j, state == RankState::kClosed ? "closed the communicator" : "died", what(),
                                  rank()));
        }
      }
    }
    if (now >= deadline) {
      return Fail(DeadlineExceeded("communicator \"{}\" (epoch {}): {} timed out after {} ms on rank {}: {}", name(),
                                   epoch(), what(), timeout().count(), rank(), explain()));
    }
    // Sleep until a peer publishes progress (or 2 ms pass, to look at the
    // clock, the abort flag and the peers' health again).
    const uint32_t bell = h->bell.load(std::memory_order_seq_cst);
    h->sleepers.fetch_add(1, std::memory_order_seq_cst);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (!ready() && !aborted()) FutexWait(&h->bell, bell, std::chrono::milliseconds(2));
    h->sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }
}

void ShmCommunicator::Ring() {
  Header* h = segment_->header();
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (h->sleepers.load(std::memory_order_seq_cst) > 0) {
    h->bell.fetch_add(1, std::memory_order_seq_cst);
    FutexWakeAll(&h->bell);
  }
}

Status ShmCommunicator::Publish(Counter which, uint64_t t) {
  CounterOf(segment_->control(rank()), static_cast<int>(which)).store(t, std::memory_order_release);
  Ring();
  return Status::Ok();
}

Status ShmCommunicator::Enter(const Op& op) {
  RankControl* me = segment_->control(rank());
  Descriptor& d = me->descriptors[op.seq % kDescriptors];
  d.seq = op.seq;
  d.count = op.count;
  d.kind = static_cast<uint8_t>(op.kind);
  d.dtype = static_cast<uint8_t>(op.dtype);
  d.op = static_cast<uint8_t>(op.op);
  d.root = op.root;
  d.entered_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
  me->entered.value.store(op.seq, std::memory_order_release);
  return PeerFailure();
}

// Called after every peer posted the collective's first step, which they do
// after writing its descriptor.
Status ShmCommunicator::CheckDescriptors(const Op& op) {
  const Descriptor& mine = segment_->control(rank())->descriptors[op.seq % kDescriptors];
  for (int j = 0; j < size(); ++j) {
    if (j == rank()) continue;
    const Descriptor theirs = segment_->control(j)->descriptors[op.seq % kDescriptors];
    if (theirs.seq == mine.seq && theirs.kind == mine.kind && theirs.count == mine.count &&
        theirs.dtype == mine.dtype && theirs.op == mine.op && theirs.root == mine.root) {
      continue;
    }
    auto describe = [](const Descriptor& d) {
      return DescribeCollective(static_cast<Kind>(d.kind), d.seq, d.count, static_cast<DType>(d.dtype),
                                static_cast<ReduceOp>(d.op), d.root);
    };
    return Fail(InvalidArgument("communicator \"{}\" (epoch {}): rank {} runs {}, but rank {} runs {}", name(), epoch(),
                                j, describe(theirs), rank(), describe(mine)));
  }
  // Whom it waited for: the rank that entered last, and by how much after
  // the next-to-last (every rank's entry time is in its descriptor).
  if (size() > 1) {
    const auto entered = [&](int j) { return segment_->control(j)->descriptors[op.seq % kDescriptors].entered_ns; };
    int late = 0;
    int64_t last = entered(0);
    int64_t before = std::numeric_limits<int64_t>::min();
    for (int j = 1; j < size(); ++j) {
      const int64_t t = entered(j);
      if (t > last) {
        before = last;
        last = t;
        late = j;
      } else if (t > before) {
        before = t;
      }
    }
    SetLastWait(Wait{late, static_cast<double>(last - before) * 1e-9});
  }
  return Status::Ok();
}

Status ShmCommunicator::BeginStep(const Op& op, uint64_t* t) {
  *t = ++step_;
  if (*t > kSets) return WaitAll(op, Counter::kConsumed, *t - kSets);
  return Status::Ok();
}

// ---------------------------------------------------------------------------
// Collectives

Status ShmCommunicator::DoBarrier(uint64_t seq) {
  const Op op{Kind::kBarrier, seq, 0, DType::kInt32, ReduceOp::kSum, 0};
  TANDEM_RETURN_IF_ERROR(Enter(op));
  uint64_t t = 0;
  TANDEM_RETURN_IF_ERROR(BeginStep(op, &t));
  TANDEM_RETURN_IF_ERROR(Publish(Counter::kPost, t));
  TANDEM_RETURN_IF_ERROR(WaitAll(op, Counter::kPost, t));
  TANDEM_RETURN_IF_ERROR(CheckDescriptors(op));
  return Publish(Counter::kConsumed, t);
}

Status ShmCommunicator::DoAllReduce(uint64_t seq, const void* in, void* out, size_t count, DType dtype,
                                    ReduceOp op_kind) {
  const Op op{Kind::kAllReduce, seq, count, dtype, op_kind, 0};
  TANDEM_RETURN_IF_ERROR(Enter(op));
  return Reduction(op, static_cast<const char*>(in), static_cast<char*>(out), -1);
}

Status ShmCommunicator::DoReduce(uint64_t seq, const void* in, void* out, size_t count, DType dtype, ReduceOp op_kind,
                                 int root) {
  const Op op{Kind::kReduce, seq, count, dtype, op_kind, root};
  TANDEM_RETURN_IF_ERROR(Enter(op));
  return Reduction(op, static_cast<const char*>(in), static_cast<char*>(out), root);
}

// All-reduce (root < 0: every rank gets the result) and reduce (only root).
Status ShmCommunicator::Reduction(const Op& op, const char* src, char* dst, int root) {
  const size_t count = op.count;
  const DType dtype = op.dtype;
  const size_t element = collectives::SizeOf(dtype);
  const size_t bytes = count * element;
  const int n = size();
  const int r = rank();
  const bool all = root < 0;
  std::vector<const void*> srcs(static_cast<size_t>(n));

  if (bytes <= options_.small_bytes || count == 0) {
    // One step: everyone posts its input; the ranks that want the result
    // reduce all slots in rank order.
    uint64_t t = 0;
    TANDEM_RETURN_IF_ERROR(BeginStep(op, &t));
    if (bytes > 0 && (all || r != root)) std::memcpy(InSlot(r, t), src, bytes);
    TANDEM_RETURN_IF_ERROR(Publish(Counter::kPost, t));
    TANDEM_RETURN_IF_ERROR(WaitAll(op, Counter::kPost, t));
    TANDEM_RETURN_IF_ERROR(CheckDescriptors(op));
    if (all || r == root) {
      for (int j = 0; j < n; ++j) srcs[static_cast<size_t>(j)] = j == r ? src : InSlot(j, t);
      collectives::ReduceMany(srcs.data(), n, dst, nullptr, count, dtype, op.op, n);
    }
    return Publish(Counter::kConsumed, t);
  }

  // Rounds, each cut into one block per rank: every rank copies the blocks
  // the others own into its slot, reduces the block it owns (into its output
  // when it wants the result, and into its result slot for the others), then
  // the ranks that want the result copy the others' blocks. Rounds are
  // software-pipelined: a rank copies in round k + 1 before it waits for its
  // peers' results of round k, so that wait overlaps useful work.
  const bool stream = Streaming(bytes);
  const size_t round_count = options_.round_bytes / element;
  const size_t rounds = (count + round_count - 1) / round_count;
  auto copy_in = [&](size_t k, uint64_t step) {
    const size_t base = k * round_count;
    const size_t e = std::min(round_count, count - base);
    char* mine = InSlot(r, step);
    for (int j = 0; j < n; ++j) {
      if (j == r) continue;
      const size_t off = collectives::BlockOffset(e, n, j);
      const size_t cnt = collectives::BlockCount(e, n, j);
      if (cnt > 0) std::memcpy(mine + off * element, src + (base + off) * element, cnt * element);
    }
  };
  uint64_t t = 0;
  TANDEM_RETURN_IF_ERROR(BeginStep(op, &t));
  copy_in(0, t);
  TANDEM_RETURN_IF_ERROR(Publish(Counter::kPost, t));
  for (size_t k = 0; k < rounds; ++k, ++t) {
    const size_t base = k * round_count;
    const size_t e = std::min(round_count, count - base);
    TANDEM_RETURN_IF_ERROR(WaitAll(op, Counter::kPost, t));
    if (k == 0) TANDEM_RETURN_IF_ERROR(CheckDescriptors(op));
    const size_t my_off = collectives::BlockOffset(e, n, r);
    const size_t my_cnt = collectives::BlockCount(e, n, r);
    for (int j = 0; j < n; ++j) {
      srcs[static_cast<size_t>(j)] = j == r ? src + (base + my_off) * element : InSlot(j, t) + my_off * element;
    }
    // No result buffer on a Reduce's other ranks: no arithmetic on null.
    char* own = dst != nullptr ? dst + (base + my_off) * element : nullptr;
    char* shared = ResultSlot(r, t) + my_off * element;
    if (all) {
      collectives::ReduceMany(srcs.data(), n, own, shared, my_cnt, dtype, op.op, n, stream);
    } else {
      collectives::ReduceMany(srcs.data(), n, r == root ? own : shared, nullptr, my_cnt, dtype, op.op, n);
    }
    TANDEM_RETURN_IF_ERROR(Publish(Counter::kReduced, t));
    if (k + 1 < rounds) {
      uint64_t next = 0;
      TANDEM_RETURN_IF_ERROR(BeginStep(op, &next));  // next == t + 1 on every rank
      copy_in(k + 1, next);
      TANDEM_RETURN_IF_ERROR(Publish(Counter::kPost, next));
    }
    if (all || r == root) {
      TANDEM_RETURN_IF_ERROR(WaitAll(op, Counter::kReduced, t));
      for (int j = 0; j < n; ++j) {
        if (j == r) continue;
        const size_t off = collectives::BlockOffset(e, n, j);
        const size_t cnt = collectives::BlockCount(e, n, j);
        collectives::Copy(dst + (base + off) * element, ResultSlot(j, t) + off * element, cnt * element, stream);
      }
    }
    TANDEM_RETURN_IF_ERROR(Publish(Counter::kConsumed, t));
  }
  if (stream) collectives::StoreFence();
  return Status::Ok();
}

bool ShmCommunicator::Streaming(size_t bytes) const {
  return options_.stream_bytes > 0 && bytes >= options_.stream_bytes;
}

Status ShmCommunicator::DoReduceScatter(uint64_t seq, const void* in, void* out, size_t count, DType dtype,
                                        ReduceOp op_kind) {
  const Op op{Kind::kReduceScatter, seq, count, dtype, op_kind, 0};
  TANDEM_RETURN_IF_ERROR(Enter(op));
  const size_t element = collectives::SizeOf(dtype);
  const int n = size();
  const int r = rank();
  const auto* src = static_cast<const char*>(in);
  auto* dst = static_cast<char*>(out);
  std::vector<const void*> srcs(static_cast<size_t>(n));
  // A round takes `per` elements of every rank's block: slot layout is one
  // slice per destination rank.
  const size_t per = options_.round_bytes / (element * static_cast<size_t>(n));
  size_t base = 0;
  do {
    const size_t e = std::min(per, count - base);
    uint64_t t = 0;
    TANDEM_RETURN_IF_ERROR(BeginStep(op, &t));
    char* mine = InSlot(r, t);
    for (int j = 0; j < n; ++j) {
      if (j == r || e == 0) continue;
      std::memcpy(mine + static_cast<size_t>(j) * per * element,
                  src + (static_cast<size_t>(j) * count + base) * element, e * element);
    }
    TANDEM_RETURN_IF_ERROR(Publish(Counter::kPost, t));
    TANDEM_RETURN_IF_ERROR(WaitAll(op, Counter::kPost, t));
    if (base == 0) TANDEM_RETURN_IF_ERROR(CheckDescriptors(op));
    for (int j = 0; j < n; ++j) {
      srcs[static_cast<size_t>(j)] = j == r ? src + (static_cast<size_t>(r) * count + base) * element
                                            : InSlot(j, t) + static_cast<size_t>(r) * per * element;
    }
    collectives::ReduceMany(srcs.data(), n, dst + base * element, nullptr, e, dtype, op_kind, n);
    TANDEM_RETURN_IF_ERROR(Publish(Counter::kConsumed, t));
    base += e;
  } while (base < count);
  return Status::Ok();
}

Status ShmCommunicator::DoAllGather(uint64_t seq, const void* in, void* out, size_t count, DType dtype) {
  const Op op{Kind::kAllGather, seq, count, dtype, ReduceOp::kSum, 0};
  TANDEM_RETURN_IF_ERROR(Enter(op));
  const size_t element = collectives::SizeOf(dtype);
  const int n = size();
  const int r = rank();
  const auto* src = static_cast<const char*>(in);
  auto* dst = static_cast<char*>(out);
  const bool stream = Streaming(count * element * static_cast<size_t>(n));
  const size_t round_count = options_.round_bytes / element;
  size_t base = 0;
  do {
    const size_t e = std::min(round_count, count - base);
    uint64_t t = 0;
    TANDEM_RETURN_IF_ERROR(BeginStep(op, &t));
    if (e > 0) {
      std::memcpy(InSlot(r, t), src + base * element, e * element);
      std::memmove(dst + (static_cast<size_t>(r) * count + base) * element, src + base * element, e * element);
    }
    TANDEM_RETURN_IF_ERROR(Publish(Counter::kPost, t));
    TANDEM_RETURN_IF_ERROR(WaitAll(op, Counter::kPost, t));
    if (base == 0) TANDEM_RETURN_IF_ERROR(CheckDescriptors(op));
    for (int j = 0; j < n && e > 0; ++j) {
      if (j == r) continue;
      collectives::Copy(dst + (static_cast<size_t>(j) * count + base) * element, InSlot(j, t), e * element, stream);
    }
    TANDEM_RETURN_IF_ERROR(Publish(Counter::kConsumed, t));
    base += e;
  } while (base < count);
  if (stream) collectives::StoreFence();
  return Status::Ok();
}

Status ShmCommunicator::DoBroadcast(uint64_t seq, void* data, size_t count, DType dtype, int root) {
  const Op op{Kind::kBroadcast, seq, count, dtype, ReduceOp::kSum, root};
  TANDEM_RETURN_IF_ERROR(Enter(op));
  const size_t element = collectives::SizeOf(dtype);
  auto* bytes = static_cast<char*>(data);
  const bool stream = Streaming(count * element);
  // Rounds of at most an eighth of the message (at least 64 KiB), so the
  // others copy out round k while the root copies in round k + 1.
  const size_t round_count =
      std::max<size_t>(1, std::min(options_.round_bytes, std::max<size_t>(64 << 10, count * element / 8)) / element);
  size_t base = 0;
  do {
    const size_t e = std::min(round_count, count - base);
    uint64_t t = 0;
    TANDEM_RETURN_IF_ERROR(BeginStep(op, &t));
    if (rank() == root && e > 0) std::memcpy(InSlot(root, t), bytes + base * element, e * element);
    TANDEM_RETURN_IF_ERROR(Publish(Counter::kPost, t));
    // The first round waits for everyone (to check the descriptors); later
    // rounds only for the root.
    TANDEM_RETURN_IF_ERROR(WaitAll(op, Counter::kPost, t, base == 0 ? -1 : root));
    if (base == 0) TANDEM_RETURN_IF_ERROR(CheckDescriptors(op));
    if (rank() != root) collectives::Copy(bytes + base * element, InSlot(root, t), e * element, stream);
    TANDEM_RETURN_IF_ERROR(Publish(Counter::kConsumed, t));
    base += e;
  } while (base < count);
  if (stream) collectives::StoreFence();
  return Status::Ok();
}

// ---------------------------------------------------------------------------
// Send and receive: one channel per ordered pair, two slots, the sender runs
// ahead by at most two chunks. Each chunk carries the whole message's size,
// so a receiver that expects another size fails (and tells the sender)
// instead of reading garbage.

// A message is max(1, ceil(bytes / slot)) chunks (an empty message is one
// empty chunk). The Try* steps move one chunk if they can and say whether
// they did; errors (a size mismatch) are returned as such.
size_t ShmCommunicator::ChunksOf(size_t bytes) const {
  const size_t slot = segment_->p2p_slot_bytes;
  return std::max<size_t>(1, (bytes + slot - 1) / slot);
}

Result<bool> ShmCommunicator::TrySendChunk(int peer, const char* src, size_t bytes, size_t index) {
  ChannelControl* ch = segment_->channel(rank(), peer);
  const uint64_t k = sent_[static_cast<size_t>(peer)];
  if (const uint64_t m = ch->mismatch.value.load(std::memory_order_acquire); m != 0) {
    return Fail(InvalidArgument("communicator \"{}\": rank {} sends {} bytes to rank {}, which expects {} bytes",
                                name(), rank(), bytes, peer, m - 1));
  }
  if (ch->tail.value.load(std::memory_order_acquire) + 2 <= k) return false;  // both slots in use
  const size_t slot = segment_->p2p_slot_bytes;
  const size_t offset = index * slot;
  const size_t chunk = std::min(slot, bytes - offset);
  if (chunk > 0) std::memcpy(segment_->channel_slot(rank(), peer, k), src + offset, chunk);
  ch->slots[k % 2].total = bytes;
  ch->slots[k % 2].bytes = chunk;
  ch->head.value.store(k + 1, std::memory_order_release);
  Ring();
  sent_[static_cast<size_t>(peer)] = k + 1;
  return true;
}

Result<bool> ShmCommunicator::TryRecvChunk(int peer, char* dst, size_t bytes, size_t index) {
  ChannelControl* ch = segment_->channel(peer, rank());
  const uint64_t k = received_[static_cast<size_t>(peer)];
  if (ch->head.value.load(std::memory_order_acquire) <= k) return false;  // nothing yet
  const size_t offset = index * segment_->p2p_slot_bytes;
  const uint64_t total = ch->slots[k % 2].total;
  const uint64_t chunk = ch->slots[k % 2].bytes;
  if (total != bytes || chunk > bytes - offset) {
    ch->mismatch.value.store(bytes + 1, std::memory_order_release);
    Ring();
    return Fail(InvalidArgument("communicator \"{}\": rank {} expects {} bytes from rank {}, which sent {} bytes",
                                name(), rank(), bytes, peer, total));
  }
  if (chunk > 0) std::memcpy(dst + offset, segment_->channel_slot(peer, rank(), k), chunk);
  ch->tail.value.store(k + 1, std::memory_order_release);
  Ring();
  received_[static_cast<size_t>(peer)] = k + 1;
  return true;
}

Status ShmCommunicator::DoSend(int peer, const void* data, size_t bytes) {
  return DoSendRecv(peer, data, -1, nullptr, bytes);
}

Status ShmCommunicator::DoRecv(int peer, void* data, size_t bytes) {
  return DoSendRecv(-1, nullptr, peer, data, bytes);
}

// Sends to `to` and receives from `from` (either may be -1: none), moving
// whichever chunk can move, so two ranks exchanging large messages never wait
// on each other.
Status ShmCommunicator::DoSendRecv(int to, const void* send, int from, void* recv, size_t bytes) {
  const auto* src = static_cast<const char*>(send);
  auto* dst = static_cast<char*>(recv);
  const size_t chunks = ChunksOf(bytes);
  size_t sent = to < 0 ? chunks : 0;
  size_t received = from < 0 ? chunks : 0;
  const Op op{to >= 0 ? Kind::kSend : Kind::kRecv, 0, bytes, DType::kInt32, ReduceOp::kSum, to >= 0 ? to : from};
  while (sent < chunks || received < chunks) {
    bool moved = false;
    if (sent < chunks) {
      TANDEM_ASSIGN_OR_RETURN(const bool ok, TrySendChunk(to, src, bytes, sent));
      if (ok) ++sent;
      moved |= ok;
    }
    if (received < chunks) {
      TANDEM_ASSIGN_OR_RETURN(const bool ok, TryRecvChunk(from, dst, bytes, received));
      if (ok) ++received;
      moved |= ok;
    }
    if (moved) continue;
    ChannelControl* out = to >= 0 ? segment_->channel(rank(), to) : nullptr;
    ChannelControl* in = from >= 0 ? segment_->channel(from, rank()) : nullptr;
    auto ready = [&] {
      if (sent < chunks && (out->tail.value.load(std::memory_order_acquire) + 2 > sent_[static_cast<size_t>(to)] ||
                            out->mismatch.value.load(std::memory_order_acquire) != 0)) {
        return true;
      }
      return received < chunks && in->head.value.load(std::memory_order_acquire) > received_[static_cast<size_t>(from)];
    };
    TANDEM_RETURN_IF_ERROR(WaitFor(
        op, ready,
        [&] {
          std::vector<int> peers;
          if (sent < chunks) peers.push_back(to);
          if (received < chunks && from != to) peers.push_back(from);
          return peers;
        },
        [&] {
          return sent < chunks ? fmt::format("rank {} did not read the previous chunks", to)
                               : fmt::format("rank {} did not send", from);
        }));
  }
  return Status::Ok();
}

}  // namespace tandem::comm
