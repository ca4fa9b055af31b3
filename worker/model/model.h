// The reference model: a small byte-level decoder language model with real
// forward and backward passes on the CPU (docs/training.md, "The reference
// model").
//
// Architecture (GPT-2 style, pre-LayerNorm):
//   x = wte[token] + wpe[position]
//   for each block: x = x + attn.proj(causal_self_attention(attn.qkv(ln1(x))))
//                   x = x + mlp.proj(gelu_tanh(mlp.fc(ln2(x))))
//   logits = head(ln_f(x)); loss = mean cross-entropy over every (batch, position)
//
// Parameters live in ONE flat fp32 buffer, tensor after tensor in the order
// of Tensors() (row-major, no padding), so the parameter servers can hold
// the model as its flattened parameter space. Linear weights are stored
// [out_features, in_features] (y = x·Wᵀ + b). The gradients live in a second
// flat buffer with the same layout. Backward(kOverwrite) replaces them,
// Backward(kAccumulate) adds to them: gradient accumulation over micro-batches
// needs no communication, and a `scale` (for example 1/micro_batches) turns
// the sum of micro-batch means into the mean over the whole batch.
//
// Activations needed by backward are kept in a workspace allocated at the
// first Forward for a given batch size and reused while the batch size stays
// the same. With ModelConfig::activation_checkpointing, Forward keeps only the
// residual stream between blocks and Backward recomputes each block's
// internals just before going back through it, into one block's worth of
// scratch: about 1/layers of the per-block memory, for computing the blocks
// but the last a second time (all but their MLP output projection), with
// bit-identical results (the same kernels on the same inputs).
//
// Backward can report gradients as they become final (its on_ready
// callback), so a distributed runtime can send them while backward goes on.
// That is why the flat order puts what backward finishes first (the head) at
// the end and what it finishes last (the embeddings) at the start.
//
// Matrix products go through CBLAS (OpenBLAS in the supported
// build); SetBlasThreads sets how many threads it uses (1 per worker process
// by default, through ModelConfig::blas_threads).
//
// Initialisation is deterministic from the seed (the same on every machine:
// mt19937_64 and our own Box-Muller): weights normal(0, 0.02), the residual
// projections (attn.proj, mlp.proj) scaled by 1/sqrt(2·layers), biases zero,
// LayerNorm weights one.
//
// Pipeline stages. With ModelConfig::pipeline_stages = P > 1 a Model is one
// stage of the model: stage 0 holds the embeddings and the first blocks, the
// last stage the last blocks, ln_f and the head, the others blocks only;
// PlanStages splits the blocks so that the most expensive stage is as cheap
// as it can be. A stage's parameters are one contiguous range of the whole
// model's flat buffer ([flat_begin(), flat_begin() + num_parameters())), so
// params() and grads() hold only that range and Tensors() lists only its
// tensors, with offsets into it. Initialisation gives every stage exactly
// the values the whole model has there. A stage after the first takes the
// previous stage's output ([batch·T, C] activations) as its input; a stage
// before the last returns 0 from Forward, exposes output() and takes the
// gradient of its output in Backward; a stage after the first exposes the
// gradient of its input (input_grad()) after Backward. Each stage runs the
// same kernels on the same inputs as the whole model, so stages chained
// together give bit for bit the whole model's loss and gradients.
//
// Tensor parallelism. With ModelConfig::tensor_parallel = T > 1 a Model is
// rank tensor_rank of T ranks that compute each block together (Megatron's
// pattern): attn.qkv and mlp.fc are column-parallel (each rank holds the
// rows of its heads, or of its 1/T of the MLP's hidden units), attn.proj and
// mlp.proj are row-parallel (the matching columns), and the embedding wte
// and the head are vocabulary-parallel (rows [rank·V/T, (rank+1)·V/T)).
// LayerNorms, wpe and the row-parallel biases are replicated: every rank
// holds and updates its own copy, and since every rank computes them from
// the same inputs their gradients and values stay equal bit for bit.
// Forward all-reduces (sum) over the tp group the embedding lookup and the
// output of each row-parallel layer, and the cross-entropy's row maxima
// (max) and sums (sum); backward all-reduces the input gradient of each
// column-parallel layer and of the head: two all-reduces per block in each
// direction. The all-reduces go through SetTensorParallel's function, so the
// model knows nothing of communicators; every rank of the group must call
// Forward and Backward with the same tokens, targets and batch. Results
// equal the whole model's up to the order of float additions in the
// all-reduced sums (the embeddings are exact).
//
// A rank's tensors are those of the whole model, each cut to its slice
// (TensorInfo says which rows and columns of the whole tensor it holds), in
// the same order: a rank has its own flat space, split into pipeline stages
// as the whole model is. The parameter servers hold every (stage, rank)
// part one after another, part stage·T + rank (ServerLayout, PartBounds);
// flat_begin() is where this model's part starts there. The tensors of a
// part are named like the whole model's with "@tp<rank>" appended.
//
// Micro-batch slots. A pipeline keeps several micro-batches in flight:
// SetSlots(n) gives the model n independent activation workspaces, and
// Forward and Backward take the slot to use (Backward of a slot uses what
// Forward of that slot kept).
//
// GPU. With ModelConfig::gpu = d >= 0 the forward and backward run on CUDA
// device d (gpu_engine.h): the same computation, the matrix products through
// cuBLAS in fp32 and the rest as CUDA kernels, equal to the CPU's within fp32
// rounding (only the order of additions differs). params() and grads() stay
// on the host, where the runtime uses them: Forward uploads the parameters
// (segment by segment through ParameterAccess, as the CPU path reads them)
// and Backward downloads each run of final gradients before on_ready reports
// it. Unless the access is paged (sharded placement hands pages back), both
// host buffers are page-locked at the first Forward, so the copies run at
// the link's speed and overlap the device's work. The whole model only: one pipeline stage, one tensor rank, and no
// activation checkpointing (Validate says so); slots work as on the CPU.
// Create fails with FAILED_PRECONDITION, naming why, when the build has no
// CUDA or the device cannot be used.
//
// The configuration, the tensor table and its splits, and the initial values
// are in layout.h; the CPU kernels (and SetBlasThreads) in kernels.h; both
// are included here.
//
// Thread safety: a Model is a value with no shared state; one thread at a
// time may use it. SetBlasThreads is process-wide.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/page_buffer.h"
#include "common/status.h"
#include "tandem/v1/types.pb.h"
#include "worker/model/gpu_engine.h"
#include "worker/model/kernels.h"
#include "worker/model/layout.h"

namespace tandem::model {

// The all-reduce of a tensor-parallel model (Model::SetTensorParallel):
// every rank of the tp group reduces data[0, count) in place, elementwise.
enum class TpReduce { kSum, kMax };
using TpAllReduce = std::function<Status(float* data, size_t count, TpReduce op)>;

// A range [first, second) of a model's params() (stage-relative elements).
using FlatRange = std::pair<size_t, size_t>;

// Parameters on demand (the sharded placement, worker/runtime/runtime.h):
// Forward and Backward call acquire(now, next) before their kernels read the
// parameters of a segment `now` (the embeddings, a part of a block, or ln_f
// and the head: Segments()) and release(now) once they no longer need them;
// `next` is the segment the same pass needs after it (empty at the end of a
// pass), so that its parameters can be fetched while `now` computes. Backward
// with activation checkpointing takes each block whole (its recomputation
// reads three of the four parts before the first backward kernel). An
// acquire error ends the pass with that error. Backward of the embeddings
// reads no parameters.
//
// Replicated placement uses acquire too, to wait for parameters still
// arriving from the servers; `paged` says the buffers' pages go back to the
// kernel between uses (sharded), which changes how gradients are zeroed.
struct ParameterAccess {
  std::function<Status(FlatRange now, FlatRange next)> acquire;
  std::function<void(FlatRange now)> release;
  bool paged = false;
};

enum class GradMode {
  kOverwrite,   // grads = dLoss/dParams · scale
  kAccumulate,  // grads += dLoss/dParams · scale
};

class Model {
 public:
  // Validates the configuration and initialises the parameters from its seed.
  // With `initialize` false the parameters are left at zero and take no
  // memory until written (their values come from elsewhere: InitialValues,
  // the parameter servers).
  static Result<Model> Create(const ModelConfig& config, bool initialize = true);

  const ModelConfig& config() const { return config_; }

  // The table the parameter servers hold: names, shapes, DTYPE_FLOAT32,
  // group "no_decay" for biases, LayerNorm parameters and embeddings ("" for
  // the rest), flat_offset in elements.
  std::vector<v1::TensorSpec> Tensors() const;
  // The whole model's tensor table (global offsets), whatever the stage.
  const std::vector<TensorInfo>& layout() const { return layout_; }
  size_t num_parameters() const { return params_.size(); }
  // This stage (the whole model when there is one stage).
  const StagePlan& stage() const { return stage_; }
  // Where this model's part starts in the servers' space (ServerLayout).
  size_t flat_begin() const { return part_begin_; }
  bool first_stage() const { return stage_.embeddings; }
  bool last_stage() const { return stage_.head; }

  std::span<float> params() { return params_; }
  std::span<const float> params() const { return params_; }
  std::span<float> grads() { return grads_; }
  std::span<const float> grads() const { return grads_; }
  void ZeroGrads();
  // Parameters and gradients live in page buffers: a range handed back reads
  // as zeros and takes no memory until written again.
  PageBuffer& param_buffer() { return params_; }
  PageBuffer& grad_buffer() { return grads_; }

  // The segments of params() that Forward reads one after another: the
  // embeddings (first stage), each block in four parts (ln1 and attn.qkv,
  // attn.proj and ln2, mlp.fc, mlp.proj), ln_f and the head (last stage).
  std::vector<FlatRange> Segments() const;
  // Installs (or, with empty functions, removes) on-demand parameter access.
  // On a GPU, paged buffers are unpinned first (see "GPU" above).
  void SetParameterAccess(ParameterAccess access) {
    if (gpu_ && access.paged) gpu_->UnpinHost();
    access_ = std::move(access);
  }
  // The tp group's all-reduce (tensor_parallel > 1; Forward and Backward
  // fail with FAILED_PRECONDITION without one). Its errors end the pass.
  void SetTensorParallel(TpAllReduce all_reduce) { all_reduce_ = std::move(all_reduce); }

  // Runs the model on `batch` sequences of context() tokens (tokens[b·T + t]).
  // With targets (same layout) it returns the mean cross-entropy and keeps
  // what Backward needs; without (nullptr) it returns 0 and only the logits
  // are meaningful. INVALID_ARGUMENT for batch < 1 or a token/target >= vocab.
  //
  // Pipeline stages: the first stage reads `tokens`, the others `input`
  // ([batch·T, C], the previous stage's output()); only the last stage reads
  // `targets` (and computes a loss); a stage before the last keeps what its
  // Backward needs whatever `targets` is, and returns 0. `slot` picks the
  // activation workspace (0 to slots() - 1).
  Result<float> Forward(const uint8_t* tokens, const uint8_t* targets, int batch, int slot = 0,
                        const float* input = nullptr);

  // Gradients of the last Forward's loss, times `scale`, into grads().
  // FAILED_PRECONDITION unless the last Forward had targets. Backward may run
  // once per Forward.
  //
  // on_ready, when given, is called on the calling thread each time Backward
  // has made the gradients of the flat elements [ready_from, num_parameters())
  // final for this call (nothing later in this Backward writes them): after
  // the head and ln_f, after each block (last to first), and after the
  // embeddings. ready_from strictly decreases from call to call and the last
  // call is on_ready(0), so there are layers + 2 calls. The callback may read
  // (or start sending) grads()[ready_from, end) but must not write grads()
  // or call into the model; the elements below ready_from are still being
  // computed.
  //
  // Pipeline stages: a stage before the last takes the gradient of its
  // output, [batch·T, C], in `output_grad` (`scale` is the last stage's
  // business: it is already in that gradient); `slot` is the Forward's.
  Status Backward(GradMode mode = GradMode::kOverwrite, float scale = 1.0f,
                  const std::function<void(size_t ready_from)>& on_ready = nullptr, int slot = 0,
                  const float* output_grad = nullptr);

  // Activation workspaces for micro-batches in flight (at least 1). Each
  // slot's memory is allocated by its first Forward.
  void SetSlots(int slots);
  int slots() const { return static_cast<int>(stored_.size()); }
  // A stage before the last: the output of the slot's last Forward,
  // [batch·T, C] (the input of the next stage).
  std::span<const float> output(int slot = 0);
  // A stage after the first: the gradient of the slot's input after its
  // Backward, [batch·T, C] (the output gradient of the previous stage).
  std::span<const float> input_grad(int slot = 0);

  // The last Forward's logits, [batch, T, vocab] (slot 0, the last stage;
  // with tensor parallelism this rank's vocabulary slice, [batch, T, V/T]).
  // On a GPU, a copy made by this call (empty if the copy failed).
  std::span<const float> logits();
  // On a GPU: the device, as "NVIDIA H100 80GB HBM3 (device 0, ...)"; else "".
  std::string gpu_description() const { return gpu_ ? gpu_->Describe() : std::string(); }

  // Bytes of activation workspace allocated now (everything Forward and
  // Backward keep between or use within calls; 0 before the first Forward).
  size_t activation_bytes() const;

 private:
  explicit Model(const ModelConfig& config);
  size_t rows_per_seq() const { return static_cast<size_t>(config_.context) * vocab_local(); }
  int tp() const { return config_.tensor_parallel; }
  int vocab_local() const { return config_.vocab / tp(); }
  int width_local() const { return config_.d_model / tp(); }  // attention width of the local heads
  int heads_local() const { return config_.heads / tp(); }
  int hidden_local() const { return config_.mlp_ratio * config_.d_model / tp(); }
  // The tp group's all-reduce (tp() > 1); a no-op on one rank.
  Status TpReduceInPlace(float* data, size_t count, TpReduce op, const char* what);
  // Makes `slot`'s workspace the current one (the members below).
  void UseSlot(int slot);
  void Initialize();
  void EnsureWorkspace(int batch);

  // Pointers to the parameters (or gradients) of one layout, by role.
  struct BlockTensors {
    float *ln1_w, *ln1_b, *qkv_w, *qkv_b, *proj_w, *proj_b, *ln2_w, *ln2_b, *fc_w, *fc_b, *fcproj_w, *fcproj_b;
  };
  struct TensorViews {
    float *wte, *wpe;
    std::vector<BlockTensors> blocks;
    float *lnf_w, *lnf_b, *head_w;
  };
  TensorViews Bind(float* base) const;

  // Where the internal activations of block l live in the workspace: its own
  // slot, or with activation checkpointing the one slot all blocks share.
  struct BlockActivations {
    float *ln1, *ln1_mean, *ln1_rstd, *qkv, *att, *atty, *res_att, *ln2, *ln2_mean, *ln2_rstd, *fch, *fch_gelu;
  };
  BlockActivations Activations(int l);
  // Block l's internal activations (everything up to the MLP's hidden layer)
  // from its input, for the current batch.
  Status BlockInternals(const BlockTensors& w, const BlockActivations& a, const float* input,
                        const std::function<Status()>& next = nullptr);

  // The GPU path of Forward and Backward (ModelConfig::gpu >= 0).
  Result<float> GpuForward(const uint8_t* tokens, const uint8_t* targets, int batch, int slot);

  ModelConfig config_;
  std::vector<TensorInfo> layout_;
  StagePlan stage_;
  size_t part_begin_ = 0;  // in the servers' space
  TpAllReduce all_reduce_;
  std::vector<float> tp_scratch_;  // the cross-entropy's row maxima and sums, [3N]
  PageBuffer params_;              // this stage's range of the flat buffer
  PageBuffer grads_;
  // ModelConfig::gpu >= 0. After the buffers, so it goes first: it unpins them.
  std::unique_ptr<GpuEngine> gpu_;
  ParameterAccess access_;
  // The stage-relative span of the tensors whose names start with any of
  // `prefixes`.
  FlatRange RangeOf(std::initializer_list<std::string> prefixes) const;
  // The range of the segment holding blocks.l (or the embeddings, l = -1, or
  // the head, l = layers), stage-relative.
  FlatRange SegmentOf(int l) const;
  // Block l's four parts in the order Forward uses them: ln1 and attn.qkv,
  // attn.proj and ln2, mlp.fc, mlp.proj.
  std::array<FlatRange, 4> BlockParts(int l) const;

  // Workspace: activations of the last Forward (per layer where it applies,
  // layer-major; one layer's worth with activation checkpointing, marked
  // [L'] below) and scratch for Backward. Sized for batch_ sequences. With
  // tensor parallelism the widths of this rank's slices: C' = C/T of
  // attention, H' = H/T heads, 4C' = 4C/T hidden units, V' = V/T tokens.
  int batch_ = 0;
  bool have_targets_ = false;
  std::vector<uint8_t> tokens_, targets_;
  std::vector<float> encoded_;                    // [N, C] input of block 0
  std::vector<float> ln1_, ln1_mean_, ln1_rstd_;  // [L', N, C], [L', N]
  std::vector<float> qkv_;                        // [L', N, 3C']
  std::vector<float> att_;                        // [L', B, H', T, T] softmax probabilities
  std::vector<float> atty_;                       // [L', N, C'] attention output before proj
  std::vector<float> res_att_;                    // [L', N, C] residual after attention
  std::vector<float> ln2_, ln2_mean_, ln2_rstd_;  // [L', N, C], [L', N]
  std::vector<float> fch_, fch_gelu_;             // [L', N, 4C']
  std::vector<float> res_mlp_;                    // [L, N, C] residual after the MLP (block output), always kept
  std::vector<float> lnf_, lnf_mean_, lnf_rstd_;  // [N, C], [N]
  std::vector<float> logits_, probs_;             // [N, V']
  std::vector<float> dres_, dln_, datty_, dqkv_;  // backward scratch, [N, C] / [N, C'] / [N, 3C']
  std::vector<float> dfch_, datt_, dlogits_;      // [N, 4C'], [T, T], [N, V']

  // The workspaces of the slots not in use: UseSlot swaps a slot's buffers
  // with the members above (the kernels always work on the members).
  struct Workspace {
    int batch = 0;
    bool have_targets = false;
    std::vector<uint8_t> tokens, targets;
    std::vector<float> encoded, ln1, ln1_mean, ln1_rstd, qkv, att, atty, res_att, ln2, ln2_mean, ln2_rstd, fch,
        fch_gelu, res_mlp, lnf, lnf_mean, lnf_rstd, logits, probs, dres, dln, datty, dqkv, dfch, datt, dlogits;
  };
  void Swap(Workspace& w);
  std::vector<Workspace> stored_ = std::vector<Workspace>(1);
  int current_ = 0;  // stored_[current_] is empty: its buffers are the members
};

}  // namespace tandem::model
