// Gradient checks and wire conversions of the optimizer's data path (the
// parameter server's, and a worker's local optimizer in all-reduce mode):
// the sum of squares and finiteness of a reduced gradient (global norm
// clipping and the non-finite policy, server.proto OptimizerConfig), and the
// conversion of push and pull payloads between the wire's element types
// (server.proto WireDType: fp32, bf16, fp16, little-endian) and the fp32
// accumulators and master weights.
//
// Conversions round to nearest even, as accelerators and PyTorch do: bf16
// keeps fp32's range (NaN stays NaN, quieted); fp16 overflows to infinity
// from 65520 on and has subnormals down to 2^-24. Widening is exact.
//
// Every function is one vectorised pass (built like the optimizer's kernels:
// -O3, AVX-512 and AVX2 clones on x86-64, no contraction), handles any length (a
// scalar tail finishes what the vectors leave) and any alignment of the wire
// data, and is deterministic: the same input gives the same bits on every
// CPU the clones run on.
//
// Thread safety: pure functions; callers may run them on disjoint ranges from
// many threads.
#pragma once

#include <cstddef>

#include "tandem/v1/server.pb.h"

namespace tandem::optim {

struct GradScan {
  double sum_squares = 0;  // sum of g[i]^2 in double (inf or nan when !finite)
  bool finite = true;      // false when any element is NaN or +-Inf
};

// The sum of squares of g[0, n) in double (fixed per-lane partial sums, so
// the result depends only on the values and on n) and whether all are
// finite. Squares of finite floats cannot overflow a double sum, so `finite`
// is exact.
GradScan ScanGradient(const float* g, size_t n);

// Bytes of n elements on the wire: 4 each for FP32 (and UNSPECIFIED, which
// means FP32), 2 for BF16 and FP16; 0 for values outside the enum.
size_t WireBytes(v1::WireDType dtype, size_t n);

// acc[i] = widen(src[i]) when `overwrite`, else acc[i] + widen(src[i]), for
// i < n. src: n elements of `dtype` (UNSPECIFIED = FP32), little-endian, any
// alignment. REQUIRES: dtype is FP32, BF16, FP16 or UNSPECIFIED; acc and src
// do not overlap.
void AccumulateWire(float* acc, const void* src, v1::WireDType dtype, size_t n, bool overwrite);

// dst = narrow(src[0, n)) as `dtype`: a copy for FP32 (and UNSPECIFIED), bf16
// or fp16 rounded to nearest even. dst may have any alignment. REQUIRES:
// dtype is FP32, BF16, FP16 or UNSPECIFIED; dst and src do not overlap.
void EncodeWire(void* dst, const float* src, v1::WireDType dtype, size_t n);

}  // namespace tandem::optim
