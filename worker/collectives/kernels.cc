#include "worker/collectives/kernels.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

// The hot loops are built with -O3 (see worker/CMakeLists.txt) and, on x86-64,
// cloned for AVX2 and chosen at load time, so one binary runs everywhere and
// is fast where the CPU allows.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__) && \
    !defined(__SANITIZE_THREAD__)
#define TANDEM_KERNEL __attribute__((target_clones("avx2", "default")))
#else
#define TANDEM_KERNEL
#endif

namespace tandem::collectives {
namespace {

constexpr size_t kBlock = 2048;  // elements per accumulation block (8-16 KiB: stays in L1)

// acc[i] op= in[i]; separate loops per op so each vectorises.
template <typename T>
TANDEM_KERNEL void Accumulate(T* __restrict acc, const T* __restrict in, size_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::kMin:
      for (size_t i = 0; i < n; ++i) acc[i] = std::min(acc[i], in[i]);
      return;
    case ReduceOp::kMax:
      for (size_t i = 0; i < n; ++i) acc[i] = std::max(acc[i], in[i]);
      return;
    default:
      for (size_t i = 0; i < n; ++i) acc[i] = static_cast<T>(acc[i] + in[i]);
      return;
  }
}

// The two-source, one-destination case without a temporary: the common
// two-rank path into private memory.
template <typename T>
TANDEM_KERNEL void Combine2(const T* a, const T* b, T* d, size_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::kMin:
      for (size_t i = 0; i < n; ++i) d[i] = std::min(a[i], b[i]);
      return;
    case ReduceOp::kMax:
      for (size_t i = 0; i < n; ++i) d[i] = std::max(a[i], b[i]);
      return;
    default:
      for (size_t i = 0; i < n; ++i) d[i] = static_cast<T>(a[i] + b[i]);
      return;
  }
}

// Non-temporal copy: unaligned head with memcpy, 16-byte streaming stores
// for the aligned middle, memcpy for the tail.
void StreamCopy(void* dst, const void* src, size_t bytes) {
#if defined(__x86_64__)
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  const size_t head = std::min(bytes, (16 - reinterpret_cast<uintptr_t>(d) % 16) % 16);
  std::memcpy(d, s, head);
  d += head;
  s += head;
  bytes -= head;
  size_t i = 0;
  for (; i + 64 <= bytes; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  std::memcpy(d + i, s + i, bytes - i);
#else
  std::memcpy(dst, src, bytes);
#endif
}

template <typename T>
void DivideBlock(T* p, size_t n, int divisor) {
  if constexpr (std::is_floating_point_v<T>) {
    const T inv = static_cast<T>(1) / static_cast<T>(divisor);
    for (size_t i = 0; i < n; ++i) p[i] *= inv;
  } else {
    for (size_t i = 0; i < n; ++i) p[i] = static_cast<T>(p[i] / divisor);
  }
}

template <typename T>
void ReduceNative(const void* const* srcs, int nsrc, void* dst0, void* dst1, size_t count, ReduceOp op, int divisor,
                  bool stream0) {
  const bool avg = op == ReduceOp::kAvg && divisor > 1;
  auto* d0 = static_cast<T*>(dst0);
  auto* d1 = static_cast<T*>(dst1);
  // With a second destination (a staging slot a peer has just read) the
  // blocked path below is faster: it stores whole blocks with the C
  // library's copy instead of element by element.
  if (nsrc == 2 && !avg && !stream0 && dst1 == nullptr) {
    Combine2(static_cast<const T*>(srcs[0]), static_cast<const T*>(srcs[1]), d0, count, op);
    return;
  }
  T acc[kBlock];
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t n = std::min(kBlock, count - base);
    std::memcpy(acc, static_cast<const T*>(srcs[0]) + base, n * sizeof(T));
    for (int k = 1; k < nsrc; ++k) Accumulate(acc, static_cast<const T*>(srcs[k]) + base, n, op);
    if (avg) DivideBlock(acc, n, divisor);
    if (stream0) {
      StreamCopy(d0 + base, acc, n * sizeof(T));
    } else {
      std::memcpy(d0 + base, acc, n * sizeof(T));
    }
    if (d1 != nullptr) std::memcpy(d1 + base, acc, n * sizeof(T));
  }
}

template <float (*Widen)(uint16_t), uint16_t (*Narrow)(float)>
void ReduceNarrow(const void* const* srcs, int nsrc, void* dst0, void* dst1, size_t count, ReduceOp op, int divisor) {
  const bool avg = op == ReduceOp::kAvg && divisor > 1;
  auto* d0 = static_cast<uint16_t*>(dst0);
  auto* d1 = static_cast<uint16_t*>(dst1);
  float acc[kBlock];
  float wide[kBlock];
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t n = std::min(kBlock, count - base);
    const auto* s0 = static_cast<const uint16_t*>(srcs[0]) + base;
    for (size_t i = 0; i < n; ++i) acc[i] = Widen(s0[i]);
    for (int k = 1; k < nsrc; ++k) {
      const auto* sk = static_cast<const uint16_t*>(srcs[k]) + base;
      for (size_t i = 0; i < n; ++i) wide[i] = Widen(sk[i]);
      Accumulate(acc, wide, n, op);
    }
    if (avg) DivideBlock(acc, n, divisor);
    for (size_t i = 0; i < n; ++i) {
      const uint16_t v = Narrow(acc[i]);
      d0[base + i] = v;
      if (d1 != nullptr) d1[base + i] = v;
    }
  }
}

}  // namespace

void ReduceMany(const void* const* srcs, int nsrc, void* dst0, void* dst1, size_t count, DType dtype, ReduceOp op,
                int divisor, bool stream0) {
  if (count == 0) return;
  switch (dtype) {
    case DType::kFloat32:
      return ReduceNative<float>(srcs, nsrc, dst0, dst1, count, op, divisor, stream0);
    case DType::kInt32:
      return ReduceNative<int32_t>(srcs, nsrc, dst0, dst1, count, op, divisor, stream0);
    case DType::kInt64:
      return ReduceNative<int64_t>(srcs, nsrc, dst0, dst1, count, op, divisor, stream0);
    case DType::kFloat16:
      return ReduceNarrow<HalfToFloat, FloatToHalf>(srcs, nsrc, dst0, dst1, count, op, divisor);
    case DType::kBFloat16:
      return ReduceNarrow<BFloat16ToFloat, FloatToBFloat16>(srcs, nsrc, dst0, dst1, count, op, divisor);
  }
}

void Copy(void* dst, const void* src, size_t bytes, bool streaming) {
  if (bytes == 0) return;
  if (streaming) {
    StreamCopy(dst, src, bytes);
  } else {
    std::memcpy(dst, src, bytes);
  }
}

void StoreFence() {
#if defined(__x86_64__)
  _mm_sfence();
#else
  std::atomic_thread_fence(std::memory_order_seq_cst);
#endif
}

}  // namespace tandem::collectives
