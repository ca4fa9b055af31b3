// TANDEM_KERNEL: marks a loop-heavy function to be cloned for AVX-512 and
// AVX2 and chosen at load time (GCC on x86-64), for the optimizer's kernels
// and the benchmark that measures them. Off under clang and the sanitizers,
// whose runtimes do not support target_clones. With -ffp-contract=off every
// clone computes every element identically.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__) && \
    !defined(__SANITIZE_THREAD__)
#define TANDEM_KERNEL __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define TANDEM_KERNEL
#endif
