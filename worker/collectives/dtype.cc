#include "worker/collectives/dtype.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "worker/collectives/kernels.h"

namespace tandem::collectives {

size_t SizeOf(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kFloat16:
      return 2;
    case DType::kBFloat16:
      return 2;
    case DType::kInt32:
      return 4;
    case DType::kInt64:
      return 8;
  }
  return 1;
}

std::string_view Name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
  }
  return "unknown";
}

std::string_view Name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kAvg:
      return "avg";
    case ReduceOp::kMin:
      return "min";
    case ReduceOp::kMax:
      return "max";
  }
  return "unknown";
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t bits = 0;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;  // zero
    } else {
      // Subnormal: normalise.
      int e = -1;
      do {
        ++e;
        mantissa <<= 1;
      } while ((mantissa & 0x400u) == 0);
      bits = sign | (static_cast<uint32_t>(127 - 15 - e) << 23) | ((mantissa & 0x3ffu) << 13);
    }
  } else if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf or nan
  } else {
    bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

uint16_t FloatToHalf(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);   // nan
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflows to inf (after rounding)
  if (abs < 0x38800000u) {
    // Subnormal or zero in half precision: round to nearest even at 2^-24.
    if (abs < 0x33000000u) return sign;  // below half the smallest subnormal
    const uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
    const int shift = 126 - static_cast<int>(abs >> 23);  // 14..24
    uint32_t half = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  // Normal: rebias and round to nearest even on the 13 dropped bits.
  uint32_t half = ((abs >> 13) - ((127 - 15) << 10));
  const uint32_t rest = abs & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;
  return static_cast<uint16_t>(sign | half);
}

float BFloat16ToFloat(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

uint16_t FloatToBFloat16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // quiet nan
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);                                     // nearest even
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

// The two-source case of the reduction kernels (worker/collectives/kernels.h):
// avg is a sum here (divisor 1); the caller divides once at the end.
void Reduce(void* acc, const void* in, size_t n, DType dtype, ReduceOp op) {
  const void* srcs[2] = {acc, in};
  ReduceMany(srcs, 2, acc, nullptr, n, dtype, op, 1);
}

double LoadAsDouble(DType dtype, const void* base, size_t i) {
  switch (dtype) {
    case DType::kFloat32:
      return static_cast<const float*>(base)[i];
    case DType::kFloat16:
      return HalfToFloat(static_cast<const uint16_t*>(base)[i]);
    case DType::kBFloat16:
      return BFloat16ToFloat(static_cast<const uint16_t*>(base)[i]);
    case DType::kInt32:
      return static_cast<const int32_t*>(base)[i];
    case DType::kInt64:
      return static_cast<double>(static_cast<const int64_t*>(base)[i]);
  }
  return 0;
}

void StoreFromDouble(DType dtype, void* base, size_t i, double v) {
  switch (dtype) {
    case DType::kFloat32:
      static_cast<float*>(base)[i] = static_cast<float>(v);
      return;
    case DType::kFloat16:
      static_cast<uint16_t*>(base)[i] = FloatToHalf(static_cast<float>(v));
      return;
    case DType::kBFloat16:
      static_cast<uint16_t*>(base)[i] = FloatToBFloat16(static_cast<float>(v));
      return;
    case DType::kInt32:
      static_cast<int32_t*>(base)[i] = static_cast<int32_t>(v);
      return;
    case DType::kInt64:
      static_cast<int64_t*>(base)[i] = static_cast<int64_t>(v);
      return;
  }
}

void Divide(void* data, size_t n, DType dtype, int divisor) {
  switch (dtype) {
    case DType::kFloat32: {
      auto* p = static_cast<float*>(data);
      const float inv = 1.0f / static_cast<float>(divisor);
      for (size_t i = 0; i < n; ++i) p[i] *= inv;
      return;
    }
    case DType::kInt32: {
      auto* p = static_cast<int32_t*>(data);
      for (size_t i = 0; i < n; ++i) p[i] /= divisor;
      return;
    }
    case DType::kInt64: {
      auto* p = static_cast<int64_t*>(data);
      for (size_t i = 0; i < n; ++i) p[i] /= divisor;
      return;
    }
    case DType::kFloat16: {
      auto* p = static_cast<uint16_t*>(data);
      for (size_t i = 0; i < n; ++i) p[i] = FloatToHalf(HalfToFloat(p[i]) / static_cast<float>(divisor));
      return;
    }
    case DType::kBFloat16: {
      auto* p = static_cast<uint16_t*>(data);
      for (size_t i = 0; i < n; ++i) p[i] = FloatToBFloat16(BFloat16ToFloat(p[i]) / static_cast<float>(divisor));
      return;
    }
  }
}

}  // namespace tandem::collectives
