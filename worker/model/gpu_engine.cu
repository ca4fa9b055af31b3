// The reference model on a CUDA device (gpu_engine.h). Every kernel computes
// what its namesake in model.cc computes, element for element; only the
// order of float additions differs (cuBLAS's products, warp reductions, and
// the atomic adds of the token embedding's gradient), so results agree with
// the CPU within fp32 rounding, not bit for bit.
//
// Row-major matrices go to column-major cuBLAS as their transposes: a
// row-major [r, c] array is a column-major [c, r] one, so out = inp · wᵀ is
// computed as outᵀ = w · inpᵀ, and so on (each call says which product it
// is). Attention runs one strided-batched product per head over the batch.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <cublas_v2.h>
#include <fmt/format.h>

// nvcc's front end takes the assignment of a [[nodiscard]] Status inside
// Result's constructor (common/status.h) for a discarded value.
#pragma nv_diag_suppress 2810
#include "worker/model/gpu_engine.h"

namespace tandem::model {
namespace {

constexpr float kLnEps = 1e-5f;
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr int kWarp = 32;
constexpr int kThreads = 256;
constexpr size_t kMaxShared = 48 * 1024;  // bytes of shared memory a kernel may take without opting in

unsigned Blocks(size_t work, int per_block = kThreads) {
  return static_cast<unsigned>((work + static_cast<size_t>(per_block) - 1) / static_cast<size_t>(per_block));
}

__device__ float WarpSum(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ float WarpMax(float v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// One warp per row: the row index of this thread's warp, or -1 past the end.
__device__ long WarpRow(size_t rows) {
  const size_t row = (static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
  return row < rows ? static_cast<long>(row) : -1;
}

// x[i] = wte[token[i]] + wpe[i mod T]
__global__ void EncoderForward(float* out, const uint8_t* tokens, const float* wte, const float* wpe, size_t n, int T,
                               int C) {
  const size_t idx = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n * static_cast<size_t>(C)) return;
  const size_t i = idx / static_cast<size_t>(C), j = idx % static_cast<size_t>(C);
  out[idx] = wte[static_cast<size_t>(tokens[i]) * C + j] + wpe[(i % static_cast<size_t>(T)) * C + j];
}

// dwpe[t] += Σ over the batch of dout[b, t]; blockIdx.y takes kPositionChunk
// sequences of the batch, whose sum is added atomically.
constexpr int kPositionChunk = 64;
__global__ void EncoderBackwardPositions(float* dwpe, const float* dout, int B, int T, int C) {
  const size_t idx = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<size_t>(T) * C) return;
  const int first = static_cast<int>(blockIdx.y) * kPositionChunk;
  const int last = first + kPositionChunk < B ? first + kPositionChunk : B;
  float sum = 0;
  for (int b = first; b < last; ++b) sum += dout[static_cast<size_t>(b) * T * C + idx];
  atomicAdd(&dwpe[idx], sum);
}

__global__ void EncoderBackwardTokens(float* dwte, const float* dout, const uint8_t* tokens, size_t n, int C) {
  const size_t idx = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n * static_cast<size_t>(C)) return;
  const size_t i = idx / static_cast<size_t>(C), j = idx % static_cast<size_t>(C);
  atomicAdd(&dwte[static_cast<size_t>(tokens[i]) * C + j], dout[idx]);
}

__global__ void LayerNormForward(float* out, float* mean, float* rstd, const float* inp, const float* w, const float* b,
                                 size_t n, int c) {
  const long row = WarpRow(n);
  if (row < 0) return;
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  const float* x = inp + static_cast<size_t>(row) * c;
  float sum = 0;
  for (int j = lane; j < c; j += kWarp) sum += x[j];
  const float m = WarpSum(sum) / static_cast<float>(c);
  float var = 0;
  for (int j = lane; j < c; j += kWarp) var += (x[j] - m) * (x[j] - m);
  const float s = rsqrtf(WarpSum(var) / static_cast<float>(c) + kLnEps);
  float* y = out + static_cast<size_t>(row) * c;
  for (int j = lane; j < c; j += kWarp) y[j] = (x[j] - m) * s * w[j] + b[j];
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = s;
  }
}

// dinp += ∂/∂inp; dw, db += the sum over every row. Each block's warps take
// rows in turn (grid-stride) and sum dw and db into the block's shared
// memory ([2, c] floats); the block then adds its sums to dw and db once, so
// the global atomics are per block, not per row.
__global__ void LayerNormBackward(float* dinp, float* dw, float* db, const float* dout, const float* inp,
                                  const float* w, const float* mean, const float* rstd, size_t n, int c) {
  extern __shared__ float sums[];  // dw [c], then db [c]
  for (int j = static_cast<int>(threadIdx.x); j < 2 * c; j += blockDim.x) sums[j] = 0.0f;
  __syncthreads();
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  const size_t warps = static_cast<size_t>(gridDim.x) * (blockDim.x / kWarp);
  for (size_t row = (static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp; row < n; row += warps) {
    const size_t base = row * c;
    const float m = mean[row], s = rstd[row];
    float dnorm_mean = 0, dnorm_norm_mean = 0;
    for (int j = lane; j < c; j += kWarp) {
      const float norm = (inp[base + j] - m) * s;
      const float dnorm = w[j] * dout[base + j];
      dnorm_mean += dnorm;
      dnorm_norm_mean += dnorm * norm;
    }
    dnorm_mean = WarpSum(dnorm_mean) / static_cast<float>(c);
    dnorm_norm_mean = WarpSum(dnorm_norm_mean) / static_cast<float>(c);
    for (int j = lane; j < c; j += kWarp) {
      const float dy = dout[base + j];
      const float norm = (inp[base + j] - m) * s;
      const float dnorm = w[j] * dy;
      atomicAdd(&sums[j], norm * dy);
      atomicAdd(&sums[c + j], dy);
      dinp[base + j] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
    }
  }
  __syncthreads();
  for (int j = static_cast<int>(threadIdx.x); j < c; j += blockDim.x) {
    atomicAdd(&dw[j], sums[j]);
    atomicAdd(&db[j], sums[c + j]);
  }
}

__global__ void AddBias(float* out, const float* b, size_t n, int oc) {
  const size_t idx = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx < n * static_cast<size_t>(oc)) out[idx] += b[idx % static_cast<size_t>(oc)];
}

// db[o] += Σ rows of dout[:, o]. A block of 32 × 8 threads takes 32
// columns of kBiasChunk rows (blockIdx.y picks the rows): each thread sums
// every 8th row of its column (a warp reads 32 consecutive floats of a row),
// the 8 partial sums are added, and the block adds its sum to db.
constexpr int kBiasRows = 8;
constexpr size_t kBiasChunk = 1024;  // rows per block, or more when n needs over 65535 blocks
__global__ void BiasBackward(float* db, const float* dout, size_t n, int oc, size_t chunk) {
  __shared__ float partial[kBiasRows][kWarp];
  const int o = static_cast<int>(blockIdx.x) * kWarp + static_cast<int>(threadIdx.x);
  const size_t first = static_cast<size_t>(blockIdx.y) * chunk;
  const size_t last = first + chunk < n ? first + chunk : n;
  float sum = 0;
  if (o < oc) {
    for (size_t i = first + threadIdx.y; i < last; i += kBiasRows) sum += dout[i * oc + o];
  }
  partial[threadIdx.y][threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.y != 0 || o >= oc) return;
  for (int r = 1; r < kBiasRows; ++r) sum += partial[r][threadIdx.x];
  atomicAdd(&db[o], sum);
}

__global__ void AddInPlace(float* out, const float* in, size_t n) {
  const size_t idx = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx < n) out[idx] += in[idx];
}

__global__ void GeluForward(float* out, const float* inp, size_t n) {
  const size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float x = inp[i];
  out[i] = 0.5f * x * (1.0f + tanhf(kGeluScale * (x + 0.044715f * x * x * x)));
}

__global__ void GeluBackward(float* dinout, const float* inp, size_t n) {
  const size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float x = inp[i];
  const float t = tanhf(kGeluScale * (x + 0.044715f * x * x * x));
  dinout[i] *= 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kGeluScale * (1.0f + 3.0f * 0.044715f * x * x);
}

// Each row i of a [rows, T] block of scores (rows = B·H·T, row i mod T is the
// query position): softmax over the positions up to i, zeros after.
__global__ void CausalSoftmax(float* att, size_t rows, int T) {
  const long row = WarpRow(rows);
  if (row < 0) return;
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  const int i = static_cast<int>(row % T);
  float* a = att + static_cast<size_t>(row) * T;
  float mx = -INFINITY;
  for (int j = lane; j <= i; j += kWarp) mx = fmaxf(mx, a[j]);
  mx = WarpMax(mx);
  float sum = 0;
  for (int j = lane; j <= i; j += kWarp) {
    const float e = expf(a[j] - mx);
    a[j] = e;
    sum += e;
  }
  const float inv = 1.0f / WarpSum(sum);
  for (int j = lane; j < T; j += kWarp) a[j] = j <= i ? a[j] * inv : 0.0f;
}

// In place: d = att ⊙ (d - Σ att ⊙ d), row by row.
__global__ void SoftmaxBackward(float* d, const float* att, size_t rows, int T) {
  const long row = WarpRow(rows);
  if (row < 0) return;
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  const int i = static_cast<int>(row % T);
  const float* a = att + static_cast<size_t>(row) * T;
  float* dr = d + static_cast<size_t>(row) * T;
  float dot = 0;
  for (int j = lane; j <= i; j += kWarp) dot += a[j] * dr[j];
  dot = WarpSum(dot);
  for (int j = lane; j < T; j += kWarp) dr[j] = a[j] * (dr[j] - dot);
}

// Softmax of each row of logits into probs, and the row's cross-entropy
// term (target's log-probability, in double as the CPU sums it).
__global__ void CrossEntropyForward(float* probs, double* row_loss, const float* logits, const uint8_t* targets,
                                    size_t n, int V) {
  const long row = WarpRow(n);
  if (row < 0) return;
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  const float* z = logits + static_cast<size_t>(row) * V;
  float* p = probs + static_cast<size_t>(row) * V;
  float mx = -INFINITY;
  for (int j = lane; j < V; j += kWarp) mx = fmaxf(mx, z[j]);
  mx = WarpMax(mx);
  float sum = 0;
  for (int j = lane; j < V; j += kWarp) {
    const float e = expf(z[j] - mx);
    p[j] = e;
    sum += e;
  }
  sum = WarpSum(sum);
  const float inv = 1.0f / sum;
  for (int j = lane; j < V; j += kWarp) p[j] *= inv;
  if (lane == 0) {
    row_loss[row] = static_cast<double>(z[targets[row]] - mx) - log(static_cast<double>(sum));
  }
}

// dlogits = k · (probs - onehot(target))
__global__ void CrossEntropyBackward(float* dlogits, const float* probs, const uint8_t* targets, size_t n, int V,
                                     float k) {
  const size_t idx = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= n * static_cast<size_t>(V)) return;
  const size_t i = idx / static_cast<size_t>(V);
  const int j = static_cast<int>(idx % static_cast<size_t>(V));
  dlogits[idx] = k * probs[idx] - (j == targets[i] ? k : 0.0f);
}

const char* CublasName(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS:
      return "success";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "allocation failed";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "invalid value";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "architecture mismatch";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "execution failed";
    case CUBLAS_STATUS_INTERNAL_ERROR:
      return "internal error";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "not supported";
    default:
      return "error";
  }
}

#define TANDEM_CUDA(call)                                                                                        \
  do {                                                                                                           \
    const cudaError_t tandem_err_ = (call);                                                                      \
    if (tandem_err_ != cudaSuccess) {                                                                            \
      return Internal("model gpu: {} failed on device {}: {}", #call, device_, cudaGetErrorString(tandem_err_)); \
    }                                                                                                            \
  } while (0)

#define TANDEM_CUBLAS(call)                                                                                    \
  do {                                                                                                         \
    const cublasStatus_t tandem_st_ = (call);                                                                  \
    if (tandem_st_ != CUBLAS_STATUS_SUCCESS) {                                                                 \
      return Internal("model gpu: {} failed on device {}: cuBLAS {}", #call, device_, CublasName(tandem_st_)); \
    }                                                                                                          \
  } while (0)

// Checks the launch of the kernels just queued.
#define TANDEM_LAUNCHED() TANDEM_CUDA(cudaGetLastError())

// One block's twelve tensors in a flat buffer (the parameters or the gradients).
struct BlockTensors {
  float *ln1_w, *ln1_b, *qkv_w, *qkv_b, *proj_w, *proj_b, *ln2_w, *ln2_b, *fc_w, *fc_b, *fcproj_w, *fcproj_b;
};

// Makes the engine's device current for the calling thread and gives the
// thread its previous device back on the way out: a worker thread may also
// drive an NCCL communicator, which relies on its own device staying current.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    set_ = cudaSetDevice(device);
    if (previous_ == device) previous_ = -1;
  }
  ~DeviceScope() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  cudaError_t status() const { return set_; }

 private:
  int previous_ = -1;
  cudaError_t set_ = cudaSuccess;
};

class CudaEngine final : public GpuEngine {
 public:
  CudaEngine(const GpuModelShape& config, std::vector<size_t> offsets, size_t num_parameters)
      : config_(config), offsets_(std::move(offsets)), num_parameters_(num_parameters), device_(config.gpu) {}

  ~CudaEngine() override {
    if (!initialized_) return;  // the device was never made current: nothing of it is held
    UnpinHost();
    const DeviceScope scope(device_);
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    for (Slot& s : slots_) cudaFree(s.memory);
    cudaFree(params_);
    cudaFree(grads_);
    cudaFreeHost(staging_);
    for (cudaEvent_t e : downloaded_) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    if (cublas_ != nullptr) cublasDestroy(cublas_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    cudaGetLastError();
  }

  Status Init() {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return FailedPrecondition("model gpu: device {} was asked for, but CUDA finds no usable device: {}", device_,
                                cudaGetErrorString(err));
    }
    if (device_ >= count) {
      return FailedPrecondition("model gpu: device {} was asked for, but CUDA sees {}", device_,
                                count == 0
                                    ? std::string("no device")
                                    : fmt::format("{} device{} (0 to {})", count, count == 1 ? "" : "s", count - 1));
    }
    const size_t shared = 2 * static_cast<size_t>(config_.d_model) * sizeof(float);
    if (shared > kMaxShared) {
      return FailedPrecondition("model gpu: d_model {} is above the {} that the GPU path's LayerNorm kernels hold",
                                config_.d_model, kMaxShared / (2 * sizeof(float)));
    }
    const DeviceScope scope(device_);
    if (scope.status() != cudaSuccess) {
      cudaGetLastError();
      return FailedPrecondition("model gpu: device {} cannot be used: {}", device_, cudaGetErrorString(scope.status()));
    }
    initialized_ = true;  // from here the destructor releases what Init took
    cudaDeviceProp prop{};
    TANDEM_CUDA(cudaGetDeviceProperties(&prop, device_));
    multiprocessors_ = prop.multiProcessorCount;
    describe_ = fmt::format("{} (device {}, compute capability {}.{})", prop.name, device_, prop.major, prop.minor);
    TANDEM_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    TANDEM_CUBLAS(cublasCreate(&cublas_));
    TANDEM_CUBLAS(cublasSetStream(cublas_, stream_));
    // fp32 products on the CUDA cores (TF32 only with CUBLAS_TF32_TENSOR_OP_MATH,
    // which is not asked for): results within fp32 rounding of the CPU's.
    TANDEM_CUBLAS(cublasSetMathMode(cublas_, CUBLAS_DEFAULT_MATH));
    TANDEM_CUDA(cudaMalloc(&params_, num_parameters_ * sizeof(float)));
    TANDEM_CUDA(cudaMalloc(&grads_, num_parameters_ * sizeof(float)));
    for (cudaEvent_t& e : downloaded_) TANDEM_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    slots_.resize(1);
    return Status::Ok();
  }

  std::string Describe() const override { return describe_; }

  void PinHost(float* params, float* grads, size_t count) override {
    if (pinned_params_ == params && pinned_grads_ == grads) return;
    UnpinHost();
    const DeviceScope scope(device_);
    const size_t bytes = count * sizeof(float);
    if (cudaHostRegister(params, bytes, cudaHostRegisterDefault) != cudaSuccess) {
      cudaGetLastError();
      return;
    }
    if (cudaHostRegister(grads, bytes, cudaHostRegisterDefault) != cudaSuccess) {
      cudaGetLastError();
      cudaHostUnregister(params);
      return;
    }
    pinned_params_ = params;
    pinned_grads_ = grads;
  }

  void UnpinHost() override {
    if (pinned_params_ == nullptr) return;
    const DeviceScope scope(device_);
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    cudaHostUnregister(pinned_params_);
    cudaHostUnregister(pinned_grads_);
    cudaGetLastError();
    pinned_params_ = pinned_grads_ = nullptr;
  }

  Status Upload(size_t begin, size_t end, const float* host) override {
    if (begin > end || end > num_parameters_) {
      return InvalidArgument("model gpu: upload of [{}, {}) is outside the {} parameters", begin, end, num_parameters_);
    }
    if (begin == end) return Status::Ok();
    const DeviceScope scope(device_);
    TANDEM_CUDA(
        cudaMemcpyAsync(params_ + begin, host + begin, (end - begin) * sizeof(float), cudaMemcpyHostToDevice, stream_));
    // The caller may give the pages back as soon as this returns.
    TANDEM_CUDA(cudaStreamSynchronize(stream_));
    return Status::Ok();
  }

  void SetSlots(int slots) override {
    const DeviceScope scope(device_);
    const size_t want = static_cast<size_t>(slots < 1 ? 1 : slots);
    for (size_t i = want; i < slots_.size(); ++i) cudaFree(slots_[i].memory);
    slots_.resize(want);
  }

  Result<float> Forward(const uint8_t* tokens, const uint8_t* targets, int batch, int slot) override {
    const DeviceScope scope(device_);
    Slot& s = slots_[static_cast<size_t>(slot)];
    TANDEM_RETURN_IF_ERROR(Ensure(s, batch));
    s.have_targets = false;
    const int T = config_.context, C = config_.d_model, V = config_.vocab, F = Hidden(), L = config_.layers;
    const size_t N = static_cast<size_t>(batch) * static_cast<size_t>(T);
    TANDEM_CUDA(cudaMemcpyAsync(s.tokens, tokens, N, cudaMemcpyHostToDevice, stream_));
    if (targets != nullptr) TANDEM_CUDA(cudaMemcpyAsync(s.targets, targets, N, cudaMemcpyHostToDevice, stream_));
    EncoderForward<<<Blocks(N * C), kThreads, 0, stream_>>>(s.encoded, s.tokens, P(0), P(1), N, T, C);
    TANDEM_LAUNCHED();
    const float* residual = s.encoded;
    for (int l = 0; l < L; ++l) {
      const BlockTensors w = BlockOf(params_, l);
      const Acts a = ActsOf(s, l);
      LayerNormForward<<<Blocks(N * kWarp), kThreads, 0, stream_>>>(a.ln1, a.ln1_mean, a.ln1_rstd, residual, w.ln1_w,
                                                                    w.ln1_b, N, C);
      TANDEM_LAUNCHED();
      TANDEM_RETURN_IF_ERROR(Linear(a.qkv, a.ln1, w.qkv_w, w.qkv_b, N, C, 3 * C));
      TANDEM_RETURN_IF_ERROR(Attention(a.atty, a.att, a.qkv, batch));
      TANDEM_RETURN_IF_ERROR(Linear(a.res_att, a.atty, w.proj_w, w.proj_b, N, C, C));
      AddInPlace<<<Blocks(N * C), kThreads, 0, stream_>>>(a.res_att, residual, N * C);
      LayerNormForward<<<Blocks(N * kWarp), kThreads, 0, stream_>>>(a.ln2, a.ln2_mean, a.ln2_rstd, a.res_att, w.ln2_w,
                                                                    w.ln2_b, N, C);
      TANDEM_LAUNCHED();
      TANDEM_RETURN_IF_ERROR(Linear(a.fch, a.ln2, w.fc_w, w.fc_b, N, C, F));
      GeluForward<<<Blocks(N * F), kThreads, 0, stream_>>>(a.fch_gelu, a.fch, N * F);
      TANDEM_LAUNCHED();
      TANDEM_RETURN_IF_ERROR(Linear(a.res_mlp, a.fch_gelu, w.fcproj_w, w.fcproj_b, N, F, C));
      AddInPlace<<<Blocks(N * C), kThreads, 0, stream_>>>(a.res_mlp, a.res_att, N * C);
      TANDEM_LAUNCHED();
      residual = a.res_mlp;
    }
    const size_t head = 2 + 12 * static_cast<size_t>(L);
    LayerNormForward<<<Blocks(N * kWarp), kThreads, 0, stream_>>>(s.lnf, s.lnf_mean, s.lnf_rstd, residual, P(head),
                                                                  P(head + 1), N, C);
    TANDEM_LAUNCHED();
    TANDEM_RETURN_IF_ERROR(Linear(s.logits, s.lnf, P(head + 2), nullptr, N, C, V));
    if (targets == nullptr) {
      TANDEM_CUDA(cudaStreamSynchronize(stream_));
      return 0.0f;
    }
    CrossEntropyForward<<<Blocks(N * kWarp), kThreads, 0, stream_>>>(s.probs, s.row_loss, s.logits, s.targets, N, V);
    TANDEM_LAUNCHED();
    std::vector<double> rows(N);
    TANDEM_CUDA(cudaMemcpyAsync(rows.data(), s.row_loss, N * sizeof(double), cudaMemcpyDeviceToHost, stream_));
    TANDEM_CUDA(cudaStreamSynchronize(stream_));
    double loss = 0;
    for (double r : rows) loss -= r;
    s.have_targets = true;
    return static_cast<float>(loss / static_cast<double>(N));
  }

  Status Backward(bool accumulate, float scale, float* host_grads,
                  const std::function<void(size_t ready_from)>& on_ready, int slot) override {
    const DeviceScope scope(device_);
    Slot& s = slots_[static_cast<size_t>(slot)];
    if (!s.have_targets) {
      return FailedPrecondition("model backward: needs a forward with targets first (and runs once per forward)");
    }
    s.have_targets = false;
    const int B = s.batch, T = config_.context, C = config_.d_model, V = config_.vocab, F = Hidden();
    const int L = config_.layers;
    const size_t N = static_cast<size_t>(B) * static_cast<size_t>(T), NC = N * static_cast<size_t>(C);
    if (accumulate) {
      TANDEM_CUDA(
          cudaMemcpyAsync(grads_, host_grads, num_parameters_ * sizeof(float), cudaMemcpyHostToDevice, stream_));
    } else {
      TANDEM_CUDA(cudaMemsetAsync(grads_, 0, num_parameters_ * sizeof(float), stream_));
    }
    // Final gradients [from, done) go to pinned memory behind the kernels
    // queued so far: host_grads itself when PinHost pinned it, else the
    // staging buffer. The run before it, whose copy was queued one layer
    // earlier, is waited for, moved into host_grads (from staging) and
    // reported. So the copies and on_ready (the runtime's sends) overlap
    // the device's next layer.
    if (host_grads != pinned_grads_ && staging_ == nullptr) {
      // Host gradients that are not page-locked (paged buffers): a pinned
      // staging buffer, taken the first time it is needed.
      TANDEM_CUDA(cudaMallocHost(&staging_, num_parameters_ * sizeof(float)));
    }
    float* const landing = host_grads == pinned_grads_ ? host_grads : staging_;
    size_t done = num_parameters_;
    struct Pending {
      size_t from = 0, to = 0;
      int event = -1;
    };
    Pending pending;
    int next_event = 0;
    const auto finish = [&]() -> Status {
      if (pending.event < 0) return Status::Ok();
      TANDEM_CUDA(cudaEventSynchronize(downloaded_[pending.event]));
      if (landing != host_grads) {
        std::memcpy(host_grads + pending.from, staging_ + pending.from, (pending.to - pending.from) * sizeof(float));
      }
      pending.event = -1;
      if (on_ready) on_ready(pending.from);
      return Status::Ok();
    };
    const auto ready = [&](size_t from) -> Status {
      TANDEM_CUDA(cudaMemcpyAsync(landing + from, grads_ + from, (done - from) * sizeof(float), cudaMemcpyDeviceToHost,
                                  stream_));
      TANDEM_CUDA(cudaEventRecord(downloaded_[next_event], stream_));
      TANDEM_RETURN_IF_ERROR(finish());
      pending = Pending{from, done, next_event};
      next_event = 1 - next_event;
      done = from;
      return Status::Ok();
    };

    const size_t head = 2 + 12 * static_cast<size_t>(L);
    CrossEntropyBackward<<<Blocks(N * V), kThreads, 0, stream_>>>(s.dlogits, s.probs, s.targets, N, V,
                                                                  scale / static_cast<float>(N));
    TANDEM_LAUNCHED();
    TANDEM_RETURN_IF_ERROR(LinearBackward(s.dln, G(head + 2), nullptr, s.dlogits, s.lnf, P(head + 2), N, C, V));
    TANDEM_CUDA(cudaMemsetAsync(s.dres, 0, NC * sizeof(float), stream_));
    const float* last = ActsOf(s, L - 1).res_mlp;
    TANDEM_RETURN_IF_ERROR(
        LayerNormBack(s.dres, G(head), G(head + 1), s.dln, last, P(head), s.lnf_mean, s.lnf_rstd, N, C));
    TANDEM_RETURN_IF_ERROR(ready(offsets_[head]));

    for (int l = L - 1; l >= 0; --l) {
      const BlockTensors w = BlockOf(params_, l);
      const BlockTensors g = BlockOf(grads_, l);
      const Acts a = ActsOf(s, l);
      const float* residual = l == 0 ? s.encoded : ActsOf(s, l - 1).res_mlp;
      TANDEM_RETURN_IF_ERROR(LinearBackward(s.dfch, g.fcproj_w, g.fcproj_b, s.dres, a.fch_gelu, w.fcproj_w, N, F, C));
      GeluBackward<<<Blocks(N * F), kThreads, 0, stream_>>>(s.dfch, a.fch, N * F);
      TANDEM_LAUNCHED();
      TANDEM_RETURN_IF_ERROR(LinearBackward(s.dln, g.fc_w, g.fc_b, s.dfch, a.ln2, w.fc_w, N, C, F));
      TANDEM_RETURN_IF_ERROR(
          LayerNormBack(s.dres, g.ln2_w, g.ln2_b, s.dln, a.res_att, w.ln2_w, a.ln2_mean, a.ln2_rstd, N, C));
      TANDEM_RETURN_IF_ERROR(LinearBackward(s.datty, g.proj_w, g.proj_b, s.dres, a.atty, w.proj_w, N, C, C));
      TANDEM_RETURN_IF_ERROR(AttentionBackward(s.dqkv, s.datt, s.datty, a.qkv, a.att, B));
      TANDEM_RETURN_IF_ERROR(LinearBackward(s.dln, g.qkv_w, g.qkv_b, s.dqkv, a.ln1, w.qkv_w, N, C, 3 * C));
      TANDEM_RETURN_IF_ERROR(
          LayerNormBack(s.dres, g.ln1_w, g.ln1_b, s.dln, residual, w.ln1_w, a.ln1_mean, a.ln1_rstd, N, C));
      TANDEM_RETURN_IF_ERROR(ready(offsets_[2 + 12 * static_cast<size_t>(l)]));
    }
    const dim3 positions(Blocks(static_cast<size_t>(T) * C),
                         static_cast<unsigned>((B + kPositionChunk - 1) / kPositionChunk));
    EncoderBackwardPositions<<<positions, kThreads, 0, stream_>>>(G(1), s.dres, B, T, C);
    EncoderBackwardTokens<<<Blocks(NC), kThreads, 0, stream_>>>(G(0), s.dres, s.tokens, N, C);
    TANDEM_LAUNCHED();
    TANDEM_RETURN_IF_ERROR(ready(0));
    return finish();
  }

  Status Logits(int slot, std::vector<float>* out) override {
    const DeviceScope scope(device_);
    const Slot& s = slots_[static_cast<size_t>(slot)];
    const size_t n = static_cast<size_t>(s.batch) * static_cast<size_t>(config_.context) * config_.vocab;
    out->resize(n);
    if (n == 0) return Status::Ok();
    TANDEM_CUDA(cudaMemcpyAsync(out->data(), s.logits, n * sizeof(float), cudaMemcpyDeviceToHost, stream_));
    TANDEM_CUDA(cudaStreamSynchronize(stream_));
    return Status::Ok();
  }

  size_t activation_bytes() const override {
    size_t bytes = 0;
    for (const Slot& s : slots_) bytes += s.bytes;
    return bytes;
  }

 private:
  // One micro-batch slot's device memory: one allocation, carved up.
  struct Slot {
    int batch = 0;
    bool have_targets = false;
    char* memory = nullptr;
    size_t bytes = 0;
    uint8_t *tokens = nullptr, *targets = nullptr;
    double* row_loss = nullptr;
    float *encoded = nullptr, *layers = nullptr;  // layers: L × the per-block activations (Acts)
    float *lnf = nullptr, *lnf_mean = nullptr, *lnf_rstd = nullptr, *logits = nullptr, *probs = nullptr;
    float *dres = nullptr, *dln = nullptr, *datty = nullptr, *dqkv = nullptr, *dfch = nullptr, *datt = nullptr;
    float* dlogits = nullptr;
  };
  struct Acts {
    float *ln1, *ln1_mean, *ln1_rstd, *qkv, *att, *atty, *res_att, *ln2, *ln2_mean, *ln2_rstd, *fch, *fch_gelu,
        *res_mlp;
  };

  int Hidden() const { return config_.mlp_ratio * config_.d_model; }
  size_t PerBlock(int batch) const {
    const size_t T = static_cast<size_t>(config_.context), C = static_cast<size_t>(config_.d_model);
    const size_t N = static_cast<size_t>(batch) * T, H = static_cast<size_t>(config_.heads);
    const size_t F = static_cast<size_t>(Hidden());
    // ln1, qkv, att, atty, res_att, ln2, fch, fch_gelu, res_mlp; four [N] statistics
    return N * C + N * 3 * C + static_cast<size_t>(batch) * H * T * T + N * C + N * C + N * C + 2 * N * F + N * C +
           4 * N;
  }

  Acts ActsOf(const Slot& s, int l) const {
    const size_t T = static_cast<size_t>(config_.context), C = static_cast<size_t>(config_.d_model);
    const size_t N = static_cast<size_t>(s.batch) * T, H = static_cast<size_t>(config_.heads);
    const size_t F = static_cast<size_t>(Hidden());
    float* p = s.layers + static_cast<size_t>(l) * PerBlock(s.batch);
    Acts a{};
    const auto take = [&p](size_t n) {
      float* at = p;
      p += n;
      return at;
    };
    a.ln1 = take(N * C);
    a.ln1_mean = take(N);
    a.ln1_rstd = take(N);
    a.qkv = take(N * 3 * C);
    a.att = take(static_cast<size_t>(s.batch) * H * T * T);
    a.atty = take(N * C);
    a.res_att = take(N * C);
    a.ln2 = take(N * C);
    a.ln2_mean = take(N);
    a.ln2_rstd = take(N);
    a.fch = take(N * F);
    a.fch_gelu = take(N * F);
    a.res_mlp = take(N * C);
    return a;
  }

  Status Ensure(Slot& s, int batch) {
    if (s.batch == batch) return Status::Ok();
    cudaFree(s.memory);
    s = Slot{};
    const size_t T = static_cast<size_t>(config_.context), C = static_cast<size_t>(config_.d_model);
    const size_t N = static_cast<size_t>(batch) * T, H = static_cast<size_t>(config_.heads);
    const size_t F = static_cast<size_t>(Hidden()), V = static_cast<size_t>(config_.vocab);
    const size_t L = static_cast<size_t>(config_.layers);
    // floats: encoded, layers, lnf (+2 stats), logits, probs, dres, dln, datty, dqkv, dfch, datt, dlogits
    const size_t floats = N * C + L * PerBlock(batch) + N * C + 2 * N + 2 * N * V + N * C * 3 + N * 3 * C + N * F +
                          static_cast<size_t>(batch) * H * T * T + N * V;
    const size_t bytes = N * sizeof(double) + floats * sizeof(float) + 2 * N + 64;
    void* memory = nullptr;
    const cudaError_t err = cudaMalloc(&memory, bytes);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return ResourceExhausted("model gpu: {} bytes of activations for a batch of {} do not fit on {}: {}", bytes,
                               batch, describe_, cudaGetErrorString(err));
    }
    s.memory = static_cast<char*>(memory);
    s.bytes = bytes;
    s.batch = batch;
    s.row_loss = reinterpret_cast<double*>(s.memory);
    float* p = reinterpret_cast<float*>(s.memory + N * sizeof(double));
    const auto take = [&p](size_t n) {
      float* at = p;
      p += n;
      return at;
    };
    s.encoded = take(N * C);
    s.layers = take(L * PerBlock(batch));
    s.lnf = take(N * C);
    s.lnf_mean = take(N);
    s.lnf_rstd = take(N);
    s.logits = take(N * V);
    s.probs = take(N * V);
    s.dres = take(N * C);
    s.dln = take(N * C);
    s.datty = take(N * C);
    s.dqkv = take(N * 3 * C);
    s.dfch = take(N * F);
    s.datt = take(static_cast<size_t>(batch) * H * T * T);
    s.dlogits = take(N * V);
    s.tokens = reinterpret_cast<uint8_t*>(p);
    s.targets = s.tokens + N;
    return Status::Ok();
  }

  const float* P(size_t tensor) const { return params_ + offsets_[tensor]; }
  float* G(size_t tensor) const { return grads_ + offsets_[tensor]; }
  // Block l's tensors in `base` (params_ or grads_), in the layout's order.
  BlockTensors BlockOf(float* base, int l) const {
    const size_t* t = offsets_.data() + 2 + 12 * static_cast<size_t>(l);
    return BlockTensors{base + t[0], base + t[1], base + t[2], base + t[3], base + t[4],  base + t[5],
                        base + t[6], base + t[7], base + t[8], base + t[9], base + t[10], base + t[11]};
  }

  Status LayerNormBack(float* dinp, float* dw, float* db, const float* dout, const float* inp, const float* w,
                       const float* mean, const float* rstd, size_t n, int c) {
    const size_t shared = 2 * static_cast<size_t>(c) * sizeof(float);  // <= kMaxShared (Init)
    // Up to 4 blocks per multiprocessor, fewer when there are few rows.
    const unsigned blocks = std::min<unsigned>(Blocks(n * kWarp), static_cast<unsigned>(4 * multiprocessors_));
    LayerNormBackward<<<std::max(blocks, 1u), kThreads, shared, stream_>>>(dinp, dw, db, dout, inp, w, mean, rstd, n,
                                                                           c);
    TANDEM_LAUNCHED();
    return Status::Ok();
  }

  // out[n, oc] = inp[n, ic] · w[oc, ic]ᵀ + b  (outᵀ = w · inpᵀ)
  Status Linear(float* out, const float* inp, const float* w, const float* b, size_t n, int ic, int oc) {
    const float one = 1.0f, zero = 0.0f;
    TANDEM_CUBLAS(cublasSgemm(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, oc, static_cast<int>(n), ic, &one, w, ic, inp, ic,
                              &zero, out, oc));
    if (b != nullptr) {
      AddBias<<<Blocks(n * static_cast<size_t>(oc)), kThreads, 0, stream_>>>(out, b, n, oc);
      TANDEM_LAUNCHED();
    }
    return Status::Ok();
  }

  // dinp = dout · w (dinpᵀ = wᵀ · doutᵀ); dw += doutᵀ · inp (dwᵀ += inpᵀ · dout); db += Σ rows of dout.
  Status LinearBackward(float* dinp, float* dw, float* db, const float* dout, const float* inp, const float* w,
                        size_t n, int ic, int oc) {
    const float one = 1.0f, zero = 0.0f;
    const int rows = static_cast<int>(n);
    TANDEM_CUBLAS(cublasSgemm(cublas_, CUBLAS_OP_N, CUBLAS_OP_N, ic, rows, oc, &one, w, ic, dout, oc, &zero, dinp, ic));
    TANDEM_CUBLAS(cublasSgemm(cublas_, CUBLAS_OP_N, CUBLAS_OP_T, ic, oc, rows, &one, inp, ic, dout, oc, &one, dw, ic));
    if (db != nullptr) {
      const size_t chunk = std::max(kBiasChunk, (n + 65534) / 65535);
      const dim3 grid(Blocks(static_cast<size_t>(oc), kWarp), static_cast<unsigned>((n + chunk - 1) / chunk));
      BiasBackward<<<grid, dim3(kWarp, kBiasRows), 0, stream_>>>(db, dout, n, oc, chunk);
      TANDEM_LAUNCHED();
    }
    return Status::Ok();
  }

  // Causal self-attention: qkv [B, T, 3C] → out [B, T, C], att [B, H, T, T].
  Status Attention(float* out, float* att, const float* qkv, int B) {
    const int T = config_.context, C = config_.d_model, H = config_.heads, hs = C / H;
    const float scale = 1.0f / std::sqrt(static_cast<float>(hs)), one = 1.0f, zero = 0.0f;
    const long long qkv_stride = static_cast<long long>(T) * 3 * C, att_stride = static_cast<long long>(H) * T * T;
    const long long out_stride = static_cast<long long>(T) * C;
    for (int h = 0; h < H; ++h) {
      const float* q = qkv + static_cast<size_t>(h) * hs;
      const float* k = q + C;
      float* a = att + static_cast<size_t>(h) * T * T;
      // att[i, j] = scale · q_i · k_j  (attᵀ = k · qᵀ)
      TANDEM_CUBLAS(cublasSgemmStridedBatched(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, T, T, hs, &scale, k, 3 * C, qkv_stride,
                                              q, 3 * C, qkv_stride, &zero, a, T, att_stride, B));
    }
    const size_t rows = static_cast<size_t>(B) * H * T;
    CausalSoftmax<<<Blocks(rows * kWarp), kThreads, 0, stream_>>>(att, rows, T);
    TANDEM_LAUNCHED();
    for (int h = 0; h < H; ++h) {
      const float* v = qkv + static_cast<size_t>(h) * hs + 2 * static_cast<size_t>(C);
      const float* a = att + static_cast<size_t>(h) * T * T;
      // y = att · v  (yᵀ = vᵀ · attᵀ)
      TANDEM_CUBLAS(cublasSgemmStridedBatched(cublas_, CUBLAS_OP_N, CUBLAS_OP_N, hs, T, T, &one, v, 3 * C, qkv_stride,
                                              a, T, att_stride, &zero, out + static_cast<size_t>(h) * hs, C, out_stride,
                                              B));
    }
    return Status::Ok();
  }

  // dqkv [B, T, 3C] (overwritten) from dout [B, T, C]; datt [B, H, T, T] scratch.
  Status AttentionBackward(float* dqkv, float* datt, const float* dout, const float* qkv, const float* att, int B) {
    const int T = config_.context, C = config_.d_model, H = config_.heads, hs = C / H;
    const float scale = 1.0f / std::sqrt(static_cast<float>(hs)), one = 1.0f, zero = 0.0f;
    const long long qkv_stride = static_cast<long long>(T) * 3 * C, att_stride = static_cast<long long>(H) * T * T;
    const long long out_stride = static_cast<long long>(T) * C;
    for (int h = 0; h < H; ++h) {
      const size_t off = static_cast<size_t>(h) * hs;
      const float* v = qkv + off + 2 * static_cast<size_t>(C);
      const float* dy = dout + off;
      const float* a = att + static_cast<size_t>(h) * T * T;
      float* da = datt + static_cast<size_t>(h) * T * T;
      float* dv = dqkv + off + 2 * static_cast<size_t>(C);
      // datt = dy · vᵀ  (dattᵀ = v · dyᵀ)
      TANDEM_CUBLAS(cublasSgemmStridedBatched(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, T, T, hs, &one, v, 3 * C, qkv_stride,
                                              dy, C, out_stride, &zero, da, T, att_stride, B));
      // dv = attᵀ · dy  (dvᵀ = dyᵀ · att)
      TANDEM_CUBLAS(cublasSgemmStridedBatched(cublas_, CUBLAS_OP_N, CUBLAS_OP_T, hs, T, T, &one, dy, C, out_stride, a,
                                              T, att_stride, &zero, dv, 3 * C, qkv_stride, B));
    }
    const size_t rows = static_cast<size_t>(B) * H * T;
    SoftmaxBackward<<<Blocks(rows * kWarp), kThreads, 0, stream_>>>(datt, att, rows, T);
    TANDEM_LAUNCHED();
    for (int h = 0; h < H; ++h) {
      const size_t off = static_cast<size_t>(h) * hs;
      const float* q = qkv + off;
      const float* k = q + C;
      const float* da = datt + static_cast<size_t>(h) * T * T;
      float* dq = dqkv + off;
      float* dk = dq + C;
      // dq = scale · dpre · k  (dqᵀ = scale · kᵀ · dpreᵀ)
      TANDEM_CUBLAS(cublasSgemmStridedBatched(cublas_, CUBLAS_OP_N, CUBLAS_OP_N, hs, T, T, &scale, k, 3 * C, qkv_stride,
                                              da, T, att_stride, &zero, dq, 3 * C, qkv_stride, B));
      // dk = scale · dpreᵀ · q  (dkᵀ = scale · qᵀ · dpre)
      TANDEM_CUBLAS(cublasSgemmStridedBatched(cublas_, CUBLAS_OP_N, CUBLAS_OP_T, hs, T, T, &scale, q, 3 * C, qkv_stride,
                                              da, T, att_stride, &zero, dk, 3 * C, qkv_stride, B));
    }
    return Status::Ok();
  }

  GpuModelShape config_;
  std::vector<size_t> offsets_;
  size_t num_parameters_;
  int device_;
  bool initialized_ = false;
  int multiprocessors_ = 1;
  std::string describe_;
  float* staging_ = nullptr;        // pinned, num_parameters_, only for unpinned host gradients
  float* pinned_params_ = nullptr;  // the host buffers PinHost pinned
  float* pinned_grads_ = nullptr;
  cudaEvent_t downloaded_[2] = {};  // one per download in flight
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  float* params_ = nullptr;
  float* grads_ = nullptr;
  std::vector<Slot> slots_;
};

}  // namespace

Result<std::unique_ptr<GpuEngine>> GpuEngine::Create(const GpuModelShape& config, std::vector<size_t> offsets,
                                                     size_t num_parameters) {
  auto engine = std::make_unique<CudaEngine>(config, std::move(offsets), num_parameters);
  TANDEM_RETURN_IF_ERROR(engine->Init());
  return std::unique_ptr<GpuEngine>(std::move(engine));
}

}  // namespace tandem::model
