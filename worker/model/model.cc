// The reference model's forward and backward (model.h), over the kernels of
// kernels.h and the parameter layout of layout.h (where the flat parameter
// order is described). Backward finishes the head and ln_f first, then the
// blocks from last to first, then the embeddings: the reverse of the flat
// order, so what is final at any point is a suffix of the flat buffer, which
// Backward's on_ready reports by its first element. No parameter is used in
// two places (head is not tied to wte), so each tensor is final as soon as
// backward has passed it.
//
// With activation checkpointing Forward runs every block through the one
// shared activation slot and keeps only the block outputs (res_mlp_, which
// are also the next blocks' inputs). Backward recomputes block l into that
// slot from its input with the same BlockInternals call as Forward, so the
// recomputed activations, and everything after, are bit for bit those of a
// run without checkpointing.
#include "worker/model/model.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "worker/model/kernels.h"

namespace tandem::model {

using kernels::AddBias;
using kernels::AttentionBackward;
using kernels::AttentionForward;
using kernels::GeluBackward;
using kernels::GeluForward;
using kernels::LayerNormBackward;
using kernels::LayerNormForward;
using kernels::LinearBackward;
using kernels::LinearForward;

namespace {

// Replaces v by n zeros with exactly n allocated (the old buffer freed first),
// so a smaller batch gives memory back and activation_bytes() is what is held.
template <typename T>
void Reallocate(std::vector<T>& v, size_t n) {
  v = std::vector<T>();
  v.resize(n);
}

}  // namespace

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

void Model::Initialize() {
  InitialValues(config_, part_begin_, part_begin_ + params_.size(), params_.data());
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
