// The distributed sampler (sampler.h): per-epoch permutations, sharding of
// the global batch, the cursor, and learning-rate scaling.
#include "worker/data/sampler.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <utility>

namespace tandem::data {
namespace {

// An unbiased integer in [0, bound) (bound > 0) by rejection: draws below
// 2^64 mod bound are rejected so every residue is equally likely.
uint64_t Uniform(std::mt19937_64& rng, uint64_t bound) {
  const uint64_t threshold = (0 - bound) % bound;
  for (;;) {
    const uint64_t r = rng();
    if (r >= threshold) return r % bound;
  }
}

}  // namespace

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

std::vector<uint64_t> EpochPermutation(uint64_t num_samples, uint64_t seed, uint64_t epoch) {
  std::vector<uint64_t> p(num_samples);
  for (uint64_t i = 0; i < num_samples; ++i) p[i] = i;
  std::mt19937_64 rng(SplitMix64(seed ^ SplitMix64(epoch)));
  for (uint64_t i = num_samples; i > 1; --i) {
    const uint64_t j = Uniform(rng, i);  // in [0, i - 1]
    std::swap(p[i - 1], p[j]);
  }
  return p;
}

Shard ShardOf(uint64_t n, uint32_t dp_rank, uint32_t dp_size) {
  const uint64_t q = n / dp_size;
  const uint64_t m = n % dp_size;
  const uint64_t begin = dp_rank * q + std::min<uint64_t>(dp_rank, m);
  return Shard{begin, begin + q + (dp_rank < m ? 1 : 0)};
}

Result<DistributedSampler> DistributedSampler::Create(uint64_t num_samples, uint64_t seed) {
  if (num_samples == 0) return InvalidArgument("distributed sampler: the dataset has no samples");
  return DistributedSampler(num_samples, seed);
}

Result<uint64_t> DistributedSampler::BatchSize(Cursor cursor, uint64_t global_batch) const {
  if (global_batch == 0) return InvalidArgument("distributed sampler: global_batch must be at least 1");
  if (cursor.offset >= num_samples_) {
    return OutOfRange("distributed sampler: cursor offset {} is past the end of the epoch ({} samples)", cursor.offset,
                      num_samples_);
  }
  return std::min(global_batch, num_samples_ - cursor.offset);
}

Result<std::vector<uint64_t>> DistributedSampler::Batch(Cursor cursor, uint64_t global_batch, uint32_t dp_rank,
                                                        uint32_t dp_size) {
  if (dp_size == 0) return InvalidArgument("distributed sampler: dp_size must be at least 1");
  if (dp_rank >= dp_size) {
    return InvalidArgument("distributed sampler: dp_rank {} is not below dp_size {}", dp_rank, dp_size);
  }
  TANDEM_ASSIGN_OR_RETURN(const uint64_t n, BatchSize(cursor, global_batch));
  const Shard shard = ShardOf(n, dp_rank, dp_size);
  const std::vector<uint64_t>& p = Permutation(cursor.epoch);
  const auto first = p.begin() + static_cast<std::ptrdiff_t>(cursor.offset + shard.begin);
  const auto last = p.begin() + static_cast<std::ptrdiff_t>(cursor.offset + shard.end);
  return std::vector<uint64_t>(first, last);
}

Result<Cursor> DistributedSampler::Advance(Cursor cursor, uint64_t global_batch) const {
  TANDEM_ASSIGN_OR_RETURN(const uint64_t n, BatchSize(cursor, global_batch));
  if (cursor.offset + n == num_samples_) return Cursor{cursor.epoch + 1, 0};
  return Cursor{cursor.epoch, cursor.offset + n};
}

const std::vector<uint64_t>& DistributedSampler::Permutation(uint64_t epoch) {
  if (!cached_ || cached_epoch_ != epoch) {
    permutation_ = EpochPermutation(num_samples_, seed_, epoch);
    cached_ = true;
    cached_epoch_ = epoch;
  }
  return permutation_;
}

Result<double> ScaledLearningRate(double base_lr, uint64_t global_batch, uint64_t base_batch) {
  if (!std::isfinite(base_lr) || base_lr < 0) {
    return InvalidArgument("learning rate scaling: base_lr {} must be finite and not negative", base_lr);
  }
  if (global_batch == 0 || base_batch == 0) {
    return InvalidArgument("learning rate scaling: global_batch ({}) and base_batch ({}) must be at least 1",
                           global_batch, base_batch);
  }
  return base_lr * static_cast<double>(global_batch) / static_cast<double>(base_batch);
}

double WarmupLearningRate(double lr, uint64_t step, uint64_t warmup_steps) {
  if (warmup_steps == 0 || step >= warmup_steps) return lr;
  return lr * static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
}

}  // namespace tandem::data
