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
#include <numbers>
#include <random>

namespace tandem::model {
namespace {

constexpr float kLnEps = 1e-5f;
constexpr int64_t kMaxParameters = int64_t{1} << 31;  // BLAS dimensions are ints

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

// out[N, OC] = inp[N, IC] · w[OC, IC]ᵀ + b
void LinearForward(float* out, const float* inp, const float* w, const float* b, int n, int ic, int oc) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, n, oc, ic, 1.0f, inp, ic, w, ic, 0.0f, out, oc);
  if (b == nullptr) return;
  for (int i = 0; i < n; ++i) {
    float* row = out + static_cast<size_t>(i) * oc;
    for (int o = 0; o < oc; ++o) row[o] += b[o];
  }
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

std::vector<TensorInfo> TensorLayout(const ModelConfig& config) {
  std::vector<TensorInfo> out;
  size_t offset = 0;
  auto add = [&](std::string name, std::vector<int64_t> shape, bool no_decay) {
    size_t size = 1;
    for (int64_t d : shape) size *= static_cast<size_t>(d);
    out.push_back(TensorInfo{std::move(name), std::move(shape), offset, size, no_decay});
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

void SetBlasThreads(int threads) {
#ifdef TANDEM_HAVE_OPENBLAS
  openblas_set_num_threads(std::max(threads, 1));
#else
  (void)threads;
#endif
}

Model::Model(const ModelConfig& config) : config_(config), layout_(TensorLayout(config)) {
  const size_t n = layout_.back().offset + layout_.back().size;
  params_.assign(n, 0.0f);
  grads_.assign(n, 0.0f);
}

Result<Model> Model::Create(const ModelConfig& config) {
  TANDEM_RETURN_IF_ERROR(config.Validate());
  if (config.blas_threads > 0) SetBlasThreads(config.blas_threads);
  Model model(config);
  model.Initialize();
  return model;
}

void Model::Initialize() {
  Normal normal(config_.seed);
  const float residual_std = 0.02f / std::sqrt(2.0f * static_cast<float>(config_.layers));
  auto ends_with = [](const std::string& s, std::string_view suffix) {
    return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  for (const TensorInfo& t : layout_) {
    float* p = params_.data() + t.offset;
    const bool layer_norm = t.name.find("ln1.") != std::string::npos || t.name.find("ln2.") != std::string::npos ||
                            t.name.starts_with("ln_f.");
    if (ends_with(t.name, ".bias")) {
      std::fill(p, p + t.size, 0.0f);
    } else if (layer_norm) {
      std::fill(p, p + t.size, 1.0f);
    } else {
      const bool residual = ends_with(t.name, "attn.proj.weight") || ends_with(t.name, "mlp.proj.weight");
      const float std = residual ? residual_std : 0.02f;
      for (size_t i = 0; i < t.size; ++i) p[i] = std * normal.Next();
    }
  }
}

std::vector<v1::TensorSpec> Model::Tensors() const {
  std::vector<v1::TensorSpec> out;
  out.reserve(layout_.size());
  for (const TensorInfo& t : layout_) {
    v1::TensorSpec& spec = out.emplace_back();
    spec.set_name(t.name);
    for (int64_t d : t.shape) spec.add_shape(d);
    spec.set_dtype(v1::DTYPE_FLOAT32);
    spec.set_group(t.no_decay ? "no_decay" : "");
    spec.set_flat_offset(t.offset);
  }
  return out;
}

void Model::ZeroGrads() {
  std::fill(grads_.begin(), grads_.end(), 0.0f);
}

Model::TensorViews Model::Bind(float* base) const {
  // Follows TensorLayout's order; the layout is the single source of offsets.
  size_t i = 0;
  auto next = [&]() { return base + layout_[i++].offset; };
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
  const size_t L = static_cast<size_t>(config_.layers), B = static_cast<size_t>(batch);
  const size_t T = static_cast<size_t>(config_.context), C = static_cast<size_t>(config_.d_model);
  const size_t H = static_cast<size_t>(config_.heads), V = static_cast<size_t>(config_.vocab);
  const size_t F = static_cast<size_t>(config_.mlp_ratio) * C, N = B * T;
  const size_t slots = config_.activation_checkpointing ? 1 : L;
  Reallocate(tokens_, N);
  Reallocate(targets_, N);
  Reallocate(encoded_, N * C);
  Reallocate(ln1_, slots * N * C);
  Reallocate(ln1_mean_, slots * N);
  Reallocate(ln1_rstd_, slots * N);
  Reallocate(qkv_, slots * N * 3 * C);
  Reallocate(att_, slots * B * H * T * T);
  Reallocate(atty_, slots * N * C);
  Reallocate(res_att_, slots * N * C);
  Reallocate(ln2_, slots * N * C);
  Reallocate(ln2_mean_, slots * N);
  Reallocate(ln2_rstd_, slots * N);
  Reallocate(fch_, slots * N * F);
  Reallocate(fch_gelu_, slots * N * F);
  Reallocate(res_mlp_, L * N * C);
  Reallocate(lnf_, N * C);
  Reallocate(lnf_mean_, N);
  Reallocate(lnf_rstd_, N);
  Reallocate(logits_, N * V);
  Reallocate(probs_, N * V);
  Reallocate(dres_, N * C);
  Reallocate(dln_, N * C);
  Reallocate(datty_, N * C);
  Reallocate(dqkv_, N * 3 * C);
  Reallocate(dfch_, N * F);
  Reallocate(datt_, T * T);
  Reallocate(dlogits_, N * V);
}

size_t Model::activation_bytes() const {
  size_t bytes = tokens_.capacity() + targets_.capacity();
  for (const std::vector<float>* v :
       {&encoded_,  &ln1_,      &ln1_mean_, &ln1_rstd_, &qkv_,     &att_,  &atty_,     &res_att_,  &ln2_,
        &ln2_mean_, &ln2_rstd_, &fch_,      &fch_gelu_, &res_mlp_, &lnf_,  &lnf_mean_, &lnf_rstd_, &logits_,
        &probs_,    &dres_,     &dln_,      &datty_,    &dqkv_,    &dfch_, &datt_,     &dlogits_}) {
    bytes += v->capacity() * sizeof(float);
  }
  return bytes;
}

Model::BlockActivations Model::Activations(int l) {
  const size_t slot = config_.activation_checkpointing ? 0 : static_cast<size_t>(l);
  const size_t C = static_cast<size_t>(config_.d_model), F = static_cast<size_t>(config_.mlp_ratio) * C;
  const size_t T = static_cast<size_t>(config_.context), H = static_cast<size_t>(config_.heads);
  const size_t N = static_cast<size_t>(batch_) * T;
  return BlockActivations{
      .ln1 = ln1_.data() + slot * N * C,
      .ln1_mean = ln1_mean_.data() + slot * N,
      .ln1_rstd = ln1_rstd_.data() + slot * N,
      .qkv = qkv_.data() + slot * N * 3 * C,
      .att = att_.data() + slot * static_cast<size_t>(batch_) * H * T * T,
      .atty = atty_.data() + slot * N * C,
      .res_att = res_att_.data() + slot * N * C,
      .ln2 = ln2_.data() + slot * N * C,
      .ln2_mean = ln2_mean_.data() + slot * N,
      .ln2_rstd = ln2_rstd_.data() + slot * N,
      .fch = fch_.data() + slot * N * F,
      .fch_gelu = fch_gelu_.data() + slot * N * F,
  };
}

void Model::BlockInternals(const BlockTensors& w, const BlockActivations& a, const float* input) {
  const int T = config_.context, C = config_.d_model, H = config_.heads, F = config_.mlp_ratio * C;
  const size_t N = static_cast<size_t>(batch_) * static_cast<size_t>(T);
  const int n = static_cast<int>(N);
  LayerNormForward(a.ln1, a.ln1_mean, a.ln1_rstd, input, w.ln1_w, w.ln1_b, n, C);
  LinearForward(a.qkv, a.ln1, w.qkv_w, w.qkv_b, n, C, 3 * C);
  AttentionForward(a.atty, a.att, a.qkv, batch_, T, C, H);
  LinearForward(a.res_att, a.atty, w.proj_w, w.proj_b, n, C, C);
  for (size_t i = 0; i < N * C; ++i) a.res_att[i] += input[i];
  LayerNormForward(a.ln2, a.ln2_mean, a.ln2_rstd, a.res_att, w.ln2_w, w.ln2_b, n, C);
  LinearForward(a.fch, a.ln2, w.fc_w, w.fc_b, n, C, F);
  GeluForward(a.fch_gelu, a.fch, N * F);
}

Result<float> Model::Forward(const uint8_t* tokens, const uint8_t* targets, int batch) {
  if (batch < 1) return InvalidArgument("model forward: batch must be at least 1, got {}", batch);
  if (tokens == nullptr) return InvalidArgument("model forward: no tokens");
  const int T = config_.context, C = config_.d_model, V = config_.vocab;
  const int F = config_.mlp_ratio * C;
  const size_t N = static_cast<size_t>(batch) * static_cast<size_t>(T);
  const int n = static_cast<int>(N);
  for (size_t i = 0; i < N; ++i) {
    if (tokens[i] >= V) return InvalidArgument("model forward: token {} at {} is not below vocab {}", tokens[i], i, V);
    if (targets != nullptr && targets[i] >= V) {
      return InvalidArgument("model forward: target {} at {} is not below vocab {}", targets[i], i, V);
    }
  }
  EnsureWorkspace(batch);
  have_targets_ = false;
  std::copy(tokens, tokens + N, tokens_.begin());
  const TensorViews p = Bind(params_.data());

  for (size_t i = 0; i < N; ++i) {
    const float* te = p.wte + static_cast<size_t>(tokens[i]) * C;
    const float* pe = p.wpe + (i % static_cast<size_t>(T)) * C;
    float* x = encoded_.data() + i * C;
    for (int j = 0; j < C; ++j) x[j] = te[j] + pe[j];
  }
  const float* residual = encoded_.data();
  for (int l = 0; l < config_.layers; ++l) {
    const BlockTensors& w = p.blocks[static_cast<size_t>(l)];
    const BlockActivations a = Activations(l);
    float* res_mlp = res_mlp_.data() + static_cast<size_t>(l) * N * C;
    BlockInternals(w, a, residual);
    LinearForward(res_mlp, a.fch_gelu, w.fcproj_w, w.fcproj_b, n, F, C);
    for (size_t i = 0; i < N * C; ++i) res_mlp[i] += a.res_att[i];
    residual = res_mlp;
  }
  LayerNormForward(lnf_.data(), lnf_mean_.data(), lnf_rstd_.data(), residual, p.lnf_w, p.lnf_b, n, C);
  LinearForward(logits_.data(), lnf_.data(), p.head_w, nullptr, n, C, V);
  if (targets == nullptr) return 0.0f;

  // Softmax and cross-entropy; the sum over positions in double.
  double loss = 0;
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
  std::copy(targets, targets + N, targets_.begin());
  have_targets_ = true;
  return static_cast<float>(loss / static_cast<double>(N));
}

Status Model::Backward(GradMode mode, float scale, const std::function<void(size_t ready_from)>& on_ready) {
  if (!have_targets_) {
    return FailedPrecondition("model backward: needs a forward with targets first (and runs once per forward)");
  }
  have_targets_ = false;
  if (mode == GradMode::kOverwrite) ZeroGrads();
  const int B = batch_, T = config_.context, C = config_.d_model, H = config_.heads, V = config_.vocab;
  const int F = config_.mlp_ratio * C;
  const size_t N = static_cast<size_t>(B) * static_cast<size_t>(T);
  const int n = static_cast<int>(N);
  const TensorViews p = Bind(params_.data());
  const TensorViews g = Bind(grads_.data());
  // Everything from the tensor at `first` to the end of the flat buffer is final.
  auto ready = [&](const float* first) {
    if (on_ready) on_ready(static_cast<size_t>(first - grads_.data()));
  };

  // dlogits = scale · (probs - onehot(target)) / N
  const float k = scale / static_cast<float>(N);
  for (size_t i = 0; i < N; ++i) {
    const float* prob = probs_.data() + i * V;
    float* d = dlogits_.data() + i * V;
    for (int j = 0; j < V; ++j) d[j] = k * prob[j];
    d[targets_[i]] -= k;
  }
  LinearBackward(dln_.data(), g.head_w, nullptr, dlogits_.data(), lnf_.data(), p.head_w, n, C, V);
  std::fill(dres_.begin(), dres_.end(), 0.0f);
  const float* last = res_mlp_.data() + static_cast<size_t>(config_.layers - 1) * N * C;  // layers >= 1
  LayerNormBackward(dres_.data(), g.lnf_w, g.lnf_b, dln_.data(), last, p.lnf_w, lnf_mean_.data(), lnf_rstd_.data(), n,
                    C);
  ready(g.lnf_w);

  // dres_ holds ∂L/∂(block output); each block turns it into ∂L/∂(block input).
  for (int l = config_.layers - 1; l >= 0; --l) {
    const BlockTensors& w = p.blocks[static_cast<size_t>(l)];
    const BlockTensors& gw = g.blocks[static_cast<size_t>(l)];
    const float* residual = l == 0 ? encoded_.data() : res_mlp_.data() + static_cast<size_t>(l - 1) * N * C;
    const BlockActivations a = Activations(l);
    // The shared slot still holds the last block from Forward; the others
    // are recomputed from their inputs.
    if (config_.activation_checkpointing && l != config_.layers - 1) BlockInternals(w, a, residual);

    LinearBackward(dfch_.data(), gw.fcproj_w, gw.fcproj_b, dres_.data(), a.fch_gelu, w.fcproj_w, n, F, C);
    GeluBackward(dfch_.data(), a.fch, N * F);
    LinearBackward(dln_.data(), gw.fc_w, gw.fc_b, dfch_.data(), a.ln2, w.fc_w, n, C, F);
    LayerNormBackward(dres_.data(), gw.ln2_w, gw.ln2_b, dln_.data(), a.res_att, w.ln2_w, a.ln2_mean, a.ln2_rstd, n, C);
    LinearBackward(datty_.data(), gw.proj_w, gw.proj_b, dres_.data(), a.atty, w.proj_w, n, C, C);
    AttentionBackward(dqkv_.data(), datt_.data(), datty_.data(), a.qkv, a.att, B, T, C, H);
    LinearBackward(dln_.data(), gw.qkv_w, gw.qkv_b, dqkv_.data(), a.ln1, w.qkv_w, n, C, 3 * C);
    LayerNormBackward(dres_.data(), gw.ln1_w, gw.ln1_b, dln_.data(), residual, w.ln1_w, a.ln1_mean, a.ln1_rstd, n, C);
    ready(gw.ln1_w);
  }
  for (size_t i = 0; i < N; ++i) {
    float* dte = g.wte + static_cast<size_t>(tokens_[i]) * C;
    float* dpe = g.wpe + (i % static_cast<size_t>(T)) * C;
    const float* d = dres_.data() + i * C;
    for (int j = 0; j < C; ++j) {
      dte[j] += d[j];
      dpe[j] += d[j];
    }
  }
  ready(g.wte);
  return Status::Ok();
}

}  // namespace tandem::model
