// The coordinator's durable store: all its state (jobs, members, epochs, the
// shard map, step counters) kept as a log of records plus snapshots, so that
// after kill -9 and a restart it recovers exactly what it had acknowledged.
//
// The store deals in opaque byte payloads (the coordinator serialises
// protobufs into them) and knows nothing of their content. Each record gets a
// sequence number: 1, 2, 3 …, strictly increasing, also across restarts. A
// snapshot is the whole state as of one sequence; recovery returns the newest
// good snapshot and every record after it.
//
// Two implementations:
//   FileStore    the real one: a directory (--data-dir) of log segments and
//                snapshots, checksummed, fsync'd, with group commit.
//   MemoryStore  for tests: the same semantics, nothing on disk.
// An etcd-backed store can be added behind the same interface.
//
// On-disk format of FileStore (all integers little-endian):
//   log-<first sequence, 20 digits>.tlog   records, back to back, each:
//       u32 magic "TLOG" | u16 format version (1) | u16 flags | u32 payload length |
//       u64 sequence | u32 CRC-32C of the 20 bytes before it and of the payload | payload
//     A record with flag 1 ("void") has no payload: it keeps the sequence of
//     an Append that was refused (too large), so the sequences in the log stay
//     contiguous; recovery does not return it.
//   snapshot-<sequence, 20 digits>.tsnap   one snapshot:
//       u32 magic "TSNP" | u16 format version (1) | u16 flags (0) | u64 sequence |
//       u64 payload length | u32 CRC-32C of the 24 bytes before it and of the payload | payload
//   LOCK   held with flock() by the process using the directory; holds its PID.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "common/thread_annotations.h"

namespace tandem::coordinator {

// What a store holds after a restart.
struct Recovery {
  uint64_t snapshot_sequence = 0;  // 0: no snapshot
  std::string snapshot;            // payload of the newest valid snapshot
  // (sequence, payload) of every record after the snapshot, in order. The
  // sequence of an Append that was refused (too large) is absent.
  std::vector<std::pair<uint64_t, std::string>> records;
  // What recovery repaired or skipped, one sentence each: a torn tail dropped,
  // a corrupt snapshot set aside. Worth logging; none of them is fatal.
  std::vector<std::string> warnings;
};

// The interface. Thread safety: Append, WaitDurable and durable_sequence are
// thread-safe; Recover and WriteSnapshot must be called by one thread at a
// time (they may run concurrently with the thread-safe calls).
class Store {
 public:
  virtual ~Store() = default;

  // Reads the newest valid snapshot and every valid record after it. Call
  // once, before Append; a second call fails with FAILED_PRECONDITION.
  virtual Result<Recovery> Recover() = 0;

  // Queues a record and returns its sequence number (strictly increasing, also
  // across restarts: continues after the recovered ones). Never blocks on
  // I/O. A payload over the store's record limit still gets a sequence, but
  // WaitDurable of that sequence fails with INVALID_ARGUMENT and the payload is
  // never stored.
  virtual uint64_t Append(std::string payload) = 0;

  // Blocks until every record up to `sequence` is durable (written and
  // fsync'd); OK at once if it already is. Fails with the store's error if the
  // store failed before that (a full disk, an I/O error): after a failure,
  // every record not yet durable fails, and so does every later Append and
  // WriteSnapshot; records durable before the failure stay OK.
  // INVALID_ARGUMENT if `sequence` itself was refused by Append or was never
  // appended. A refused record does not make later sequences fail.
  virtual Status WaitDurable(uint64_t sequence) = 0;

  // The highest sequence up to which everything is durable.
  virtual uint64_t durable_sequence() const = 0;

  // Durably stores a snapshot of the whole state as of record `sequence`
  // (REQUIRES: 0 < sequence <= the last appended, and not below an earlier
  // snapshot's sequence; INVALID_ARGUMENT otherwise), after waiting until the
  // records up to `sequence` are durable, then drops the log records that are
  // no longer needed (FileStore: see retained_snapshots). Once this returns
  // OK, recovery starts from this snapshot. Writing the same sequence again
  // replaces that snapshot.
  virtual Status WriteSnapshot(uint64_t sequence, std::string payload) = 0;
};

struct FileStoreOptions {
  // Start a new log segment once the current one has this many bytes.
  uint64_t segment_bytes = uint64_t{64} << 20;
  // The largest payload Append accepts (at most 4 GiB - 1, the format's limit).
  uint64_t max_record_bytes = uint64_t{64} << 20;
  // How many snapshots to keep (at least 1). Log segments are deleted once
  // the OLDEST kept snapshot covers them, so that when the newest snapshot
  // turns out corrupt, recovery falls back to an older one and replays the
  // log from there without losing anything. With 1, WriteSnapshot deletes the
  // segments the new snapshot covers at once (and a corrupt snapshot then
  // leaves a gap that recovery reports as DATA_LOSS).
  int retained_snapshots = 2;
  // Test seam: when set, called before every write of a batch; a non-zero
  // return fails that write with this errno (e.g. ENOSPC for a full disk).
  std::function<int()> write_error_for_testing;
};

// Counters of the writer thread, for metrics and the group-commit test.
struct FileStoreStats {
  uint64_t records = 0;  // records written (void ones included)
  uint64_t bytes = 0;    // log bytes written, headers included
  uint64_t batches = 0;  // group commits: one write and one fdatasync of everything queued
  uint64_t syncs = 0;    // fdatasync/fsync calls on log segments (a batch that crosses segments makes more than one)
};

// The store in a directory. Open takes an exclusive lock on the directory,
// reads the newest valid snapshot and the log after it, and repairs the log:
// a torn or corrupt tail is truncated at the last good record and later
// segments are deleted, so new appends continue right after it. Recover hands
// over what Open read.
//
// Group commit: Append only queues the record under a mutex and wakes the
// writer thread; the writer takes everything queued, writes it with writev,
// calls fdatasync once, then publishes durable_sequence and wakes the waiters.
//
// Thread safety: as Store says. The destructor writes and syncs what is
// queued, joins the writer and releases the lock; no call may be in progress.
class FileStore final : public Store {
 public:
  // Creates `dir` if missing. FAILED_PRECONDITION "data dir X is in use by
  // another process" if another FileStore (in any process) has it open.
  static Result<std::unique_ptr<FileStore>> Open(const std::string& dir, FileStoreOptions options = {});
  ~FileStore() override;
  FileStore(const FileStore&) = delete;
  FileStore& operator=(const FileStore&) = delete;

  Result<Recovery> Recover() override;
  uint64_t Append(std::string payload) override;
  Status WaitDurable(uint64_t sequence) override;
  uint64_t durable_sequence() const override;
  Status WriteSnapshot(uint64_t sequence, std::string payload) override;

  const std::string& dir() const { return dir_; }
  FileStoreStats stats() const;

 private:
  struct Pending {
    uint64_t sequence;
    std::string payload;
    bool is_void;  // refused by Append: written as a void record
  };
  struct Segment {
    uint64_t first;  // sequence of its first record (from the file name)
    std::string path;
  };

  FileStore(std::string dir, FileStoreOptions options, int lock_fd);
  Status Load();  // Open's reading and repair; fills recovery_ and the writer's state
  void WriterLoop();
  Status WriteBatch(std::vector<Pending>& batch, FileStoreStats* delta);
  Status RollSegment(uint64_t first);
  Status SyncActive(FileStoreStats* delta);
  Status WaitDurableUpTo(uint64_t sequence, bool check_refused);
  std::string SegmentPath(uint64_t first) const;
  std::string SnapshotPath(uint64_t sequence) const;

  const std::string dir_;
  const FileStoreOptions options_;
  int lock_fd_ = -1;

  // Set by Open, taken by Recover.
  std::unique_ptr<Recovery> recovery_;
  bool recovered_ = false;

  mutable Mutex mu_;
  CondVar writer_cv_;   // wakes the writer: something queued, or stop
  CondVar durable_cv_;  // wakes WaitDurable: durable_ moved or the store failed
  std::vector<Pending> queue_ TANDEM_GUARDED_BY(mu_);
  uint64_t next_sequence_ TANDEM_GUARDED_BY(mu_) = 1;
  std::atomic<uint64_t> durable_{0};  // written under mu_
  Status failure_ TANDEM_GUARDED_BY(mu_);
  std::map<uint64_t, Status> refused_ TANDEM_GUARDED_BY(mu_);  // sequences Append refused, and why
  bool stop_ TANDEM_GUARDED_BY(mu_) = false;
  // Log segments in order; the last one is the writer's. The writer adds,
  // WriteSnapshot removes (never the last).
  std::vector<Segment> segments_ TANDEM_GUARDED_BY(mu_);
  FileStoreStats stats_ TANDEM_GUARDED_BY(mu_);

  // The writer thread's own state (set up by Open before the thread starts).
  int active_fd_ = -1;         // the segment being appended to; -1: none yet
  std::string active_path_;    //
  uint64_t active_next_ = 0;   // the sequence its next record must have
  uint64_t active_bytes_ = 0;  // its size
  std::thread writer_;

  // WriteSnapshot's state. One caller at a time is the contract; the mutex
  // only makes a violation harmless.
  Mutex snapshot_mu_;
  std::vector<uint64_t> snapshots_ TANDEM_GUARDED_BY(snapshot_mu_);  // sequences of the snapshots kept, ascending
};

// The durable contents of MemoryStores: share one between a MemoryStore and
// the next one made from it to simulate a restart. Thread safety: opaque;
// used only through MemoryStore, which locks it.
class MemoryStoreBacking {
 public:
  MemoryStoreBacking() = default;
  MemoryStoreBacking(const MemoryStoreBacking&) = delete;
  MemoryStoreBacking& operator=(const MemoryStoreBacking&) = delete;

 private:
  friend class MemoryStore;
  Mutex mu_;
  uint64_t last_sequence_ TANDEM_GUARDED_BY(mu_) = 0;
  uint64_t snapshot_sequence_ TANDEM_GUARDED_BY(mu_) = 0;
  std::string snapshot_ TANDEM_GUARDED_BY(mu_);
  // Records after the snapshot; nullopt payload: a refused Append's sequence.
  std::vector<std::pair<uint64_t, std::optional<std::string>>> records_ TANDEM_GUARDED_BY(mu_);
};

// A store with FileStore's semantics that keeps everything in memory: every
// Append is durable at once. Make it from the backing of an earlier one to
// simulate a restart (its Recover returns what the earlier one stored).
//
// Thread safety: as Store says.
class MemoryStore final : public Store {
 public:
  explicit MemoryStore(std::shared_ptr<MemoryStoreBacking> backing = std::make_shared<MemoryStoreBacking>(),
                       uint64_t max_record_bytes = uint64_t{64} << 20);

  Result<Recovery> Recover() override;
  uint64_t Append(std::string payload) override;
  Status WaitDurable(uint64_t sequence) override;
  uint64_t durable_sequence() const override;
  Status WriteSnapshot(uint64_t sequence, std::string payload) override;

  const std::shared_ptr<MemoryStoreBacking>& backing() const { return backing_; }
  // Makes the store fail as a full disk would: from now on every record not
  // yet durable (none) and every later Append fails with `status`.
  void InjectFailure(Status status);

 private:
  const std::shared_ptr<MemoryStoreBacking> backing_;
  const uint64_t max_record_bytes_;
  std::atomic<bool> recovered_{false};
  std::atomic<uint64_t> durable_{0};
  Status failure_ TANDEM_GUARDED_BY(backing_->mu_);
  std::map<uint64_t, Status> refused_ TANDEM_GUARDED_BY(backing_->mu_);  // sequences Append refused, and why
};

}  // namespace tandem::coordinator
