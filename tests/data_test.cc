// The training data and the distributed sampler (worker/data/): datasets are
// byte windows whose targets are the inputs shifted by one; missing, short
// and unreadable files and bad arguments give errors that name what was
// wrong; the default corpus is deterministic prose of the promised size; each
// epoch's order is a permutation, the same on every call and different per
// epoch; the shards of a global batch are disjoint and cover it; the last
// batch of an epoch is truncated; and across whole epochs with the number of
// ranks changing between steps every sample is seen exactly once.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/test_util.h"
#include "worker/data/dataset.h"
#include "worker/data/sampler.h"

namespace tandem::data {
namespace {

using tandem::testing::TempDir;

std::string Str(std::span<const uint8_t> s) {
  return std::string(s.begin(), s.end());
}

TEST(DatasetTest, WindowsAndTargetsShiftByOne) {
  TempDir dir;
  const std::string path = dir.File("text.txt", "abcdefghijk");  // 11 bytes
  auto ds = TextDataset::Open(path, 4);
  ASSERT_TRUE(ds.ok()) << ds.status().ToString();
  EXPECT_EQ(ds->context(), 4u);
  EXPECT_EQ(ds->stride(), 4u);
  EXPECT_EQ(ds->name(), path);
  // Windows [0,5) and [4,9); [8,13) would run past the 11 bytes.
  ASSERT_EQ(ds->size(), 2u);
  EXPECT_EQ(Str(ds->Window(0)), "abcde");
  EXPECT_EQ(Str(ds->Get(0).inputs), "abcd");
  EXPECT_EQ(Str(ds->Get(0).targets), "bcde");
  EXPECT_EQ(Str(ds->Get(1).inputs), "efgh");
  EXPECT_EQ(Str(ds->Get(1).targets), "fghi");

  auto strided = TextDataset::FromBytes("abcdefghijk", 4, 1);
  ASSERT_TRUE(strided.ok());
  EXPECT_EQ(strided->size(), 7u);  // starts 0..6
  EXPECT_EQ(Str(strided->Get(6).inputs), "ghij");
  EXPECT_EQ(Str(strided->Get(6).targets), "hijk");

  auto exact = TextDataset::FromBytes("abcde", 4);  // exactly context + 1
  ASSERT_TRUE(exact.ok());
  EXPECT_EQ(exact->size(), 1u);
}

TEST(DatasetTest, SpansSurviveAMove) {
  auto ds = TextDataset::FromBytes("0123456789", 3);
  ASSERT_TRUE(ds.ok());
  const Sample before = ds->Get(1);
  TextDataset moved = std::move(ds).value();
  EXPECT_EQ(Str(before.inputs), "345");
  EXPECT_EQ(moved.Get(1).inputs.data(), before.inputs.data());
}

TEST(DatasetTest, ErrorsNameTheFile) {
  TempDir dir;
  const std::string missing = dir.path() + "/no-such-file.txt";
  auto r = TextDataset::Open(missing, 8);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kNotFound);
  EXPECT_NE(r.status().message().find(missing), std::string::npos) << r.status().ToString();

  const std::string small = dir.File("small.txt", "12345678");  // 8 bytes, context 8 needs 9
  r = TextDataset::Open(small, 8);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find(small), std::string::npos) << r.status().ToString();
  EXPECT_NE(r.status().message().find("too small"), std::string::npos) << r.status().ToString();

  const std::string empty = dir.path() + "/empty.txt";
  ASSERT_TRUE(WriteDefaultCorpus(empty, 0).ok());
  r = TextDataset::Open(empty, 1);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);

  r = TextDataset::Open(dir.path(), 8);  // a directory
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find(dir.path()), std::string::npos) << r.status().ToString();

  r = TextDataset::Open(small, 0);
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("context"), std::string::npos) << r.status().ToString();

  if (::geteuid() != 0) {  // root reads anything
    const std::string locked = dir.File("locked.txt", "some text that nobody may read");
    ASSERT_EQ(::chmod(locked.c_str(), 0), 0);
    r = TextDataset::Open(locked, 4);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kPermissionDenied);
    EXPECT_NE(r.status().message().find(locked), std::string::npos) << r.status().ToString();
  }

  EXPECT_FALSE(WriteDefaultCorpus(dir.path() + "/no/such/dir/corpus.txt").ok());
}

TEST(DatasetTest, DefaultCorpusIsDeterministicProse) {
  const std::string a = DefaultCorpus();
  EXPECT_EQ(a, DefaultCorpus());
  EXPECT_EQ(a.size(), kDefaultCorpusBytes);
  EXPECT_GE(a.size(), 32u * 1024);
  EXPECT_NE(a, DefaultCorpus(kDefaultCorpusBytes, 1));  // the seed matters
  EXPECT_EQ(DefaultCorpus(1000), a.substr(0, 1000));    // a prefix of the same stream

  // Printable text: letters, spaces, punctuation and paragraph breaks, with
  // a varied vocabulary and many distinct sentences.
  for (char c : a) EXPECT_TRUE((c >= 0x20 && c < 0x7f) || c == '\n') << static_cast<int>(c);
  std::set<char> chars(a.begin(), a.end());
  EXPECT_GE(chars.size(), 30u);
  std::set<std::string> sentences;
  size_t start = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] == '.' || a[i] == '?' || a[i] == '!') {
      sentences.insert(a.substr(start, i - start));
      start = i + 1;
    }
  }
  EXPECT_GE(sentences.size(), 300u);

  TempDir dir;
  const std::string path = dir.path() + "/corpus.txt";
  ASSERT_TRUE(WriteDefaultCorpus(path).ok());
  EXPECT_EQ(tandem::testing::ReadFile(path), a);

  auto ds = TextDataset::Default(64);
  ASSERT_TRUE(ds.ok()) << ds.status().ToString();
  EXPECT_EQ(ds->size(), (a.size() - 65) / 64 + 1);
  EXPECT_EQ(Str(ds->bytes()), a);
  auto opened = TextDataset::Open(path, 64);
  ASSERT_TRUE(opened.ok());
  EXPECT_EQ(Str(opened->Get(17).inputs), Str(ds->Get(17).inputs));
}

TEST(SamplerTest, EpochOrderIsADeterministicPermutation) {
  for (uint64_t n : {1u, 2u, 7u, 1000u}) {
    const std::vector<uint64_t> p = EpochPermutation(n, 42, 0);
    std::vector<uint64_t> sorted = p;
    std::sort(sorted.begin(), sorted.end());
    std::vector<uint64_t> iota(n);
    std::iota(iota.begin(), iota.end(), 0);
    EXPECT_EQ(sorted, iota) << n;
    EXPECT_EQ(p, EpochPermutation(n, 42, 0)) << n;
  }
  const std::vector<uint64_t> e0 = EpochPermutation(1000, 42, 0);
  EXPECT_NE(e0, EpochPermutation(1000, 42, 1));
  EXPECT_NE(e0, EpochPermutation(1000, 43, 0));
  std::vector<uint64_t> iota(1000);
  std::iota(iota.begin(), iota.end(), 0);
  EXPECT_NE(e0, iota);

  // The sampler's cached permutation is the same as the free function's.
  auto s = DistributedSampler::Create(1000, 42);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->Permutation(1), EpochPermutation(1000, 42, 1));
  EXPECT_EQ(s->Permutation(0), e0);

  // Pinned: the order is part of the documented contract (mt19937_64,
  // SplitMix64 seeding, rejection sampling), so it must not change silently.
  EXPECT_EQ(EpochPermutation(8, 1, 0), (std::vector<uint64_t>{5, 2, 1, 4, 3, 6, 0, 7}));
}

TEST(SamplerTest, ShardsOfABatchAreDisjointAndCoverIt) {
  auto s = DistributedSampler::Create(100, 7);
  ASSERT_TRUE(s.ok());
  const Cursor cursor{3, 10};
  for (uint32_t dp : {1u, 2u, 3u, 5u, 7u, 16u, 40u}) {
    std::vector<uint64_t> all;
    size_t smallest = SIZE_MAX;
    size_t largest = 0;
    for (uint32_t r = 0; r < dp; ++r) {
      auto b = s->Batch(cursor, 16, r, dp);
      ASSERT_TRUE(b.ok()) << b.status().ToString();
      smallest = std::min(smallest, b->size());
      largest = std::max(largest, b->size());
      all.insert(all.end(), b->begin(), b->end());
    }
    // Concatenated in rank order, the shards are the batch in permutation order.
    const std::vector<uint64_t>& p = s->Permutation(3);
    EXPECT_EQ(all, std::vector<uint64_t>(p.begin() + 10, p.begin() + 26)) << dp;
    EXPECT_LE(largest - smallest, 1u) << dp;
  }
  // Fewer samples than ranks: the first ranks get one each, the rest none.
  auto b = s->Batch(cursor, 3, 4, 5);
  ASSERT_TRUE(b.ok());
  EXPECT_TRUE(b->empty());
  EXPECT_EQ(ShardOf(3, 2, 5).end - ShardOf(3, 2, 5).begin, 1u);
}

TEST(SamplerTest, LastBatchIsTruncatedAndTheNextEpochStarts) {
  auto s = DistributedSampler::Create(10, 1);
  ASSERT_TRUE(s.ok());
  Cursor c{0, 0};
  std::vector<uint64_t> sizes;
  while (c.epoch == 0) {
    auto n = s->BatchSize(c, 4);
    ASSERT_TRUE(n.ok());
    sizes.push_back(*n);
    auto next = s->Advance(c, 4);
    ASSERT_TRUE(next.ok());
    c = *next;
  }
  EXPECT_EQ(sizes, (std::vector<uint64_t>{4, 4, 2}));
  EXPECT_EQ(c, (Cursor{1, 0}));

  auto r0 = s->Batch(Cursor{0, 8}, 4, 0, 2);
  auto r1 = s->Batch(Cursor{0, 8}, 4, 1, 2);
  ASSERT_TRUE(r0.ok() && r1.ok());
  const std::vector<uint64_t> p = EpochPermutation(10, 1, 0);
  EXPECT_EQ(*r0, (std::vector<uint64_t>{p[8]}));
  EXPECT_EQ(*r1, (std::vector<uint64_t>{p[9]}));

  // A batch larger than the epoch is the whole epoch.
  auto whole = s->Batch(Cursor{5, 0}, 1000, 0, 1);
  ASSERT_TRUE(whole.ok());
  EXPECT_EQ(*whole, EpochPermutation(10, 1, 5));
  EXPECT_EQ(*s->Advance(Cursor{5, 0}, 1000), (Cursor{6, 0}));
}

TEST(SamplerTest, EverySampleOnceAcrossMembershipChanges) {
  constexpr uint64_t kSamples = 1009;  // prime: batches never divide it evenly
  constexpr uint64_t kGlobalBatch = 24;
  auto s = DistributedSampler::Create(kSamples, 2024);
  ASSERT_TRUE(s.ok());
  // Ranks by step: 4, then 3 from step 7, then 5 from step 19, then 1, then 4
  // again in the second epoch.
  auto dp_at = [](uint64_t step) -> uint32_t {
    if (step < 7) return 4;
    if (step < 19) return 3;
    if (step < 30) return 5;
    if (step < 45) return 1;
    return 4;
  };
  Cursor c{0, 0};
  uint64_t step = 0;
  for (uint64_t epoch = 0; epoch < 2; ++epoch) {
    std::vector<int> seen(kSamples, 0);
    std::vector<uint64_t> order;
    while (c.epoch == epoch) {
      const uint32_t dp = dp_at(step);
      for (uint32_t r = 0; r < dp; ++r) {
        auto b = s->Batch(c, kGlobalBatch, r, dp);
        ASSERT_TRUE(b.ok()) << b.status().ToString();
        for (uint64_t i : *b) {
          ASSERT_LT(i, kSamples);
          ++seen[i];
          order.push_back(i);
        }
      }
      auto next = s->Advance(c, kGlobalBatch);
      ASSERT_TRUE(next.ok());
      c = *next;
      ++step;
    }
    for (uint64_t i = 0; i < kSamples; ++i) EXPECT_EQ(seen[i], 1) << "sample " << i << " in epoch " << epoch;
    EXPECT_EQ(order, EpochPermutation(kSamples, 2024, epoch));
  }
  EXPECT_EQ(c, (Cursor{2, 0}));
  EXPECT_EQ(step, 2 * ((kSamples + kGlobalBatch - 1) / kGlobalBatch));
}

TEST(SamplerTest, BadArgumentsAreRefused) {
  EXPECT_EQ(DistributedSampler::Create(0, 1).status().code(), StatusCode::kInvalidArgument);
  auto s = DistributedSampler::Create(10, 1);
  ASSERT_TRUE(s.ok());
  auto b = s->Batch(Cursor{0, 0}, 0, 0, 1);
  EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(b.status().message().find("global_batch"), std::string::npos) << b.status().ToString();
  b = s->Batch(Cursor{0, 0}, 4, 2, 2);
  EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(b.status().message().find("dp_rank 2"), std::string::npos) << b.status().ToString();
  b = s->Batch(Cursor{0, 0}, 4, 0, 0);
  EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(b.status().message().find("dp_size"), std::string::npos) << b.status().ToString();
  b = s->Batch(Cursor{0, 10}, 4, 0, 1);
  EXPECT_EQ(b.status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(s->Advance(Cursor{0, 10}, 4).status().code(), StatusCode::kOutOfRange);
  EXPECT_EQ(s->Advance(Cursor{0, 0}, 0).status().code(), StatusCode::kInvalidArgument);
}

TEST(LearningRateTest, LinearScalingAndWarmup) {
  auto lr = ScaledLearningRate(0.1, 256, 64);
  ASSERT_TRUE(lr.ok());
  EXPECT_DOUBLE_EQ(*lr, 0.4);
  EXPECT_DOUBLE_EQ(*ScaledLearningRate(0.1, 32, 64), 0.05);
  EXPECT_FALSE(ScaledLearningRate(0.1, 0, 64).ok());
  EXPECT_FALSE(ScaledLearningRate(0.1, 64, 0).ok());
  EXPECT_FALSE(ScaledLearningRate(-1.0, 64, 64).ok());

  EXPECT_DOUBLE_EQ(WarmupLearningRate(0.4, 0, 4), 0.1);
  EXPECT_DOUBLE_EQ(WarmupLearningRate(0.4, 3, 4), 0.4);
  EXPECT_DOUBLE_EQ(WarmupLearningRate(0.4, 100, 4), 0.4);
  EXPECT_DOUBLE_EQ(WarmupLearningRate(0.4, 0, 0), 0.4);
}

}  // namespace
}  // namespace tandem::data
