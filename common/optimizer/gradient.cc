#include "common/optimizer/gradient.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/optimizer/kernel_clones.h"

// Built with -O3 -ffp-contract=off (common/CMakeLists.txt); on x86-64 with GCC
// the loops are cloned for AVX-512 and AVX2 and chosen at load time.

namespace tandem::optim {
namespace {

// Four lanes of doubles and floats (GCC/clang vector extensions: one AVX
// register, or two SSE2 registers in the baseline clone, with the same
// per-lane arithmetic either way).
using V4d = double __attribute__((vector_size(32)));
using V4f = float __attribute__((vector_size(16)));

TANDEM_KERNEL GradScan Scan(const float* __restrict g, size_t n) {
  // 16 elements per iteration into four vector accumulators: element i of a
  // block of 16 always lands in lane i, so the sum depends only on the data.
  V4d acc0 = {0, 0, 0, 0};
  V4d acc1 = acc0;
  V4d acc2 = acc0;
  V4d acc3 = acc0;
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    V4f f0;
    V4f f1;
    V4f f2;
    V4f f3;
    std::memcpy(&f0, g + i, sizeof(f0));
    std::memcpy(&f1, g + i + 4, sizeof(f1));
    std::memcpy(&f2, g + i + 8, sizeof(f2));
    std::memcpy(&f3, g + i + 12, sizeof(f3));
    const V4d d0 = __builtin_convertvector(f0, V4d);
    const V4d d1 = __builtin_convertvector(f1, V4d);
    const V4d d2 = __builtin_convertvector(f2, V4d);
    const V4d d3 = __builtin_convertvector(f3, V4d);
    acc0 += d0 * d0;
    acc1 += d1 * d1;
    acc2 += d2 * d2;
    acc3 += d3 * d3;
  }
  double tail = 0;
  for (; i < n; ++i) tail += static_cast<double>(g[i]) * g[i];
  const V4d acc = (acc0 + acc1) + (acc2 + acc3);
  GradScan scan;
  scan.sum_squares = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + tail;
  scan.finite = std::isfinite(scan.sum_squares);
  return scan;
}

// cond ? a : b without a branch (GCC does not if-convert every ?: in a loop).
inline uint32_t Select(bool cond, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(cond);
  return (a & mask) | (b & ~mask);
}

// --- Widening (exact) -------------------------------------------------------

float Bf16ToFloat(uint16_t b) {
  return std::bit_cast<float>(static_cast<uint32_t>(b) << 16);
}

// Branch-free: exponent and mantissa moved into fp32 position and rescaled
// by 2^112 (exact for normals; subnormal halves land on fp32 subnormals and
// scale exactly too); Inf and NaN take fp32's all-ones exponent.
float Fp16ToFloat(uint16_t h) {
  const uint32_t em = h & 0x7fffu;
  const float scaled = std::bit_cast<float>(em << 13) * 0x1p112f;
  const uint32_t special = 0x7f800000u | ((em & 0x3ffu) << 13);
  const uint32_t bits = Select(em >= 0x7c00u, special, std::bit_cast<uint32_t>(scaled));
  return std::bit_cast<float>(bits | (static_cast<uint32_t>(h & 0x8000u) << 16));
}

template <bool kOverwrite>
TANDEM_KERNEL void AccumulateF32(float* __restrict acc, const unsigned char* __restrict src, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    float v;
    std::memcpy(&v, src + 4 * i, sizeof(v));
    acc[i] = kOverwrite ? v : acc[i] + v;
  }
}

template <bool kOverwrite>
TANDEM_KERNEL void AccumulateBf16(float* __restrict acc, const unsigned char* __restrict src, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    uint16_t b;
    std::memcpy(&b, src + 2 * i, sizeof(b));
    const float v = Bf16ToFloat(b);
    acc[i] = kOverwrite ? v : acc[i] + v;
  }
}

template <bool kOverwrite>
TANDEM_KERNEL void AccumulateFp16(float* __restrict acc, const unsigned char* __restrict src, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, src + 2 * i, sizeof(h));
    const float v = Fp16ToFloat(h);
    acc[i] = kOverwrite ? v : acc[i] + v;
  }
}

// --- Narrowing (round to nearest even) --------------------------------------

uint16_t FloatToBf16(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t nan = (bits >> 16) | 0x40u;  // quiet, sign and payload kept
  return static_cast<uint16_t>(Select((bits & 0x7fffffffu) > 0x7f800000u, nan, rounded));
}

// Branch-free (all three cases computed, one selected), after F. Giesen's
// float_to_half_fast3_rtne.
uint16_t FloatToFp16(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t abs = bits & 0x7fffffffu;
  // Results of 65520 and above (after rounding) are Inf; NaN stays NaN.
  const uint32_t big = Select(abs > 0x7f800000u, 0x7e00u, 0x7c00u);
  // Subnormal or zero halves (|f| < 2^-14): adding 0.5 lines the half's
  // last mantissa bit up with fp32's, and the addition rounds to nearest even.
  const uint32_t small = std::bit_cast<uint32_t>(std::bit_cast<float>(abs) + 0.5f) - 0x3f000000u;
  // Normal halves: rebias, round the 13 dropped bits to nearest even (a carry
  // into the exponent is the right result, up to Inf).
  const uint32_t normal = (abs - (112u << 23) + 0xfffu + ((abs >> 13) & 1u)) >> 13;
  const uint32_t half = Select(abs >= 0x47800000u, big, Select(abs < 0x38800000u, small, normal));
  return static_cast<uint16_t>(sign | half);
}

TANDEM_KERNEL void EncodeBf16(unsigned char* __restrict dst, const float* __restrict src, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const uint16_t b = FloatToBf16(src[i]);
    std::memcpy(dst + 2 * i, &b, sizeof(b));
  }
}

TANDEM_KERNEL void EncodeFp16(unsigned char* __restrict dst, const float* __restrict src, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const uint16_t h = FloatToFp16(src[i]);
    std::memcpy(dst + 2 * i, &h, sizeof(h));
  }
}

}  // namespace

GradScan ScanGradient(const float* g, size_t n) {
  if (n == 0) return {};
  return Scan(g, n);
}

size_t WireBytes(v1::WireDType dtype, size_t n) {
  switch (dtype) {
    case v1::WIRE_DTYPE_UNSPECIFIED:
    case v1::WIRE_DTYPE_FP32:
      return 4 * n;
    case v1::WIRE_DTYPE_BF16:
    case v1::WIRE_DTYPE_FP16:
      return 2 * n;
    default:
      return 0;
  }
}

void AccumulateWire(float* acc, const void* src, v1::WireDType dtype, size_t n, bool overwrite) {
  if (n == 0) return;
  const auto* s = static_cast<const unsigned char*>(src);
  switch (dtype) {
    case v1::WIRE_DTYPE_UNSPECIFIED:
    case v1::WIRE_DTYPE_FP32:
      if (overwrite) {
        std::memcpy(acc, s, 4 * n);
      } else {
        AccumulateF32<false>(acc, s, n);
      }
      return;
    case v1::WIRE_DTYPE_BF16:
      return overwrite ? AccumulateBf16<true>(acc, s, n) : AccumulateBf16<false>(acc, s, n);
    case v1::WIRE_DTYPE_FP16:
      return overwrite ? AccumulateFp16<true>(acc, s, n) : AccumulateFp16<false>(acc, s, n);
    default:
      return;
  }
}

void EncodeWire(void* dst, const float* src, v1::WireDType dtype, size_t n) {
  if (n == 0) return;
  auto* d = static_cast<unsigned char*>(dst);
  switch (dtype) {
    case v1::WIRE_DTYPE_UNSPECIFIED:
    case v1::WIRE_DTYPE_FP32:
      std::memcpy(d, src, 4 * n);
      return;
    case v1::WIRE_DTYPE_BF16:
      return EncodeBf16(d, src, n);
    case v1::WIRE_DTYPE_FP16:
      return EncodeFp16(d, src, n);
    default:
      return;
  }
}

}  // namespace tandem::optim
