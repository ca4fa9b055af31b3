// The reference model's parameter space (layout.h): the configuration's
// checks, the tensor table and its tensor-parallel slices, the pipeline
// stages, the servers' layout, and the initial values.
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
// Backward (model.cc) finishes the tensors in the reverse of this order.
#include "worker/model/layout.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>
#include <random>

#include <fmt/format.h>

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

constexpr int64_t kMaxParameters = int64_t{1} << 31;  // BLAS dimensions are ints

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

}  // namespace tandem::model
