// Reduction kernels for the shared-memory paths: combine several source
// buffers into one or two destinations in a single pass, so a rank reads each
// input once and writes each output once.
//
// float16 and bfloat16 accumulate in float32 over all sources and round once
// at the end (more accurate than rounding after every pairwise step). avg
// divides the sum by `divisor` before the result is stored; integers divide
// with truncation.
//
// Sources are combined in the order given, so every rank that passes the same
// sources in the same order gets bit-identical results.
//
// Thread safety: pure functions.
#pragma once

#include <cstddef>

#include "worker/collectives/dtype.h"

namespace tandem::collectives {

// dst0[i] (and dst1[i] when dst1 is not null) = op over srcs[0..nsrc)[i],
// for i < count. nsrc >= 1. A destination may alias srcs[0] exactly (in
// place) or any one source exactly (element i is read before it is written).
// With `stream0`, dst0 is written with non-temporal stores (see Copy).
void ReduceMany(const void* const* srcs, int nsrc, void* dst0, void* dst1, size_t count, DType dtype, ReduceOp op,
                int divisor, bool stream0 = false);

// memcpy; with `streaming`, the stores bypass the caches (on x86-64), which
// saves reading the destination lines first and keeps the caches for the
// staging data: for outputs larger than the cache that nothing reads soon.
// Streaming stores are weakly ordered: call StoreFence() before another
// thread or process may read what they wrote.
void Copy(void* dst, const void* src, size_t bytes, bool streaming);
void StoreFence();

}  // namespace tandem::collectives
