// The reference model's parameter space: its configuration, the tensor
// table of the flat parameter buffer (and a tensor-parallel rank's slices of
// it), the split into pipeline stages, the layout the parameter servers hold
// (every stage and rank part), and the initial values of every element. The
// model itself (model.h) describes what the configuration means; this is
// where its parameters live. Shared by the model, the runtime (which places
// and names the parameters on the servers) and the tools that rebuild a
// whole model from its parts.
//
// Thread safety: functions of values only; an InitialValueStream belongs to
// one thread at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "tandem/v1/types.pb.h"

namespace tandem::model {

struct ModelConfig {
  int vocab = 256;       // byte-level: tokens are bytes, so at most 256
  int context = 64;      // T: positions per sequence
  int d_model = 128;     // C: width of the residual stream
  int heads = 4;         // attention heads; must divide d_model
  int layers = 4;        // transformer blocks
  int mlp_ratio = 4;     // hidden width of the MLP is mlp_ratio · d_model
  uint64_t seed = 1;     // initialisation seed
  int blas_threads = 1;  // applied by Model::Create; 0 leaves the BLAS setting alone
  // Recompute each block's internal activations in Backward instead of
  // keeping them from Forward (see model.h).
  bool activation_checkpointing = false;
  // Pipeline parallelism: this model is stage pipeline_stage of
  // pipeline_stages (see model.h); 1 stage is the whole model.
  int pipeline_stages = 1;
  int pipeline_stage = 0;
  // Tensor parallelism: this model is rank tensor_rank of tensor_parallel
  // (see model.h); 1 rank is the whole model.
  int tensor_parallel = 1;
  int tensor_rank = 0;
  // Where forward and backward run: -1 on the CPU, else on this CUDA device
  // (see "GPU" in model.h).
  int gpu = -1;

  // OK, or INVALID_ARGUMENT naming the field and the rule it breaks.
  Status Validate() const;
};

// Which blocks and which part of the flat buffer one pipeline stage holds
// (the flat space of the configuration's tensor rank).
struct StagePlan {
  int first_block = 0;  // blocks [first_block, end_block)
  int end_block = 0;
  bool embeddings = false;  // wte and wpe (stage 0)
  bool head = false;        // ln_f and head (the last stage)
  size_t flat_begin = 0;    // parameters [flat_begin, flat_end) of the whole model
  size_t flat_end = 0;
  double cost = 0;  // relative compute cost (forward multiply-adds per token)
};

// Every stage of config.pipeline_stages, in order: contiguous runs of blocks
// (at least one each) chosen so that the largest stage cost (blocks plus the
// embeddings on the first stage and the head on the last) is as small as
// possible. REQUIRES: config.Validate().ok()
std::vector<StagePlan> PlanStages(const ModelConfig& config);

// One tensor of the flat parameter buffer.
struct TensorInfo {
  std::string name;            // "blocks.3.attn.qkv.weight"
  std::vector<int64_t> shape;  // outermost first (a tensor-parallel rank's slice)
  size_t offset = 0;           // first element in the flat buffer
  size_t size = 0;             // elements
  bool no_decay = false;       // biases, LayerNorm parameters, embeddings
  // Which elements of the whole model's tensor these are, the whole tensor
  // seen as [rows, whole_cols] (a vector as [n, 1]): the rows of `rows`
  // (ranges, concatenated in order) and of each the columns [col_begin,
  // col_end). All of it (replicated) without tensor parallelism.
  size_t whole_offset = 0;  // the whole tensor's first element in the whole model
  size_t whole_size = 0;
  int64_t whole_cols = 1;
  std::vector<std::pair<int64_t, int64_t>> rows;
  int64_t col_begin = 0;
  int64_t col_end = 1;
  bool replicated = true;
  // In ServerLayout, a replicated tensor's copy on a tensor rank above 0:
  // group "tp_copy", whose gradients do not count in the global gradient
  // norm again (the runtime configures the group: kTensorParallelCopyGroup
  // in worker/runtime/runtime.h).
  bool copy = false;
};

// The tensor table of a configuration's tensor rank (the whole model's
// without tensor parallelism), in its flat-buffer order (see layout.cc
// for the order). REQUIRES: config.Validate().ok()
std::vector<TensorInfo> TensorLayout(const ModelConfig& config);

// The element of the whole model's flat buffer that element i (< t.size)
// of a tensor-parallel rank's tensor t holds (TensorInfo's rows and columns).
size_t WholeElement(const TensorInfo& t, size_t i);

// What the parameter servers hold: every (pipeline stage, tensor rank) part
// of the configuration's split, part stage·tensor_parallel + rank after
// part, offsets in that space, names with "@tp<rank>" when tensor_parallel
// > 1. The same as TensorLayout without tensor parallelism.
std::vector<TensorInfo> ServerLayout(const ModelConfig& config);
// Where each part begins in ServerLayout's space, and the end (parts + 1
// ascending offsets).
std::vector<size_t> PartBounds(const ModelConfig& config);

// Writes the whole model's parameters of pipeline stage `stage` (the tensors
// of its blocks, and the embeddings or the head where it has them), in the
// whole model's flat order and tensor by tensor, from the stage's
// tensor-parallel parts: parts[r] is rank r's part (ServerLayout's elements
// of part stage·T + r). Replicated tensors come from rank 0's part.
Status WriteWholeStage(const ModelConfig& config, int stage, const std::vector<std::span<const float>>& parts,
                       const std::function<Status(std::span<const float>)>& write);

// The table the parameter servers hold for the tensors that start in
// [begin, end) of a layout (names, shapes, DTYPE_FLOAT32, group "tp_copy"
// where TensorInfo::copy, else "no_decay" where TensorInfo::no_decay),
// flat_offset relative to `begin`.
std::vector<v1::TensorSpec> TensorSpecs(const std::vector<TensorInfo>& layout, size_t begin, size_t end);

// The initial values of ServerLayout's flat elements [begin, end) into
// out[0, end - begin): what Model::Create gives those elements, whatever
// stage and rank hold them (the whole model's values, sliced). Costs one
// random draw per weight before `end` (before the end of the tensors
// involved, once per part, with tensor parallelism).
// REQUIRES: config.Validate().ok(), begin <= end <= the parameter count.
void InitialValues(const ModelConfig& config, size_t begin, size_t end, float* out);

// The same for many ranges: ranges in ascending order continue the random
// stream where the last one ended (a range before the last one starts it
// again), so filling a model range by range costs about one pass.
class Normal;
class InitialValueStream {
 public:
  explicit InitialValueStream(const ModelConfig& config);  // REQUIRES: config.Validate().ok()
  ~InitialValueStream();
  void Fill(size_t begin, size_t end, float* out);

 private:
  ModelConfig config_;
  std::vector<TensorInfo> layout_;
  std::unique_ptr<Normal> normal_;
  size_t position_ = 0;  // the next element the stream gives
  size_t tensor_ = 0;    // the tensor holding it
  // Tensor parallelism: the whole model's stream, and the last whole tensor
  // it gave (the slices of the parts are cut from it).
  std::unique_ptr<InitialValueStream> whole_;
  std::vector<float> cached_;
  size_t cached_offset_ = SIZE_MAX;
};

}  // namespace tandem::model
