// The distributed sampler: which samples each data-parallel rank trains on
// (docs/training.md, "Data and the distributed sampler").
//
// Order. Each data epoch e has its own permutation of the N sample indices:
// a Fisher–Yates shuffle (from the last position down, swapping position i
// with a uniform j in [0, i]) driven by mt19937_64 seeded with
// SplitMix64(seed ^ SplitMix64(e)), and uniform integers drawn by rejection
// from the raw 64-bit outputs (not std::uniform_int_distribution, which is
// not specified bit for bit). Every rank on every machine computes the same
// order, with no communication.
//
// The cursor. Position {epoch, offset}: `offset` samples of the epoch's
// permutation have been consumed. It is global, not per rank: the
// coordinator keeps it, and every rank derives its share from it.
//
// One step. Batch(cursor, B, r, P) takes the global batch, positions
// [offset, offset + B) of the epoch's permutation, and splits it into P
// contiguous shards as equal as possible: with n samples in the batch,
// q = n / P and m = n % P, ranks 0..m-1 get q + 1 and the others q (a rank
// gets none when n < P). Rank r gets shard r, in permutation order.
//
// The end of an epoch. A batch never crosses an epoch boundary: when fewer
// than B samples remain, the batch is those n = N - offset samples (the last
// batch of the epoch is truncated, not padded and not wrapped). Advance then
// gives {epoch + 1, 0}, where a new permutation starts.
//
// Membership changes. Because the split depends only on the cursor and on
// the P of this step, the survivors of a resize continue from the same
// cursor with the new P: within a data epoch every sample is trained on
// exactly once, none skipped and none twice, however P changes between
// steps (a step that failed and is retried uses the same cursor again).
//
// Thread safety: a sampler caches the permutation of the last epoch asked
// for, so one thread at a time may use it; the free functions are pure.
#pragma once

#include <cstdint>
#include <vector>

#include "common/status.h"

namespace tandem::data {

// The global sample cursor.
struct Cursor {
  uint64_t epoch = 0;
  uint64_t offset = 0;  // samples of this epoch already consumed, in [0, N)

  friend bool operator==(const Cursor&, const Cursor&) = default;
};

// SplitMix64 (Steele, Lea and Flood 2014): the seed mixer above.
uint64_t SplitMix64(uint64_t x);

// The permutation of [0, num_samples) for (seed, epoch).
std::vector<uint64_t> EpochPermutation(uint64_t num_samples, uint64_t seed, uint64_t epoch);

// This rank's share [begin, end) of a batch of n samples over `dp_size`
// ranks (positions within the batch). REQUIRES: dp_rank < dp_size.
struct Shard {
  uint64_t begin = 0;
  uint64_t end = 0;
};
Shard ShardOf(uint64_t n, uint32_t dp_rank, uint32_t dp_size);

class DistributedSampler {
 public:
  // INVALID_ARGUMENT when num_samples is 0.
  static Result<DistributedSampler> Create(uint64_t num_samples, uint64_t seed);

  uint64_t num_samples() const { return num_samples_; }
  uint64_t seed() const { return seed_; }

  // The number of samples in the global batch at `cursor` (B, or fewer at
  // the end of the epoch). INVALID_ARGUMENT for global_batch 0,
  // OUT_OF_RANGE for a cursor past the end of the epoch.
  Result<uint64_t> BatchSize(Cursor cursor, uint64_t global_batch) const;

  // This rank's sample indices for the global batch at `cursor`.
  // INVALID_ARGUMENT for global_batch 0, dp_size 0 or dp_rank >= dp_size;
  // OUT_OF_RANGE for a cursor past the end of the epoch.
  Result<std::vector<uint64_t>> Batch(Cursor cursor, uint64_t global_batch, uint32_t dp_rank, uint32_t dp_size);

  // The cursor after the global batch at `cursor`: {epoch, offset + B}, or
  // {epoch + 1, 0} when that batch ends the epoch. Errors as BatchSize.
  Result<Cursor> Advance(Cursor cursor, uint64_t global_batch) const;

  // The whole permutation of `epoch` (cached).
  const std::vector<uint64_t>& Permutation(uint64_t epoch);

 private:
  DistributedSampler(uint64_t num_samples, uint64_t seed) : num_samples_(num_samples), seed_(seed) {}

  uint64_t num_samples_ = 0;
  uint64_t seed_ = 0;
  bool cached_ = false;
  uint64_t cached_epoch_ = 0;
  std::vector<uint64_t> permutation_;
};

// Linear learning-rate scaling (Goyal et al. 2017): base_lr was tuned for
// base_batch samples per step; with global_batch samples the rate is
// base_lr · global_batch / base_batch. INVALID_ARGUMENT for a zero batch or a
// negative or non-finite base_lr.
Result<double> ScaledLearningRate(double base_lr, uint64_t global_batch, uint64_t base_batch);

// Linear warmup: lr · (step + 1) / warmup_steps for the first warmup_steps
// steps (step counts from 0), then lr. warmup_steps 0 means no warmup. Large
// scaled rates diverge early without it.
double WarmupLearningRate(double lr, uint64_t step, uint64_t warmup_steps);

}  // namespace tandem::data
