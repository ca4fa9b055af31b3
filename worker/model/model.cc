// The reference model's layout, initialisation, forward and backward
// (model.h). The kernels follow the usual formulation of a GPT-2 style
// decoder (as in llm.c): every backward kernel adds into the parameter
// gradients, so GradMode only decides whether they are zeroed first.
//
// Flat parameter order (the tensor table):
//   wte.weight [V, C], wpe.weight [T, C],
//   per block l = 0 .. L-1:
//     blocks.l.ln1.weight [C], blocks.l.ln1.bias [C],
//     blocks.l.attn.qkv.weight [3C, C], blocks.l.attn.qkv.bias [3C],
//     blocks.l.attn.proj.weight [C, C], blocks.l.attn.proj.bias [C],
//     blocks.l.ln2.weight [C], blocks.l.ln2.bias [C],
//     blocks.l.mlp.fc.weight [4C, C], blocks.l.mlp.fc.bias [4C],
//     blocks.l.mlp.proj.weight [C, 4C], blocks.l.mlp.proj.bias [C],
//   ln_f.weight [C], ln_f.bias [C], head.weight [V, C].
// The qkv output of a position is [q | k | v], each [heads, C/heads].
// Backward finishes the head and ln_f first, then the blocks from last to
// first, then the embeddings: the reverse of this order, so what is final at
// any point is a suffix of the flat buffer, which Backward's on_ready reports
// by its first element. No parameter is used in two places (head is not tied
// to wte), so each tensor is final as soon as backward has passed it.
//
// With activation checkpointing Forward runs every block through the one
// shared activation slot and keeps only the block outputs (res_mlp_, which
// are also the next blocks' inputs). Backward recomputes block l into that
// slot from its input with the same BlockInternals call as Forward, so the
// recomputed activations, and everything after, are bit for bit those of a
// run without checkpointing.
#include "worker/model/model.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>
#include <random>

namespace tandem::model {
// Normal samples that are the same on every platform: mt19937_64 is fully
// specified by the standard, std::normal_distribution is not.
class Normal {
 public:
  explicit Normal(uint64_t seed) : engine_(seed) {}
  float Next() {
    if (have_spare_) {
      have_spare_ = false;
      return static_cast<float>(spare_);
    }
    // Two uniforms in (0, 1] from the top 53 bits.
    const double u1 = (static_cast<double>(engine_() >> 11) + 1.0) * 0x1.0p-53;
    const double u2 = static_cast<double>(engine_() >> 11) * 0x1.0p-53;
    const double r = std::sqrt(-2.0 * std::log(u1));
    const double theta = 2.0 * std::numbers::pi * u2;
    spare_ = r * std::sin(theta);
    have_spare_ = true;
    return static_cast<float>(r * std::cos(theta));
  }

 private:
  std::mt19937_64 engine_;
  double spare_ = 0;
  bool have_spare_ = false;
};

namespace {

constexpr float kLnEps = 1e-5f;
constexpr int64_t kMaxParameters = int64_t{1} << 31;  // BLAS dimensions are ints

// out[N, OC] += b
void AddBias(float* out, const float* b, int n, int oc) {
  for (int i = 0; i < n; ++i) {
    float* row = out + static_cast<size_t>(i) * oc;
    for (int o = 0; o < oc; ++o) row[o] += b[o];
  }
}

// out[N, OC] = inp[N, IC] · w[OC, IC]ᵀ + b
void LinearForward(float* out, const float* inp, const float* w, const float* b, int n, int ic, int oc) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, oc, ic, 1.0f, inp, ic, w, ic, 0.0f, out, oc);
  if (b != nullptr) AddBias(out, b, n, oc);
}

// dinp = dout · w (overwritten); dw += doutᵀ · inp; db += Σ rows of dout.
void LinearBackward(float* dinp, float* dw, float* db, const float* dout, const float* inp, const float* w, int n,
                    int ic, int oc) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, ic, oc, 1.0f, dout, oc, w, ic, 0.0f, dinp, ic);
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, oc, ic, n, 1.0f, dout, oc, inp, ic, 1.0f, dw, ic);
  if (db == nullptr) return;
  for (int i = 0; i < n; ++i) {
    const float* row = dout + static_cast<size_t>(i) * oc;
    for (int o = 0; o < oc; ++o) db[o] += row[o];
  }
}

void LayerNormForward(float* out, float* mean, float* rstd, const float* inp, const float* w, const float* b, int n,
                      int c) {
  for (int i = 0; i < n; ++i) {
    const float* x = inp + static_cast<size_t>(i) * c;
    float* y = out + static_cast<size_t>(i) * c;
    float m = 0;
    for (int j = 0; j < c; ++j) m += x[j];
    m /= static_cast<float>(c);
    float v = 0;
    for (int j = 0; j < c; ++j) v += (x[j] - m) * (x[j] - m);
    v /= static_cast<float>(c);
    const float s = 1.0f / std::sqrt(v + kLnEps);
    for (int j = 0; j < c; ++j) y[j] = (x[j] - m) * s * w[j] + b[j];
    mean[i] = m;
    rstd[i] = s;
  }
}

// dinp += ∂/∂inp (accumulates: the input is the residual stream); dw, db +=.
void LayerNormBackward(float* dinp, float* dw, float* db, const float* dout, const float* inp, const float* w,
                       const float* mean, const float* rstd, int n, int c) {
  for (int i = 0; i < n; ++i) {
    const float* x = inp + static_cast<size_t>(i) * c;
    const float* dy = dout + static_cast<size_t>(i) * c;
    float* dx = dinp + static_cast<size_t>(i) * c;
    const float m = mean[i];
    const float s = rstd[i];
    float dnorm_mean = 0;
    float dnorm_norm_mean = 0;
    for (int j = 0; j < c; ++j) {
      const float norm = (x[j] - m) * s;
      const float dnorm = w[j] * dy[j];
      dnorm_mean += dnorm;
      dnorm_norm_mean += dnorm * norm;
    }
    dnorm_mean /= static_cast<float>(c);
    dnorm_norm_mean /= static_cast<float>(c);
    for (int j = 0; j < c; ++j) {
      const float norm = (x[j] - m) * s;
      const float dnorm = w[j] * dy[j];
      db[j] += dy[j];
      dw[j] += norm * dy[j];
      dx[j] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
    }
  }
}

const float kGeluScale = static_cast<float>(std::sqrt(2.0 / std::numbers::pi));

void GeluForward(float* out, const float* inp, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const float x = inp[i];
    out[i] = 0.5f * x * (1.0f + std::tanh(kGeluScale * (x + 0.044715f * x * x * x)));
  }
}

// dinout: in, ∂L/∂gelu(x); out, ∂L/∂x.
void GeluBackward(float* dinout, const float* inp, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const float x = inp[i];
    const float t = std::tanh(kGeluScale * (x + 0.044715f * x * x * x));
    const float local = 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
    dinout[i] *= local;
  }
}

// Causal self-attention of B sequences of T positions: qkv [B, T, 3C] →
// out [B, T, C]; att [B, H, T, T] keeps the probabilities (zero above the
// diagonal).
void AttentionForward(float* out, float* att, const float* qkv, int B, int T, int C, int H) {
  const int hs = C / H;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      const float* q = qkv + static_cast<size_t>(b) * T * 3 * C + static_cast<size_t>(h) * hs;
      const float* k = q + C;
      const float* v = q + 2 * static_cast<ptrdiff_t>(C);
      float* a = att + (static_cast<size_t>(b) * H + h) * T * T;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, T, hs, scale, q, 3 * C, k, 3 * C, 0.0f, a, T);
      for (int i = 0; i < T; ++i) {
        float* row = a + static_cast<size_t>(i) * T;
        float mx = row[0];
        for (int j = 1; j <= i; ++j) mx = std::max(mx, row[j]);
        float sum = 0;
        for (int j = 0; j <= i; ++j) {
          row[j] = std::exp(row[j] - mx);
          sum += row[j];
        }
        const float inv = 1.0f / sum;
        for (int j = 0; j <= i; ++j) row[j] *= inv;
        for (int j = i + 1; j < T; ++j) row[j] = 0.0f;
      }
      float* y = out + static_cast<size_t>(b) * T * C + static_cast<size_t>(h) * hs;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, hs, T, 1.0f, a, T, v, 3 * C, 0.0f, y, C);
    }
  }
}

// dqkv [B, T, 3C] (overwritten) from dout [B, T, C]; scratch [T, T].
void AttentionBackward(float* dqkv, float* scratch, const float* dout, const float* qkv, const float* att, int B, int T,
                       int C, int H) {
  const int hs = C / H;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      const size_t base = static_cast<size_t>(b) * T * 3 * C + static_cast<size_t>(h) * hs;
      const float* q = qkv + base;
      const float* k = q + C;
      const float* v = q + 2 * static_cast<ptrdiff_t>(C);
      float* dq = dqkv + base;
      float* dk = dq + C;
      float* dv = dq + 2 * static_cast<ptrdiff_t>(C);
      const float* a = att + (static_cast<size_t>(b) * H + h) * T * T;
      const float* dy = dout + static_cast<size_t>(b) * T * C + static_cast<size_t>(h) * hs;
      // datt = dy · vᵀ; dv = attᵀ · dy
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, T, T, hs, 1.0f, dy, C, v, 3 * C, 0.0f, scratch, T);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, T, hs, T, 1.0f, a, T, dy, C, 0.0f, dv, 3 * C);
      // Softmax backward, in place: dpre = att ⊙ (datt - Σ att ⊙ datt). Masked entries have att = 0.
      for (int i = 0; i < T; ++i) {
        const float* arow = a + static_cast<size_t>(i) * T;
        float* drow = scratch + static_cast<size_t>(i) * T;
        float dot = 0;
        for (int j = 0; j <= i; ++j) dot += arow[j] * drow[j];
        for (int j = 0; j < T; ++j) drow[j] = arow[j] * (drow[j] - dot);
      }
      // dq = scale · dpre · k; dk = scale · dpreᵀ · q
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, T, hs, T, scale, scratch, T, k, 3 * C, 0.0f, dq, 3 * C);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, T, hs, T, scale, scratch, T, q, 3 * C, 0.0f, dk, 3 * C);
    }
  }
}

// Replaces v by n zeros with exactly n allocated (the old buffer freed first),
// so a smaller batch gives memory back and activation_bytes() is what is held.
template <typename T>
void Reallocate(std::vector<T>& v, size_t n) {
  v = std::vector<T>();
  v.resize(n);
}

}  // namespace

Status ModelConfig::Validate() const {
  if (vocab < 2 || vocab > 256) {
    return InvalidArgument("model vocab: must be 2 to 256 (tokens are bytes), got {}", vocab);
  }
  if (context < 1 || context > 65536) return InvalidArgument("model context: must be 1 to 65536, got {}", context);
  if (d_model < 1 || d_model > 65536) return InvalidArgument("model d_model: must be 1 to 65536, got {}", d_model);
  if (heads < 1) return InvalidArgument("model heads: must be at least 1, got {}", heads);
  if (d_model % heads != 0) {
    return InvalidArgument("model heads: must divide d_model ({}), got {}", d_model, heads);
  }
  if (layers < 1 || layers > 1024) return InvalidArgument("model layers: must be 1 to 1024, got {}", layers);
  if (mlp_ratio < 1 || mlp_ratio > 64) return InvalidArgument("model mlp_ratio: must be 1 to 64, got {}", mlp_ratio);
  if (pipeline_stages < 1 || pipeline_stages > layers) {
    return InvalidArgument(
        "model pipeline_stages: must be 1 to layers ({}): each stage holds at least one block, got {}", layers,
        pipeline_stages);
  }
  if (pipeline_stage < 0 || pipeline_stage >= pipeline_stages) {
    return InvalidArgument("model pipeline_stage: must be 0 to pipeline_stages - 1 ({}), got {}", pipeline_stages - 1,
                           pipeline_stage);
  }
  if (tensor_parallel < 1 || tensor_parallel > 1024) {
    return InvalidArgument("model tensor_parallel: must be 1 to 1024, got {}", tensor_parallel);
  }
  if (heads % tensor_parallel != 0) {
    return InvalidArgument(
        "model tensor_parallel: must divide the attention heads ({}): each rank computes whole heads, got {}", heads,
        tensor_parallel);
  }
  if (vocab % tensor_parallel != 0) {
    return InvalidArgument(
        "model tensor_parallel: must divide the vocabulary ({}): each rank holds an equal slice of the embedding and "
        "the head, got {}",
        vocab, tensor_parallel);
  }
  if (tensor_rank < 0 || tensor_rank >= tensor_parallel) {
    return InvalidArgument("model tensor_rank: must be 0 to tensor_parallel - 1 ({}), got {}", tensor_parallel - 1,
                           tensor_rank);
  }
  if (gpu < -1) return InvalidArgument("model gpu: must be -1 (the CPU) or a CUDA device index, got {}", gpu);
  if (gpu >= 0 && (pipeline_stages != 1 || tensor_parallel != 1)) {
    return InvalidArgument(
        "model gpu: the GPU path runs the whole model (pipeline_stages 1, tensor_parallel 1), got pipeline_stages {} "
        "and tensor_parallel {}",
        pipeline_stages, tensor_parallel);
  }
  if (gpu >= 0 && activation_checkpointing) {
    return InvalidArgument("model gpu: activation_checkpointing is for the CPU path; the GPU keeps every activation");
  }
  if (blas_threads < 0 || blas_threads > 1024) {
    return InvalidArgument("model blas_threads: must be 0 (leave as is) to 1024, got {}", blas_threads);
  }
  const int64_t c = d_model;
  const int64_t per_block = 4 * c + (3 * c * c + 3 * c) + (c * c + c) + 2 * (mlp_ratio * c * c) + mlp_ratio * c + c;
  const int64_t total = 2 * c * vocab + context * c + layers * per_block + 2 * c;
  if (total > kMaxParameters) {
    return InvalidArgument("model: {} parameters is more than the {} this model supports", total, kMaxParameters);
  }
  return Status::Ok();
}

namespace {

// The whole model's tensor table (whatever the tensor rank).
std::vector<TensorInfo> WholeLayout(const ModelConfig& config) {
  std::vector<TensorInfo> out;
  size_t offset = 0;
  auto add = [&](std::string name, std::vector<int64_t> shape, bool no_decay) {
    size_t size = 1;
    for (int64_t d : shape) size *= static_cast<size_t>(d);
    TensorInfo& info = out.emplace_back();
    info.name = std::move(name);
    info.shape = std::move(shape);
    info.offset = offset;
    info.size = size;
    info.no_decay = no_decay;
    // All of the whole tensor.
    info.whole_offset = offset;
    info.whole_size = size;
    info.whole_cols = info.shape.size() > 1 ? info.shape[1] : 1;
    info.rows = {{0, info.shape[0]}};
    info.col_end = info.whole_cols;
    offset += size;
  };
  const int64_t v = config.vocab, t = config.context, c = config.d_model, f = int64_t{config.mlp_ratio} * c;
  add("wte.weight", {v, c}, true);
  add("wpe.weight", {t, c}, true);
  for (int l = 0; l < config.layers; ++l) {
    const std::string p = "blocks." + std::to_string(l) + ".";
    add(p + "ln1.weight", {c}, true);
    add(p + "ln1.bias", {c}, true);
    add(p + "attn.qkv.weight", {3 * c, c}, false);
    add(p + "attn.qkv.bias", {3 * c}, true);
    add(p + "attn.proj.weight", {c, c}, false);
    add(p + "attn.proj.bias", {c}, true);
    add(p + "ln2.weight", {c}, true);
    add(p + "ln2.bias", {c}, true);
    add(p + "mlp.fc.weight", {f, c}, false);
    add(p + "mlp.fc.bias", {f}, true);
    add(p + "mlp.proj.weight", {c, f}, false);
    add(p + "mlp.proj.bias", {c}, true);
  }
  add("ln_f.weight", {c}, true);
  add("ln_f.bias", {c}, true);
  add("head.weight", {v, c}, false);
  return out;
}

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// Cuts a whole tensor to tensor rank r of tp (Megatron's split; see model.h).
void Slice(TensorInfo& t, const ModelConfig& config) {
  const int64_t tp = config.tensor_parallel, r = config.tensor_rank;
  if (tp == 1) return;
  const int64_t c = config.d_model, rows = t.shape[0];
  const auto split_rows = [&] {
    const int64_t n = rows / tp;
    t.rows = {{r * n, (r + 1) * n}};
  };
  if (t.name == "wte.weight" || t.name == "head.weight" || EndsWith(t.name, "mlp.fc.weight") ||
      EndsWith(t.name, "mlp.fc.bias")) {
    split_rows();  // vocabulary-parallel, or column-parallel
  } else if (EndsWith(t.name, "attn.qkv.weight") || EndsWith(t.name, "attn.qkv.bias")) {
    const int64_t n = c / tp;  // the rank's heads, in each of q, k and v
    t.rows = {{r * n, (r + 1) * n}, {c + r * n, c + (r + 1) * n}, {2 * c + r * n, 2 * c + (r + 1) * n}};
  } else if (EndsWith(t.name, "attn.proj.weight") || EndsWith(t.name, "mlp.proj.weight")) {
    const int64_t n = t.whole_cols / tp;  // row-parallel: the columns of the rank's inputs
    t.col_begin = r * n;
    t.col_end = (r + 1) * n;
  } else {
    return;  // replicated
  }
  t.replicated = false;
  int64_t kept_rows = 0;
  for (const auto& [b, e] : t.rows) kept_rows += e - b;
  if (t.shape.size() > 1) {
    t.shape = {kept_rows, t.col_end - t.col_begin};
  } else {
    t.shape = {kept_rows};
  }
  t.size = static_cast<size_t>(kept_rows * (t.col_end - t.col_begin));
}

}  // namespace

double RelativeDifference(std::span<const float> a, std::span<const float> b) {
  double worst = 0, scale = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    worst = std::max(worst, std::abs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::abs(static_cast<double>(b[i])));
  }
  return worst / (scale > 0 ? scale : 1.0);
}

size_t WholeElement(const TensorInfo& t, size_t i) {
  const auto cols = static_cast<size_t>(t.col_end - t.col_begin);
  size_t row = i / cols;
  const size_t col = i % cols;
  for (const auto& [b, e] : t.rows) {
    const auto n = static_cast<size_t>(e - b);
    if (row < n) {
      return t.whole_offset + (static_cast<size_t>(b) + row) * static_cast<size_t>(t.whole_cols) +
             static_cast<size_t>(t.col_begin) + col;
    }
    row -= n;
  }
  return t.whole_offset + t.whole_size;  // unreachable for i < t.size
}

std::vector<TensorInfo> TensorLayout(const ModelConfig& config) {
  std::vector<TensorInfo> out = WholeLayout(config);
  if (config.tensor_parallel == 1) return out;
  size_t offset = 0;
  for (TensorInfo& t : out) {
    Slice(t, config);
    t.offset = offset;
    offset += t.size;
  }
  return out;
}

std::vector<TensorInfo> ServerLayout(const ModelConfig& config) {
  const int tp = config.tensor_parallel;
  if (tp == 1) return TensorLayout(config);
  std::vector<TensorInfo> out;
  size_t base = 0;
  for (int s = 0; s < config.pipeline_stages; ++s) {
    for (int r = 0; r < tp; ++r) {
      ModelConfig c = config;
      c.tensor_rank = r;
      const StagePlan stage = PlanStages(c)[static_cast<size_t>(s)];
      for (TensorInfo t : TensorLayout(c)) {
        if (t.offset < stage.flat_begin || t.offset >= stage.flat_end) continue;
        t.offset = base + (t.offset - stage.flat_begin);
        t.name += fmt::format("@tp{}", r);
        t.copy = t.replicated && r > 0;
        out.push_back(std::move(t));
      }
      base += stage.flat_end - stage.flat_begin;
    }
  }
  return out;
}

std::vector<size_t> PartBounds(const ModelConfig& config) {
  std::vector<size_t> bounds = {0};
  for (int s = 0; s < config.pipeline_stages; ++s) {
    for (int r = 0; r < config.tensor_parallel; ++r) {
      ModelConfig c = config;
      c.tensor_rank = r;
      const StagePlan stage = PlanStages(c)[static_cast<size_t>(s)];
      bounds.push_back(bounds.back() + (stage.flat_end - stage.flat_begin));
    }
  }
  return bounds;
}

Status WriteWholeStage(const ModelConfig& config, int stage, const std::vector<std::span<const float>>& parts,
                       const std::function<Status(std::span<const float>)>& write) {
  const int tp = config.tensor_parallel;
  if (stage < 0 || stage >= config.pipeline_stages || parts.size() != static_cast<size_t>(tp)) {
    return InvalidArgument("writing the whole model's stage {} of {}: {} tensor-parallel parts for tp={}", stage,
                           config.pipeline_stages, parts.size(), tp);
  }
  // Each rank's tensors of the stage, in the whole model's order.
  std::vector<std::vector<TensorInfo>> ranks(static_cast<size_t>(tp));
  for (int r = 0; r < tp; ++r) {
    ModelConfig c = config;
    c.tensor_rank = r;
    const StagePlan plan = PlanStages(c)[static_cast<size_t>(stage)];
    if (parts[static_cast<size_t>(r)].size() != plan.flat_end - plan.flat_begin) {
      return InvalidArgument("writing the whole model's stage {}: rank {}'s part has {} elements, not {}", stage, r,
                             parts[static_cast<size_t>(r)].size(), plan.flat_end - plan.flat_begin);
    }
    for (TensorInfo t : TensorLayout(c)) {
      if (t.offset < plan.flat_begin || t.offset >= plan.flat_end) continue;
      t.offset -= plan.flat_begin;
      ranks[static_cast<size_t>(r)].push_back(std::move(t));
    }
  }
  std::vector<float> whole;
  for (size_t k = 0; k < ranks[0].size(); ++k) {
    const TensorInfo& first = ranks[0][k];
    if (first.replicated) {
      TANDEM_RETURN_IF_ERROR(write(parts[0].subspan(first.offset, first.size)));
      continue;
    }
    whole.assign(first.whole_size, 0.0f);
    for (int r = 0; r < tp; ++r) {
      const TensorInfo& t = ranks[static_cast<size_t>(r)][k];
      const float* from = parts[static_cast<size_t>(r)].data() + t.offset;
      for (size_t i = 0; i < t.size; ++i) whole[WholeElement(t, i) - t.whole_offset] = from[i];
    }
    TANDEM_RETURN_IF_ERROR(write(whole));
  }
  return Status::Ok();
}

std::vector<StagePlan> PlanStages(const ModelConfig& config) {
  const int L = config.layers, P = config.pipeline_stages;
  const double C = config.d_model, T = config.context, V = config.vocab, F = static_cast<double>(config.mlp_ratio) * C;
  // Forward multiply-adds per token: a block's four linear layers and its
  // attention (q·k and att·v over T/2 positions on average); the head's
  // linear layer and softmax; the embeddings' lookup and sum.
  const double block = 3 * C * C + C * C + 2 * F * C + T * C;
  const double head = C * V + 2 * V;
  const double embed = C;
  auto cost = [&](int first, int end, int stage) {
    return (end - first) * block + (stage == 0 ? embed : 0) + (stage == P - 1 ? head : 0);
  };
  // best[p][l]: the smallest largest-stage cost of blocks [0, l) in stages
  // [0, p); cut[p][l] the first block of stage p - 1 in it.
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(P + 1, std::vector<double>(L + 1, inf));
  std::vector<std::vector<int>> cut(P + 1, std::vector<int>(L + 1, 0));
  best[0][0] = 0;
  for (int p = 1; p <= P; ++p) {
    for (int l = p; l <= L; ++l) {
      for (int f = p - 1; f < l; ++f) {
        const double c = std::max(best[p - 1][f], cost(f, l, p - 1));
        if (c < best[p][l]) {
          best[p][l] = c;
          cut[p][l] = f;
        }
      }
    }
  }
  std::vector<StagePlan> stages(P);
  for (int p = P, l = L; p >= 1; l = cut[p][l], --p) {
    stages[p - 1].first_block = cut[p][l];
    stages[p - 1].end_block = l;
  }
  const std::vector<TensorInfo> layout = TensorLayout(config);
  const size_t per_block = (layout.size() - 5) / static_cast<size_t>(L);  // 2 embeddings, 3 head tensors
  for (int p = 0; p < P; ++p) {
    StagePlan& s = stages[p];
    s.embeddings = p == 0;
    s.head = p == P - 1;
    const size_t first = s.embeddings ? 0 : 2 + per_block * static_cast<size_t>(s.first_block);
    const size_t last = s.head ? layout.size() - 1 : 2 + per_block * static_cast<size_t>(s.end_block) - 1;
    s.flat_begin = layout[first].offset;
    s.flat_end = layout[last].offset + layout[last].size;
    s.cost = cost(s.first_block, s.end_block, p);
  }
  return stages;
}

void SetBlasThreads(int threads) {
#ifdef TANDEM_HAVE_OPENBLAS
  openblas_set_num_threads(std::max(threads, 1));
#else
  (void)threads;
#endif
}

Model::Model(const ModelConfig& config)
    : config_(config),
      layout_(TensorLayout(config)),
      stage_(PlanStages(config)[static_cast<size_t>(config.pipeline_stage)]),
      part_begin_(PartBounds(
          config)[static_cast<size_t>(config.pipeline_stage * config.tensor_parallel + config.tensor_rank)]) {
  const size_t n = stage_.flat_end - stage_.flat_begin;
  params_ = PageBuffer(n);
  grads_ = PageBuffer(n);
}

Result<Model> Model::Create(const ModelConfig& config, bool initialize) {
  TANDEM_RETURN_IF_ERROR(config.Validate());
  if (config.blas_threads > 0) SetBlasThreads(config.blas_threads);
  Model model(config);
  if (config.gpu >= 0) {
    std::vector<size_t> offsets;
    offsets.reserve(model.layout_.size());
    for (const TensorInfo& t : model.layout_) offsets.push_back(t.offset);
    const GpuModelShape shape{.vocab = config.vocab,
                              .context = config.context,
                              .d_model = config.d_model,
                              .heads = config.heads,
                              .layers = config.layers,
                              .mlp_ratio = config.mlp_ratio,
                              .gpu = config.gpu};
    auto engine = GpuEngine::Create(shape, std::move(offsets), model.params_.size());
    if (!engine.ok()) return engine.status();
    model.gpu_ = std::move(*engine);
  }
  if (initialize) model.Initialize();
  return model;
}

FlatRange Model::RangeOf(std::initializer_list<std::string> prefixes) const {
  size_t b = SIZE_MAX, e = 0;
  for (const TensorInfo& t : layout_) {
    for (const std::string& p : prefixes) {
      if (!t.name.starts_with(p)) continue;
      b = std::min(b, t.offset);
      e = std::max(e, t.offset + t.size);
    }
  }
  return FlatRange(b - stage_.flat_begin, e - stage_.flat_begin);
}

FlatRange Model::SegmentOf(int l) const {
  // Layout order: wte, wpe, blocks..., ln_f, head (see TensorLayout).
  if (l < 0) return RangeOf({"wte.", "wpe."});
  if (l >= config_.layers) return RangeOf({"ln_f.", "head."});
  return RangeOf({fmt::format("blocks.{}.", l)});
}

std::array<FlatRange, 4> Model::BlockParts(int l) const {
  // Within a block the layout is ln1, attn.qkv, attn.proj, ln2, mlp.fc,
  // mlp.proj: each part a contiguous run of it.
  const std::string p = fmt::format("blocks.{}.", l);
  return {RangeOf({p + "ln1.", p + "attn.qkv."}), RangeOf({p + "attn.proj.", p + "ln2."}), RangeOf({p + "mlp.fc."}),
          RangeOf({p + "mlp.proj."})};
}

std::vector<FlatRange> Model::Segments() const {
  std::vector<FlatRange> out;
  if (stage_.embeddings) out.push_back(SegmentOf(-1));
  for (int l = stage_.first_block; l < stage_.end_block; ++l) {
    for (const FlatRange& part : BlockParts(l)) out.push_back(part);
  }
  if (stage_.head) out.push_back(SegmentOf(config_.layers));
  return out;
}

InitialValueStream::InitialValueStream(const ModelConfig& config)
    : config_(config), layout_(ServerLayout(config)), normal_(std::make_unique<Normal>(config.seed)) {
  if (config.tensor_parallel > 1) {
    ModelConfig whole = config;
    whole.tensor_parallel = 1;
    whole.tensor_rank = 0;
    whole_ = std::make_unique<InitialValueStream>(whole);
  }
}

InitialValueStream::~InitialValueStream() = default;

void InitialValueStream::Fill(size_t begin, size_t end, float* out) {
  if (whole_) {
    // Each part's slices are cut from the whole tensor's values.
    for (const TensorInfo& t : layout_) {
      const size_t lo = std::max(begin, t.offset), hi = std::min(end, t.offset + t.size);
      if (lo >= hi) continue;
      if (cached_offset_ != t.whole_offset) {
        cached_.resize(t.whole_size);
        whole_->Fill(t.whole_offset, t.whole_offset + t.whole_size, cached_.data());
        cached_offset_ = t.whole_offset;
      }
      for (size_t i = lo; i < hi; ++i) out[i - begin] = cached_[WholeElement(t, i - t.offset) - t.whole_offset];
    }
    return;
  }
  if (begin < position_) {  // behind the stream: start it again
    normal_ = std::make_unique<Normal>(config_.seed);
    position_ = 0;
    tensor_ = 0;
  }
  const float residual_std = 0.02f / std::sqrt(2.0f * static_cast<float>(config_.layers));
  auto ends_with = [](const std::string& s, std::string_view suffix) {
    return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  // The whole model's values in layout order, from one random stream: a
  // range's values do not depend on where the range starts or ends. The
  // stream is at element position_ of tensor tensor_.
  for (; tensor_ < layout_.size() && layout_[tensor_].offset < end; ++tensor_) {
    const TensorInfo& t = layout_[tensor_];
    const size_t from = std::max(position_, t.offset);
    const size_t hi = std::min(end, t.offset + t.size);
    const size_t lo = std::max(begin, t.offset);
    const bool layer_norm = t.name.find("ln1.") != std::string::npos || t.name.find("ln2.") != std::string::npos ||
                            t.name.starts_with("ln_f.");
    if (ends_with(t.name, ".bias") || layer_norm) {
      if (lo < hi) {
        std::fill(out + (lo - begin), out + (hi - begin), layer_norm && !ends_with(t.name, ".bias") ? 1.0f : 0.0f);
      }
    } else {
      const bool residual = ends_with(t.name, "attn.proj.weight") || ends_with(t.name, "mlp.proj.weight");
      const float std = residual ? residual_std : 0.02f;
      // Draws from where the stream is to the end of the range; those
      // before the range only advance the stream.
      for (size_t i = from; i < hi; ++i) {
        const float v = std * normal_->Next();
        if (i >= lo) out[i - begin] = v;
      }
    }
    position_ = hi;
    if (hi < t.offset + t.size) return;  // the range ends inside this tensor
  }
  position_ = std::max(position_, end);
}

void InitialValues(const ModelConfig& config, size_t begin, size_t end, float* out) {
  InitialValueStream(config).Fill(begin, end, out);
}

void Model::Initialize() {
  InitialValues(config_, part_begin_, part_begin_ + params_.size(), params_.data());
}

std::vector<v1::TensorSpec> TensorSpecs(const std::vector<TensorInfo>& layout, size_t begin, size_t end) {
  std::vector<v1::TensorSpec> out;
  for (const TensorInfo& t : layout) {
    if (t.offset < begin || t.offset >= end) continue;
    v1::TensorSpec& spec = out.emplace_back();
    spec.set_name(t.name);
    for (int64_t d : t.shape) spec.add_shape(d);
    spec.set_dtype(v1::DTYPE_FLOAT32);
    spec.set_group(t.copy ? "tp_copy" : t.no_decay ? "no_decay" : "");
    spec.set_flat_offset(t.offset - begin);
  }
  return out;
}

std::vector<v1::TensorSpec> Model::Tensors() const {
  if (tp() == 1) return TensorSpecs(layout_, stage_.flat_begin, stage_.flat_end);
  return TensorSpecs(ServerLayout(config_), part_begin_, part_begin_ + params_.size());
}

void Model::ZeroGrads() {
  // With on-demand parameters (sharded placement) the gradient pages go
  // back to the kernel, so that only the ones backward writes come back;
  // otherwise clearing them in place avoids a page fault per page per step.
  if (access_.paged) {
    grads_.Zero();
  } else {
    std::fill(grads_.data(), grads_.data() + grads_.size(), 0.0f);
  }
}

Model::TensorViews Model::Bind(float* base) const {
  // Follows TensorLayout's order; the layout is the single source of offsets.
  // Tensors of other stages get no pointer.
  size_t i = 0;
  auto next = [&]() -> float* {
    const TensorInfo& t = layout_[i++];
    if (t.offset < stage_.flat_begin || t.offset >= stage_.flat_end) return nullptr;
    return base + (t.offset - stage_.flat_begin);
  };
  TensorViews v{};
  v.wte = next();
  v.wpe = next();
  v.blocks.resize(static_cast<size_t>(config_.layers));
  for (BlockTensors& b : v.blocks) {
    b.ln1_w = next();
    b.ln1_b = next();
    b.qkv_w = next();
    b.qkv_b = next();
    b.proj_w = next();
    b.proj_b = next();
    b.ln2_w = next();
    b.ln2_b = next();
    b.fc_w = next();
    b.fc_b = next();
    b.fcproj_w = next();
    b.fcproj_b = next();
  }
  v.lnf_w = next();
  v.lnf_b = next();
  v.head_w = next();
  return v;
}

void Model::EnsureWorkspace(int batch) {
  if (batch == batch_) return;
  batch_ = batch;
  const size_t L = static_cast<size_t>(stage_.end_block - stage_.first_block), B = static_cast<size_t>(batch);
  const size_t T = static_cast<size_t>(config_.context), C = static_cast<size_t>(config_.d_model);
  // This rank's widths (the whole model's without tensor parallelism).
  const size_t Cl = static_cast<size_t>(width_local()), H = static_cast<size_t>(heads_local());
  const size_t V = static_cast<size_t>(vocab_local()), F = static_cast<size_t>(hidden_local()), N = B * T;
  const size_t slots = config_.activation_checkpointing ? 1 : L;
  const size_t head = stage_.head ? 1 : 0;
  Reallocate(tokens_, N);
  Reallocate(targets_, N);
  Reallocate(encoded_, N * C);
  Reallocate(ln1_, slots * N * C);
  Reallocate(ln1_mean_, slots * N);
  Reallocate(ln1_rstd_, slots * N);
  Reallocate(qkv_, slots * N * 3 * Cl);
  Reallocate(att_, slots * B * H * T * T);
  Reallocate(atty_, slots * N * Cl);
  Reallocate(res_att_, slots * N * C);
  Reallocate(ln2_, slots * N * C);
  Reallocate(ln2_mean_, slots * N);
  Reallocate(ln2_rstd_, slots * N);
  Reallocate(fch_, slots * N * F);
  Reallocate(fch_gelu_, slots * N * F);
  Reallocate(res_mlp_, L * N * C);
  Reallocate(lnf_, head * N * C);
  Reallocate(lnf_mean_, head * N);
  Reallocate(lnf_rstd_, head * N);
  Reallocate(logits_, head * N * V);
  Reallocate(probs_, head * N * V);
  Reallocate(dres_, N * C);
  Reallocate(dln_, N * C);
  Reallocate(datty_, N * Cl);
  Reallocate(dqkv_, N * 3 * Cl);
  Reallocate(dfch_, N * F);
  Reallocate(datt_, T * T);
  Reallocate(dlogits_, head * N * V);
  if (tp() > 1 && stage_.head && tp_scratch_.size() < 3 * N) tp_scratch_.resize(3 * N);
}

void Model::Swap(Workspace& w) {
  std::swap(batch_, w.batch);
  std::swap(have_targets_, w.have_targets);
  tokens_.swap(w.tokens);
  targets_.swap(w.targets);
  encoded_.swap(w.encoded);
  ln1_.swap(w.ln1);
  ln1_mean_.swap(w.ln1_mean);
  ln1_rstd_.swap(w.ln1_rstd);
  qkv_.swap(w.qkv);
  att_.swap(w.att);
  atty_.swap(w.atty);
  res_att_.swap(w.res_att);
  ln2_.swap(w.ln2);
  ln2_mean_.swap(w.ln2_mean);
  ln2_rstd_.swap(w.ln2_rstd);
  fch_.swap(w.fch);
  fch_gelu_.swap(w.fch_gelu);
  res_mlp_.swap(w.res_mlp);
  lnf_.swap(w.lnf);
  lnf_mean_.swap(w.lnf_mean);
  lnf_rstd_.swap(w.lnf_rstd);
  logits_.swap(w.logits);
  probs_.swap(w.probs);
  dres_.swap(w.dres);
  dln_.swap(w.dln);
  datty_.swap(w.datty);
  dqkv_.swap(w.dqkv);
  dfch_.swap(w.dfch);
  datt_.swap(w.datt);
  dlogits_.swap(w.dlogits);
}

void Model::UseSlot(int slot) {
  if (slot == current_) return;
  Swap(stored_[static_cast<size_t>(current_)]);  // the members go back to their slot
  Swap(stored_[static_cast<size_t>(slot)]);
  current_ = slot;
}

void Model::SetSlots(int slots) {
  UseSlot(0);
  stored_.resize(static_cast<size_t>(std::max(slots, 1)));
  if (gpu_) gpu_->SetSlots(std::max(slots, 1));
}

std::span<const float> Model::logits() {
  UseSlot(0);
  if (gpu_) {
    if (!gpu_->Logits(0, &logits_).ok()) logits_.clear();
    return logits_;
  }
  return {logits_.data(), static_cast<size_t>(batch_) * rows_per_seq()};
}

std::span<const float> Model::output(int slot) {
  UseSlot(slot);
  if (stage_.head || batch_ == 0) return {};
  const size_t n = static_cast<size_t>(batch_) * static_cast<size_t>(config_.context) * config_.d_model;
  const size_t last = static_cast<size_t>(stage_.end_block - stage_.first_block - 1);
  return {res_mlp_.data() + last * n, n};
}

std::span<const float> Model::input_grad(int slot) {
  UseSlot(slot);
  if (stage_.embeddings || batch_ == 0) return {};
  return {dres_.data(), dres_.size()};
}

size_t Model::activation_bytes() const {
  if (gpu_) return gpu_->activation_bytes();
  size_t bytes = tokens_.capacity() + targets_.capacity();
  for (const Workspace& w : stored_) {
    bytes += w.tokens.capacity() + w.targets.capacity();
    for (const std::vector<float>* v :
         {&w.encoded,  &w.ln1,      &w.ln1_mean, &w.ln1_rstd, &w.qkv,     &w.att,  &w.atty,     &w.res_att,  &w.ln2,
          &w.ln2_mean, &w.ln2_rstd, &w.fch,      &w.fch_gelu, &w.res_mlp, &w.lnf,  &w.lnf_mean, &w.lnf_rstd, &w.logits,
          &w.probs,    &w.dres,     &w.dln,      &w.datty,    &w.dqkv,    &w.dfch, &w.datt,     &w.dlogits}) {
      bytes += v->capacity() * sizeof(float);
    }
  }
  bytes += tp_scratch_.capacity() * sizeof(float);
  for (const std::vector<float>* v :
       {&encoded_,  &ln1_,      &ln1_mean_, &ln1_rstd_, &qkv_,     &att_,  &atty_,     &res_att_,  &ln2_,
        &ln2_mean_, &ln2_rstd_, &fch_,      &fch_gelu_, &res_mlp_, &lnf_,  &lnf_mean_, &lnf_rstd_, &logits_,
        &probs_,    &dres_,     &dln_,      &datty_,    &dqkv_,    &dfch_, &datt_,     &dlogits_}) {
    bytes += v->capacity() * sizeof(float);
  }
  return bytes;
}

Model::BlockActivations Model::Activations(int l) {
  const size_t slot = config_.activation_checkpointing ? 0 : static_cast<size_t>(l - stage_.first_block);
  const size_t C = static_cast<size_t>(config_.d_model), F = static_cast<size_t>(hidden_local());
  const size_t Cl = static_cast<size_t>(width_local());
  const size_t T = static_cast<size_t>(config_.context), H = static_cast<size_t>(heads_local());
  const size_t N = static_cast<size_t>(batch_) * T;
  return BlockActivations{
      .ln1 = ln1_.data() + slot * N * C,
      .ln1_mean = ln1_mean_.data() + slot * N,
      .ln1_rstd = ln1_rstd_.data() + slot * N,
      .qkv = qkv_.data() + slot * N * 3 * Cl,
      .att = att_.data() + slot * static_cast<size_t>(batch_) * H * T * T,
      .atty = atty_.data() + slot * N * Cl,
      .res_att = res_att_.data() + slot * N * C,
      .ln2 = ln2_.data() + slot * N * C,
      .ln2_mean = ln2_mean_.data() + slot * N,
      .ln2_rstd = ln2_rstd_.data() + slot * N,
      .fch = fch_.data() + slot * N * F,
      .fch_gelu = fch_gelu_.data() + slot * N * F,
  };
}

Status Model::TpReduceInPlace(float* data, size_t count, TpReduce op, const char* what) {
  if (tp() == 1) return Status::Ok();
  if (!all_reduce_) {
    return FailedPrecondition("model: tensor-parallel rank {} of {} has no all-reduce (SetTensorParallel) for {}",
                              config_.tensor_rank, tp(), what);
  }
  return all_reduce_(data, count, op).WithContext(fmt::format("tensor-parallel all-reduce of {}", what));
}

// A row-parallel layer's output: the rank's partial product (no bias),
// summed over the tp group, then the bias (replicated) added, as the whole
// model's LinearForward adds it after its product.
// `next`, when given, moves on-demand parameters to the block's next part
// before attn.proj and before mlp.fc.
Status Model::BlockInternals(const BlockTensors& w, const BlockActivations& a, const float* input,
                             const std::function<Status()>& next) {
  const int T = config_.context, C = config_.d_model, H = heads_local(), F = hidden_local(), Cl = width_local();
  const size_t N = static_cast<size_t>(batch_) * static_cast<size_t>(T);
  const int n = static_cast<int>(N);
  LayerNormForward(a.ln1, a.ln1_mean, a.ln1_rstd, input, w.ln1_w, w.ln1_b, n, C);
  LinearForward(a.qkv, a.ln1, w.qkv_w, w.qkv_b, n, C, 3 * Cl);
  AttentionForward(a.atty, a.att, a.qkv, batch_, T, Cl, H);
  if (next) TANDEM_RETURN_IF_ERROR(next());
  if (tp() == 1) {
    LinearForward(a.res_att, a.atty, w.proj_w, w.proj_b, n, C, C);
  } else {
    LinearForward(a.res_att, a.atty, w.proj_w, nullptr, n, Cl, C);
    TANDEM_RETURN_IF_ERROR(TpReduceInPlace(a.res_att, N * static_cast<size_t>(C), TpReduce::kSum, "attn.proj"));
    AddBias(a.res_att, w.proj_b, n, C);
  }
  for (size_t i = 0; i < N * C; ++i) a.res_att[i] += input[i];
  LayerNormForward(a.ln2, a.ln2_mean, a.ln2_rstd, a.res_att, w.ln2_w, w.ln2_b, n, C);
  if (next) TANDEM_RETURN_IF_ERROR(next());
  LinearForward(a.fch, a.ln2, w.fc_w, w.fc_b, n, C, F);
  GeluForward(a.fch_gelu, a.fch, N * F);
  return Status::Ok();
}

namespace {

// One pass's on-demand parameters (ParameterAccess): each segment acquired
// with the next one named, and released once its kernels are done. Without
// segments (no ParameterAccess) both are no-ops.
class SegmentWalk {
 public:
  SegmentWalk(const ParameterAccess& access, std::vector<FlatRange> segments)
      : access_(access), segments_(std::move(segments)) {}
  Status Acquire() {
    if (segments_.empty()) return Status::Ok();
    const FlatRange next = at_ + 1 < segments_.size() ? segments_[at_ + 1] : FlatRange(0, 0);
    return access_.acquire(segments_[at_], next);
  }
  void Release() {
    if (segments_.empty()) return;
    if (access_.release) access_.release(segments_[at_]);
    ++at_;
  }

 private:
  const ParameterAccess& access_;
  std::vector<FlatRange> segments_;
  size_t at_ = 0;
};

}  // namespace

Result<float> Model::Forward(const uint8_t* tokens, const uint8_t* targets, int batch, int slot, const float* input) {
  if (batch < 1) return InvalidArgument("model forward: batch must be at least 1, got {}", batch);
  if (slot < 0 || slot >= slots()) {
    return InvalidArgument("model forward: slot {} is not below the model's {} slots", slot, slots());
  }
  if (stage_.embeddings && tokens == nullptr) return InvalidArgument("model forward: no tokens");
  if (!stage_.embeddings && input == nullptr) {
    return InvalidArgument("model forward: pipeline stage {} needs the previous stage's output as its input",
                           config_.pipeline_stage);
  }
  if (tp() > 1 && !all_reduce_) {
    return FailedPrecondition("model forward: tensor-parallel rank {} of {} has no all-reduce (SetTensorParallel)",
                              config_.tensor_rank, tp());
  }
  const int T = config_.context, C = config_.d_model, V = config_.vocab;
  const int F = hidden_local(), Vl = vocab_local(), v0 = config_.tensor_rank * Vl;
  const size_t N = static_cast<size_t>(batch) * static_cast<size_t>(T);
  const int n = static_cast<int>(N);
  for (size_t i = 0; i < N; ++i) {
    if (stage_.embeddings && tokens[i] >= V) {
      return InvalidArgument("model forward: token {} at {} is not below vocab {}", tokens[i], i, V);
    }
    if (stage_.head && targets != nullptr && targets[i] >= V) {
      return InvalidArgument("model forward: target {} at {} is not below vocab {}", targets[i], i, V);
    }
  }
  if (gpu_) return GpuForward(tokens, targets, batch, slot);
  UseSlot(slot);
  EnsureWorkspace(batch);
  have_targets_ = false;
  const TensorViews p = Bind(params_.data());
  // On-demand parameters: the segments in order.
  SegmentWalk walk(access_, access_.acquire ? Segments() : std::vector<FlatRange>());
  const auto acquire = [&] { return walk.Acquire(); };
  const auto release = [&] { walk.Release(); };
  // From one part of a block to the next (nothing without on-demand parameters).
  const std::function<Status()> next_part = [&] {
    release();
    return acquire();
  };

  if (stage_.embeddings) {
    TANDEM_RETURN_IF_ERROR(acquire());
    std::copy(tokens, tokens + N, tokens_.begin());
    if (tp() == 1) {
      for (size_t i = 0; i < N; ++i) {
        const float* te = p.wte + static_cast<size_t>(tokens[i]) * C;
        const float* pe = p.wpe + (i % static_cast<size_t>(T)) * C;
        float* x = encoded_.data() + i * C;
        for (int j = 0; j < C; ++j) x[j] = te[j] + pe[j];
      }
    } else {
      // Vocabulary-parallel: each rank looks up the tokens of its slice
      // (zeros for the others), the sum over the group is every token's
      // row exactly (x + 0 = x), then the position as the whole model adds it.
      for (size_t i = 0; i < N; ++i) {
        float* x = encoded_.data() + i * C;
        const int t = tokens[i] - v0;
        if (t >= 0 && t < Vl) {
          std::copy_n(p.wte + static_cast<size_t>(t) * C, C, x);
        } else {
          std::fill_n(x, C, 0.0f);
        }
      }
      TANDEM_RETURN_IF_ERROR(TpReduceInPlace(encoded_.data(), N * static_cast<size_t>(C), TpReduce::kSum, "wte"));
      for (size_t i = 0; i < N; ++i) {
        const float* pe = p.wpe + (i % static_cast<size_t>(T)) * C;
        float* x = encoded_.data() + i * C;
        for (int j = 0; j < C; ++j) x[j] += pe[j];
      }
    }
    release();
  } else {
    std::copy(input, input + N * static_cast<size_t>(C), encoded_.begin());
  }
  const float* residual = encoded_.data();
  for (int l = stage_.first_block; l < stage_.end_block; ++l) {
    const BlockTensors& w = p.blocks[static_cast<size_t>(l)];
    const BlockActivations a = Activations(l);
    float* res_mlp = res_mlp_.data() + static_cast<size_t>(l - stage_.first_block) * N * C;
    TANDEM_RETURN_IF_ERROR(acquire());
    TANDEM_RETURN_IF_ERROR(BlockInternals(w, a, residual, next_part));
    TANDEM_RETURN_IF_ERROR(next_part());
    if (tp() == 1) {
      LinearForward(res_mlp, a.fch_gelu, w.fcproj_w, w.fcproj_b, n, F, C);
    } else {
      LinearForward(res_mlp, a.fch_gelu, w.fcproj_w, nullptr, n, F, C);
      TANDEM_RETURN_IF_ERROR(TpReduceInPlace(res_mlp, N * static_cast<size_t>(C), TpReduce::kSum, "mlp.proj"));
      AddBias(res_mlp, w.fcproj_b, n, C);
    }
    release();
    for (size_t i = 0; i < N * C; ++i) res_mlp[i] += a.res_att[i];
    residual = res_mlp;
  }
  if (!stage_.head) {
    have_targets_ = true;  // Backward takes the output's gradient instead of targets
    return 0.0f;
  }
  TANDEM_RETURN_IF_ERROR(acquire());
  LayerNormForward(lnf_.data(), lnf_mean_.data(), lnf_rstd_.data(), residual, p.lnf_w, p.lnf_b, n, C);
  LinearForward(logits_.data(), lnf_.data(), p.head_w, nullptr, n, C, Vl);
  release();
  if (targets == nullptr) return 0.0f;

  // Softmax and cross-entropy; the sum over positions in double.
  double loss = 0;
  if (tp() > 1) {
    // Vocabulary-parallel: each row's maximum over the group, then its sum
    // of exponentials and its target's logit (from the rank that holds it).
    float* mx = tp_scratch_.data();
    float* sums = mx + N;  // [N] sums of exponentials, [N] target logit - maximum
    for (size_t i = 0; i < N; ++i) {
      const float* z = logits_.data() + i * Vl;
      mx[i] = *std::max_element(z, z + Vl);
    }
    TANDEM_RETURN_IF_ERROR(TpReduceInPlace(mx, N, TpReduce::kMax, "the logits' maxima"));
    for (size_t i = 0; i < N; ++i) {
      const float* z = logits_.data() + i * Vl;
      float* prob = probs_.data() + i * Vl;
      float sum = 0;
      for (int j = 0; j < Vl; ++j) {
        prob[j] = std::exp(z[j] - mx[i]);
        sum += prob[j];
      }
      sums[i] = sum;
      const int t = targets[i] - v0;
      sums[N + i] = t >= 0 && t < Vl ? z[t] - mx[i] : 0.0f;
    }
    TANDEM_RETURN_IF_ERROR(TpReduceInPlace(sums, 2 * N, TpReduce::kSum, "the softmax sums"));
    for (size_t i = 0; i < N; ++i) {
      float* prob = probs_.data() + i * Vl;
      const float inv = 1.0f / sums[i];
      for (int j = 0; j < Vl; ++j) prob[j] *= inv;
      loss -= static_cast<double>(sums[N + i]) - std::log(static_cast<double>(sums[i]));
    }
  } else {
    for (size_t i = 0; i < N; ++i) {
      const float* z = logits_.data() + i * V;
      float* prob = probs_.data() + i * V;
      const float mx = *std::max_element(z, z + V);
      float sum = 0;
      for (int j = 0; j < V; ++j) {
        prob[j] = std::exp(z[j] - mx);
        sum += prob[j];
      }
      const float inv = 1.0f / sum;
      for (int j = 0; j < V; ++j) prob[j] *= inv;
      loss -= static_cast<double>(z[targets[i]] - mx) - std::log(static_cast<double>(sum));
    }
  }
  std::copy(targets, targets + N, targets_.begin());
  have_targets_ = true;
  return static_cast<float>(loss / static_cast<double>(N));
}

Result<float> Model::GpuForward(const uint8_t* tokens, const uint8_t* targets, int batch, int slot) {
  if (!access_.paged) gpu_->PinHost(params_.data(), grads_.data(), params_.size());
  // The parameters go to the device as the runtime hands them out: segment by
  // segment with on-demand access (each released once it is on its way), or
  // all at once.
  if (access_.acquire) {
    const std::vector<FlatRange> segments = Segments();
    SegmentWalk walk(access_, segments);
    for (const FlatRange& segment : segments) {
      TANDEM_RETURN_IF_ERROR(walk.Acquire());
      const Status uploaded = gpu_->Upload(segment.first, segment.second, params_.data());
      walk.Release();
      TANDEM_RETURN_IF_ERROR(uploaded);
    }
  } else {
    TANDEM_RETURN_IF_ERROR(gpu_->Upload(0, params_.size(), params_.data()));
  }
  return gpu_->Forward(tokens, targets, batch, slot);
}

Status Model::Backward(GradMode mode, float scale, const std::function<void(size_t ready_from)>& on_ready, int slot,
                       const float* output_grad) {
  if (slot < 0 || slot >= slots()) {
    return InvalidArgument("model backward: slot {} is not below the model's {} slots", slot, slots());
  }
  if (gpu_) {
    TANDEM_RETURN_IF_ERROR(gpu_->Backward(mode == GradMode::kAccumulate, scale, grads_.data(), on_ready, slot));
    // Backward read the parameters Forward uploaded. With on-demand access
    // each segment is still taken and given back in backward's order (as the
    // CPU path takes them), so the runtime sees the same passes either way:
    // in sharded placement each take is a gather every worker of the node
    // joins, so a worker must not leave one out.
    if (access_.acquire) {
      std::vector<FlatRange> segments = Segments();
      segments.erase(segments.begin());  // the embeddings' backward reads no parameters
      std::reverse(segments.begin(), segments.end());
      const size_t count = segments.size();
      SegmentWalk walk(access_, std::move(segments));
      for (size_t i = 0; i < count; ++i) {
        TANDEM_RETURN_IF_ERROR(walk.Acquire());
        walk.Release();
      }
    }
    return Status::Ok();
  }
  UseSlot(slot);
  if (!have_targets_) {
    return FailedPrecondition("model backward: needs a forward with targets first (and runs once per forward)");
  }
  if (!stage_.head && output_grad == nullptr) {
    return InvalidArgument("model backward: pipeline stage {} needs the gradient of its output",
                           config_.pipeline_stage);
  }
  if (tp() > 1 && !all_reduce_) {
    return FailedPrecondition("model backward: tensor-parallel rank {} of {} has no all-reduce (SetTensorParallel)",
                              config_.tensor_rank, tp());
  }
  have_targets_ = false;
  if (mode == GradMode::kOverwrite) ZeroGrads();
  const int B = batch_, T = config_.context, C = config_.d_model, H = heads_local(), V = vocab_local();
  const int F = hidden_local(), Cl = width_local(), v0 = config_.tensor_rank * V;
  const size_t N = static_cast<size_t>(B) * static_cast<size_t>(T);
  const int n = static_cast<int>(N);
  const TensorViews p = Bind(params_.data());
  const TensorViews g = Bind(grads_.data());
  // Everything from the tensor at `first` to the end of the flat buffer is final.
  auto ready = [&](const float* first) {
    if (on_ready) on_ready(static_cast<size_t>(first - grads_.data()));
  };
  // On-demand parameters, last segment first (the embeddings' backward reads
  // no parameters). A block goes part by part (mlp.proj, mlp.fc, attn.proj
  // and ln2, attn.qkv and ln1), or whole with activation checkpointing,
  // whose recomputation needs all but mlp.proj first.
  const bool whole_blocks = config_.activation_checkpointing;
  std::vector<FlatRange> segments;
  if (access_.acquire) {
    if (stage_.head) segments.push_back(SegmentOf(config_.layers));
    for (int l = stage_.end_block - 1; l >= stage_.first_block; --l) {
      if (whole_blocks) {
        segments.push_back(SegmentOf(l));
        continue;
      }
      const auto parts = BlockParts(l);
      segments.insert(segments.end(), parts.rbegin(), parts.rend());
    }
  }
  SegmentWalk walk(access_, std::move(segments));
  const auto acquire = [&] { return walk.Acquire(); };
  const auto release = [&] { walk.Release(); };
  const auto next_part = [&]() -> Status {
    if (whole_blocks) return Status::Ok();
    release();
    return acquire();
  };

  const int blocks = stage_.end_block - stage_.first_block;  // >= 1
  if (stage_.head) {
    // dlogits = scale · (probs - onehot(target)) / N
    const float k = scale / static_cast<float>(N);
    for (size_t i = 0; i < N; ++i) {
      const float* prob = probs_.data() + i * V;
      float* d = dlogits_.data() + i * V;
      for (int j = 0; j < V; ++j) d[j] = k * prob[j];
      const int t = targets_[i] - v0;
      if (t >= 0 && t < V) d[t] -= k;
    }
    TANDEM_RETURN_IF_ERROR(acquire());
    LinearBackward(dln_.data(), g.head_w, nullptr, dlogits_.data(), lnf_.data(), p.head_w, n, C, V);
    TANDEM_RETURN_IF_ERROR(TpReduceInPlace(dln_.data(), N * static_cast<size_t>(C), TpReduce::kSum, "ln_f's gradient"));
    std::fill(dres_.begin(), dres_.end(), 0.0f);
    const float* last = res_mlp_.data() + static_cast<size_t>(blocks - 1) * N * C;
    LayerNormBackward(dres_.data(), g.lnf_w, g.lnf_b, dln_.data(), last, p.lnf_w, lnf_mean_.data(), lnf_rstd_.data(), n,
                      C);
    release();
    ready(g.lnf_w);
  } else {
    std::copy(output_grad, output_grad + N * static_cast<size_t>(C), dres_.begin());
  }

  // dres_ holds ∂L/∂(block output); each block turns it into ∂L/∂(block input).
  for (int l = stage_.end_block - 1; l >= stage_.first_block; --l) {
    const BlockTensors& w = p.blocks[static_cast<size_t>(l)];
    const BlockTensors& gw = g.blocks[static_cast<size_t>(l)];
    const size_t local = static_cast<size_t>(l - stage_.first_block);
    const float* residual = local == 0 ? encoded_.data() : res_mlp_.data() + (local - 1) * N * C;
    const BlockActivations a = Activations(l);
    TANDEM_RETURN_IF_ERROR(acquire());
    // The shared slot still holds the last block from Forward; the others
    // are recomputed from their inputs.
    if (config_.activation_checkpointing && l != stage_.end_block - 1) {
      TANDEM_RETURN_IF_ERROR(BlockInternals(w, a, residual));
    }

    // Row-parallel layers need no communication backwards (their output's
    // gradient is the same on every rank); the input gradient of each
    // column-parallel layer is the sum of the ranks' parts.
    const size_t NC = N * static_cast<size_t>(C);
    LinearBackward(dfch_.data(), gw.fcproj_w, gw.fcproj_b, dres_.data(), a.fch_gelu, w.fcproj_w, n, F, C);
    TANDEM_RETURN_IF_ERROR(next_part());
    GeluBackward(dfch_.data(), a.fch, N * F);
    LinearBackward(dln_.data(), gw.fc_w, gw.fc_b, dfch_.data(), a.ln2, w.fc_w, n, C, F);
    TANDEM_RETURN_IF_ERROR(next_part());
    TANDEM_RETURN_IF_ERROR(TpReduceInPlace(dln_.data(), NC, TpReduce::kSum, "ln2's gradient"));
    LayerNormBackward(dres_.data(), gw.ln2_w, gw.ln2_b, dln_.data(), a.res_att, w.ln2_w, a.ln2_mean, a.ln2_rstd, n, C);
    LinearBackward(datty_.data(), gw.proj_w, gw.proj_b, dres_.data(), a.atty, w.proj_w, n, Cl, C);
    TANDEM_RETURN_IF_ERROR(next_part());
    AttentionBackward(dqkv_.data(), datt_.data(), datty_.data(), a.qkv, a.att, B, T, Cl, H);
    LinearBackward(dln_.data(), gw.qkv_w, gw.qkv_b, dqkv_.data(), a.ln1, w.qkv_w, n, C, 3 * Cl);
    TANDEM_RETURN_IF_ERROR(TpReduceInPlace(dln_.data(), NC, TpReduce::kSum, "ln1's gradient"));
    LayerNormBackward(dres_.data(), gw.ln1_w, gw.ln1_b, dln_.data(), residual, w.ln1_w, a.ln1_mean, a.ln1_rstd, n, C);
    release();
    ready(gw.ln1_w);
  }
  if (!stage_.embeddings) return Status::Ok();  // dres_ is the input's gradient (input_grad())
  for (size_t i = 0; i < N; ++i) {
    const int t = tokens_[i] - v0;  // this rank's row of wte, if it holds the token's
    float* dte = t >= 0 && t < V ? g.wte + static_cast<size_t>(t) * C : nullptr;
    float* dpe = g.wpe + (i % static_cast<size_t>(T)) * C;
    const float* d = dres_.data() + i * C;
    for (int j = 0; j < C; ++j) {
      if (dte != nullptr) dte[j] += d[j];
      dpe[j] += d[j];
    }
  }
  ready(g.wte);
  return Status::Ok();
}

}  // namespace tandem::model
