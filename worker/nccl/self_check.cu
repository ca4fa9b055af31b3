// A start-up check that a GPU runs Tandem's compiled code: a kernel computes
// y[i] = a * x[i] + i over a buffer and the host checks every element.
// Kept free of Tandem's headers so nvcc compiles only this file's own code;
// gpu_info.cc turns the returned text into a Status.
#include <cuda_runtime.h>

#include <string>
#include <vector>

namespace tandem::gpu {
namespace {

__global__ void ScaleAddIndex(const float* x, float* y, float a, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + static_cast<float>(i);
}

}  // namespace

// Returns an empty string on success, else what failed.
std::string RunSelfCheckKernel(int device) {
  constexpr int kN = 1 << 16;
  constexpr float kA = 3.0f;
  const auto fail = [](const char* what, cudaError_t err) {
    cudaGetLastError();
    return std::string(what) + ": " + cudaGetErrorString(err);
  };
  if (cudaError_t err = cudaSetDevice(device); err != cudaSuccess) return fail("cudaSetDevice", err);
  std::vector<float> host(kN);
  for (int i = 0; i < kN; ++i) host[i] = static_cast<float>(i % 97) * 0.5f;
  float* x = nullptr;
  float* y = nullptr;
  if (cudaError_t err = cudaMalloc(&x, kN * sizeof(float)); err != cudaSuccess) return fail("cudaMalloc", err);
  if (cudaError_t err = cudaMalloc(&y, kN * sizeof(float)); err != cudaSuccess) {
    cudaFree(x);
    return fail("cudaMalloc", err);
  }
  cudaError_t err = cudaMemcpy(x, host.data(), kN * sizeof(float), cudaMemcpyHostToDevice);
  if (err == cudaSuccess) {
    ScaleAddIndex<<<(kN + 255) / 256, 256>>>(x, y, kA, kN);
    err = cudaGetLastError();
  }
  std::vector<float> out(kN);
  if (err == cudaSuccess) err = cudaMemcpy(out.data(), y, kN * sizeof(float), cudaMemcpyDeviceToHost);
  cudaFree(x);
  cudaFree(y);
  if (err != cudaSuccess) return fail("kernel", err);
  for (int i = 0; i < kN; ++i) {
    const float want = kA * host[i] + static_cast<float>(i);
    if (out[i] != want) {
      return "element " + std::to_string(i) + " is " + std::to_string(out[i]) + " instead of " + std::to_string(want);
    }
  }
  return std::string();
}

}  // namespace tandem::gpu
