#include "coordinator/store.h"

#include <fcntl.h>
#include <limits.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <string_view>

#include "common/crc32c.h"

namespace tandem::coordinator {
namespace {

constexpr uint16_t kFormatVersion = 1;

// Log records: magic, version, flags, payload length, sequence, CRC.
constexpr uint32_t kRecordMagic = 0x474F4C54u;  // "TLOG" in file order
constexpr size_t kRecordHeaderBytes = 24;
constexpr size_t kRecordCrcOffset = 20;
constexpr uint16_t kRecordFlagVoid = 1;  // the sequence of a refused Append; no payload

// Snapshots: magic, version, flags, sequence, payload length, CRC.
constexpr uint32_t kSnapshotMagic = 0x504E5354u;  // "TSNP" in file order
constexpr size_t kSnapshotHeaderBytes = 28;
constexpr size_t kSnapshotCrcOffset = 24;

constexpr std::string_view kLogPrefix = "log-";
constexpr std::string_view kLogSuffix = ".tlog";
constexpr std::string_view kSnapshotPrefix = "snapshot-";
constexpr std::string_view kSnapshotSuffix = ".tsnap";
constexpr std::string_view kTempSuffix = ".tmp";
constexpr std::string_view kCorruptSuffix = ".corrupt";

void Put16(unsigned char* p, uint16_t v) {
  p[0] = static_cast<unsigned char>(v);
  p[1] = static_cast<unsigned char>(v >> 8);
}
void Put32(unsigned char* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
void Put64(unsigned char* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
uint16_t Get16(const unsigned char* p) {
  return static_cast<uint16_t>(p[0] | p[1] << 8);
}
uint32_t Get32(const unsigned char* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = v << 8 | p[i];
  return v;
}
uint64_t Get64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = v << 8 | p[i];
  return v;
}
const unsigned char* Bytes(const std::string& s, size_t offset = 0) {
  return reinterpret_cast<const unsigned char*>(s.data()) + offset;
}

// A failed system call as a Status: a full disk is RESOURCE_EXHAUSTED, the rest INTERNAL.
Status IoError(int err, std::string_view what) {
  const bool full = err == ENOSPC || err == EDQUOT || err == EFBIG;
  return Status(full ? StatusCode::kResourceExhausted : StatusCode::kInternal,
                fmt::format("{}: {}", what, std::strerror(err)));
}

Status TooLarge(uint64_t sequence, size_t size, uint64_t limit) {
  return InvalidArgument("record {} has {} bytes, more than the store's limit of {} bytes (max_record_bytes)", sequence,
                         size, limit);
}

std::string Basename(const std::string& path) {
  return std::filesystem::path(path).filename().string();
}

// "log-00000000000000000042.tlog" -> 42.
bool ParseName(std::string_view name, std::string_view prefix, std::string_view suffix, uint64_t* sequence) {
  if (name.size() <= prefix.size() + suffix.size() || !name.starts_with(prefix) || !name.ends_with(suffix)) {
    return false;
  }
  const std::string_view digits = name.substr(prefix.size(), name.size() - prefix.size() - suffix.size());
  if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) return false;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), *sequence);
  return ec == std::errc() && end == digits.data() + digits.size();
}

Result<std::string> ReadWholeFile(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return IoError(errno, fmt::format("cannot open {}", path));
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return IoError(err, fmt::format("cannot stat {}", path));
  }
  std::string data(static_cast<size_t>(st.st_size), '\0');
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = read(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      close(fd);
      return IoError(err, fmt::format("cannot read {}", path));
    }
    if (n == 0) break;  // shrank meanwhile
    done += static_cast<size_t>(n);
  }
  data.resize(done);
  close(fd);
  return data;
}

Status FsyncDir(const std::string& dir) {
  const int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return IoError(errno, fmt::format("cannot open data dir {} to sync it", dir));
  const int rc = fsync(fd);
  const int err = errno;
  close(fd);
  if (rc != 0) return IoError(err, fmt::format("fsync of data dir {}", dir));
  return Status::Ok();
}

Status Unlink(const std::string& path) {
  if (unlink(path.c_str()) != 0 && errno != ENOENT) return IoError(errno, fmt::format("cannot delete {}", path));
  return Status::Ok();
}

// Writes all of `iov` (any number of entries), continuing after short writes.
int WriteAll(int fd, std::vector<iovec>& iov) {
  size_t i = 0;
  while (i < iov.size()) {
    const int count = static_cast<int>(std::min<size_t>(iov.size() - i, IOV_MAX));
    ssize_t n = writev(fd, &iov[i], count);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return EIO;  // no progress on a regular file: do not spin
    while (n > 0 && i < iov.size()) {
      if (static_cast<size_t>(n) >= iov[i].iov_len) {
        n -= static_cast<ssize_t>(iov[i].iov_len);
        ++i;
      } else {
        iov[i].iov_base = static_cast<char*>(iov[i].iov_base) + n;
        iov[i].iov_len -= static_cast<size_t>(n);
        n = 0;
      }
    }
  }
  return 0;
}

// Reads and checks one snapshot file. DATA_LOSS means the file is corrupt
// (recovery skips it); any other error stops recovery.
Result<std::string> ReadSnapshot(const std::string& path, uint64_t name_sequence) {
  TANDEM_ASSIGN_OR_RETURN(std::string data, ReadWholeFile(path));
  if (data.size() < kSnapshotHeaderBytes) {
    return DataLoss("{} is corrupt: {} bytes, shorter than a snapshot header ({} bytes)", path, data.size(),
                    kSnapshotHeaderBytes);
  }
  const unsigned char* h = Bytes(data);
  if (Get32(h) != kSnapshotMagic) return DataLoss("{} is corrupt: bad magic 0x{:08x}", path, Get32(h));
  if (Get16(h + 4) != kFormatVersion) {
    return FailedPrecondition(
        "{}: snapshot format version {} is not supported (this build reads version {}); was the data dir written "
        "by a newer Tandem?",
        path, Get16(h + 4), kFormatVersion);
  }
  const uint64_t length = Get64(h + 16);
  if (length != data.size() - kSnapshotHeaderBytes) {
    return DataLoss("{} is corrupt: the header says {} payload bytes, the file has {}", path, length,
                    data.size() - kSnapshotHeaderBytes);
  }
  const uint32_t stored = Get32(h + kSnapshotCrcOffset);
  const uint32_t computed = Crc32c(data.data() + kSnapshotHeaderBytes, length, Crc32c(h, kSnapshotCrcOffset));
  if (stored != computed) {
    return DataLoss("{} is corrupt: checksum mismatch (stored 0x{:08x}, computed 0x{:08x})", path, stored, computed);
  }
  if (Get16(h + 6) != 0) {
    return FailedPrecondition("{}: unknown snapshot flags 0x{:04x}; was the data dir written by a newer Tandem?", path,
                              Get16(h + 6));
  }
  if (Get64(h + 8) != name_sequence) {
    return DataLoss("{} is corrupt: its header says sequence {}", path, Get64(h + 8));
  }
  return data.substr(kSnapshotHeaderBytes);
}

}  // namespace

// ---------------------------------------------------------------------------
// FileStore

FileStore::FileStore(std::string dir, FileStoreOptions options, int lock_fd)
    : dir_(std::move(dir)), options_(std::move(options)), lock_fd_(lock_fd) {}

Result<std::unique_ptr<FileStore>> FileStore::Open(const std::string& dir, FileStoreOptions options) {
  if (dir.empty()) return InvalidArgument("the data dir is empty");
  if (options.segment_bytes == 0) return InvalidArgument("segment_bytes must be positive");
  if (options.max_record_bytes == 0 || options.max_record_bytes > UINT32_MAX) {
    return InvalidArgument("max_record_bytes must be between 1 and {}, not {}", UINT32_MAX, options.max_record_bytes);
  }
  if (options.retained_snapshots < 1) {
    return InvalidArgument("retained_snapshots must be at least 1, not {}", options.retained_snapshots);
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return FailedPrecondition("cannot create data dir {}: {}", dir, ec.message());
  if (!std::filesystem::is_directory(dir, ec)) return FailedPrecondition("data dir {} is not a directory", dir);

  const std::string lock_path = dir + "/LOCK";
  const int lock_fd = open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock_fd < 0) {
    return FailedPrecondition("data dir {} is not writable: cannot create {}: {}", dir, lock_path,
                              std::strerror(errno));
  }
  if (flock(lock_fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    std::string owner;
    if (err == EWOULDBLOCK) {
      char buf[32] = {};
      const ssize_t n = pread(lock_fd, buf, sizeof(buf) - 1, 0);
      std::string_view pid(buf, n > 0 ? static_cast<size_t>(n) : 0);
      while (!pid.empty() && (pid.back() == '\n' || pid.back() == ' ')) pid.remove_suffix(1);
      if (!pid.empty()) owner = fmt::format(" (pid {})", pid);
    }
    close(lock_fd);
    if (err == EWOULDBLOCK) return FailedPrecondition("data dir {} is in use by another process{}", dir, owner);
    return FailedPrecondition("cannot lock data dir {} ({}): {}", dir, lock_path, std::strerror(err));
  }
  const std::string pid = fmt::format("{}\n", getpid());
  if (ftruncate(lock_fd, 0) != 0 || pwrite(lock_fd, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    const int err = errno;
    close(lock_fd);
    return FailedPrecondition("data dir {} is not writable: cannot write {}: {}", dir, lock_path, std::strerror(err));
  }

  std::unique_ptr<FileStore> store(new FileStore(dir, std::move(options), lock_fd));
  TANDEM_RETURN_IF_ERROR(store->Load());
  store->writer_ = std::thread([s = store.get()] { s->WriterLoop(); });
  return store;
}

FileStore::~FileStore() {
  if (writer_.joinable()) {
    {
      MutexLock lock(&mu_);
      stop_ = true;
    }
    writer_cv_.NotifyOne();
    writer_.join();
  }
  if (active_fd_ >= 0) close(active_fd_);
  if (lock_fd_ >= 0) close(lock_fd_);  // releases the flock
}

std::string FileStore::SegmentPath(uint64_t first) const {
  return fmt::format("{}/{}{:020}{}", dir_, kLogPrefix, first, kLogSuffix);
}

std::string FileStore::SnapshotPath(uint64_t sequence) const {
  return fmt::format("{}/{}{:020}{}", dir_, kSnapshotPrefix, sequence, kSnapshotSuffix);
}

Status FileStore::Load() {
  // A probe, so that a read-only directory is reported now and by name, not at the first append.
  const std::string probe = dir_ + "/write-probe.tmp";
  const int probe_fd = open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (probe_fd < 0) return FailedPrecondition("data dir {} is not writable: {}", dir_, std::strerror(errno));
  close(probe_fd);

  // What is there. Leftover temporary files (a snapshot being written at a crash) are deleted.
  std::vector<std::pair<uint64_t, std::string>> snapshots;  // (sequence, path)
  std::vector<std::pair<uint64_t, std::string>> logs;       // (first sequence, path)
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir_, ec)) {
    const std::string name = entry.path().filename().string();
    uint64_t sequence = 0;
    if (name.ends_with(kTempSuffix)) {
      TANDEM_RETURN_IF_ERROR(Unlink(entry.path().string()));
    } else if (ParseName(name, kSnapshotPrefix, kSnapshotSuffix, &sequence)) {
      snapshots.emplace_back(sequence, entry.path().string());
    } else if (ParseName(name, kLogPrefix, kLogSuffix, &sequence)) {
      logs.emplace_back(sequence, entry.path().string());
    }
  }
  if (ec) return FailedPrecondition("cannot list data dir {}: {}", dir_, ec.message());
  std::sort(snapshots.begin(), snapshots.end());
  std::sort(logs.begin(), logs.end());

  auto recovery = std::make_unique<Recovery>();
  bool dir_changed = false;

  // The newest snapshot that verifies. Corrupt ones are set aside (renamed),
  // once the log is known to be usable.
  std::vector<std::string> corrupt;
  size_t kept_snapshots = 0;  // snapshots[0, kept_snapshots) stay
  for (size_t i = snapshots.size(); i-- > 0;) {
    auto payload = ReadSnapshot(snapshots[i].second, snapshots[i].first);
    if (payload.ok()) {
      recovery->snapshot_sequence = snapshots[i].first;
      recovery->snapshot = std::move(*payload);
      kept_snapshots = i + 1;
      break;
    }
    if (payload.status().code() != StatusCode::kDataLoss) return payload.status();
    corrupt.push_back(snapshots[i].second);
    recovery->warnings.push_back(fmt::format("{}; renamed it to {}{} and recovered from {}", payload.status().message(),
                                             Basename(snapshots[i].second), kCorruptSuffix,
                                             i > 0 ? "an older snapshot" : "the log alone"));
  }
  const uint64_t snap = recovery->snapshot_sequence;

  // Segments whose records all precede the snapshot need no reading: they
  // are kept while an older snapshot may need them, and deleted with it.
  size_t begin = 0;
  while (begin + 1 < logs.size() && logs[begin + 1].first <= snap + 1) ++begin;
  if (!logs.empty() && logs[begin].first > snap + 1) {
    std::string why;
    for (const auto& w : recovery->warnings) why += "; " + w;
    return DataLoss(
        "data dir {}: records {} to {} are missing: {}, and the oldest log segment {} starts at sequence {}{}", dir_,
        snap + 1, logs[begin].first - 1,
        snap == 0 ? std::string("there is no valid snapshot") : fmt::format("the newest valid snapshot is {}", snap),
        Basename(logs[begin].second), logs[begin].first, why);
  }

  // Read the log from there. The first record that is incomplete or wrong
  // ends it: its file is truncated there and later segments are deleted.
  uint64_t expected = logs.empty() ? snap + 1 : logs[begin].first;
  size_t end = logs.size();  // logs[0, end) stay
  uint64_t last_bytes = 0;   // size of logs[end - 1] once read
  for (size_t k = begin; k < logs.size(); ++k) {
    const std::string& path = logs[k].second;
    if (logs[k].first != expected) {
      recovery->warnings.push_back(
          fmt::format("{} starts at sequence {}, but the log before it ends at sequence {}; the log now ends there",
                      path, logs[k].first, expected - 1));
      end = k;
      break;
    }
    TANDEM_ASSIGN_OR_RETURN(std::string data, ReadWholeFile(path));
    size_t offset = 0;
    std::string problem;
    while (offset < data.size()) {
      const size_t left = data.size() - offset;
      const unsigned char* h = Bytes(data, offset);
      if (left < kRecordHeaderBytes) {
        problem = fmt::format("an incomplete record header ({} of {} bytes)", left, kRecordHeaderBytes);
        break;
      }
      if (Get32(h) != kRecordMagic) {
        problem = fmt::format("bad magic 0x{:08x}", Get32(h));
        break;
      }
      if (Get16(h + 4) != kFormatVersion) {
        return FailedPrecondition(
            "{} offset {}: record format version {} is not supported (this build reads version {}); was the data "
            "dir written by a newer Tandem?",
            path, offset, Get16(h + 4), kFormatVersion);
      }
      const uint32_t length = Get32(h + 8);
      if (left - kRecordHeaderBytes < length) {
        problem = fmt::format("an incomplete record (its header says {} payload bytes, {} are there)", length,
                              left - kRecordHeaderBytes);
        break;
      }
      const uint32_t stored = Get32(h + kRecordCrcOffset);
      const uint32_t computed = Crc32c(h + kRecordHeaderBytes, length, Crc32c(h, kRecordCrcOffset));
      if (stored != computed) {
        problem = fmt::format(
            "a checksum mismatch (stored 0x{:08x}, computed 0x{:08x}) in the record expected to be "
            "sequence {}",
            stored, computed, expected);
        break;
      }
      const uint16_t flags = Get16(h + 6);
      if ((flags & ~kRecordFlagVoid) != 0 || ((flags & kRecordFlagVoid) != 0 && length != 0)) {
        return FailedPrecondition(
            "{} offset {}: record with unknown flags 0x{:04x}; was the data dir written by a newer Tandem?", path,
            offset, flags);
      }
      const uint64_t sequence = Get64(h + 12);
      if (sequence != expected) {
        problem = fmt::format("sequence {} where {} was expected", sequence, expected);
        break;
      }
      if (sequence > snap && (flags & kRecordFlagVoid) == 0) {
        recovery->records.emplace_back(sequence, data.substr(offset + kRecordHeaderBytes, length));
      }
      ++expected;
      offset += kRecordHeaderBytes + length;
    }
    last_bytes = offset;
    if (problem.empty()) continue;

    // Cut the log here.
    std::string warning = fmt::format(
        "{}: {} at offset {}; dropped the {} bytes from there to the end of the file; the last good record is {}", path,
        problem, offset, data.size() - offset,
        expected > 1 ? fmt::format("sequence {}", expected - 1) : std::string("none (the log is empty)"));
    const int fd = open(path.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd < 0) return IoError(errno, fmt::format("cannot open {} to truncate it", path));
    if (ftruncate(fd, static_cast<off_t>(offset)) != 0 || fsync(fd) != 0) {
      const int err = errno;
      close(fd);
      return IoError(err, fmt::format("cannot truncate {} to {} bytes", path, offset));
    }
    close(fd);
    dir_changed = true;
    if (k + 1 < logs.size()) {
      warning += fmt::format("; deleted the {} later segment(s) from {} on", logs.size() - k - 1,
                             Basename(logs[k + 1].second));
    }
    recovery->warnings.push_back(std::move(warning));
    end = k + 1;
    break;
  }
  for (size_t k = end; k < logs.size(); ++k) {
    TANDEM_RETURN_IF_ERROR(Unlink(logs[k].second));
    dir_changed = true;
  }
  logs.resize(end);
  // What a crashed process wrote may sit in the page cache only: make it durable before calling it so.
  for (size_t k = begin; k < logs.size(); ++k) {
    const int fd = open(logs[k].second.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0 || fdatasync(fd) != 0) {
      const int err = errno;
      if (fd >= 0) close(fd);
      return IoError(err, fmt::format("cannot sync {}", logs[k].second));
    }
    close(fd);
  }

  for (const auto& path : corrupt) {
    if (rename(path.c_str(), (path + std::string(kCorruptSuffix)).c_str()) != 0) {
      return IoError(errno, fmt::format("cannot rename corrupt snapshot {}", path));
    }
    dir_changed = true;
  }
  if (dir_changed) TANDEM_RETURN_IF_ERROR(FsyncDir(dir_));

  // The writer continues in the last segment when the next sequence follows
  // its last record (otherwise it starts a new segment).
  if (!logs.empty()) {
    active_path_ = logs.back().second;
    active_fd_ = open(active_path_.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
    if (active_fd_ < 0) return IoError(errno, fmt::format("cannot open {} for appending", active_path_));
    active_next_ = expected;
    active_bytes_ = last_bytes;
  }
  {
    MutexLock lock(&snapshot_mu_);
    for (size_t i = 0; i < kept_snapshots; ++i) snapshots_.push_back(snapshots[i].first);
  }
  MutexLock lock(&mu_);
  for (const auto& [first, path] : logs) segments_.push_back({first, path});
  next_sequence_ = std::max(snap, expected - 1) + 1;
  durable_ = next_sequence_ - 1;
  recovery_ = std::move(recovery);
  return Status::Ok();
}

Result<Recovery> FileStore::Recover() {
  if (recovered_) return FailedPrecondition("Recover was already called on the store in {}", dir_);
  recovered_ = true;
  return std::move(*recovery_);
}

uint64_t FileStore::Append(std::string payload) {
  const bool too_large = payload.size() > options_.max_record_bytes;
  const size_t size = payload.size();
  if (too_large) std::string().swap(payload);
  bool wake = false;
  uint64_t sequence = 0;
  {
    MutexLock lock(&mu_);
    sequence = next_sequence_++;
    if (too_large) refused_.emplace(sequence, TooLarge(sequence, size, options_.max_record_bytes));
    if (!failure_.ok()) return sequence;  // never written; WaitDurable reports the failure
    queue_.push_back({sequence, std::move(payload), too_large});
    wake = queue_.size() == 1;
  }
  if (wake) writer_cv_.NotifyOne();
  return sequence;
}

Status FileStore::WaitDurable(uint64_t sequence) {
  return WaitDurableUpTo(sequence, /*check_refused=*/true);
}

Status FileStore::WaitDurableUpTo(uint64_t sequence, bool check_refused) {
  MutexLock lock(&mu_);
  if (check_refused) {
    const auto it = refused_.find(sequence);
    if (it != refused_.end()) return it->second;
  }
  if (sequence >= next_sequence_) {
    return InvalidArgument("sequence {} was never appended (the last is {})", sequence, next_sequence_ - 1);
  }
  durable_cv_.Wait(lock, [&]() TANDEM_REQUIRES(mu_) { return durable_.load() >= sequence || !failure_.ok(); });
  if (durable_.load() >= sequence) return Status::Ok();
  return failure_;
}

uint64_t FileStore::durable_sequence() const {
  return durable_.load();
}

FileStoreStats FileStore::stats() const {
  MutexLock lock(&mu_);
  return stats_;
}

void FileStore::WriterLoop() {
  std::vector<Pending> batch;
  for (;;) {
    {
      MutexLock lock(&mu_);
      writer_cv_.Wait(lock, [&]() TANDEM_REQUIRES(mu_) { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything is written
      batch.swap(queue_);
      if (!failure_.ok()) {  // failed meanwhile: nothing more is written
        batch.clear();
        continue;
      }
    }
    FileStoreStats delta;
    delta.records = batch.size();
    Status status = WriteBatch(batch, &delta);
    {
      MutexLock lock(&mu_);
      stats_.records += delta.records;
      stats_.bytes += delta.bytes;
      stats_.batches += 1;
      stats_.syncs += delta.syncs;
      if (status.ok()) {
        durable_ = batch.back().sequence;
      } else {
        failure_ = std::move(status);
        queue_.clear();
      }
    }
    durable_cv_.NotifyAll();
    batch.clear();
  }
}

Status FileStore::SyncActive(FileStoreStats* delta) {
  ++delta->syncs;
  if (fdatasync(active_fd_) != 0) return IoError(errno, fmt::format("fdatasync of {}", active_path_));
  return Status::Ok();
}

Status FileStore::RollSegment(uint64_t first) {
  if (active_fd_ >= 0) {
    close(active_fd_);
    active_fd_ = -1;
  }
  const std::string path = SegmentPath(first);
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return IoError(errno, fmt::format("cannot create log segment {}", path));
  active_fd_ = fd;
  active_path_ = path;
  active_next_ = first;
  active_bytes_ = 0;
  TANDEM_RETURN_IF_ERROR(FsyncDir(dir_));
  MutexLock lock(&mu_);
  segments_.push_back({first, path});
  return Status::Ok();
}

Status FileStore::WriteBatch(std::vector<Pending>& batch, FileStoreStats* delta) {
  std::vector<std::array<unsigned char, kRecordHeaderBytes>> headers(batch.size());
  std::vector<iovec> iov;
  iov.reserve(2 * batch.size());
  uint64_t first_unwritten = batch.front().sequence;
  // Writes what `iov` holds to the active segment and syncs it.
  auto flush = [&](uint64_t upto) -> Status {
    if (iov.empty()) return Status::Ok();
    int err = options_.write_error_for_testing ? options_.write_error_for_testing() : 0;
    if (err == 0) err = WriteAll(active_fd_, iov);
    if (err != 0) {
      return IoError(err, fmt::format("cannot write records {} to {} to {}", first_unwritten, upto, active_path_));
    }
    iov.clear();
    first_unwritten = upto + 1;
    return SyncActive(delta);
  };
  for (size_t i = 0; i < batch.size(); ++i) {
    Pending& r = batch[i];
    if (active_fd_ < 0 || r.sequence != active_next_ || active_bytes_ >= options_.segment_bytes) {
      TANDEM_RETURN_IF_ERROR(flush(r.sequence - 1));
      TANDEM_RETURN_IF_ERROR(RollSegment(r.sequence));
    }
    unsigned char* h = headers[i].data();
    Put32(h, kRecordMagic);
    Put16(h + 4, kFormatVersion);
    Put16(h + 6, r.is_void ? kRecordFlagVoid : 0);
    Put32(h + 8, static_cast<uint32_t>(r.payload.size()));
    Put64(h + 12, r.sequence);
    Put32(h + kRecordCrcOffset, Crc32c(r.payload.data(), r.payload.size(), Crc32c(h, kRecordCrcOffset)));
    iov.push_back({h, kRecordHeaderBytes});
    if (!r.payload.empty()) iov.push_back({r.payload.data(), r.payload.size()});
    const uint64_t bytes = kRecordHeaderBytes + r.payload.size();
    active_bytes_ += bytes;
    active_next_ = r.sequence + 1;
    delta->bytes += bytes;
  }
  return flush(batch.back().sequence);
}

Status FileStore::WriteSnapshot(uint64_t sequence, std::string payload) {
  MutexLock snapshot_lock(&snapshot_mu_);
  {
    MutexLock lock(&mu_);
    if (!failure_.ok()) return failure_;
    if (sequence == 0 || sequence >= next_sequence_) {
      return InvalidArgument("cannot snapshot the state as of sequence {}: the last appended record is {}", sequence,
                             next_sequence_ - 1);
    }
  }
  if (!snapshots_.empty() && sequence < snapshots_.back()) {
    return InvalidArgument("cannot snapshot the state as of sequence {}: there is a newer snapshot, as of {}", sequence,
                           snapshots_.back());
  }
  // The log must hold everything up to `sequence` first, so that recovery
  // never finds a snapshot ahead of the log's end.
  TANDEM_RETURN_IF_ERROR(WaitDurableUpTo(sequence, /*check_refused=*/false));

  const std::string path = SnapshotPath(sequence);
  const std::string temp = path + std::string(kTempSuffix);
  std::array<unsigned char, kSnapshotHeaderBytes> header{};
  unsigned char* h = header.data();
  Put32(h, kSnapshotMagic);
  Put16(h + 4, kFormatVersion);
  Put16(h + 6, 0);
  Put64(h + 8, sequence);
  Put64(h + 16, payload.size());
  Put32(h + kSnapshotCrcOffset, Crc32c(payload.data(), payload.size(), Crc32c(h, kSnapshotCrcOffset)));
  const int fd = open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return IoError(errno, fmt::format("cannot create snapshot file {}", temp));
  std::vector<iovec> iov = {{h, header.size()}};
  if (!payload.empty()) iov.push_back({payload.data(), payload.size()});
  int err = WriteAll(fd, iov);
  if (err == 0 && fsync(fd) != 0) err = errno;
  close(fd);
  if (err == 0 && rename(temp.c_str(), path.c_str()) != 0) err = errno;
  if (err != 0) {
    unlink(temp.c_str());
    return IoError(err, fmt::format("cannot write snapshot {}", path));
  }
  TANDEM_RETURN_IF_ERROR(FsyncDir(dir_).WithContext(fmt::format("snapshot {}", path)));
  if (snapshots_.empty() || snapshots_.back() != sequence) snapshots_.push_back(sequence);

  // The new snapshot is durable: now older snapshots beyond the retained
  // number go, and the log segments the oldest kept snapshot covers.
  std::vector<std::string> doomed;
  while (snapshots_.size() > static_cast<size_t>(options_.retained_snapshots)) {
    doomed.push_back(SnapshotPath(snapshots_.front()));
    snapshots_.erase(snapshots_.begin());
  }
  const uint64_t oldest = snapshots_.front();
  {
    MutexLock lock(&mu_);
    size_t covered = 0;  // never the last segment: the writer appends to it
    while (covered + 1 < segments_.size() && segments_[covered + 1].first <= oldest + 1) ++covered;
    for (size_t i = 0; i < covered; ++i) doomed.push_back(segments_[i].path);
    segments_.erase(segments_.begin(), segments_.begin() + static_cast<std::ptrdiff_t>(covered));
  }
  if (doomed.empty()) return Status::Ok();
  for (const auto& file : doomed) {
    TANDEM_RETURN_IF_ERROR(
        Unlink(file).WithContext(fmt::format("snapshot as of {} is durable, but cleaning up failed", sequence)));
  }
  return FsyncDir(dir_).WithContext(fmt::format("snapshot as of {} is durable, but cleaning up failed", sequence));
}

// ---------------------------------------------------------------------------
// MemoryStore

MemoryStore::MemoryStore(std::shared_ptr<MemoryStoreBacking> backing, uint64_t max_record_bytes)
    : backing_(std::move(backing)), max_record_bytes_(max_record_bytes) {
  MutexLock lock(&backing_->mu_);
  durable_ = backing_->last_sequence_;
}

Result<Recovery> MemoryStore::Recover() {
  if (recovered_.exchange(true)) return FailedPrecondition("Recover was already called on this MemoryStore");
  MutexLock lock(&backing_->mu_);
  Recovery recovery;
  recovery.snapshot_sequence = backing_->snapshot_sequence_;
  recovery.snapshot = backing_->snapshot_;
  for (const auto& [sequence, payload] : backing_->records_) {
    if (payload.has_value()) recovery.records.emplace_back(sequence, *payload);
  }
  return recovery;
}

uint64_t MemoryStore::Append(std::string payload) {
  MutexLock lock(&backing_->mu_);
  const uint64_t sequence = ++backing_->last_sequence_;
  if (payload.size() > max_record_bytes_)
    refused_.emplace(sequence, TooLarge(sequence, payload.size(), max_record_bytes_));
  if (!failure_.ok()) return sequence;
  if (payload.size() > max_record_bytes_) {
    backing_->records_.emplace_back(sequence, std::nullopt);
  } else {
    backing_->records_.emplace_back(sequence, std::move(payload));
  }
  durable_ = sequence;
  return sequence;
}

Status MemoryStore::WaitDurable(uint64_t sequence) {
  MutexLock lock(&backing_->mu_);
  const auto it = refused_.find(sequence);
  if (it != refused_.end()) return it->second;
  if (sequence > backing_->last_sequence_) {
    return InvalidArgument("sequence {} was never appended (the last is {})", sequence, backing_->last_sequence_);
  }
  if (sequence <= durable_.load()) return Status::Ok();
  return failure_;
}

uint64_t MemoryStore::durable_sequence() const {
  return durable_.load();
}

Status MemoryStore::WriteSnapshot(uint64_t sequence, std::string payload) {
  MutexLock lock(&backing_->mu_);
  if (!failure_.ok()) return failure_;
  if (sequence == 0 || sequence > backing_->last_sequence_) {
    return InvalidArgument("cannot snapshot the state as of sequence {}: the last appended record is {}", sequence,
                           backing_->last_sequence_);
  }
  if (sequence < backing_->snapshot_sequence_) {
    return InvalidArgument("cannot snapshot the state as of sequence {}: there is a newer snapshot, as of {}", sequence,
                           backing_->snapshot_sequence_);
  }
  backing_->snapshot_sequence_ = sequence;
  backing_->snapshot_ = std::move(payload);
  auto& records = backing_->records_;
  records.erase(records.begin(),
                std::find_if(records.begin(), records.end(), [&](const auto& r) { return r.first > sequence; }));
  return Status::Ok();
}

void MemoryStore::InjectFailure(Status status) {
  MutexLock lock(&backing_->mu_);
  if (failure_.ok() && !status.ok()) failure_ = std::move(status);
}

}  // namespace tandem::coordinator
