// The coordinator's durable store: CRC-32C, FileStore's log and snapshots
// (round trips across reopen, group commit, torn and corrupt tails, snapshot
// fallback, segment rollover and clean-up, the data-dir lock, limits, a full
// disk) and MemoryStore's matching semantics.
#include "coordinator/store.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "common/crc32c.h"
#include "common/mutex.h"
#include "test_util.h"

namespace tandem::coordinator {
namespace {

namespace fs = std::filesystem;

::testing::AssertionResult Contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << text << "\"\ndoes not contain \"" << part << "\"";
}

// Aborts the test binary if a test outlives `limit`, so that a hang in the
// store shows up as a failure with the test's name rather than a stuck run.
class Watchdog {
 public:
  explicit Watchdog(std::chrono::seconds limit)
      : thread_([this, limit] {
          MutexLock lock(&mu_);
          if (!cv_.WaitFor(lock, limit, [this]() TANDEM_REQUIRES(mu_) { return done_; })) {
            const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
            std::fprintf(stderr, "%s.%s did not finish within %lld s\n",
                         info != nullptr ? info->test_suite_name() : "?", info != nullptr ? info->name() : "?",
                         static_cast<long long>(limit.count()));
            std::abort();
          }
        }) {}
  ~Watchdog() {
    {
      MutexLock lock(&mu_);
      done_ = true;
    }
    cv_.NotifyOne();
    thread_.join();
  }

 private:
  Mutex mu_;
  CondVar cv_;
  bool done_ TANDEM_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: starts after the members it uses
};

class StoreTest : public ::testing::Test {
 protected:
  Watchdog watchdog_{std::chrono::seconds(60)};
  testing::TempDir tmp_;
  std::string dir_ = tmp_.path() + "/data";

  std::unique_ptr<FileStore> Open(FileStoreOptions options = {}) { return OpenAt(dir_, std::move(options)); }
  static std::unique_ptr<FileStore> OpenAt(const std::string& dir, FileStoreOptions options = {}) {
    auto store = FileStore::Open(dir, std::move(options));
    EXPECT_TRUE(store.ok()) << store.status().ToString();
    return store.ok() ? std::move(*store) : nullptr;
  }
};

std::string SegmentName(uint64_t first) {
  return fmt::format("log-{:020}.tlog", first);
}
std::string SnapshotName(uint64_t sequence) {
  return fmt::format("snapshot-{:020}.tsnap", sequence);
}

std::string ReadBinary(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}
void WriteBinary(const std::string& path, const std::string& data) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << data;
}
void FlipByte(const std::string& path, size_t offset) {
  std::string data = ReadBinary(path);
  ASSERT_LT(offset, data.size()) << path;
  data[offset] = static_cast<char>(data[offset] ^ 0x5A);
  WriteBinary(path, data);
}

// The names in `dir` that end with `suffix`, sorted.
std::vector<std::string> Names(const std::string& dir, const std::string& suffix) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.ends_with(suffix)) names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

std::vector<uint64_t> Sequences(const Recovery& r) {
  std::vector<uint64_t> out;
  for (const auto& [sequence, payload] : r.records) out.push_back(sequence);
  return out;
}
std::vector<uint64_t> Range(uint64_t first, uint64_t last) {
  std::vector<uint64_t> out;
  for (uint64_t s = first; s <= last; ++s) out.push_back(s);
  return out;
}
std::string JoinWarnings(const Recovery& r) {
  std::string out;
  for (const auto& w : r.warnings) out += w + "\n";
  return out;
}

// ---------------------------------------------------------------------------
// CRC-32C

uint32_t BitwiseCrc32c(const std::string& data) {
  uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char c : data) {
    crc ^= c;
    for (int i = 0; i < 8; ++i) crc = (crc & 1u) != 0 ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
  }
  return ~crc;
}

TEST(Crc32cTest, KnownVectors) {
  EXPECT_EQ(Crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(Crc32c(""), 0u);
  EXPECT_EQ(Crc32c("a"), 0xC1D04330u);
  // RFC 3720 (iSCSI), appendix B.4.
  EXPECT_EQ(Crc32c(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(Crc32c(std::string(32, '\xFF')), 0x62A8AB43u);
  std::string up, down;
  for (int i = 0; i < 32; ++i) {
    up.push_back(static_cast<char>(i));
    down.push_back(static_cast<char>(31 - i));
  }
  EXPECT_EQ(Crc32c(up), 0x46DD794Eu);
  EXPECT_EQ(Crc32c(down), 0x113FDB5Cu);
}

TEST(Crc32cTest, MatchesBitwiseReferenceAtAnyLengthAndAlignmentAndChains) {
  std::string data;
  uint32_t x = 12345;
  for (int i = 0; i < 300; ++i) {
    x = x * 1103515245u + 12345u;
    data.push_back(static_cast<char>(x >> 16));
  }
  for (size_t start = 0; start < 9; ++start) {
    for (size_t n = 0; n + start <= data.size(); n += 7) {
      const std::string piece = data.substr(start, n);
      ASSERT_EQ(Crc32c(piece), BitwiseCrc32c(piece)) << "start " << start << " length " << n;
    }
  }
  const uint32_t whole = Crc32c(data);
  for (size_t split = 0; split <= data.size(); ++split) {
    ASSERT_EQ(Crc32c(data.data() + split, data.size() - split, Crc32c(data.data(), split)), whole) << split;
  }
}

// ---------------------------------------------------------------------------
// The round trip, for both stores: `open` makes the store again from what
// the previous one left (a restart).

void RoundTrip(const std::function<std::unique_ptr<Store>()>& open) {
  const std::string binary("\0\x01\xFFzero\0bytes", 12);
  {
    auto store = open();
    ASSERT_NE(store, nullptr);
    auto r = store->Recover();
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->snapshot_sequence, 0u);
    EXPECT_TRUE(r->records.empty());
    EXPECT_TRUE(r->warnings.empty()) << JoinWarnings(*r);
    EXPECT_EQ(store->Recover().status().code(), StatusCode::kFailedPrecondition);  // once only

    EXPECT_EQ(store->Append("alpha"), 1u);
    EXPECT_EQ(store->Append(""), 2u);
    EXPECT_EQ(store->Append(binary), 3u);
    EXPECT_TRUE(store->WaitDurable(3).ok());
    EXPECT_TRUE(store->WaitDurable(1).ok());
    EXPECT_TRUE(store->WaitDurable(0).ok());
    EXPECT_EQ(store->durable_sequence(), 3u);
    const Status never = store->WaitDurable(4);
    EXPECT_EQ(never.code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(Contains(never.message(), "sequence 4 was never appended (the last is 3)"));
  }
  {
    auto store = open();
    ASSERT_NE(store, nullptr);
    EXPECT_EQ(store->durable_sequence(), 3u);
    auto r = store->Recover();
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    ASSERT_EQ(r->records.size(), 3u);
    EXPECT_EQ(r->records[0], std::make_pair(uint64_t{1}, std::string("alpha")));
    EXPECT_EQ(r->records[1], std::make_pair(uint64_t{2}, std::string()));
    EXPECT_EQ(r->records[2], std::make_pair(uint64_t{3}, binary));
    EXPECT_TRUE(r->warnings.empty()) << JoinWarnings(*r);
    // Sequences continue after the recovered ones. These are not waited for:
    // closing the store must still make them durable.
    for (int i = 0; i < 100; ++i) EXPECT_EQ(store->Append(fmt::format("r{}", i)), 4u + i);
  }
  {
    auto store = open();
    ASSERT_NE(store, nullptr);
    auto r = store->Recover();
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(Sequences(*r), Range(1, 103));
    EXPECT_EQ(r->records.back().second, "r99");
    // A snapshot as of 50 replaces the records up to 50.
    EXPECT_EQ(store->WriteSnapshot(0, "x").code(), StatusCode::kInvalidArgument);
    EXPECT_EQ(store->WriteSnapshot(104, "x").code(), StatusCode::kInvalidArgument);
    ASSERT_TRUE(store->WriteSnapshot(50, "state@50").ok());
    EXPECT_EQ(store->WriteSnapshot(40, "x").code(), StatusCode::kInvalidArgument);  // older than the newest
    EXPECT_EQ(store->Append("after"), 104u);
    EXPECT_TRUE(store->WaitDurable(104).ok());
  }
  {
    auto store = open();
    ASSERT_NE(store, nullptr);
    auto r = store->Recover();
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->snapshot_sequence, 50u);
    EXPECT_EQ(r->snapshot, "state@50");
    EXPECT_EQ(Sequences(*r), Range(51, 104));
    EXPECT_EQ(r->records.back().second, "after");
    EXPECT_EQ(store->Append("next"), 105u);
  }
}

TEST_F(StoreTest, FileStoreRoundTripAcrossReopenContinuesSequences) {
  RoundTrip([&]() -> std::unique_ptr<Store> { return Open(); });
}

TEST_F(StoreTest, MemoryStoreRoundTripHasTheSameSemantics) {
  auto backing = std::make_shared<MemoryStoreBacking>();
  RoundTrip([&]() -> std::unique_ptr<Store> { return std::make_unique<MemoryStore>(backing); });
}

// ---------------------------------------------------------------------------
// Group commit

struct GroupCommitResult {
  double seconds = 0;
  std::vector<std::vector<uint64_t>> sequences;  // per thread, in append order
};

// `threads` threads append `per_thread` records each; with `wait_each`, every
// append is followed by WaitDurable of its record (as an RPC handler would),
// otherwise each thread waits once, for its last record.
GroupCommitResult AppendFromThreads(Store& store, int threads, int per_thread, bool wait_each) {
  GroupCommitResult result;
  result.sequences.resize(static_cast<size_t>(threads));
  std::atomic<int> failures{0};
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      auto& mine = result.sequences[static_cast<size_t>(t)];
      for (int i = 0; i < per_thread; ++i) {
        mine.push_back(store.Append(fmt::format("thread {} record {}", t, i)));
        if (wait_each && !store.WaitDurable(mine.back()).ok()) ++failures;
      }
      if (!store.WaitDurable(mine.back()).ok()) ++failures;
    });
  }
  for (auto& w : workers) w.join();
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(failures, 0);
  return result;
}

// Every record comes back exactly once, in sequence order, with the payload
// its thread appended under that sequence.
void ExpectAllRecovered(const Recovery& r, const GroupCommitResult& g, int threads, int per_thread) {
  const size_t total = static_cast<size_t>(threads) * static_cast<size_t>(per_thread);
  ASSERT_EQ(Sequences(r), Range(1, total));
  std::map<uint64_t, std::string> expected;
  for (int t = 0; t < threads; ++t) {
    const auto& mine = g.sequences[static_cast<size_t>(t)];
    ASSERT_EQ(mine.size(), static_cast<size_t>(per_thread));
    EXPECT_TRUE(std::is_sorted(mine.begin(), mine.end()));
    for (int i = 0; i < per_thread; ++i)
      expected[mine[static_cast<size_t>(i)]] = fmt::format("thread {} record {}", t, i);
  }
  ASSERT_EQ(expected.size(), total);  // no sequence handed out twice
  for (const auto& [sequence, payload] : r.records) EXPECT_EQ(payload, expected[sequence]) << sequence;
}

TEST_F(StoreTest, GroupCommitFromManyThreadsWaitingForEachRecord) {
  constexpr int kThreads = 16, kPerThread = 256;
  GroupCommitResult g;
  {
    auto store = Open();
    ASSERT_NE(store, nullptr);
    g = AppendFromThreads(*store, kThreads, kPerThread, /*wait_each=*/true);
    const FileStoreStats stats = store->stats();
    std::printf(
        "[ figure   ] group commit, each append waited for: %d records from %d threads in %.3f s, "
        "%llu fdatasyncs in %llu batches (%.1f records per fsync)\n",
        kThreads * kPerThread, kThreads, g.seconds, static_cast<unsigned long long>(stats.syncs),
        static_cast<unsigned long long>(stats.batches),
        static_cast<double>(stats.records) / static_cast<double>(std::max<uint64_t>(stats.syncs, 1)));
    EXPECT_EQ(stats.records, static_cast<uint64_t>(kThreads * kPerThread));
    EXPECT_EQ(store->durable_sequence(), static_cast<uint64_t>(kThreads * kPerThread));
  }
  auto store = Open();
  ASSERT_NE(store, nullptr);
  auto r = store->Recover();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->warnings.empty()) << JoinWarnings(*r);
  ExpectAllRecovered(*r, g, kThreads, kPerThread);
}

TEST_F(StoreTest, GroupCommitFromManyThreadsAppendingThenWaiting) {
  constexpr int kThreads = 16, kPerThread = 256;
  GroupCommitResult g;
  {
    auto store = Open();
    ASSERT_NE(store, nullptr);
    g = AppendFromThreads(*store, kThreads, kPerThread, /*wait_each=*/false);
    const FileStoreStats stats = store->stats();
    std::printf(
        "[ figure   ] group commit, appends then one wait per thread: %d records from %d threads in %.3f s, "
        "%llu fdatasyncs in %llu batches\n",
        kThreads * kPerThread, kThreads, g.seconds, static_cast<unsigned long long>(stats.syncs),
        static_cast<unsigned long long>(stats.batches));
  }
  auto store = Open();
  ASSERT_NE(store, nullptr);
  auto r = store->Recover();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ExpectAllRecovered(*r, g, kThreads, kPerThread);
}

// ---------------------------------------------------------------------------
// Torn and corrupt logs

TEST_F(StoreTest, TornTailCutAtEveryByteOfTheLastRecordRecoversTheRest) {
  {
    auto store = Open();
    ASSERT_NE(store, nullptr);
    for (int i = 1; i <= 4; ++i) store->Append(std::string(static_cast<size_t>(10 * i), static_cast<char>('a' + i)));
    ASSERT_TRUE(store->WaitDurable(store->Append(std::string(40, 'z'))).ok());
  }
  const std::string whole = ReadBinary(dir_ + "/" + SegmentName(1));
  const size_t last_start = whole.size() - (24 + 40);
  for (size_t cut = last_start; cut < whole.size(); ++cut) {
    SCOPED_TRACE(fmt::format("cut at byte {}", cut));
    testing::TempDir tmp;
    const std::string dir = tmp.path() + "/data";
    fs::create_directories(dir);
    const std::string segment = dir + "/" + SegmentName(1);
    WriteBinary(segment, whole.substr(0, cut));
    {
      auto store = OpenAt(dir);
      ASSERT_NE(store, nullptr);
      auto r = store->Recover();
      ASSERT_TRUE(r.ok()) << r.status().ToString();
      ASSERT_EQ(Sequences(*r), Range(1, 4));
      EXPECT_EQ(r->records[3].second, std::string(40, 'e'));
      if (cut == last_start) {
        EXPECT_TRUE(r->warnings.empty()) << JoinWarnings(*r);  // ends cleanly between records
      } else {
        ASSERT_EQ(r->warnings.size(), 1u) << JoinWarnings(*r);
        const std::string& w = r->warnings[0];
        EXPECT_TRUE(Contains(w, segment));
        EXPECT_TRUE(Contains(w, fmt::format("at offset {};", last_start)));
        EXPECT_TRUE(Contains(w, fmt::format("dropped the {} bytes", cut - last_start)));
        EXPECT_TRUE(Contains(w, "the last good record is sequence 4"));
        EXPECT_TRUE(Contains(w, "incomplete record"));
      }
      EXPECT_EQ(fs::file_size(segment), last_start);  // truncated there
      EXPECT_EQ(store->Append("after the tear"), 5u);
      ASSERT_TRUE(store->WaitDurable(5).ok());
    }
    auto store = OpenAt(dir);
    ASSERT_NE(store, nullptr);
    auto r = store->Recover();
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_TRUE(r->warnings.empty()) << JoinWarnings(*r);
    ASSERT_EQ(Sequences(*r), Range(1, 5));
    EXPECT_EQ(r->records[4].second, "after the tear");
  }
}

TEST_F(StoreTest, FlippedByteInTheMiddleRecordStopsRecoveryThere) {
  {
    auto store = Open();
    ASSERT_NE(store, nullptr);
    for (int i = 0; i < 3; ++i) store->Append(std::string(100, static_cast<char>('a' + i)));
    ASSERT_TRUE(store->WaitDurable(3).ok());
  }
  const std::string segment = dir_ + "/" + SegmentName(1);
  const size_t second = 24 + 100;  // where record 2 starts
  FlipByte(segment, second + 24 + 50);
  {
    auto store = Open();
    ASSERT_NE(store, nullptr);
    auto r = store->Recover();
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(Sequences(*r), Range(1, 1));
    ASSERT_EQ(r->warnings.size(), 1u) << JoinWarnings(*r);
    EXPECT_TRUE(Contains(r->warnings[0], segment));
    EXPECT_TRUE(Contains(r->warnings[0], fmt::format("checksum mismatch")));
    EXPECT_TRUE(Contains(r->warnings[0], fmt::format("at offset {};", second)));
    EXPECT_TRUE(Contains(r->warnings[0], fmt::format("dropped the {} bytes", 2 * (24 + 100))));
    EXPECT_TRUE(Contains(r->warnings[0], "the last good record is sequence 1"));
    EXPECT_EQ(fs::file_size(segment), second);
    EXPECT_EQ(store->Append("two again"), 2u);
    ASSERT_TRUE(store->WaitDurable(2).ok());
  }
  auto store = Open();
  ASSERT_NE(store, nullptr);
  auto r = store->Recover();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(Sequences(*r), Range(1, 2));
  EXPECT_EQ(r->records[1].second, "two again");
}

TEST_F(StoreTest, ZeroFilledTailIsDroppedAsBadMagic) {
  {
    auto store = Open();
    ASSERT_NE(store, nullptr);
    ASSERT_TRUE(store->WaitDurable(store->Append("one")).ok());
  }
  const std::string segment = dir_ + "/" + SegmentName(1);
  WriteBinary(segment, ReadBinary(segment) + std::string(4096, '\0'));  // as after a crash with preallocated blocks
  auto store = Open();
  ASSERT_NE(store, nullptr);
  auto r = store->Recover();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(Sequences(*r), Range(1, 1));
  ASSERT_EQ(r->warnings.size(), 1u);
  EXPECT_TRUE(Contains(r->warnings[0], "bad magic 0x00000000 at offset 27"));
  EXPECT_TRUE(Contains(r->warnings[0], "dropped the 4096 bytes"));
}

TEST_F(StoreTest, RecordOutOfSequenceStopsRecovery) {
  // Two stores' logs spliced together: the second one's record 1 follows record 2.
  {
    auto store = Open();
    ASSERT_NE(store, nullptr);
    store->Append("one");
    ASSERT_TRUE(store->WaitDurable(store->Append("two")).ok());
  }
  const std::string segment = dir_ + "/" + SegmentName(1);
  const std::string log = ReadBinary(segment);
  WriteBinary(segment, log + log.substr(0, 27));
  auto store = Open();
  ASSERT_NE(store, nullptr);
  auto r = store->Recover();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(Sequences(*r), Range(1, 2));
  ASSERT_EQ(r->warnings.size(), 1u);
  EXPECT_TRUE(Contains(r->warnings[0], "sequence 1 where 3 was expected at offset 54"));
  EXPECT_EQ(store->Append("three"), 3u);
}

TEST_F(StoreTest, UnknownFormatVersionIsAnErrorNotGarbage) {
  {
    auto store = Open();
    ASSERT_NE(store, nullptr);
    store->Append("one");
    ASSERT_TRUE(store->WaitDurable(1).ok());
    ASSERT_TRUE(store->WriteSnapshot(1, "state").ok());
  }
  const std::string segment = dir_ + "/" + SegmentName(1);
  const std::string snapshot = dir_ + "/" + SnapshotName(1);
  const std::string log = ReadBinary(segment);
  std::string newer = log;
  newer[4] = 2;  // the version field of record 1
  WriteBinary(segment, newer);
  auto opened = FileStore::Open(dir_);
  ASSERT_FALSE(opened.ok());
  EXPECT_EQ(opened.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(opened.status().message(), segment + " offset 0: record format version 2 is not supported"));
  EXPECT_EQ(ReadBinary(segment), newer);  // left alone

  WriteBinary(segment, log);
  FlipByte(snapshot, 4);  // the snapshot's version field
  opened = FileStore::Open(dir_);
  ASSERT_FALSE(opened.ok());
  EXPECT_EQ(opened.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(opened.status().message(), snapshot + ": snapshot format version"));
}

// ---------------------------------------------------------------------------
// Snapshots and segments

TEST_F(StoreTest, SnapshotPlusLaterRecords) {
  {
    auto store = Open();
    ASSERT_NE(store, nullptr);
    for (int i = 1; i <= 5; ++i) store->Append(fmt::format("r{}", i));
    // Not waited for: WriteSnapshot waits for the records it covers itself.
    ASSERT_TRUE(store->WriteSnapshot(3, "state@3").ok());
    EXPECT_GE(store->durable_sequence(), 3u);
    store->Append("r6");
    store->Append("r7");
  }
  EXPECT_EQ(Names(dir_, ".tsnap"), std::vector<std::string>{SnapshotName(3)});
  EXPECT_TRUE(Names(dir_, ".tmp").empty());
  auto store = Open();
  ASSERT_NE(store, nullptr);
  auto r = store->Recover();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->snapshot_sequence, 3u);
  EXPECT_EQ(r->snapshot, "state@3");
  EXPECT_EQ(Sequences(*r), Range(4, 7));
  EXPECT_EQ(r->records[0].second, "r4");
  EXPECT_TRUE(r->warnings.empty()) << JoinWarnings(*r);
}

FileStoreOptions SmallSegments(int retained = 2) {
  FileStoreOptions options;
  options.segment_bytes = 256;  // three 100-byte records (124 bytes each on disk) per segment
  options.retained_snapshots = retained;
  return options;
}

void AppendNumbered(Store& store, int first, int last) {
  for (int i = first; i <= last; ++i) {
    std::string payload = fmt::format("record {}", i);
    payload.resize(100, '.');
    ASSERT_EQ(store.Append(std::move(payload)), static_cast<uint64_t>(i));
  }
  ASSERT_TRUE(store.WaitDurable(static_cast<uint64_t>(last)).ok());
}

TEST_F(StoreTest, SegmentsRollOverAndSnapshotsDeleteTheCoveredOnes) {
  {
    auto store = Open(SmallSegments());
    ASSERT_NE(store, nullptr);
    ASSERT_TRUE(store->Recover().ok());
    AppendNumbered(*store, 1, 10);  // in one batch or several: segments roll between records either way
    AppendNumbered(*store, 11, 20);
    EXPECT_EQ(Names(dir_, ".tlog"),
              (std::vector<std::string>{SegmentName(1), SegmentName(4), SegmentName(7), SegmentName(10),
                                        SegmentName(13), SegmentName(16), SegmentName(19)}));
  }
  {
    auto store = Open(SmallSegments());
    ASSERT_NE(store, nullptr);
    auto r = store->Recover();
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(Sequences(*r), Range(1, 20));
    EXPECT_TRUE(r->warnings.empty()) << JoinWarnings(*r);
    // Segments whose records all precede the snapshot go: log-13 holds 13..15, so it stays.
    ASSERT_TRUE(store->WriteSnapshot(14, "state@14").ok());
    EXPECT_EQ(Names(dir_, ".tlog"), (std::vector<std::string>{SegmentName(13), SegmentName(16), SegmentName(19)}));
    AppendNumbered(*store, 21, 22);
  }
  auto store = Open(SmallSegments());
  ASSERT_NE(store, nullptr);
  auto r = store->Recover();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->snapshot_sequence, 14u);
  EXPECT_EQ(Sequences(*r), Range(15, 22));
  EXPECT_TRUE(r->warnings.empty()) << JoinWarnings(*r);
  EXPECT_EQ(store->Append("next"), 23u);
}

TEST_F(StoreTest, OnlyTheRetainedNumberOfSnapshotsIsKept) {
  auto store = Open(SmallSegments(/*retained=*/2));
  ASSERT_NE(store, nullptr);
  AppendNumbered(*store, 1, 12);
  ASSERT_TRUE(store->WriteSnapshot(4, "s4").ok());
  ASSERT_TRUE(store->WriteSnapshot(8, "s8").ok());
  // The log stays complete from the older kept snapshot (4) on: log-4 holds 4..6.
  EXPECT_EQ(Names(dir_, ".tlog"), (std::vector<std::string>{SegmentName(4), SegmentName(7), SegmentName(10)}));
  ASSERT_TRUE(store->WriteSnapshot(11, "s11").ok());
  EXPECT_EQ(Names(dir_, ".tsnap"), (std::vector<std::string>{SnapshotName(8), SnapshotName(11)}));
  EXPECT_EQ(Names(dir_, ".tlog"), (std::vector<std::string>{SegmentName(7), SegmentName(10)}));
  ASSERT_TRUE(store->WriteSnapshot(11, "s11 again").ok());  // the same sequence again replaces it
  EXPECT_EQ(Names(dir_, ".tsnap"), (std::vector<std::string>{SnapshotName(8), SnapshotName(11)}));
}

TEST_F(StoreTest, CorruptNewestSnapshotFallsBackToThePreviousOne) {
  {
    auto store = Open(SmallSegments());
    ASSERT_NE(store, nullptr);
    AppendNumbered(*store, 1, 10);
    ASSERT_TRUE(store->WriteSnapshot(5, "state@5").ok());
    AppendNumbered(*store, 11, 20);
    ASSERT_TRUE(store->WriteSnapshot(15, "state@15").ok());
  }
  const std::string newest = dir_ + "/" + SnapshotName(15);
  FlipByte(newest, 30);
  {
    auto store = Open(SmallSegments());
    ASSERT_NE(store, nullptr);
    auto r = store->Recover();
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->snapshot_sequence, 5u);
    EXPECT_EQ(r->snapshot, "state@5");
    EXPECT_EQ(Sequences(*r), Range(6, 20));  // nothing lost: the log was kept from 5 on
    ASSERT_EQ(r->warnings.size(), 1u) << JoinWarnings(*r);
    EXPECT_TRUE(Contains(r->warnings[0], newest + " is corrupt: checksum mismatch"));
    EXPECT_TRUE(Contains(r->warnings[0], "recovered from an older snapshot"));
    EXPECT_FALSE(fs::exists(newest));
    EXPECT_TRUE(fs::exists(newest + ".corrupt"));  // set aside for inspection, ignored from now on
    EXPECT_EQ(store->Append("next"), 21u);
    ASSERT_TRUE(store->WaitDurable(21).ok());
  }
  auto store = Open(SmallSegments());
  ASSERT_NE(store, nullptr);
  auto r = store->Recover();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->warnings.empty()) << JoinWarnings(*r);
  EXPECT_EQ(Sequences(*r), Range(6, 21));
}

TEST_F(StoreTest, CorruptOnlySnapshotRecoversFromACompleteLog) {
  {
    auto store = Open();
    ASSERT_NE(store, nullptr);
    AppendNumbered(*store, 1, 6);
    ASSERT_TRUE(store->WriteSnapshot(4, "state@4").ok());  // one segment: nothing is deleted
  }
  FlipByte(dir_ + "/" + SnapshotName(4), 10);  // inside the header's sequence field
  auto store = Open();
  ASSERT_NE(store, nullptr);
  auto r = store->Recover();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->snapshot_sequence, 0u);
  EXPECT_EQ(Sequences(*r), Range(1, 6));
  ASSERT_EQ(r->warnings.size(), 1u);
  EXPECT_TRUE(Contains(r->warnings[0], "recovered from the log alone"));
}

TEST_F(StoreTest, CorruptSnapshotWithoutTheLogItCoveredIsReportedAsDataLoss) {
  {
    auto store = Open(SmallSegments(/*retained=*/1));
    ASSERT_NE(store, nullptr);
    AppendNumbered(*store, 1, 20);
    ASSERT_TRUE(store->WriteSnapshot(15, "state@15").ok());
    EXPECT_EQ(Names(dir_, ".tlog"), (std::vector<std::string>{SegmentName(16), SegmentName(19)}));
  }
  const std::string snapshot = dir_ + "/" + SnapshotName(15);
  FlipByte(snapshot, 30);
  auto opened = FileStore::Open(dir_, SmallSegments(1));
  ASSERT_FALSE(opened.ok());
  EXPECT_EQ(opened.status().code(), StatusCode::kDataLoss);
  EXPECT_TRUE(Contains(opened.status().message(), "records 1 to 15 are missing: there is no valid snapshot"));
  EXPECT_TRUE(Contains(opened.status().message(), snapshot + " is corrupt"));
  EXPECT_TRUE(fs::exists(snapshot));  // nothing renamed or deleted on the way out
  EXPECT_EQ(Names(dir_, ".tlog").size(), 2u);
}

TEST_F(StoreTest, MissingMiddleSegmentEndsTheLogBeforeIt) {
  {
    auto store = Open(SmallSegments());
    ASSERT_NE(store, nullptr);
    AppendNumbered(*store, 1, 12);
  }
  fs::remove(dir_ + "/" + SegmentName(7));
  auto store = Open(SmallSegments());
  ASSERT_NE(store, nullptr);
  auto r = store->Recover();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(Sequences(*r), Range(1, 6));
  ASSERT_EQ(r->warnings.size(), 1u);
  EXPECT_TRUE(Contains(r->warnings[0], SegmentName(10) + " starts at sequence 10, but the log before it ends at "
                                                         "sequence 6"));
  EXPECT_EQ(Names(dir_, ".tlog"), (std::vector<std::string>{SegmentName(1), SegmentName(4)}));
  EXPECT_EQ(store->Append("seven"), 7u);
  ASSERT_TRUE(store->WaitDurable(7).ok());
}

TEST_F(StoreTest, SnapshotsWhileAppendingLoseNothing) {
  constexpr int kThreads = 4, kPerThread = 300;
  FileStoreOptions options = SmallSegments();
  options.segment_bytes = 2048;
  uint64_t last_snapshot = 0;
  {
    auto store = Open(options);
    ASSERT_NE(store, nullptr);
    std::atomic<int> running{kThreads};
    std::vector<std::thread> appenders;
    for (int t = 0; t < kThreads; ++t) {
      appenders.emplace_back([&, t] {
        for (int i = 0; i < kPerThread; ++i)
          EXPECT_TRUE(store->WaitDurable(store->Append(fmt::format("{}:{}", t, i))).ok());
        --running;
      });
    }
    while (running > 0) {
      const uint64_t durable = store->durable_sequence();
      if (durable > last_snapshot) {
        ASSERT_TRUE(store->WriteSnapshot(durable, fmt::format("state@{}", durable)).ok());
        last_snapshot = durable;
      }
    }
    for (auto& a : appenders) a.join();
  }
  auto store = Open(options);
  ASSERT_NE(store, nullptr);
  auto r = store->Recover();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->warnings.empty()) << JoinWarnings(*r);
  EXPECT_EQ(r->snapshot_sequence, last_snapshot);
  EXPECT_EQ(r->snapshot, fmt::format("state@{}", last_snapshot));
  EXPECT_EQ(Sequences(*r), Range(last_snapshot + 1, kThreads * kPerThread));
}

// ---------------------------------------------------------------------------
// The directory, limits and failures

TEST_F(StoreTest, DataDirIsLockedAgainstASecondUser) {
  auto first = Open();
  ASSERT_NE(first, nullptr);
  auto second = FileStore::Open(dir_);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(second.status().message(), fmt::format("data dir {} is in use by another process", dir_)));
  EXPECT_TRUE(Contains(second.status().message(), fmt::format("(pid {})", getpid())));
  // Another process sees the lock too (flock(1) -n fails at once on a held lock).
  auto held = testing::RunCommand({"/usr/bin/flock", "-n", dir_ + "/LOCK", "true"});
  EXPECT_TRUE(held.exit.exited && held.exit.code == 1) << held.exit.ToString() << " " << held.output;

  first.reset();
  auto free = testing::RunCommand({"/usr/bin/flock", "-n", dir_ + "/LOCK", "true"});
  EXPECT_TRUE(free.exit.success()) << free.exit.ToString() << " " << free.output;
  auto again = FileStore::Open(dir_);
  EXPECT_TRUE(again.ok()) << again.status().ToString();
}

TEST_F(StoreTest, DataDirThatCannotBeCreatedIsNamed) {
  const std::string file = tmp_.File("plain-file", "x");
  auto opened = FileStore::Open(file + "/data");
  ASSERT_FALSE(opened.ok());
  EXPECT_EQ(opened.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(Contains(opened.status().message(), "cannot create data dir " + file + "/data"));

  opened = FileStore::Open(file);
  ASSERT_FALSE(opened.ok());
  EXPECT_TRUE(Contains(opened.status().message(), file));

  FileStoreOptions bad;
  bad.segment_bytes = 0;
  EXPECT_EQ(FileStore::Open(dir_, bad).status().code(), StatusCode::kInvalidArgument);
}

TEST_F(StoreTest, OversizedRecordFailsItsWaitAndNothingElse) {
  FileStoreOptions options;
  options.max_record_bytes = 1000;
  auto check = [](Store& store) {
    EXPECT_EQ(store.Append("small"), 1u);
    EXPECT_EQ(store.Append(std::string(1001, 'x')), 2u);
    EXPECT_EQ(store.Append("small again"), 3u);
    const Status refused = store.WaitDurable(2);
    EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(Contains(refused.message(), "record 2 has 1001 bytes, more than the store's limit of 1000 bytes"));
    EXPECT_TRUE(store.WaitDurable(3).ok());
    EXPECT_TRUE(store.WaitDurable(1).ok());
    EXPECT_EQ(store.durable_sequence(), 3u);
  };
  {
    auto store = Open(options);
    ASSERT_NE(store, nullptr);
    check(*store);
  }
  auto store = Open(options);
  ASSERT_NE(store, nullptr);
  auto r = store->Recover();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->warnings.empty()) << JoinWarnings(*r);
  EXPECT_EQ(Sequences(*r), (std::vector<uint64_t>{1, 3}));  // 2's sequence is kept, its payload never was
  EXPECT_EQ(store->Append("four"), 4u);

  auto backing = std::make_shared<MemoryStoreBacking>();
  {
    MemoryStore memory(backing, 1000);
    check(memory);
  }
  MemoryStore memory(backing, 1000);
  auto m = memory.Recover();
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(Sequences(*m), (std::vector<uint64_t>{1, 3}));
  EXPECT_EQ(memory.Append("four"), 4u);
}

TEST_F(StoreTest, WriteFailureFailsWaitersAndEveryLaterCall) {
  auto full = std::make_shared<std::atomic<bool>>(false);
  FileStoreOptions options;
  options.write_error_for_testing = [full] { return full->load() ? ENOSPC : 0; };
  {
    auto store = Open(options);
    ASSERT_NE(store, nullptr);
    ASSERT_TRUE(store->WaitDurable(store->Append("one")).ok());
    full->store(true);
    const Status failed = store->WaitDurable(store->Append("two"));
    EXPECT_EQ(failed.code(), StatusCode::kResourceExhausted);
    EXPECT_TRUE(Contains(failed.message(), "cannot write records 2 to 2 to " + dir_ + "/" + SegmentName(1)));
    EXPECT_TRUE(Contains(failed.message(), "No space left on device"));
    full->store(false);  // the disk has room again: the store stays failed all the same
    EXPECT_EQ(store->WaitDurable(store->Append("three")), failed);
    EXPECT_EQ(store->WriteSnapshot(1, "state"), failed);
    EXPECT_TRUE(store->WaitDurable(1).ok());  // what was durable stays durable
    EXPECT_EQ(store->durable_sequence(), 1u);
  }
  auto store = Open();
  ASSERT_NE(store, nullptr);
  auto r = store->Recover();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(Sequences(*r), Range(1, 1));
  EXPECT_EQ(store->Append("two"), 2u);
}

TEST(MemoryStoreTest, InjectedFailureFailsLaterCalls) {
  MemoryStore store;
  ASSERT_TRUE(store.WaitDurable(store.Append("one")).ok());
  store.InjectFailure(ResourceExhausted("disk full"));
  const uint64_t two = store.Append("two");
  EXPECT_EQ(store.WaitDurable(two), ResourceExhausted("disk full"));
  EXPECT_EQ(store.WriteSnapshot(1, "s"), ResourceExhausted("disk full"));
  EXPECT_TRUE(store.WaitDurable(1).ok());
  EXPECT_EQ(store.durable_sequence(), 1u);
  MemoryStore restarted(store.backing());
  auto r = restarted.Recover();
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(Sequences(*r), Range(1, 1));
}

}  // namespace
}  // namespace tandem::coordinator
