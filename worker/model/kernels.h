// The reference model's CPU kernels: the linear layers (through CBLAS),
// LayerNorm, GELU (tanh approximation) and causal self-attention, forward and
// backward, on row-major fp32 buffers the caller owns (model.cc keeps them in
// its workspace). N is the number of rows (batch · positions), C the width,
// IC and OC a linear layer's input and output features, B, T and H the
// sequences, positions and heads of attention. Also how many threads the
// BLAS library uses, and how far one result is from another.
//
// Thread safety: the kernels touch only the buffers they are given (the BLAS
// library may use threads of its own: SetBlasThreads); SetBlasThreads is
// process-wide.
#pragma once

#include <cstddef>
#include <span>

namespace tandem::model {
namespace kernels {

// out[N, OC] += b
void AddBias(float* out, const float* b, int n, int oc);

// out[N, OC] = inp[N, IC] · w[OC, IC]ᵀ + b (b may be null).
void LinearForward(float* out, const float* inp, const float* w, const float* b, int n, int ic, int oc);

// dinp = dout · w (overwritten); dw += doutᵀ · inp; db += Σ rows of dout (db
// may be null).
void LinearBackward(float* dinp, float* dw, float* db, const float* dout, const float* inp, const float* w, int n,
                    int ic, int oc);

// out[N, C] = LayerNorm(inp) · w + b, keeping each row's mean and 1/std
// (mean[N], rstd[N]) for the backward.
void LayerNormForward(float* out, float* mean, float* rstd, const float* inp, const float* w, const float* b, int n,
                      int c);

// dinp += ∂/∂inp (accumulates: the input is the residual stream); dw, db +=.
void LayerNormBackward(float* dinp, float* dw, float* db, const float* dout, const float* inp, const float* w,
                       const float* mean, const float* rstd, int n, int c);

// out[i] = gelu(inp[i]) (tanh approximation), n elements.
void GeluForward(float* out, const float* inp, size_t n);

// dinout: in, ∂L/∂gelu(x); out, ∂L/∂x.
void GeluBackward(float* dinout, const float* inp, size_t n);

// Causal self-attention of B sequences of T positions: qkv [B, T, 3C] →
// out [B, T, C]; att [B, H, T, T] keeps the probabilities (zero above the
// diagonal).
void AttentionForward(float* out, float* att, const float* qkv, int B, int T, int C, int H);

// dqkv [B, T, 3C] (overwritten) from dout [B, T, C]; scratch [T, T].
void AttentionBackward(float* dqkv, float* scratch, const float* dout, const float* qkv, const float* att, int B, int T,
                       int C, int H);

}  // namespace kernels

// max |a[i] - b[i]| over max |b[i]| (over max 1 when b is all zeros): how far
// a (the GPU's values, say) is from b (the CPU's), relative to b's scale.
// REQUIRES: a.size() >= b.size()
double RelativeDifference(std::span<const float> a, std::span<const float> b);

// Sets the number of threads the BLAS library uses, process-wide. A no-op
// when the BLAS found at build time has no such setting (not OpenBLAS).
void SetBlasThreads(int threads);

}  // namespace tandem::model
