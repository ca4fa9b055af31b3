// tandem bench model: the reference model's forward and backward (one
// training step's compute, no communication) on the CPU and on a GPU, side
// by side in one run, and PyTorch's eager fp32 version of the same model on
// the same GPU as the baseline (bench/torch_model.py).
//
// For each batch size: the median over --iters timed steps (after --warmup)
// of Forward + Backward, tokens/s (batch × context / step time), and the
// GPU's loss and gradients checked against the CPU's on the first step
// (max relative difference, as the GPU test bounds it). gpu_vs_cpu is the
// GPU's tokens/s over the CPU's; gpu_vs_torch over PyTorch's.
#include <stdio.h>

#include <chrono>
#include <cmath>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "cli/commands.h"
#include "common/config.h"
#include "worker/model/model.h"
#include "worker/nccl/gpu_info.h"

#ifndef TANDEM_SOURCE_DIR
#define TANDEM_SOURCE_DIR "."
#endif

namespace tandem::cli {
namespace {

using Clock = std::chrono::steady_clock;

struct Timing {
  double step_ms = 0;
  double tokens_per_second = 0;
  float loss = 0;
};

// Median Forward + Backward over `iters` steps after `warmup`, on one batch.
Result<Timing> TimeSteps(model::Model& m, const std::vector<uint8_t>& tokens, const std::vector<uint8_t>& targets,
                         int batch, int64_t warmup, int64_t iters) {
  std::vector<double> ms;
  Timing t;
  for (int64_t i = 0; i < warmup + iters; ++i) {
    const auto start = Clock::now();
    auto loss = m.Forward(tokens.data(), targets.data(), batch);
    if (!loss.ok()) return loss.status();
    TANDEM_RETURN_IF_ERROR(m.Backward());
    if (i >= warmup) ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - start).count());
    t.loss = *loss;
  }
  t.step_ms = Median(ms);
  t.tokens_per_second = static_cast<double>(batch) * m.config().context / (t.step_ms / 1e3);
  return t;
}

// PyTorch's step time in ms per batch size, or why there is none.
struct TorchRows {
  std::vector<std::optional<double>> ms;
  std::string problem;
};

TorchRows RunTorch(const std::string& python, const std::string& script, const model::ModelConfig& c,
                   const std::vector<int64_t>& batches, int64_t warmup, int64_t iters) {
  TorchRows rows;
  rows.ms.resize(batches.size());
  std::string list;
  for (int64_t b : batches) list += (list.empty() ? "" : ",") + std::to_string(b);
  const std::string cmd =
      fmt::format("{} {} --context {} --d-model {} --heads {} --layers {} --batches {} --warmup {} --iters {} 2>&1",
                  python, script, c.context, c.d_model, c.heads, c.layers, list, warmup, iters);
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) {
    rows.problem = "could not start " + python;
    return rows;
  }
  std::string out;
  char buf[4096];
  while (fgets(buf, sizeof(buf), pipe) != nullptr) out += buf;
  const int rc = pclose(pipe);
  // Lines "batch ms" for each batch, or one line "unavailable: why".
  size_t at = 0;
  while (at < out.size()) {
    const size_t end = out.find('\n', at);
    const std::string line = out.substr(at, end == std::string::npos ? std::string::npos : end - at);
    at = end == std::string::npos ? out.size() : end + 1;
    if (line.starts_with("unavailable: ")) rows.problem = line.substr(13);
    int64_t b = 0;
    double ms = 0;
    if (sscanf(line.c_str(), "%ld %lf", &b, &ms) == 2) {
      for (size_t i = 0; i < batches.size(); ++i) {
        if (batches[i] == b) rows.ms[i] = ms;
      }
    }
  }
  if (rc != 0 && rows.problem.empty()) rows.problem = fmt::format("{} exited with {}: {}", python, rc, out);
  return rows;
}

}  // namespace

int BenchModelCommand(int argc, char** argv) {
  model::ModelConfig c;
  std::string batches_text = "8,32,128";
  int64_t warmup = 3, iters = 20, device = 0, blas_threads = 0;
  bool json = false, torch = true, cpu = true;
  std::string python = "python3";
  std::string script = std::string(TANDEM_SOURCE_DIR) + "/bench/torch_model.py";
  int64_t context = c.context, d_model = c.d_model, heads = c.heads, layers = c.layers;
  OptionSet options("tandem bench model",
                    "the reference model's forward and backward on the CPU and on a GPU, and PyTorch's on the same "
                    "GPU, side by side");
  options.String("batches", &batches_text, "comma-separated batch sizes (sequences per step)");
  options.Int("context", &context, "tokens per sequence", 1, 1 << 16);
  options.Int("d_model", &d_model, "width of the model", 1, 1 << 16);
  options.Int("heads", &heads, "attention heads (divides d_model)", 1, 1 << 10);
  options.Int("layers", &layers, "transformer blocks", 1, 1 << 10);
  options.Int("warmup", &warmup, "untimed steps first", 0, 1 << 20);
  options.Int("iters", &iters, "timed steps (the median is reported)", 1, 1 << 20);
  options.Int("device", &device, "the CUDA device", 0, 1024);
  options.Int("blas_threads", &blas_threads, "BLAS threads of the CPU run (0: one per CPU)", 0, 1024);
  options.Bool("cpu", &cpu, "also time the CPU (and check the GPU against it)");
  options.Bool("torch", &torch, "also time PyTorch on the same GPU (bench/torch_model.py)");
  options.String("python", &python, "the Python with PyTorch");
  options.String("torch_script", &script, "PyTorch's version of the model (bench/torch_model.py)");
  options.Bool("json", &json, "print one JSON object per batch size instead of the table");
  if (int rc = ParseOrExit(options, argc, argv); rc >= 0) return rc;
  std::vector<int64_t> batches;
  for (const std::string& item : SplitList(batches_text)) {
    char* end = nullptr;
    const long long v = std::strtoll(item.c_str(), &end, 10);
    if (end == item.c_str() || *end != '\0' || v < 1 || v > (1 << 20)) {
      fmt::print(stderr, "tandem bench model: --batches: '{}' is not a batch size (1 to {})\n", item, 1 << 20);
      return 2;
    }
    batches.push_back(v);
  }
  if (batches.empty()) {
    fmt::print(stderr, "tandem bench model: --batches: name at least one batch size\n");
    return 2;
  }
  c.context = static_cast<int>(context);
  c.d_model = static_cast<int>(d_model);
  c.heads = static_cast<int>(heads);
  c.layers = static_cast<int>(layers);
  c.blas_threads = static_cast<int>(blas_threads);
  if (Status s = c.Validate(); !s.ok()) {
    fmt::print(stderr, "tandem bench model: {}\n", s.message());
    return 2;
  }
  if (blas_threads == 0) model::SetBlasThreads(static_cast<int>(std::thread::hardware_concurrency()));
  model::ModelConfig g = c;
  g.gpu = static_cast<int>(device);
  auto cpu_model = model::Model::Create(c);
  auto gpu_model = model::Model::Create(g);
  if (!cpu_model.ok()) {
    fmt::print(stderr, "tandem bench model: {}\n", cpu_model.status().ToString());
    return 1;
  }
  if (!gpu_model.ok()) {
    fmt::print(stderr, "tandem bench model: {}\n", gpu_model.status().message());
    return 1;
  }
  TorchRows torch_rows;
  if (torch) {
    torch_rows = RunTorch(python, script, c, batches, warmup, iters);
  } else {
    torch_rows.ms.resize(batches.size());
    torch_rows.problem = "not asked for (--torch=false)";
  }
  if (!json) {
    fmt::print(
        "# tandem bench model: {} layers x d_model {}, {} heads, context {}, {} parameters; forward + backward, "
        "median of {} steps after {}\n",
        c.layers, c.d_model, c.heads, c.context, cpu_model->num_parameters(), iters, warmup);
    fmt::print("# GPU: {}; CPU: {} BLAS thread(s); PyTorch: {}\n", gpu_model->gpu_description(),
               blas_threads == 0 ? std::thread::hardware_concurrency() : static_cast<unsigned>(blas_threads),
               torch_rows.problem.empty() ? "eager fp32 on the same GPU" : torch_rows.problem);
    fmt::print("{:>6} {:>10} {:>12} {:>10} {:>12} {:>10} {:>12} {:>10} {:>12} {:>10} {:>10}\n", "batch", "cpu ms",
               "cpu tok/s", "gpu ms", "gpu tok/s", "torch ms", "torch tok/s", "gpu/cpu", "gpu/torch", "loss diff",
               "grad diff");
  }
  int rc = 0;
  std::mt19937_64 rng(1);
  for (size_t i = 0; i < batches.size(); ++i) {
    const int batch = static_cast<int>(batches[i]);
    const size_t n = static_cast<size_t>(batch) * static_cast<size_t>(c.context);
    std::vector<uint8_t> tokens(n), targets(n);
    for (size_t k = 0; k < n; ++k) {
      tokens[k] = static_cast<uint8_t>(rng() % 256);
      targets[k] = static_cast<uint8_t>(rng() % 256);
    }
    // The check: one step on each, compared.
    std::optional<double> loss_diff, grad_diff;
    if (cpu) {
      auto lc = cpu_model->Forward(tokens.data(), targets.data(), batch);
      auto lg = gpu_model->Forward(tokens.data(), targets.data(), batch);
      if (!lc.ok() || !lg.ok() || !cpu_model->Backward().ok() || !gpu_model->Backward().ok()) {
        fmt::print(stderr, "tandem bench model: batch {}: the checked step failed: {}\n", batch,
                   (!lg.ok() ? lg.status() : lc.status()).ToString());
        return 1;
      }
      loss_diff = std::abs(*lg - *lc) / std::abs(*lc);
      grad_diff = model::RelativeDifference(gpu_model->grads(), cpu_model->grads());
      if (*loss_diff > 1e-4 || *grad_diff > 1e-3) rc = 1;
    }
    std::optional<Timing> tc;
    if (cpu) {
      auto t = TimeSteps(*cpu_model, tokens, targets, batch, warmup, iters);
      if (!t.ok()) {
        fmt::print(stderr, "tandem bench model: CPU, batch {}: {}\n", batch, t.status().ToString());
        return 1;
      }
      tc = *t;
    }
    auto tg = TimeSteps(*gpu_model, tokens, targets, batch, warmup, iters);
    if (!tg.ok()) {
      fmt::print(stderr, "tandem bench model: GPU, batch {}: {}\n", batch, tg.status().ToString());
      return 1;
    }
    const std::optional<double> torch_ms = torch_rows.ms[i];
    const std::optional<double> torch_tps =
        torch_ms ? std::optional<double>(static_cast<double>(n) / (*torch_ms / 1e3)) : std::nullopt;
    const std::optional<double> vs_cpu =
        tc ? std::optional<double>(tg->tokens_per_second / tc->tokens_per_second) : std::nullopt;
    const std::optional<double> vs_torch =
        torch_tps ? std::optional<double>(tg->tokens_per_second / *torch_tps) : std::nullopt;
    const auto cell = [](std::optional<double> v, int prec) {
      return v ? fmt::format("{:.{}f}", *v, prec) : std::string("-");
    };
    const auto sci = [](std::optional<double> v) { return v ? fmt::format("{:.1e}", *v) : std::string("-"); };
    if (json) {
      fmt::print(
          "{{\"batch\":{},\"tokens\":{},\"cpu_ms\":{},\"cpu_tokens_per_second\":{},\"gpu_ms\":{},"
          "\"gpu_tokens_per_second\":{},\"torch_ms\":{},\"torch_tokens_per_second\":{},\"gpu_vs_cpu\":{},"
          "\"gpu_vs_torch\":{},\"loss_rel_diff\":{},\"grad_rel_diff\":{},\"torch_problem\":{}}}\n",
          batch, n, JsonNumber(tc ? std::optional<double>(tc->step_ms) : std::nullopt, 5),
          JsonNumber(tc ? std::optional<double>(tc->tokens_per_second) : std::nullopt, 6), JsonNumber(tg->step_ms, 5),
          JsonNumber(tg->tokens_per_second, 6), JsonNumber(torch_ms, 5), JsonNumber(torch_tps, 6),
          JsonNumber(vs_cpu, 4), JsonNumber(vs_torch, 4), JsonNumber(loss_diff, 3), JsonNumber(grad_diff, 3),
          torch_rows.problem.empty() ? std::string("null") : JsonQuote(torch_rows.problem));
    } else {
      fmt::print("{:>6} {:>10} {:>12} {:>10.3f} {:>12.0f} {:>10} {:>12} {:>10} {:>12} {:>10} {:>10}\n", batch,
                 cell(tc ? std::optional<double>(tc->step_ms) : std::nullopt, 3),
                 cell(tc ? std::optional<double>(tc->tokens_per_second) : std::nullopt, 0), tg->step_ms,
                 tg->tokens_per_second, cell(torch_ms, 3), cell(torch_tps, 0), cell(vs_cpu, 2), cell(vs_torch, 2),
                 sci(loss_diff), sci(grad_diff));
    }
    fflush(stdout);
  }
  if (rc != 0) fmt::print(stderr, "tandem bench model: the GPU's loss or gradients differ from the CPU's\n");
  return rc;
}

}  // namespace tandem::cli
