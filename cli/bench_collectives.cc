// tandem bench allreduce | reducescatter | allgather | broadcast | reduce |
// sendrecv | barrier: the data plane's collectives between --np processes on
// this machine, swept over message sizes.
//
// Method (the same as the baselines we compare with): buffers are allocated
// and touched once; each size runs --warmup untimed iterations, then --iters
// timed ones, each preceded by a barrier; an iteration's time is the slowest
// rank's; the table shows the median iteration. Operations are out of place
// (separate input and output buffers). algbw = size / time; busbw = algbw x
// the collective's bus factor (allreduce 2(n-1)/n, reducescatter and allgather
// (n-1)/n, others 1), as the data-plane literature reports it.
//
// Every rank fills its input with values that every dtype represents exactly,
// so results are checked exactly: the last iteration of each size always;
// every iteration with --check (the output is poisoned before each, outside
// the timed region). #wrong counts wrong elements summed over ranks.
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <random>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "cli/commands.h"
#include "common/config.h"
#include "common/cpus.h"
#include "worker/comm/factory.h"

namespace tandem::cli {
namespace {

using Clock = std::chrono::steady_clock;
using collectives::DType;
using collectives::ReduceOp;

struct BenchConfig {
  std::string collective;
  int np = 2;
  std::string backend = "shm";
  uint64_t min_bytes = 8;
  uint64_t max_bytes = 256ULL << 20;
  int64_t factor = 2;
  int64_t iters = 20;
  int64_t warmup = 5;
  DType dtype = DType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
  bool check = false;
  bool json = false;
  std::chrono::milliseconds timeout{60000};
  comm::BackendOptions backend_options;
  std::string rendezvous_dir;
  bool bind = true;
};

// Pins the calling process to the rank-th CPU it may use (modulo their
// number), as MPI launchers do by default for small runs.
void BindToCpu(int rank) {
  const std::vector<int> cpus = AllowedCpus();
  if (!cpus.empty()) (void)BindProcess({cpus[static_cast<size_t>(rank) % cpus.size()]});
}

double BusFactor(const std::string& c, int n) {
  const double nd = n;
  if (c == "allreduce") return 2 * (nd - 1) / nd;
  if (c == "reducescatter" || c == "allgather") return (nd - 1) / nd;
  return 1;
}

bool Reduces(const std::string& c) {
  return c == "allreduce" || c == "reducescatter" || c == "reduce";
}

// The value rank `r` contributes at element i: small integers (exact in every
// dtype, sums of up to 64 ranks too).
double InputValue(int r, size_t i) {
  return static_cast<double>((r + 1) + static_cast<int>(i % 7));
}

// op over ranks 0..n-1 of InputValue(r, i).
double Expected(ReduceOp op, DType dtype, int n, size_t i) {
  double sum = 0;
  double lo = 1e300;
  double hi = -1e300;
  for (int r = 0; r < n; ++r) {
    const double v = InputValue(r, i);
    sum += v;
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  switch (op) {
    case ReduceOp::kSum:
      return sum;
    case ReduceOp::kMin:
      return lo;
    case ReduceOp::kMax:
      return hi;
    case ReduceOp::kAvg:
      if (dtype == DType::kInt32 || dtype == DType::kInt64) return std::trunc(sum / n);
      return sum / n;
  }
  return 0;
}

bool Close(DType dtype, double got, double want) {
  if (dtype == DType::kInt32 || dtype == DType::kInt64 || dtype == DType::kFloat32) {
    return std::fabs(got - want) <= 1e-6 * std::max(1.0, std::fabs(want));
  }
  // float16 / bfloat16: one rounding of the exact result.
  const double ulp = dtype == DType::kFloat16 ? 1.0 / 1024 : 1.0 / 128;
  return std::fabs(got - want) <= ulp * std::max(1.0, std::fabs(want));
}

struct Sizes {
  size_t count;       // elements per rank's send buffer ("count" column)
  size_t in_elems;    // elements of the input buffer
  size_t out_elems;   // elements of the output buffer
  size_t size_bytes;  // the "size" column
};

Sizes SizesFor(const BenchConfig& c, size_t bytes) {
  const size_t e = collectives::SizeOf(c.dtype);
  const auto n = static_cast<size_t>(c.np);
  Sizes s{};
  if (c.collective == "reducescatter") {
    s.count = std::max<size_t>(1, bytes / e / n);  // per-rank result
    s.in_elems = s.count * n;
    s.out_elems = s.count;
    s.size_bytes = s.count * n * e;
  } else if (c.collective == "allgather") {
    s.count = std::max<size_t>(1, bytes / e / n);
    s.in_elems = s.count;
    s.out_elems = s.count * n;
    s.size_bytes = s.count * n * e;
  } else if (c.collective == "barrier") {
    s = {0, 0, 0, 0};
  } else {
    s.count = std::max<size_t>(1, bytes / e);
    s.in_elems = s.count;
    s.out_elems = s.count;
    s.size_bytes = s.count * e;
  }
  return s;
}

// One rank's view: run the collective once.
Status RunOnce(const BenchConfig& c, comm::Communicator& comm, const Sizes& s, const void* in, void* out) {
  const int n = comm.size();
  const int r = comm.rank();
  if (c.collective == "allreduce") return comm.AllReduce(in, out, s.count, c.dtype, c.op);
  if (c.collective == "reducescatter") return comm.ReduceScatter(in, out, s.count, c.dtype, c.op);
  if (c.collective == "allgather") return comm.AllGather(in, out, s.count, c.dtype);
  if (c.collective == "reduce") return comm.Reduce(in, out, s.count, c.dtype, c.op, c.root);
  if (c.collective == "barrier") return comm.Barrier();
  if (c.collective == "broadcast") {
    // In place on `out`: the root's output already holds its input.
    return comm.Broadcast(out, s.count, c.dtype, c.root);
  }
  if (c.collective == "sendrecv") {
    if (n == 1) return Status::Ok();
    return comm.SendRecv((r + 1) % n, in, (r + n - 1) % n, out, s.count, c.dtype);
  }
  return InvalidArgument("unknown collective {}", c.collective);
}

// Wrong elements of this rank's output after one run.
uint64_t CountWrong(const BenchConfig& c, int n, int r, const Sizes& s, const void* out) {
  uint64_t wrong = 0;
  const DType d = c.dtype;
  if (c.collective == "allreduce" || (c.collective == "reduce" && r == c.root)) {
    for (size_t i = 0; i < s.count; ++i)
      wrong += !Close(d, collectives::LoadAsDouble(d, out, i), Expected(c.op, d, n, i));
  } else if (c.collective == "reducescatter") {
    for (size_t i = 0; i < s.count; ++i) {
      wrong +=
          !Close(d, collectives::LoadAsDouble(d, out, i), Expected(c.op, d, n, static_cast<size_t>(r) * s.count + i));
    }
  } else if (c.collective == "allgather") {
    for (int j = 0; j < n; ++j) {
      for (size_t i = 0; i < s.count; ++i) {
        wrong += !Close(d, collectives::LoadAsDouble(d, out, static_cast<size_t>(j) * s.count + i), InputValue(j, i));
      }
    }
  } else if (c.collective == "broadcast") {
    for (size_t i = 0; i < s.count; ++i)
      wrong += !Close(d, collectives::LoadAsDouble(d, out, i), InputValue(c.root, i));
  } else if (c.collective == "sendrecv" && n > 1) {
    const int from = (r + n - 1) % n;
    for (size_t i = 0; i < s.count; ++i) wrong += !Close(d, collectives::LoadAsDouble(d, out, i), InputValue(from, i));
  }
  return wrong;
}

void Prepare(const BenchConfig& c, int r, const Sizes& s, std::vector<char>& in, std::vector<char>& out) {
  const size_t e = collectives::SizeOf(c.dtype);
  for (size_t i = 0; i < s.in_elems; ++i) collectives::StoreFromDouble(c.dtype, in.data(), i, InputValue(r, i));
  std::memset(out.data(), 0xff, s.out_elems * e);  // poison: NaN / -1 everywhere
  if (c.collective == "broadcast" && r == c.root) std::memcpy(out.data(), in.data(), s.count * e);
}

struct Row {
  Sizes sizes;
  double time_us;
  uint64_t wrong;
};

std::string Format(const BenchConfig& c, const Row& row) {
  const double algbw = row.time_us > 0 ? static_cast<double>(row.sizes.size_bytes) / (row.time_us * 1e3) : 0;
  const double busbw = algbw * BusFactor(c.collective, c.np);
  const bool has_op = Reduces(c.collective);
  const bool has_root = c.collective == "broadcast" || c.collective == "reduce";
  if (c.json) {
    return fmt::format(
        "{{\"collective\": \"{}\", \"np\": {}, \"backend\": \"{}\", \"size_bytes\": {}, \"count\": {}, \"type\": "
        "\"{}\", \"redop\": \"{}\", \"root\": {}, \"time_us\": {:.3f}, \"algbw_gbps\": {:.4f}, \"busbw_gbps\": {:.4f}, "
        "\"wrong\": {}}}",
        c.collective, c.np, c.backend, row.sizes.size_bytes, row.sizes.count, collectives::Name(c.dtype),
        has_op ? std::string(collectives::Name(c.op)) : "none", has_root ? c.root : -1, row.time_us, algbw, busbw,
        row.wrong);
  }
  return fmt::format("{:>12} {:>12} {:>9} {:>6} {:>5} {:>10.2f} {:>8.3f} {:>8.3f} {:>7}", row.sizes.size_bytes,
                     row.sizes.count, collectives::Name(c.dtype), has_op ? collectives::Name(c.op) : "none",
                     has_root ? c.root : -1, row.time_us, algbw, busbw, row.wrong);
}

// Runs on each rank's process. Rank 0 prints. Returns the exit code.
int RankMain(const BenchConfig& c, int r) {
  if (c.bind) BindToCpu(r);
  comm::FileRendezvous rendezvous(c.rendezvous_dir);
  comm::CommInfo info;
  info.name = "bench";
  info.epoch = 1;
  info.rank = r;
  info.size = c.np;
  info.timeout = c.timeout;
  auto made = comm::CreateCommunicator(c.backend, info, rendezvous, c.backend_options);
  if (!made.ok()) {
    fmt::print(stderr, "tandem bench: rank {}: {}\n", r, made.status().ToString());
    return 1;
  }
  comm::Communicator& comm = **made;
  std::vector<uint64_t> byte_sizes;
  if (c.collective == "barrier") {
    byte_sizes.push_back(0);
  } else {
    for (uint64_t b = c.min_bytes; b <= c.max_bytes;
         b = std::max<uint64_t>(b + 1, b * static_cast<uint64_t>(c.factor))) {
      byte_sizes.push_back(b);
    }
  }
  const size_t e = collectives::SizeOf(c.dtype);
  const Sizes largest = SizesFor(c, c.max_bytes);
  std::vector<char> in(std::max<size_t>(1, largest.in_elems * e));
  std::vector<char> out(std::max<size_t>(1, largest.out_elems * e));
  std::vector<int64_t> times(static_cast<size_t>(c.iters));
  std::vector<int64_t> slowest(static_cast<size_t>(c.iters));
  if (r == 0 && !c.json) {
    fmt::print("# tandem bench {}: {} ranks, backend {}, {} iterations after {} warm-up, out of place\n", c.collective,
               c.np, comm.backend(), c.iters, c.warmup);
    fmt::print("# time: median over iterations of the slowest rank; algbw = size/time; busbw = algbw x {:.3f}\n",
               BusFactor(c.collective, c.np));
    fmt::print("#\n# {:>10} {:>12} {:>9} {:>6} {:>5} {:>10} {:>8} {:>8} {:>7}\n", "size", "count", "type", "redop",
               "root", "time", "algbw", "busbw", "#wrong");
    fmt::print("# {:>10} {:>12} {:>9} {:>6} {:>5} {:>10} {:>8} {:>8} {:>7}\n", "(B)", "(elements)", "", "", "", "(us)",
               "(GB/s)", "(GB/s)", "");
    std::fflush(stdout);
  }
  uint64_t total_wrong = 0;
  for (const uint64_t bytes : byte_sizes) {
    const Sizes s = SizesFor(c, bytes);
    Prepare(c, r, s, in, out);
    for (int64_t w = 0; w < c.warmup; ++w) {
      if (Status st = RunOnce(c, comm, s, in.data(), out.data()); !st.ok()) {
        fmt::print(stderr, "tandem bench: rank {}: {}\n", r, st.ToString());
        return 1;
      }
    }
    uint64_t wrong = 0;
    for (int64_t it = 0; it < c.iters; ++it) {
      const bool verify = c.check || it == c.iters - 1;
      if (verify) Prepare(c, r, s, in, out);
      Status st = comm.Barrier();
      const auto t0 = Clock::now();
      if (st.ok()) st = RunOnce(c, comm, s, in.data(), out.data());
      const auto t1 = Clock::now();
      if (!st.ok()) {
        fmt::print(stderr, "tandem bench: rank {}: {}\n", r, st.ToString());
        return 1;
      }
      times[static_cast<size_t>(it)] = std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count();
      if (verify) wrong += CountWrong(c, c.np, r, s, out.data());
    }
    // The slowest rank's time per iteration, and the wrong elements of all ranks.
    int64_t wrong_total = static_cast<int64_t>(wrong);
    Status st = comm.AllReduce(times.data(), slowest.data(), times.size(), DType::kInt64, ReduceOp::kMax);
    if (st.ok()) st = comm.AllReduce(&wrong_total, &wrong_total, 1, DType::kInt64, ReduceOp::kSum);
    if (!st.ok()) {
      fmt::print(stderr, "tandem bench: rank {}: {}\n", r, st.ToString());
      return 1;
    }
    std::sort(slowest.begin(), slowest.end());
    const size_t m = slowest.size();
    const double median_ns =
        m % 2 ? static_cast<double>(slowest[m / 2]) : 0.5 * static_cast<double>(slowest[m / 2 - 1] + slowest[m / 2]);
    total_wrong += static_cast<uint64_t>(wrong_total);
    if (r == 0) {
      fmt::print("{}\n", Format(c, Row{s, median_ns / 1e3, static_cast<uint64_t>(wrong_total)}));
      std::fflush(stdout);
    }
  }
  if (r == 0 && !c.json) {
    fmt::print("# {} wrong elements in total{}\n", total_wrong, c.check ? " (every iteration checked)" : "");
  }
  return total_wrong == 0 ? 0 : 3;
}

}  // namespace

int BenchCollectiveCommand(const std::string& collective, int argc, char** argv) {
  BenchConfig c;
  c.collective = collective;
  int64_t np = 2;
  int64_t root = 0;
  std::string dtype = "float32";
  std::string op = "sum";
  uint64_t round_bytes = c.backend_options.shm.round_bytes;
  uint64_t small_bytes = c.backend_options.shm.small_bytes;
  uint64_t stream_bytes = c.backend_options.shm.stream_bytes;
  OptionSet options(
      "tandem bench " + collective,
      "Times the " + collective +
          " collective between --np processes on this machine over a sweep of message sizes and prints one row per "
          "size: size, count, type, redop, root, time, algbw, busbw, #wrong.");
  options.Int("np", &np, "number of ranks (processes)", 1, 64);
  options.Choice("backend", &c.backend, comm::BackendNames(), "data-plane backend");
  options.Bytes("min_bytes", &c.min_bytes, "smallest message size", 1, 1ULL << 34);
  options.Bytes("max_bytes", &c.max_bytes, "largest message size", 1, 1ULL << 34);
  options.Int("factor", &c.factor, "size multiplier between rows", 2, 1024);
  options.Int("iters", &c.iters, "timed iterations per size", 1, 100000);
  options.Int("warmup", &c.warmup, "untimed iterations per size", 0, 100000);
  options.Choice("dtype", &dtype, {"float32", "float16", "bfloat16", "int32", "int64"}, "element type");
  options.Choice("op", &op, {"sum", "avg", "min", "max"}, "reduction (allreduce, reducescatter, reduce)");
  options.Int("root", &root, "root rank (broadcast, reduce)", 0, 63);
  options.Bool("check", &c.check, "verify the result of every iteration (not only the last)");
  options.Bool("json", &c.json, "print one JSON object per size instead of the table");
  options.Bool("bind", &c.bind, "pin rank i to the i-th CPU this process may use (modulo their number)");
  options.Duration("timeout", &c.timeout, "longest wait on a peer before the run fails", std::chrono::milliseconds(1),
                   std::chrono::hours(1));
  options.Bytes("shm_round_bytes", &round_bytes, "shm backend: staging bytes per rank and round", 4096, 1ULL << 30);
  options.Bytes("shm_small_bytes", &small_bytes, "shm backend: largest allreduce done in one step", 0, 1ULL << 30);
  options.Bytes("shm_stream_bytes", &stream_bytes,
                "shm backend: outputs from this size on bypass the caches (0: never)", 0, 1ULL << 40);
  if (const int rc = ParseOrExit(options, argc, argv); rc >= 0) return rc;
  c.np = static_cast<int>(np);
  c.root = static_cast<int>(root);
  c.backend_options.shm.round_bytes = round_bytes;
  c.backend_options.shm.small_bytes = small_bytes;
  c.backend_options.shm.stream_bytes = stream_bytes;
  if (c.min_bytes > c.max_bytes) {
    fmt::print(stderr, "tandem bench: --min-bytes ({}) exceeds --max-bytes ({})\n", c.min_bytes, c.max_bytes);
    return 2;
  }
  if (c.root >= c.np) {
    fmt::print(stderr, "tandem bench: --root {} is not a rank of {}\n", c.root, c.np);
    return 2;
  }
  const std::vector<std::pair<std::string, DType>> dtypes = {{"float32", DType::kFloat32},
                                                             {"float16", DType::kFloat16},
                                                             {"bfloat16", DType::kBFloat16},
                                                             {"int32", DType::kInt32},
                                                             {"int64", DType::kInt64}};
  for (const auto& [name, d] : dtypes) {
    if (name == dtype) c.dtype = d;
  }
  const std::vector<std::pair<std::string, ReduceOp>> ops = {
      {"sum", ReduceOp::kSum}, {"avg", ReduceOp::kAvg}, {"min", ReduceOp::kMin}, {"max", ReduceOp::kMax}};
  for (const auto& [name, o] : ops) {
    if (name == op) c.op = o;
  }
  std::random_device random;
  c.rendezvous_dir =
      (std::filesystem::temp_directory_path() / fmt::format("tandem-bench-{}-{:08x}", ::getpid(), random())).string();
  std::filesystem::create_directories(c.rendezvous_dir);

  // One process per rank, forked before this process starts any thread.
  std::fflush(stdout);
  std::vector<pid_t> pids;
  for (int r = 0; r < c.np; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      fmt::print(stderr, "tandem bench: fork failed: {}\n", std::strerror(errno));
      for (pid_t p : pids) ::kill(p, SIGKILL);
      break;
    }
    if (pid == 0) {
      const int code = RankMain(c, r);
      std::fflush(stdout);
      std::fflush(stderr);
      ::_exit(code);
    }
    pids.push_back(pid);
  }
  // Wait for every rank; when one fails, the others get the error within the
  // timeout; kill them after that.
  int exit_code = pids.size() == static_cast<size_t>(c.np) ? 0 : 1;
  size_t left = pids.size();
  bool killing = false;  // a rank failed: kill the others at kill_at
  Clock::time_point kill_at{};
  while (left > 0) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, killing ? WNOHANG : 0);
    if (pid > 0) {
      auto it = std::find(pids.begin(), pids.end(), pid);
      if (it == pids.end()) continue;
      *it = -1;
      --left;
      const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      if (code != 0) {
        if (exit_code == 0) exit_code = code;
        if (!killing) {
          killing = true;
          kill_at = Clock::now() + c.timeout + std::chrono::seconds(5);
        }
      }
      continue;
    }
    if (pid < 0 && errno != EINTR) break;
    if (killing && Clock::now() > kill_at) {
      for (pid_t p : pids) {
        if (p > 0) ::kill(p, SIGKILL);
      }
      killing = false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::error_code ec;
  std::filesystem::remove_all(c.rendezvous_dir, ec);
  return exit_code;
}

}  // namespace tandem::cli
