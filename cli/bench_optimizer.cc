// tandem bench optimizer: the parameter server's optimizer update
// (common/optimizer/optimizer.h) on fp32 buffers of --params sizes, spread
// over --threads with the server's ThreadPool, beside two baselines measured
// in the same run: the memory bandwidth of a kernel with the same memory
// traffic, and torch.optim with foreach=True (bench/torch_optimizer.py).
//
// Byte model (fp32; every written buffer is also read, so no write-allocate
// traffic comes on top): AdamW and Adam read w, g, m, v and write w, m, v:
// 28 bytes per parameter; SGD with momentum reads w, g, buf and writes w,
// buf: 20; plain SGD reads w, g and writes w: 12. effective GB/s = bytes per
// parameter x params / time.
//
// Method: buffers are allocated and first touched by the pool that uses
// them; each size runs --warmup untimed steps, then --iters timed ones; the
// table shows the median step. The bandwidth baseline runs a triad
// (x[i] += a * g[i] for each written buffer x) of the same shape (same
// buffers, reads and writes, threads and chunks) --iters times, at least 5,
// alternating with the timed steps so both see the same machine, and keeps
// the best, as STREAM reports it; bandwidth_ratio = effective / that. The torch baseline is one Python process for all
// sizes (median step); torch_speedup = torch time / Tandem time.
//
// Verification: after timing, one more pooled step is checked bit for bit
// against a single-threaded Apply of the same step on a copy of the first
// up to 1M elements (#wrong counts mismatches), and every weight must be
// finite.
#include <stdio.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "cli/commands.h"
#include "common/config.h"
#include "common/optimizer/kernel_clones.h"
#include "common/optimizer/optimizer.h"
#include "common/optimizer/thread_pool.h"

#ifndef TANDEM_SOURCE_DIR
#define TANDEM_SOURCE_DIR "."
#endif

namespace tandem::cli {
namespace {

using Clock = std::chrono::steady_clock;
using optim::Optimizer;
using optim::ThreadPool;

constexpr size_t kGrain = 16384;  // elements: 64 KiB of each buffer per chunk at least

struct BenchConfig {
  std::string optimizer = "adamw";
  std::vector<uint64_t> params;
  int threads = 1;
  int64_t iters = 10;
  int64_t warmup = 2;
  bool json = false;
  bool torch = true;
  std::string python = "python3";
  bool python_given = false;
  std::string torch_script;
  // Hyperparameters (torch's defaults, weight decay 0.01 for all three).
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double momentum = 0.9;
  double weight_decay = 0.01;
};

// "1M,16M,64M": counts with an optional K/M/G (x1000) or Ki/Mi/Gi (x1024) suffix.
Result<std::vector<uint64_t>> ParseCounts(std::string_view text) {
  std::vector<uint64_t> out;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    std::string_view item = text.substr(start, comma - start);
    const std::string_view given = item;
    start = comma + 1;
    if (item.empty()) return InvalidArgument("--params: empty item in '{}'", text);
    uint64_t scale = 1;
    const std::pair<std::string_view, uint64_t> suffixes[] = {
        {"Ki", 1ULL << 10}, {"Mi", 1ULL << 20}, {"Gi", 1ULL << 30}, {"K", 1000}, {"M", 1000000}, {"G", 1000000000}};
    for (const auto& [s, v] : suffixes) {
      if (item.size() > s.size() && item.substr(item.size() - s.size()) == s) {
        scale = v;
        item.remove_suffix(s.size());
        break;
      }
    }
    uint64_t value = 0;
    for (char c : item) {
      if (c < '0' || c > '9' || value > (1ULL << 40)) {
        return InvalidArgument("--params: '{}' is not a count (e.g. 1M, 16M, 1048576, 64Mi)", text);
      }
      value = value * 10 + static_cast<uint64_t>(c - '0');
    }
    // Bounded before scaling: value * scale could wrap around 2^64 (e.g.
    // 17179869185Gi would become 2^30).
    if (value == 0 || value > (1ULL << 32) / scale) {
      return InvalidArgument("--params: {} must be 1 to 2^32 parameters", given);
    }
    out.push_back(value * scale);
  }
  return out;
}

std::string FormatCount(uint64_t n) {
  if (n >= 1000000 && n % 1000000 == 0) return fmt::format("{}M", n / 1000000);
  if (n >= (1ULL << 20) && n % (1ULL << 20) == 0) return fmt::format("{}Mi", n >> 20);
  if (n >= 1000 && n % 1000 == 0) return fmt::format("{}K", n / 1000);
  return fmt::format("{}", n);
}

v1::OptimizerConfig MakeConfig(const BenchConfig& c) {
  v1::OptimizerConfig config;
  if (c.optimizer == "sgd") {
    config.mutable_sgd()->set_lr(c.lr);
    config.mutable_sgd()->set_momentum(c.momentum);
    config.mutable_sgd()->set_weight_decay(c.weight_decay);
  } else {
    v1::AdamConfig* a = config.mutable_adam();
    a->set_lr(c.lr);
    a->set_beta1(c.beta1);
    a->set_beta2(c.beta2);
    a->set_eps(c.eps);
    a->set_weight_decay(c.weight_decay);
    a->set_decoupled_weight_decay(c.optimizer == "adamw");
  }
  return config;
}

std::string Describe(const BenchConfig& c) {
  if (c.optimizer == "sgd") {
    return fmt::format("sgd (lr {}, momentum {}, weight decay {})", c.lr, c.momentum, c.weight_decay);
  }
  return fmt::format("{} (lr {}, betas {}/{}, eps {}, weight decay {})", c.optimizer, c.lr, c.beta1, c.beta2, c.eps,
                     c.weight_decay);
}

// fp32 buffers without value-initialisation: the pool's threads touch them
// first, so their pages come from where they will be used.
struct FloatBuffer {
  std::unique_ptr<float[]> data;
  explicit FloatBuffer(size_t n) : data(n > 0 ? std::make_unique_for_overwrite<float[]>(n) : nullptr) {}
  float* get() const { return data.get(); }
};

// The bandwidth baseline: x[i] += a * g[i] for each of the `writes` buffers
// (1 to 3), reading g once: the optimizer's reads and writes without its
// arithmetic.
TANDEM_KERNEL __attribute__((noinline)) void Triad(float* __restrict x0, float* __restrict x1, float* __restrict x2,
                                                   const float* __restrict g, size_t n, int writes, float a) {
  if (writes == 3) {
    for (size_t i = 0; i < n; ++i) {
      // All loads before the stores, as the optimizer's kernel does: buffers
      // at the same offset in their pages would otherwise make each load wait
      // for the store before it (4K aliasing).
      const float t = a * g[i];
      const float y0 = x0[i] + t;
      const float y1 = x1[i] + t;
      const float y2 = x2[i] + t;
      x0[i] = y0;
      x1[i] = y1;
      x2[i] = y2;
    }
  } else if (writes == 2) {
    for (size_t i = 0; i < n; ++i) {
      const float t = a * g[i];
      const float y0 = x0[i] + t;
      const float y1 = x1[i] + t;
      x0[i] = y0;
      x1[i] = y1;
    }
  } else {
    for (size_t i = 0; i < n; ++i) x0[i] += a * g[i];
  }
}

// Cheap deterministic values in about [-1, 1) (splitmix64 of i).
float Noise(uint64_t i) {
  uint64_t z = i * 0x9e3779b97f4a7c15ULL + 0x632be59bd9b4e019ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  return static_cast<float>(static_cast<double>(z >> 40) / static_cast<double>(1ULL << 23) - 1.0);
}

struct TorchResult {
  bool available = false;
  std::string reason;   // why not, when !available
  std::string version;  // torch.__version__
  std::string python;   // the interpreter that ran it
  struct Time {
    uint64_t params;
    double median;  // seconds per step
    double best;
  };
  std::vector<Time> seconds;
};

// The value of "key": in a one-line JSON object written by torch_optimizer.py
// (a number, or a string without escapes); nullopt when absent.
std::optional<std::string> JsonField(const std::string& line, const std::string& key) {
  const std::string needle = fmt::format("\"{}\": ", key);
  const size_t at = line.find(needle);
  if (at == std::string::npos) return std::nullopt;
  size_t p = at + needle.size();
  if (p < line.size() && line[p] == '"') {
    const size_t end = line.find('"', p + 1);
    if (end == std::string::npos) return std::nullopt;
    return line.substr(p + 1, end - p - 1);
  }
  const size_t end = line.find_first_of(",}", p);
  return line.substr(p, end == std::string::npos ? std::string::npos : end - p);
}

std::string ShellQuote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out += c;
    }
  }
  return out + "'";
}

TorchResult RunTorchWith(const BenchConfig& c, const std::string& python) {
  TorchResult r;
  r.python = python;
  std::string sizes;
  for (uint64_t n : c.params) {
    if (!sizes.empty()) sizes += ',';
    sizes += std::to_string(n);
  }
  const std::string command = fmt::format(
      "{} {} --optimizer {} --params {} --threads {} --iters {} --warmup {} --lr {} --beta1 {} --beta2 {} --eps {} "
      "--momentum {} --weight-decay {}",
      ShellQuote(python), ShellQuote(c.torch_script), c.optimizer, sizes, c.threads, c.iters, c.warmup, c.lr, c.beta1,
      c.beta2, c.eps, c.momentum, c.weight_decay);
  std::fflush(stdout);
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) {
    r.reason = fmt::format("cannot run {}: {}", python, std::strerror(errno));
    return r;
  }
  std::string line;
  char buffer[4096];
  while (std::fgets(buffer, sizeof(buffer), pipe) != nullptr) {
    line += buffer;
    if (line.empty() || line.back() != '\n') continue;
    if (JsonField(line, "available") == "false") {
      r.reason = JsonField(line, "reason").value_or("torch unavailable");
    } else if (auto n = JsonField(line, "params"), s = JsonField(line, "seconds_per_step"); n && s) {
      r.available = true;
      r.version = JsonField(line, "torch_version").value_or("?");
      const double median = std::stod(*s);
      r.seconds.push_back({std::stoull(*n), median, std::stod(JsonField(line, "best_seconds_per_step").value_or(*s))});
    }
    line.clear();
  }
  const int status = ::pclose(pipe);
  if (status != 0 && r.reason.empty()) {
    r.available = false;
    // pclose returns a wait status (256 for exit 1, 32512 for the shell's 127).
    const std::string ran = fmt::format("{} {}", python, c.torch_script);
    if (WIFEXITED(status)) {
      r.reason = fmt::format("{} exited with status {}", ran, WEXITSTATUS(status));
    } else if (WIFSIGNALED(status)) {
      r.reason = fmt::format("{} was killed by signal {}", ran, WTERMSIG(status));
    } else {
      r.reason = fmt::format("{} failed (wait status {})", ran, status);
    }
  }
  return r;
}

TorchResult RunTorch(const BenchConfig& c) {
  TorchResult r = RunTorchWith(c, c.python);
  // A python3 first on PATH (a virtual environment, pyenv) may lack the
  // Debian package that `make bench` installs; try the system one too.
  if (!r.available && !c.python_given && std::filesystem::exists("/usr/bin/python3")) {
    TorchResult system = RunTorchWith(c, "/usr/bin/python3");
    if (system.available) return system;
    r.reason += "; /usr/bin/python3: " + system.reason;
  }
  return r;
}

struct Row {
  uint64_t params = 0;
  double seconds = 0;        // median optimizer step
  double best_seconds = 0;   // fastest optimizer step
  double triad_seconds = 0;  // fastest same-shape triad
  std::optional<double> torch_seconds;
  std::optional<double> torch_best_seconds;
  uint64_t wrong = 0;
};

Row Measure(const BenchConfig& c, const Optimizer& o, ThreadPool& pool, uint64_t n64) {
  const auto n = static_cast<size_t>(n64);
  const int buffers = o.state_buffers();
  FloatBuffer w(n);
  FloatBuffer g(n);
  FloatBuffer s0(buffers > 0 ? n : 0);
  FloatBuffer s1(buffers > 1 ? n : 0);
  pool.ParallelFor(n, kGrain, [&](size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      w.get()[i] = Noise(i);
      g.get()[i] = 0.01f * Noise(i + n);
    }
    if (s0.get()) std::memset(s0.get() + begin, 0, (end - begin) * sizeof(float));
    if (s1.get()) std::memset(s1.get() + begin, 0, (end - begin) * sizeof(float));
  });
  const optim::GroupParams group = o.Group("");
  uint64_t step = 0;
  auto apply = [&] {
    const uint64_t index = step++;
    pool.ParallelFor(n, kGrain, [&](size_t begin, size_t end) {
      o.Apply(w.get() + begin, s0.get() ? s0.get() + begin : nullptr, s1.get() ? s1.get() + begin : nullptr,
              g.get() + begin, end - begin, index, group, 1.0);
    });
  };
  // The bandwidth baseline over the same buffers, threads and chunks.
  const int writes = 1 + buffers;
  // a = 0 leaves every value as it is (the optimizer's state stays valid:
  // even a tiny a could push a second moment below zero); Triad is not
  // inlined, so the compiler cannot drop the work.
  const float a = 0.0f;
  auto triad = [&] {
    pool.ParallelFor(n, kGrain, [&](size_t begin, size_t end) {
      float* x0 = w.get() + begin;
      float* x1 = s0.get() ? s0.get() + begin : nullptr;
      float* x2 = s1.get() ? s1.get() + begin : nullptr;
      Triad(x0, x1, x2, g.get() + begin, end - begin, writes, a);
    });
  };
  auto seconds = [](const auto& fn) {
    const auto t0 = Clock::now();
    fn();
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  for (int64_t i = 0; i < c.warmup; ++i) {
    apply();
    triad();
  }
  // Steps and triads alternate, so both see the same conditions on a busy machine.
  std::vector<double> times;
  double best_triad = 1e300;
  for (int64_t i = 0; i < std::max<int64_t>(c.iters, 5); ++i) {
    if (i < c.iters) times.push_back(seconds(apply));
    best_triad = std::min(best_triad, seconds(triad));
  }
  Row row;
  row.params = n64;
  row.seconds = Median(times);
  row.best_seconds = *std::min_element(times.begin(), times.end());
  row.triad_seconds = best_triad;

  // Verification: one more pooled step against one call on a copy.
  const size_t check = std::min<size_t>(n, 1 << 20);
  std::vector<float> cw(w.get(), w.get() + check);
  std::vector<float> c0;
  std::vector<float> c1;
  if (s0.get()) c0.assign(s0.get(), s0.get() + check);
  if (s1.get()) c1.assign(s1.get(), s1.get() + check);
  o.Apply(cw.data(), s0.get() ? c0.data() : nullptr, s1.get() ? c1.data() : nullptr, g.get(), check, step, group, 1.0);
  apply();
  for (size_t i = 0; i < check; ++i) {
    row.wrong += std::memcmp(&cw[i], &w.get()[i], sizeof(float)) != 0;
    if (s0.get()) row.wrong += std::memcmp(&c0[i], &s0.get()[i], sizeof(float)) != 0;
    if (s1.get()) row.wrong += std::memcmp(&c1[i], &s1.get()[i], sizeof(float)) != 0;
  }
  for (size_t i = 0; i < n; ++i) row.wrong += !std::isfinite(w.get()[i]);
  return row;
}

int BytesPerParam(const Optimizer& o) {
  // Reads w, g and each state buffer; writes w and each state buffer.
  return 4 * (2 + o.state_buffers()) + 4 * (1 + o.state_buffers());
}

}  // namespace

int BenchOptimizerCommand(int argc, char** argv) {
  BenchConfig c;
  std::string params = "1M,16M,64M";
  const unsigned hw = std::thread::hardware_concurrency();
  int64_t threads = hw > 0 ? static_cast<int64_t>(hw) : 1;
  bool no_torch = false;
  c.torch_script = std::string(TANDEM_SOURCE_DIR) + "/bench/torch_optimizer.py";
  OptionSet options("tandem bench optimizer",
                    "Times the parameter server's optimizer update (fp32 master weights and moments, spread over "
                    "--threads) for each --params size, beside the memory bandwidth of a kernel with the same reads "
                    "and writes and beside torch.optim with foreach=True, and prints one row per size.");
  options.Bool("json", &c.json, "print one JSON object per size instead of the table");
  options.Choice("optimizer", &c.optimizer, {"adamw", "adam", "sgd"}, "update rule (all: weight decay 0.01)");
  options.Double("momentum", &c.momentum, "sgd: the momentum (0: plain SGD, no momentum buffer)", 0.0, 0.999999);
  options.String("params", &params, "parameter counts, comma-separated (K/M/G = 10^3/10^6/10^9; Ki/Mi/Gi = 2^10...)");
  options.Int("threads", &threads, "threads (the pool and the caller; default: the hardware threads)", 1, 1024);
  options.Int("iters", &c.iters, "timed steps per size", 1, 100000);
  options.Int("warmup", &c.warmup, "untimed steps per size", 0, 100000);
  options.Bool("no_torch", &no_torch, "skip the torch baseline");
  options.String("python", &c.python, "Python interpreter for the torch baseline");
  options.String("torch_script", &c.torch_script, "the torch baseline script");
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--python", 8) == 0 && (argv[i][8] == '\0' || argv[i][8] == '=')) c.python_given = true;
  }
  if (const int rc = ParseOrExit(options, argc, argv); rc >= 0) return rc;
  auto counts = ParseCounts(params);
  if (!counts.ok()) {
    fmt::print(stderr, "tandem bench optimizer: {}\n", counts.status().message());
    return 2;
  }
  c.params = *counts;
  c.threads = static_cast<int>(threads);
  c.torch = !no_torch;
  if (c.optimizer != "sgd" && c.momentum != BenchConfig{}.momentum) {
    fmt::print(stderr, "tandem bench optimizer: --momentum: applies to --optimizer sgd only (this is {})\n",
               c.optimizer);
    return 2;
  }
  auto made = Optimizer::Create(MakeConfig(c));
  if (!made.ok()) {
    fmt::print(stderr, "tandem bench optimizer: {}\n", made.status().ToString());
    return 1;
  }
  const Optimizer& o = *made;
  const int bytes_per_param = BytesPerParam(o);

  TorchResult torch;
  if (c.torch) {
    fmt::print(stderr, "bench optimizer: torch baseline ({} {})...\n", c.python, c.torch_script);
    torch = RunTorch(c);
    if (!torch.available) fmt::print(stderr, "bench optimizer: torch unavailable: {}\n", torch.reason);
  } else {
    torch.reason = "skipped (--no-torch)";
  }

  if (!c.json) {
    fmt::print("# tandem bench optimizer: {}, {} threads, {} steps after {} warm-up\n", Describe(c), c.threads, c.iters,
               c.warmup);
    fmt::print("# bytes per parameter: {} ({}, fp32); eff = bytes / median step time\n", bytes_per_param,
               o.state_buffers() == 2   ? "reads w, g, m, v; writes w, m, v"
               : o.state_buffers() == 1 ? "reads w, g, buf; writes w, buf"
                                        : "reads w, g; writes w");
    fmt::print("# mem: best of {} same-shape triads over the same buffers and threads; ratio = eff / mem\n",
               std::max<int64_t>(c.iters, 5));
    if (torch.available) {
      fmt::print("# torch: {} {}(foreach=True) via {}, one flat tensor, median step; speedup = torch / tandem\n",
                 torch.version,
                 c.optimizer == "adamw"  ? "torch.optim.AdamW"
                 : c.optimizer == "adam" ? "torch.optim.Adam"
                                         : "torch.optim.SGD",
                 torch.python);
    } else {
      fmt::print("# torch: unavailable ({})\n", torch.reason);
    }
    fmt::print("#\n# {:>10} {:>10} {:>10} {:>8} {:>8} {:>6} {:>10} {:>8} {:>7}\n", "params", "bytes", "time", "eff",
               "mem", "ratio", "torch", "speedup", "#wrong");
    fmt::print("# {:>10} {:>10} {:>10} {:>8} {:>8} {:>6} {:>10} {:>8} {:>7}\n", "", "(MB)", "(ms)", "(GB/s)", "(GB/s)",
               "", "(ms)", "", "");
  }
  ThreadPool pool(c.threads);
  uint64_t total_wrong = 0;
  for (uint64_t n : c.params) {
    fmt::print(stderr, "bench optimizer: {} params: {} + {} steps...\n", FormatCount(n), c.warmup, c.iters);
    Row row = Measure(c, o, pool, n);
    for (const TorchResult::Time& t : torch.seconds) {
      if (t.params != n) continue;
      row.torch_seconds = t.median;
      row.torch_best_seconds = t.best;
    }
    total_wrong += row.wrong;
    const double bytes = static_cast<double>(bytes_per_param) * static_cast<double>(n);
    const double eff = bytes / row.seconds / 1e9;
    const double mem = bytes / row.triad_seconds / 1e9;
    std::optional<double> speedup;
    if (row.torch_seconds) speedup = *row.torch_seconds / row.seconds;
    if (c.json) {
      fmt::print(
          "{{\"optimizer\": \"{}\", \"momentum\": {}, \"params\": {}, \"threads\": {}, \"bytes_per_param\": {}, "
          "\"seconds_per_step\": {}, "
          "\"best_seconds_per_step\": {}, \"effective_gbps\": {}, \"memory_gbps\": {}, \"bandwidth_ratio\": {}, "
          "\"torch_seconds_per_step\": {}, \"torch_best_seconds_per_step\": {}, \"torch_speedup\": {}, "
          "\"torch_version\": {}, \"torch_unavailable\": {}, \"wrong\": {}}}\n",
          o.name(), c.optimizer == "sgd" ? JsonNumber(c.momentum, 6) : "null", n, c.threads, bytes_per_param,
          JsonNumber(row.seconds, 6), JsonNumber(row.best_seconds, 6), JsonNumber(eff, 5), JsonNumber(mem, 5),
          JsonNumber(eff / mem, 4), JsonNumber(row.torch_seconds, 6), JsonNumber(row.torch_best_seconds, 6),
          JsonNumber(speedup, 4), torch.available ? JsonQuote(torch.version) : "null",
          torch.available ? "null" : JsonQuote(torch.reason), row.wrong);
    } else {
      fmt::print("  {:>10} {:>10.1f} {:>10.3f} {:>8.2f} {:>8.2f} {:>6.2f} {:>10} {:>8} {:>7}\n", FormatCount(n),
                 bytes / 1e6, row.seconds * 1e3, eff, mem, eff / mem,
                 row.torch_seconds ? fmt::format("{:.3f}", *row.torch_seconds * 1e3) : "n/a",
                 speedup ? fmt::format("{:.2f}", *speedup) : "n/a", row.wrong);
    }
  }
  if (!c.json) fmt::print("# {} wrong elements in total\n", total_wrong);
  return total_wrong == 0 ? 0 : 3;
}

}  // namespace tandem::cli
