// Element types and reduction arithmetic of the collectives. float16 and
// bfloat16 are reduced in float32 (each element is widened, combined and
// rounded back to nearest-even), as accelerators do.
//
// Thread safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace tandem::collectives {

enum class DType : uint8_t { kFloat32, kFloat16, kBFloat16, kInt32, kInt64 };
enum class ReduceOp : uint8_t { kSum, kAvg, kMin, kMax };

size_t SizeOf(DType dtype);
std::string_view Name(DType dtype);
std::string_view Name(ReduceOp op);

float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
float BFloat16ToFloat(uint16_t b);
uint16_t FloatToBFloat16(float f);

// Element i of an array of `dtype` as a double, and a double stored into one
// (rounded to nearest-even for the narrow floats, truncated for integers):
// for checks, references and benchmarks, not the hot path.
double LoadAsDouble(DType dtype, const void* base, size_t i);
void StoreFromDouble(DType dtype, void* base, size_t i, double v);

// acc[i] = op(acc[i], in[i]) for n elements (kAvg sums; see Scale).
void Reduce(void* acc, const void* in, size_t n, DType dtype, ReduceOp op);
// data[i] /= divisor (for kAvg after the sum; integers divide with truncation).
void Divide(void* data, size_t n, DType dtype, int divisor);

}  // namespace tandem::collectives
