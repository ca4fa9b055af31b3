// Parameter-server checkpoint files (server/checkpoint/checkpoint.h,
// docs/checkpoints.md): bit-identical round trips for every optimizer-state
// shape, resharding reads across partition sizes and server counts, missing
// files, every kind of corruption (header and payload bit flips, truncation,
// trailing garbage, bad magic, newer versions, forged lengths, files from
// another checkpoint), no overwrites, temporary files, failed writes leaving
// nothing behind, and checkpoint id validation.
#include "server/checkpoint/checkpoint.h"

#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "common/crc32c.h"

namespace tandem::server {
namespace {

namespace fs = std::filesystem;

::testing::AssertionResult Contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << text << "\"\ndoes not contain \"" << part << "\"";
}

// A fresh directory under $TMPDIR (or /tmp), removed with everything in it at the end.
class ScratchDir {
 public:
  ScratchDir() {
    const char* tmp = std::getenv("TMPDIR");
    std::string tmpl = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/tandem-checkpoint-test-XXXXXX";
    if (mkdtemp(tmpl.data()) != nullptr) path_ = tmpl;
  }
  ~ScratchDir() {
    std::error_code ec;
    if (!path_.empty()) fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}
uint32_t Get32(const std::string& s, size_t at) {
  uint32_t v = 0;
  std::memcpy(&v, s.data() + at, 4);
  return v;
}
uint64_t Get64(const std::string& s, size_t at) {
  uint64_t v = 0;
  std::memcpy(&v, s.data() + at, 8);
  return v;
}
void Put32(std::string& s, size_t at, uint32_t v) {
  std::memcpy(s.data() + at, &v, 4);
}
void Put64(std::string& s, size_t at, uint64_t v) {
  std::memcpy(s.data() + at, &v, 8);
}
void Put16(std::string& s, size_t at, uint16_t v) {
  std::memcpy(s.data() + at, &v, 2);
}
// Recomputes the header checksum (the header's last 4 bytes) after a deliberate edit.
void FixHeaderCrc(std::string& s) {
  const uint32_t header_bytes = Get32(s, 12);
  Put32(s, header_bytes - 4, Crc32c(s.data(), size_t{header_bytes} - 4));
}

// The whole parameter space of a test job: each buffer's values as random bit
// patterns, with NaNs (payloads and signs), infinities, signed zeros and
// subnormals mixed in, so that only a bit-exact copy compares equal.
struct Model {
  CheckpointMeta meta;
  uint64_t version = 0;
  uint64_t step = 0;
  std::vector<float> buffers[3];

  Model(uint64_t n, uint32_t state_buffers, std::string optimizer, uint64_t seed = 1) {
    meta.job_id = "job-1";
    meta.checkpoint_id = "step-0000000100";
    meta.step = 100;
    meta.parameter_count = n;
    meta.tensor_fingerprint = 0x0123456789abcdefull;
    meta.optimizer = std::move(optimizer);
    meta.state_buffers = state_buffers;
    version = 101;
    step = 100;
    std::mt19937_64 rng(seed);
    const uint32_t specials[] = {0x7fc00000u, 0xffc00001u, 0x7f800001u, 0x7f800000u, 0xff800000u,
                                 0x80000000u, 0x00000000u, 0x00000001u, 0x807fffffu, 0x7f7fffffu};
    for (uint32_t s = 0; s <= state_buffers; ++s) {
      buffers[s].resize(n);
      for (uint64_t i = 0; i < n; ++i) {
        const uint64_t r = rng();
        const uint32_t bits = r % 16 == 0 ? specials[(r >> 8) % std::size(specials)] : static_cast<uint32_t>(r >> 32);
        buffers[s][i] = std::bit_cast<float>(bits);
      }
    }
  }

  PartitionState Partition(uint32_t id, uint64_t begin, uint64_t end) const {
    PartitionState p;
    p.id = id;
    p.begin = begin;
    p.end = end;
    p.version = version;
    p.step = step;
    std::vector<float>* out[3] = {&p.weights, &p.state0, &p.state1};
    for (uint32_t s = 0; s <= meta.state_buffers && s < 3; ++s) {
      out[s]->assign(buffers[s].begin() + static_cast<ptrdiff_t>(begin),
                     buffers[s].begin() + static_cast<ptrdiff_t>(end));
    }
    return p;
  }

  // Partitions of `size` elements over the whole space (the last one shorter).
  std::vector<PartitionState> Partitions(uint64_t size) const {
    std::vector<PartitionState> parts;
    for (uint64_t b = 0; b < meta.parameter_count; b += size) {
      parts.push_back(Partition(static_cast<uint32_t>(parts.size()), b, std::min(b + size, meta.parameter_count)));
    }
    return parts;
  }

  // Writes partitions of `size` elements the way `servers` servers would: server k saves partitions k, k +
  // servers, ... with one call. Returns the total bytes written.
  uint64_t Save(const std::string& dir, uint64_t size, int servers,
                uint32_t block_bytes = kCheckpointDefaultBlockBytes) const {
    const std::vector<PartitionState> parts = Partitions(size);
    uint64_t total = 0;
    for (int k = 0; k < servers; ++k) {
      std::vector<const PartitionState*> mine;
      for (size_t i = static_cast<size_t>(k); i < parts.size(); i += static_cast<size_t>(servers)) {
        mine.push_back(&parts[i]);
      }
      uint64_t bytes = 0;
      const Status s = WriteCheckpointFiles(dir, meta, mine, nullptr, &bytes, CheckpointWriteOptions{block_bytes});
      EXPECT_TRUE(s.ok()) << s.ToString();
      total += bytes;
    }
    return total;
  }

  // Whether `p` holds exactly this model's elements [p.begin, p.end), bit for bit.
  ::testing::AssertionResult Matches(const PartitionState& p, bool with_state) const {
    const std::vector<float>* got[3] = {&p.weights, &p.state0, &p.state1};
    for (uint32_t s = 0; s < 3; ++s) {
      const bool stored = s == 0 || (with_state && s <= meta.state_buffers);
      const size_t want = stored ? static_cast<size_t>(p.end - p.begin) : 0;
      if (got[s]->size() != want) {
        return ::testing::AssertionFailure()
               << "buffer " << s << " has " << got[s]->size() << " elements, want " << want;
      }
      if (want > 0 && std::memcmp(got[s]->data(), buffers[s].data() + p.begin, want * 4) != 0) {
        return ::testing::AssertionFailure() << "buffer " << s << " of [" << p.begin << ", " << p.end << ") differs";
      }
    }
    if (p.version != version || p.step != step) {
      return ::testing::AssertionFailure() << "version " << p.version << " step " << p.step;
    }
    return ::testing::AssertionSuccess();
  }
};

std::vector<std::string> ListDir(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

TEST(CheckpointTest, RoundTripIsBitIdenticalForEveryOptimizerState) {
  struct Case {
    std::string optimizer;
    uint32_t buffers;
  };
  for (const Case& c : {Case{"sgd", 0}, Case{"sgd", 1}, Case{"adam", 2}, Case{"adamw", 2}}) {
    SCOPED_TRACE(fmt::format("{} with {} buffers", c.optimizer, c.buffers));
    ScratchDir scratch;
    const std::string dir = scratch.path() + "/ckpt/" + c.optimizer;  // parents created
    const Model model(5000, c.buffers, c.optimizer, c.buffers + 7);
    const std::vector<PartitionState> parts = model.Partitions(2048);
    std::vector<const PartitionState*> pointers;
    pointers.reserve(parts.size());
    for (const auto& p : parts) pointers.push_back(&p);
    std::vector<uint64_t> progress;
    uint64_t bytes = 0;
    const Status s = WriteCheckpointFiles(
        dir, model.meta, pointers, [&](uint64_t total) { progress.push_back(total); }, &bytes);
    ASSERT_TRUE(s.ok()) << s.ToString();

    // Progress rises to the total, which is what is on disk.
    uint64_t on_disk = 0;
    for (const auto& name : ListDir(dir)) on_disk += fs::file_size(dir + "/" + name);
    EXPECT_EQ(ListDir(dir).size(), parts.size());
    EXPECT_EQ(bytes, on_disk);
    ASSERT_FALSE(progress.empty());
    EXPECT_TRUE(std::is_sorted(progress.begin(), progress.end()));
    EXPECT_EQ(progress.back(), bytes);

    auto reader = CheckpointReader::Open(dir);
    ASSERT_TRUE(reader.ok()) << reader.status().ToString();
    EXPECT_EQ(reader->meta(), model.meta);
    EXPECT_TRUE(reader->Missing().empty());
    EXPECT_TRUE(reader->Verify().ok());
    for (const auto& p : parts) {
      auto got = reader->Read(p.id, p.begin, p.end, true);
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      EXPECT_EQ(got->id, p.id);
      EXPECT_EQ(got->begin, p.begin);
      EXPECT_EQ(got->end, p.end);
      EXPECT_TRUE(model.Matches(*got, true));
    }
    auto whole = reader->Read(42, 0, 5000, false);
    ASSERT_TRUE(whole.ok()) << whole.status().ToString();
    EXPECT_TRUE(model.Matches(*whole, false));
    EXPECT_TRUE(whole->state0.empty());
    EXPECT_GT(reader->bytes_read(), 0u);
  }
}

TEST(CheckpointTest, ReshardsAcrossPartitionSizesAndServerCounts) {
  ScratchDir scratch;
  const uint64_t n = 10007;
  const Model model(n, 2, "adam");
  // Three servers, partitions of 1000 elements, checksum blocks of 64 elements.
  model.Save(scratch.path(), 1000, 3, 256);
  auto reader = CheckpointReader::Open(scratch.path());
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  EXPECT_EQ(reader->files().size(), 11u);
  EXPECT_TRUE(reader->Missing().empty());
  // The same, bigger, smaller, unaligned and whole-space partition sizes.
  for (uint64_t size : {1000u, 2500u, 333u, 4096u, 7u, 10007u}) {
    SCOPED_TRACE(fmt::format("partition size {}", size));
    uint32_t id = 0;
    for (uint64_t b = 0; b < n; b += size) {
      const uint64_t e = std::min(b + size, n);
      auto got = reader->Read(id++, b, e, true);
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      ASSERT_TRUE(model.Matches(*got, true)) << "[" << b << ", " << e << ")";
    }
  }
  std::mt19937_64 rng(3);
  for (int i = 0; i < 200; ++i) {
    const uint64_t b = rng() % n;
    const uint64_t e = b + 1 + rng() % (n - b);
    auto got = reader->Read(0, b, e, i % 2 == 0);
    ASSERT_TRUE(got.ok()) << got.status().ToString();
    ASSERT_TRUE(model.Matches(*got, i % 2 == 0)) << "[" << b << ", " << e << ")";
  }

  // Restoring onto 2 servers of 5000 elements from the same files.
  ScratchDir again;
  model.Save(again.path(), 5000, 2, 256);
  auto second = CheckpointReader::Open(again.path());
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  auto got = second->Read(1, 999, 9001, true);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_TRUE(model.Matches(*got, true));
}

TEST(CheckpointTest, PartialReadsReadOnlyTheBlocksTheyNeed) {
  ScratchDir scratch;
  // Default 1 MiB blocks: 300000-element sections span two blocks each.
  const uint64_t n = 700000;
  const Model model(n, 2, "adamw");
  model.Save(scratch.path(), 300000, 3);
  auto reader = CheckpointReader::Open(scratch.path());
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  for (uint64_t size : {300000u, 250000u, 123457u}) {
    for (uint64_t b = 0; b < n; b += size) {
      auto got = reader->Read(0, b, std::min(b + size, n), true);
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      ASSERT_TRUE(model.Matches(*got, true));
    }
  }
  // Ten elements inside one block of one file: one block per section.
  uint64_t before = reader->bytes_read();
  auto small = reader->Read(0, 400000, 400010, true);
  ASSERT_TRUE(small.ok()) << small.status().ToString();
  EXPECT_TRUE(model.Matches(*small, true));
  EXPECT_LE(reader->bytes_read() - before, 3u * kCheckpointDefaultBlockBytes);
  // Straddling two files: at most two blocks per section and file.
  before = reader->bytes_read();
  auto straddle = reader->Read(0, 299990, 300010, false);
  ASSERT_TRUE(straddle.ok()) << straddle.status().ToString();
  EXPECT_TRUE(model.Matches(*straddle, false));
  EXPECT_LE(reader->bytes_read() - before, 2u * kCheckpointDefaultBlockBytes);

  // Concurrent reads from one reader.
  std::vector<std::thread> threads;
  threads.reserve(4);
  std::vector<int> ok(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      const uint64_t b = static_cast<uint64_t>(t) * 150000;
      auto got = reader->Read(0, b, b + 200000, true);
      ok[static_cast<size_t>(t)] = got.ok() && model.Matches(*got, true);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok, std::vector<int>(4, 1));
}

TEST(CheckpointTest, MissingPartitionFileIsReported) {
  ScratchDir scratch;
  const Model model(10007, 1, "sgd");
  model.Save(scratch.path(), 1000, 3, 256);
  // The server holding partition 2 crashed before its file was in place; so did the last partition's.
  fs::remove(scratch.path() + "/" + CheckpointFileName(2, 2000, 3000));
  fs::remove(scratch.path() + "/" + CheckpointFileName(10, 10000, 10007));
  auto reader = CheckpointReader::Open(scratch.path());
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  const std::vector<std::pair<uint64_t, uint64_t>> missing = {{2000, 3000}, {10000, 10007}};
  EXPECT_EQ(reader->Missing(), missing);

  auto got = reader->Read(0, 1500, 2500, true);
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(got.status().message(), "[2000, 2500)"));
  got = reader->Read(0, 0, 10007, false);
  ASSERT_FALSE(got.ok());
  EXPECT_TRUE(Contains(got.status().message(), "[2000, 3000), [10000, 10007)"));
  // Ranges the remaining files cover still read.
  got = reader->Read(0, 0, 2000, true);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_TRUE(model.Matches(*got, true));
  got = reader->Read(0, 3000, 10000, true);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_TRUE(model.Matches(*got, true));
}

TEST(CheckpointTest, ReadArgumentsAreChecked) {
  ScratchDir scratch;
  const Model model(100, 0, "sgd");
  model.Save(scratch.path(), 100, 1);
  auto reader = CheckpointReader::Open(scratch.path());
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  EXPECT_EQ(reader->Read(0, 10, 10, true).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(reader->Read(0, 20, 10, true).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(reader->Read(0, 0, 101, true).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(reader->Read(0, ~uint64_t{0} - 1, ~uint64_t{0}, true).status().code(), StatusCode::kInvalidArgument);
}

// One small checkpoint file to damage: 64 elements, 2 buffers, 64-byte blocks.
class CorruptionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = scratch_.path() + "/ckpt";
    model_.Save(dir_, 64, 1, 64);
    path_ = dir_ + "/" + CheckpointFileName(0, 0, 64);
    original_ = ReadBytes(path_);
    ASSERT_FALSE(original_.empty());
    header_bytes_ = Get32(original_, 12);
  }

  // The first error opening the checkpoint, reading all of it, or verifying it; OK if none.
  Status Check() const {
    auto reader = CheckpointReader::Open(dir_);
    if (!reader.ok()) return reader.status();
    auto got = reader->Read(0, 0, 64, true);
    if (!got.ok()) return got.status();
    if (!model_.Matches(*got, true)) return Internal("read wrong data without an error");
    return reader->Verify();
  }

  ScratchDir scratch_;
  Model model_{64, 2, "adam"};
  std::string dir_;
  std::string path_;
  std::string original_;
  uint32_t header_bytes_ = 0;
};

TEST_F(CorruptionTest, TheLayoutIsTheDocumentedOne) {
  const std::string& f = original_;
  EXPECT_EQ(f.substr(0, 8), "TNDMCKPT");
  EXPECT_EQ(Get32(f, 8), 1u);
  EXPECT_EQ(Get32(f, 16), 0u);   // partition id
  EXPECT_EQ(Get32(f, 20), 2u);   // state buffers
  EXPECT_EQ(Get64(f, 24), 0u);   // begin
  EXPECT_EQ(Get64(f, 32), 64u);  // end
  EXPECT_EQ(Get64(f, 40), 101u);
  EXPECT_EQ(Get64(f, 48), 100u);
  EXPECT_EQ(Get64(f, 56), 100u);
  EXPECT_EQ(Get64(f, 64), 64u);
  EXPECT_EQ(Get64(f, 72), 0x0123456789abcdefull);
  EXPECT_EQ(Get32(f, 80), 64u);  // block bytes
  const std::string strings = "job-1step-0000000100adam";
  EXPECT_EQ(f.substr(84, 8), std::string("\x05\x00\x0f\x00\x04\x00\x00\x00", 8));
  EXPECT_EQ(f.substr(92, strings.size()), strings);
  const size_t table = (92 + strings.size() + 7) / 8 * 8;
  // 3 sections of 256 bytes, 4 blocks each.
  EXPECT_EQ(header_bytes_, table + size_t{12} * 4 + 4);
  EXPECT_EQ(Get32(f, header_bytes_ - 4), Crc32c(f.data(), size_t{header_bytes_} - 4));
  EXPECT_EQ(f.size(), header_bytes_ + 3 * 256u);
  for (size_t s = 0; s < 3; ++s) {
    const size_t section = header_bytes_ + size_t{256} * s;
    EXPECT_EQ(f.substr(section, 256), std::string(reinterpret_cast<const char*>(model_.buffers[s].data()), 256));
    for (size_t k = 0; k < 4; ++k) {
      EXPECT_EQ(Get32(f, table + 4 * (4 * s + k)), Crc32c(f.data() + section + 64 * k, 64));
    }
  }
  EXPECT_TRUE(Check().ok());
}

TEST_F(CorruptionTest, EveryFlippedBitIsDetected) {
  // Each byte of the file in turn, a different bit each time.
  for (size_t i = 0; i < original_.size(); ++i) {
    std::string damaged = original_;
    damaged[i] = static_cast<char>(damaged[i] ^ (1 << (i % 8)));
    WriteBytes(path_, damaged);
    const Status s = Check();
    ASSERT_EQ(s.code(), StatusCode::kDataLoss) << "byte " << i << ": " << s.ToString();
    ASSERT_TRUE(Contains(s.message(), path_)) << "byte " << i;
    if (i >= header_bytes_) {
      const char* section = i < header_bytes_ + 256 ? "weights" : i < header_bytes_ + 512 ? "state0" : "state1";
      ASSERT_TRUE(Contains(s.message(), section)) << "byte " << i;
    }
  }
}

TEST_F(CorruptionTest, PayloadDamageIsFoundByTheReadsThatTouchIt) {
  std::string damaged = original_;
  damaged[header_bytes_ + 256 + 100] ^= 0x10;  // state0, block 1 (elements 16..31)
  WriteBytes(path_, damaged);
  auto reader = CheckpointReader::Open(dir_);  // headers only
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  auto got = reader->Read(0, 20, 21, true);
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kDataLoss);
  EXPECT_TRUE(Contains(got.status().message(), path_));
  EXPECT_TRUE(Contains(got.status().message(), "state0 block 1"));
  // Reads that do not touch the block, or skip the optimizer state, succeed.
  got = reader->Read(0, 32, 64, true);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_TRUE(model_.Matches(*got, true));
  got = reader->Read(0, 0, 64, false);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_TRUE(model_.Matches(*got, false));
  EXPECT_EQ(reader->Verify().code(), StatusCode::kDataLoss);

  // The last byte of the last block.
  damaged = original_;
  damaged.back() ^= 0x01;
  WriteBytes(path_, damaged);
  reader = CheckpointReader::Open(dir_);
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  got = reader->Read(0, 63, 64, true);
  ASSERT_FALSE(got.ok());
  EXPECT_TRUE(Contains(got.status().message(), "state1 block 3"));
}

TEST_F(CorruptionTest, TruncatedFilesAndTrailingGarbageAreDetected) {
  for (size_t size : {size_t{0}, size_t{5}, size_t{16}, size_t{50}, size_t{header_bytes_} - 1, size_t{header_bytes_},
                      original_.size() - 300, original_.size() - 1}) {
    WriteBytes(path_, original_.substr(0, size));
    const Status s = Check();
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << size << ": " << s.ToString();
    EXPECT_TRUE(Contains(s.message(), path_));
  }
  for (const std::string& garbage : {std::string(1, '\0'), std::string(100, 'x')}) {
    WriteBytes(path_, original_ + garbage);
    const Status s = Check();
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << s.ToString();
    EXPECT_TRUE(Contains(s.message(), "trailing garbage"));
    EXPECT_TRUE(Contains(s.message(), path_));
  }
}

TEST_F(CorruptionTest, WrongMagicAndOtherVersionsAreRefused) {
  std::string damaged = original_;
  damaged.replace(0, 8, "NOTACKPT");
  WriteBytes(path_, damaged);
  Status s = Check();
  EXPECT_EQ(s.code(), StatusCode::kDataLoss);
  EXPECT_TRUE(Contains(s.message(), "bad magic"));
  EXPECT_TRUE(Contains(s.message(), path_));

  // A newer format, with a valid header checksum: a clear refusal, not "corrupt".
  damaged = original_;
  Put32(damaged, 8, kCheckpointFormatVersion + 1);
  FixHeaderCrc(damaged);
  WriteBytes(path_, damaged);
  s = Check();
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(s.message(), "newer"));
  EXPECT_TRUE(Contains(s.message(), path_));

  damaged = original_;
  Put32(damaged, 8, 0);
  FixHeaderCrc(damaged);
  WriteBytes(path_, damaged);
  EXPECT_EQ(Check().code(), StatusCode::kDataLoss);
}

TEST_F(CorruptionTest, ForgedHeaderFieldsAreRejectedWithoutLargeAllocations) {
  // Each edit keeps a valid header checksum, so only the field checks stand between it and the reader.
  const std::vector<std::pair<std::string, std::function<void(std::string&)>>> edits = {
      {"state buffers 3", [](std::string& f) { Put32(f, 20, 3); }},
      {"state buffers huge", [](std::string& f) { Put32(f, 20, 0xffffffffu); }},
      {"empty range", [](std::string& f) { Put64(f, 32, 0); }},
      {"end past the space", [](std::string& f) { Put64(f, 32, 65); }},
      {"end huge", [](std::string& f) { Put64(f, 32, ~uint64_t{0}); }},
      {"begin huge", [](std::string& f) { Put64(f, 24, ~uint64_t{0} - 1); }},
      {"parameter count 0", [](std::string& f) { Put64(f, 64, 0); }},
      {"parameter count huge", [](std::string& f) { Put64(f, 64, ~uint64_t{0}); }},
      {"everything huge",
       [](std::string& f) {
         Put64(f, 32, uint64_t{1} << 60);
         Put64(f, 64, uint64_t{1} << 60);
       }},
      {"block size 0", [](std::string& f) { Put32(f, 80, 0); }},
      {"block size 3", [](std::string& f) { Put32(f, 80, 3); }},
      {"block size huge", [](std::string& f) { Put32(f, 80, 0x80000000u); }},
      {"block size 128", [](std::string& f) { Put32(f, 80, 128); }},
      {"job id length huge", [](std::string& f) { Put16(f, 84, 0xffff); }},
      {"job id empty", [](std::string& f) { Put16(f, 84, 0); }},
      {"checkpoint id length huge", [](std::string& f) { Put16(f, 86, 0xffff); }},
      {"optimizer length huge", [](std::string& f) { Put16(f, 88, 0xffff); }},
      {"reserved", [](std::string& f) { Put16(f, 90, 1); }},
      {"checkpoint id with a slash", [](std::string& f) { f[92 + 5 + 4] = '/'; }},
      {"padding", [](std::string& f) { f[92 + 24] = 'x'; }},
      {"another partition id (name mismatch)", [](std::string& f) { Put32(f, 16, 7); }},
  };
  for (const auto& [what, edit] : edits) {
    std::string damaged = original_;
    edit(damaged);
    FixHeaderCrc(damaged);
    WriteBytes(path_, damaged);
    const Status s = Check();
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << what << ": " << s.ToString();
    EXPECT_TRUE(Contains(s.message(), path_)) << what;
  }
  // Header lengths from 0 to huge (no checksum can be fixed up past the end of the file).
  for (uint32_t length : {0u, 4u, 95u, 96u, header_bytes_ - 4, header_bytes_ + 4, 1u << 30, 0xffffffffu}) {
    std::string damaged = original_;
    Put32(damaged, 12, length);
    if (length >= 96 && length <= damaged.size())
      Put32(damaged, length - 4, Crc32c(damaged.data(), size_t{length} - 4));
    WriteBytes(path_, damaged);
    const Status s = Check();
    EXPECT_EQ(s.code(), StatusCode::kDataLoss) << length << ": " << s.ToString();
  }
}

TEST_F(CorruptionTest, RandomDamageNeverCrashes) {
  std::mt19937_64 rng(11);
  for (int i = 0; i < 2000; ++i) {
    std::string damaged;
    switch (i % 3) {
      case 0:  // garbage behind a valid magic number
        damaged = "TNDMCKPT";
        for (size_t n = rng() % 2048; n > 0; --n) damaged.push_back(static_cast<char>(rng()));
        break;
      case 1:  // random header edits with the checksum fixed up
        damaged = original_;
        for (int k = 0; k < 1 + static_cast<int>(rng() % 4); ++k) {
          damaged[8 + rng() % (header_bytes_ - 12)] = static_cast<char>(rng());
        }
        if (Get32(damaged, 12) >= 96 && Get32(damaged, 12) <= damaged.size()) FixHeaderCrc(damaged);
        break;
      default:  // random truncation of random edits
        damaged = original_;
        damaged[rng() % damaged.size()] = static_cast<char>(rng());
        damaged.resize(rng() % damaged.size());
        break;
    }
    WriteBytes(path_, damaged);
    auto reader = CheckpointReader::Open(dir_);
    if (!reader.ok()) continue;
    for (const auto& [b, e] : std::vector<std::pair<uint64_t, uint64_t>>{{0, 64}, {3, 5}, {0, 1}}) {
      if (e <= reader->meta().parameter_count) (void)reader->Read(0, b, e, true);
    }
    (void)reader->Verify();
  }
}

TEST(CheckpointTest, FilesFromAnotherCheckpointAreRefused) {
  const Model model(4000, 1, "sgd");
  struct Case {
    std::string what;
    std::function<void(CheckpointMeta&)> change;
    std::string says;
  };
  const std::vector<Case> cases = {
      {"another step", [](CheckpointMeta& m) { m.step = 200; }, "step 100 vs 200"},
      {"another checkpoint", [](CheckpointMeta& m) { m.checkpoint_id = "other"; }, "checkpoint id"},
      {"another job", [](CheckpointMeta& m) { m.job_id = "job-2"; }, "job"},
      {"another model", [](CheckpointMeta& m) { m.tensor_fingerprint = 7; }, "tensor fingerprint"},
      {"another parameter count", [](CheckpointMeta& m) { m.parameter_count = 5000; }, "parameter count"},
      {"another optimizer", [](CheckpointMeta& m) { m.optimizer = "sgd2"; }, "optimizer"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    ScratchDir scratch;
    const std::string dir = scratch.path() + "/a";
    model.Save(dir, 1000, 2);
    // Partition 1 of the other checkpoint replaces this one's.
    Model other = model;
    c.change(other.meta);
    const PartitionState p = other.Partition(1, 1000, 2000);
    fs::remove(dir + "/" + CheckpointFileName(1, 1000, 2000));
    ASSERT_TRUE(WriteCheckpointFiles(scratch.path() + "/b", other.meta, {&p}, nullptr, nullptr).ok());
    fs::copy_file(scratch.path() + "/b/" + CheckpointFileName(1, 1000, 2000),
                  dir + "/" + CheckpointFileName(1, 1000, 2000));
    auto reader = CheckpointReader::Open(dir);
    ASSERT_FALSE(reader.ok());
    EXPECT_EQ(reader.status().code(), StatusCode::kFailedPrecondition);
    EXPECT_TRUE(Contains(reader.status().message(), CheckpointFileName(0, 0, 1000)));
    EXPECT_TRUE(Contains(reader.status().message(), CheckpointFileName(1, 1000, 2000)));
    EXPECT_TRUE(Contains(reader.status().message(), c.says));
  }

  // A file of the same checkpoint from another partitioning overlaps.
  ScratchDir scratch;
  model.Save(scratch.path() + "/a", 1000, 1);
  model.Save(scratch.path() + "/b", 1500, 1);
  fs::copy_file(scratch.path() + "/b/" + CheckpointFileName(1, 1500, 3000),
                scratch.path() + "/a/" + CheckpointFileName(1, 1500, 3000));
  auto reader = CheckpointReader::Open(scratch.path() + "/a");
  ASSERT_FALSE(reader.ok());
  EXPECT_EQ(reader.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(reader.status().message(), "overlap"));
  EXPECT_TRUE(Contains(reader.status().message(), CheckpointFileName(1, 1500, 3000)));
}

TEST(CheckpointTest, PartitionsAtDifferentVersionsDoNotMix) {
  ScratchDir scratch;
  const Model model(2000, 0, "sgd");
  PartitionState a = model.Partition(0, 0, 1000);
  PartitionState b = model.Partition(1, 1000, 2000);
  b.version = 99;
  ASSERT_TRUE(WriteCheckpointFiles(scratch.path(), model.meta, {&a, &b}, nullptr, nullptr).ok());
  auto reader = CheckpointReader::Open(scratch.path());
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  auto got = reader->Read(0, 500, 1500, true);
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(got.status().message(), CheckpointFileName(1, 1000, 2000)));
  got = reader->Read(0, 1000, 2000, true);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_EQ(got->version, 99u);
}

TEST(CheckpointTest, CheckpointsAreNeverOverwritten) {
  ScratchDir scratch;
  const Model model(2000, 1, "sgd");
  const PartitionState a = model.Partition(0, 0, 1000);
  const PartitionState b = model.Partition(1, 1000, 2000);
  ASSERT_TRUE(WriteCheckpointFiles(scratch.path(), model.meta, {&a}, nullptr, nullptr).ok());
  const std::string a_path = scratch.path() + "/" + CheckpointFileName(0, 0, 1000);
  const std::string before = ReadBytes(a_path);

  Model changed = model;
  changed.meta.step = 200;
  const PartitionState a2 = changed.Partition(0, 0, 1000);
  uint64_t bytes = 1;
  const Status s = WriteCheckpointFiles(scratch.path(), changed.meta, {&b, &a2}, nullptr, &bytes);
  EXPECT_EQ(s.code(), StatusCode::kAlreadyExists) << s.ToString();
  EXPECT_TRUE(Contains(s.message(), a_path));
  EXPECT_EQ(bytes, 0u);
  // Nothing written: not b's file, no temporary file, a's file untouched.
  EXPECT_EQ(ListDir(scratch.path()), std::vector<std::string>{CheckpointFileName(0, 0, 1000)});
  EXPECT_EQ(ReadBytes(a_path), before);
}

TEST(CheckpointTest, TemporaryAndUnrelatedFilesAreIgnored) {
  ScratchDir scratch;
  const Model model(3000, 2, "adam");
  model.Save(scratch.path(), 1000, 2);
  // A successful save leaves no temporary file.
  for (const auto& name : ListDir(scratch.path())) EXPECT_TRUE(name.ends_with(".tpc")) << name;
  // A crashed writer's leftovers and other files.
  std::ofstream(scratch.path() + "/" + CheckpointFileName(3, 3000, 4000) + ".1234.0.tmp") << "half a file";
  std::ofstream(scratch.path() + "/" + CheckpointFileName(1, 1000, 2000) + ".99.1.tmp") << "garbage";
  std::ofstream(scratch.path() + "/README") << "notes";
  std::ofstream(scratch.path() + "/part-x.tpc") << "not a partition file name";
  auto reader = CheckpointReader::Open(scratch.path());
  ASSERT_TRUE(reader.ok()) << reader.status().ToString();
  EXPECT_EQ(reader->files().size(), 3u);
  EXPECT_TRUE(reader->Missing().empty());
  auto got = reader->Read(0, 0, 3000, true);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  EXPECT_TRUE(model.Matches(*got, true));

  // Only temporary files: no checkpoint here.
  ScratchDir empty;
  std::ofstream(empty.path() + "/" + CheckpointFileName(0, 0, 10) + ".1.0.tmp") << "x";
  auto none = CheckpointReader::Open(empty.path());
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound);
}

TEST(CheckpointTest, OpenReportsMissingCheckpoints) {
  ScratchDir scratch;
  auto reader = CheckpointReader::Open(scratch.path() + "/nope");
  EXPECT_EQ(reader.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(Contains(reader.status().message(), scratch.path() + "/nope"));
  reader = CheckpointReader::Open(scratch.path());
  EXPECT_EQ(reader.status().code(), StatusCode::kNotFound);
  std::ofstream(scratch.path() + "/file") << "x";
  reader = CheckpointReader::Open(scratch.path() + "/file");
  EXPECT_EQ(reader.status().code(), StatusCode::kNotFound);
}

TEST(CheckpointTest, AFailedWriteLeavesNothingInPlace) {
  ScratchDir scratch;
  const Model model(300000, 2, "adam");
  const PartitionState small = model.Partition(0, 0, 1000);
  const PartitionState big = model.Partition(1, 1000, 300000);
  // Files may grow to 1 MiB: the first partition's file fits, the second's does not.
  struct sigaction ignore {};
  struct sigaction old_action {};
  ignore.sa_handler = SIG_IGN;
  ASSERT_EQ(sigaction(SIGXFSZ, &ignore, &old_action), 0);
  rlimit old_limit{};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  rlimit limit = old_limit;
  limit.rlim_cur = 1 << 20;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &limit), 0);
  uint64_t bytes = 1;
  const Status s = WriteCheckpointFiles(scratch.path() + "/ckpt", model.meta, {&small, &big}, nullptr, &bytes);
  setrlimit(RLIMIT_FSIZE, &old_limit);
  sigaction(SIGXFSZ, &old_action, nullptr);

  EXPECT_EQ(s.code(), StatusCode::kResourceExhausted) << s.ToString();
  EXPECT_TRUE(Contains(s.message(), CheckpointFileName(1, 1000, 300000)));
  EXPECT_TRUE(Contains(s.message(), ".tmp"));
  EXPECT_TRUE(Contains(s.message(), std::strerror(EFBIG)));
  EXPECT_EQ(bytes, 0u);
  EXPECT_TRUE(ListDir(scratch.path() + "/ckpt").empty());

  // A directory that cannot be created.
  std::ofstream(scratch.path() + "/plain") << "x";
  const Status t = WriteCheckpointFiles(scratch.path() + "/plain/ckpt", model.meta, {&small}, nullptr, nullptr);
  EXPECT_FALSE(t.ok());
  EXPECT_TRUE(Contains(t.message(), scratch.path() + "/plain/ckpt"));
}

TEST(CheckpointTest, BadWritesAreRefusedBeforeWritingAnything) {
  ScratchDir scratch;
  const std::string dir = scratch.path() + "/ckpt";
  const Model model(2000, 1, "sgd");
  const PartitionState good = model.Partition(0, 0, 1000);
  auto refused = [&](const CheckpointMeta& meta, const std::vector<const PartitionState*>& parts,
                     const std::string& says) {
    const Status s = WriteCheckpointFiles(dir, meta, parts, nullptr, nullptr);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.ToString();
    EXPECT_TRUE(Contains(s.message(), says));
    EXPECT_FALSE(fs::exists(dir));
  };
  CheckpointMeta meta = model.meta;
  meta.checkpoint_id = "a/b";
  refused(meta, {&good}, "a/b");
  meta = model.meta;
  meta.state_buffers = 3;
  refused(meta, {&good}, "state_buffers");
  meta = model.meta;
  meta.job_id = "";
  refused(meta, {&good}, "job_id");
  meta = model.meta;
  meta.optimizer = "";
  refused(meta, {&good}, "optimizer");
  refused(model.meta, {nullptr}, "null");

  PartitionState p = good;
  p.weights.pop_back();
  refused(model.meta, {&p}, "weights");
  p = good;
  p.state1 = p.state0;  // a buffer the meta does not store
  refused(model.meta, {&p}, "state1");
  p = good;
  p.state0.clear();
  refused(model.meta, {&p}, "state0");
  p = model.Partition(1, 1500, 2000);
  p.end = 2001;
  p.weights.push_back(0);
  p.state0.push_back(0);
  refused(model.meta, {&p}, "[1500, 2001)");
  p = model.Partition(1, 500, 1500);
  refused(model.meta, {&good, &p}, "overlap");
  p = model.Partition(0, 1000, 2000);
  refused(model.meta, {&good, &p}, "twice");
  const Status s = WriteCheckpointFiles(dir, model.meta, {&good}, nullptr, nullptr, CheckpointWriteOptions{6});
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
}

TEST(CheckpointTest, CheckpointIdsAreValidated) {
  for (const std::string& id : {std::string("a"), std::string("step-0000000100"), std::string("A.b_c-9"),
                                std::string("..."), std::string(128, 'x')}) {
    EXPECT_TRUE(ValidateCheckpointId(id).ok()) << id;
  }
  for (const std::string& id :
       {std::string(), std::string("."), std::string(".."), std::string("a/b"), std::string("a b"),
        std::string(129, 'x'), std::string("\xc3\xbc"), std::string("a\0b", 3), std::string("a\nb")}) {
    const Status s = ValidateCheckpointId(id);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << id;
    EXPECT_TRUE(Contains(s.message(), "checkpoint id"));
  }
  EXPECT_TRUE(Contains(ValidateCheckpointId("a/b").message(), "\"a/b\""));
  EXPECT_EQ(CheckpointFileName(12, 0, 1000), "part-000012-0-1000.tpc");
  EXPECT_EQ(DefaultCheckpointId(100), "step-0000000100");
  EXPECT_TRUE(ValidateCheckpointId(DefaultCheckpointId(~uint64_t{0})).ok());
}

}  // namespace
}  // namespace tandem::server
