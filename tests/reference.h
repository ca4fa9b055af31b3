// The values and the double-precision reference the collective suites check
// against (collectives_test over transports, communicator_test over every
// backend).
//
// Values are multiples of 1/8 in [-4, 4] (integers hold 8x the value), so
// sums of up to 8 ranks, minima and maxima are exact in every dtype and only
// avg needs a tolerance.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "worker/collectives/dtype.h"

namespace tandem::reference {

using collectives::DType;
using collectives::ReduceOp;

// splitmix64 of (seed, rank, i): cheap enough for millions of elements.
inline double Value(int rank, size_t i, uint64_t seed) {
  uint64_t z = seed + (static_cast<uint64_t>(rank) << 40) + i * 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  return static_cast<double>(static_cast<int>(z % 65) - 32) / 8.0;
}

inline bool IsInt(DType dtype) {
  return dtype == DType::kInt32 || dtype == DType::kInt64;
}

inline void Store(DType dtype, void* base, size_t i, double v) {
  collectives::StoreFromDouble(dtype, base, i, IsInt(dtype) ? v * 8 : v);
}

inline double Load(DType dtype, const void* base, size_t i) {
  const double v = collectives::LoadAsDouble(dtype, base, i);
  return IsInt(dtype) ? v / 8 : v;
}

// op over ranks 0..n-1 of Value(rank, i, seed), in double.
inline double Expected(int n, size_t i, uint64_t seed, ReduceOp op, DType dtype) {
  double acc = Value(0, i, seed);
  for (int r = 1; r < n; ++r) {
    const double v = Value(r, i, seed);
    acc = op == ReduceOp::kMin ? std::min(acc, v) : op == ReduceOp::kMax ? std::max(acc, v) : acc + v;
  }
  // Integers divide with truncation (of the value times 8, as stored).
  if (op == ReduceOp::kAvg) acc = IsInt(dtype) ? std::trunc(acc * 8 / n) / 8 : acc / n;
  return acc;
}

inline double Tolerance(DType dtype, ReduceOp op) {
  if (op != ReduceOp::kAvg) return 0;  // exact by construction
  switch (dtype) {
    case DType::kFloat32:
      return 1e-6;
    case DType::kFloat16:
      return 4e-3;  // 11-bit significand of values up to 4
    case DType::kBFloat16:
      return 3e-2;  // 8-bit significand
    default:
      return 0;
  }
}

}  // namespace tandem::reference
