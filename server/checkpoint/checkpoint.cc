#include "server/checkpoint/checkpoint.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>

#include <fmt/format.h>

#include "common/crc32c.h"

namespace tandem::server {
namespace {

// Payloads are the host's fp32 bytes; the format is little-endian.
static_assert(std::endian::native == std::endian::little, "checkpoint payloads are written in host byte order");
static_assert(sizeof(float) == 4);

// The on-disk layout (docs/checkpoints.md). Every format version keeps bytes
// 0..15 (magic, format version, header length) and ends its header with the
// header's CRC-32C, so that any reader can tell a corrupt header from a newer one.
constexpr unsigned char kMagic[8] = {'T', 'N', 'D', 'M', 'C', 'K', 'P', 'T'};
constexpr size_t kPrefixBytes = 16;       // magic, format version, header length
constexpr size_t kFixedHeaderBytes = 92;  // the fields before the strings
constexpr uint64_t kMaxHeaderBytes = 64u << 20;
constexpr uint32_t kMaxBlockBytes = 64u << 20;
constexpr uint64_t kMaxParameterCount = uint64_t{1} << 60;
constexpr size_t kMaxJobIdBytes = 128;
constexpr size_t kMaxCheckpointIdBytes = 128;
constexpr size_t kMaxOptimizerBytes = 32;
// Writes and whole-block reads go to the kernel in pieces of at most this size.
constexpr uint64_t kIoChunkBytes = 8u << 20;
constexpr std::string_view kFilePrefix = "part-";
constexpr const char* kSectionNames[3] = {"weights", "state0", "state1"};

void Put16(std::string& out, uint16_t v) {
  for (int i = 0; i < 2; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}
void Put32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}
void Put64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}
uint16_t Get16(const char* p) {
  const auto* u = reinterpret_cast<const unsigned char*>(p);
  return static_cast<uint16_t>(u[0] | u[1] << 8);
}
uint32_t Get32(const char* p) {
  const auto* u = reinterpret_cast<const unsigned char*>(p);
  return static_cast<uint32_t>(u[0]) | static_cast<uint32_t>(u[1]) << 8 | static_cast<uint32_t>(u[2]) << 16 |
         static_cast<uint32_t>(u[3]) << 24;
}
uint64_t Get64(const char* p) {
  return Get32(p) | static_cast<uint64_t>(Get32(p + 4)) << 32;
}

// A failed system call as a Status: a full disk is RESOURCE_EXHAUSTED, the rest INTERNAL.
Status IoError(int err, std::string_view what) {
  const bool full = err == ENOSPC || err == EDQUOT || err == EFBIG;
  return Status(full ? StatusCode::kResourceExhausted : StatusCode::kInternal,
                fmt::format("{}: {}", what, std::strerror(err)));
}

uint64_t SectionBlocks(uint64_t elements, uint32_t block_bytes) {
  return (elements * 4 + block_bytes - 1) / block_bytes;
}

// Offset of the block checksum table: the strings follow the fixed fields and are zero-padded to a multiple of 8.
uint64_t TableOffset(size_t strings_bytes) {
  return (kFixedHeaderBytes + strings_bytes + 7) / 8 * 8;
}

Status CheckBlockBytes(uint32_t block_bytes) {
  if (block_bytes < 4 || block_bytes > kMaxBlockBytes || block_bytes % 4 != 0) {
    return InvalidArgument("checksum block size {} is not a multiple of 4 from 4 to {} bytes", block_bytes,
                           kMaxBlockBytes);
  }
  return Status::Ok();
}

bool ValidOptimizerName(std::string_view name) {
  return !name.empty() && name.size() <= kMaxOptimizerBytes && std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
  });
}

// The checks a meta must pass to be written, and a header's meta to be read (INVALID_ARGUMENT).
Status CheckMeta(const CheckpointMeta& meta) {
  if (meta.job_id.empty() || meta.job_id.size() > kMaxJobIdBytes) {
    return InvalidArgument("job_id must be 1 to {} bytes, got {}", kMaxJobIdBytes, meta.job_id.size());
  }
  TANDEM_RETURN_IF_ERROR(ValidateCheckpointId(meta.checkpoint_id));
  if (meta.parameter_count == 0 || meta.parameter_count > kMaxParameterCount) {
    return InvalidArgument("parameter_count {} is not from 1 to 2^60", meta.parameter_count);
  }
  if (!ValidOptimizerName(meta.optimizer)) {
    return InvalidArgument("optimizer \"{}\" is not a name of 1 to {} bytes of [a-z0-9_-]", meta.optimizer,
                           kMaxOptimizerBytes);
  }
  if (meta.state_buffers > 2) return InvalidArgument("state_buffers {} is more than 2", meta.state_buffers);
  return Status::Ok();
}

std::string FormatRanges(const std::vector<std::pair<uint64_t, uint64_t>>& ranges) {
  std::string out;
  for (const auto& [a, b] : ranges) {
    if (!out.empty()) out += ", ";
    out += fmt::format("[{}, {})", a, b);
  }
  return out;
}

// Parses "part-<id>-<begin>-<end>.tpc"; anything else (temporary files included) is not a partition file.
bool ParseFileName(std::string_view name, uint32_t* id, uint64_t* begin, uint64_t* end) {
  if (!name.starts_with(kFilePrefix) || !name.ends_with(kCheckpointFileSuffix)) return false;
  std::string_view rest =
      name.substr(kFilePrefix.size(), name.size() - kFilePrefix.size() - kCheckpointFileSuffix.size());
  uint64_t values[3] = {};
  for (int i = 0; i < 3; ++i) {
    const size_t dash = i < 2 ? rest.find('-') : rest.size();
    if (dash == std::string_view::npos || dash == 0 || dash > 20) return false;
    uint64_t v = 0;
    for (char c : rest.substr(0, dash)) {
      if (c < '0' || c > '9') return false;
      const uint64_t digit = static_cast<uint64_t>(c - '0');
      if (v > (std::numeric_limits<uint64_t>::max() - digit) / 10) return false;
      v = v * 10 + digit;
    }
    values[i] = v;
    rest = rest.substr(std::min(dash + 1, rest.size()));
  }
  if (values[0] > std::numeric_limits<uint32_t>::max()) return false;
  *id = static_cast<uint32_t>(values[0]);
  *begin = values[1];
  *end = values[2];
  return true;
}

// Writes all of [data, data + n) at `offset`, continuing after short writes; 0 or an errno.
int PwriteAll(int fd, const char* data, uint64_t n, uint64_t offset) {
  while (n > 0) {
    const ssize_t w = pwrite(fd, data, static_cast<size_t>(std::min(n, kIoChunkBytes)), static_cast<off_t>(offset));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return errno;
    if (w == 0) return EIO;  // no progress on a regular file: do not spin
    data += w;
    n -= static_cast<uint64_t>(w);
    offset += static_cast<uint64_t>(w);
  }
  return 0;
}

// Reads n bytes at `offset`; 0, an errno, or -1 when the file ends first.
int PreadAll(int fd, char* data, uint64_t n, uint64_t offset) {
  while (n > 0) {
    const ssize_t r = pread(fd, data, static_cast<size_t>(std::min(n, kIoChunkBytes)), static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return errno;
    if (r == 0) return -1;
    data += r;
    n -= static_cast<uint64_t>(r);
    offset += static_cast<uint64_t>(r);
  }
  return 0;
}

Status FsyncDir(const std::string& dir) {
  const int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return IoError(errno, fmt::format("cannot open directory {} to sync it", dir));
  const int rc = fsync(fd);
  const int err = errno;
  close(fd);
  if (rc != 0) return IoError(err, fmt::format("fsync of directory {}", dir));
  return Status::Ok();
}

// Renames `from` to `to` unless `to` exists (EEXIST); 0 or an errno.
int RenameNoReplace(const std::string& from, const std::string& to) {
  if (renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) == 0) return 0;
  int err = errno;
  if (err != EINVAL && err != ENOSYS && err != EOPNOTSUPP) return err;
  // A filesystem without RENAME_NOREPLACE: link() never replaces either.
  if (link(from.c_str(), to.c_str()) == 0) {
    unlink(from.c_str());
    return 0;
  }
  err = errno;
  if (err != EPERM && err != EOPNOTSUPP && err != ENOSYS) return err;
  // Nor hard links: check, then rename.
  struct stat st {};
  if (lstat(to.c_str(), &st) == 0) return EEXIST;
  return rename(from.c_str(), to.c_str()) == 0 ? 0 : errno;
}

std::atomic<uint64_t> temp_sequence{0};

// Writes one partition's file at `path` through a temporary file; adds the bytes written to *total.
Status WritePartitionFile(const std::string& path, const CheckpointMeta& meta, const PartitionState& p,
                          uint32_t block_bytes, const std::function<void(uint64_t)>& progress, uint64_t* total) {
  const uint64_t n = p.size();
  const uint64_t section_bytes = n * 4;
  const uint64_t blocks = SectionBlocks(n, block_bytes);
  const uint32_t sections = 1 + meta.state_buffers;
  const float* data[3] = {p.weights.data(), p.state0.data(), p.state1.data()};
  const size_t strings = meta.job_id.size() + meta.checkpoint_id.size() + meta.optimizer.size();
  const uint64_t table_offset = TableOffset(strings);
  const uint64_t header_bytes = table_offset + 4 * blocks * sections + 4;
  if (header_bytes > kMaxHeaderBytes) {
    return InvalidArgument(
        "partition {} needs {} checksum blocks of {} bytes, more than a header holds: use larger blocks", p.id,
        blocks * sections, block_bytes);
  }

  const std::string temp = fmt::format("{}.{}.{}{}", path, getpid(), temp_sequence.fetch_add(1), kCheckpointTempSuffix);
  int fd = open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return IoError(errno, fmt::format("cannot create checkpoint file {}", temp));
  auto fail = [&](int err, std::string_view what) {
    if (fd >= 0) close(fd);
    unlink(temp.c_str());
    return IoError(err, fmt::format("cannot {} checkpoint file {}", what, temp));
  };

  // The payload first (checksumming each block as it goes out), then the header with the checksums at offset 0.
  std::string header;
  header.reserve(static_cast<size_t>(header_bytes));
  header.append(reinterpret_cast<const char*>(kMagic), sizeof(kMagic));
  Put32(header, kCheckpointFormatVersion);
  Put32(header, static_cast<uint32_t>(header_bytes));
  Put32(header, p.id);
  Put32(header, meta.state_buffers);
  Put64(header, p.begin);
  Put64(header, p.end);
  Put64(header, p.version);
  Put64(header, p.step);
  Put64(header, meta.step);
  Put64(header, meta.parameter_count);
  Put64(header, meta.tensor_fingerprint);
  Put32(header, block_bytes);
  Put16(header, static_cast<uint16_t>(meta.job_id.size()));
  Put16(header, static_cast<uint16_t>(meta.checkpoint_id.size()));
  Put16(header, static_cast<uint16_t>(meta.optimizer.size()));
  Put16(header, 0);
  header += meta.job_id;
  header += meta.checkpoint_id;
  header += meta.optimizer;
  header.resize(static_cast<size_t>(table_offset), '\0');

  uint64_t offset = header_bytes;
  for (uint32_t s = 0; s < sections; ++s) {
    const char* bytes = reinterpret_cast<const char*>(data[s]);
    for (uint64_t done = 0; done < section_bytes;) {
      // A chunk of whole blocks (the last one may be short).
      const uint64_t chunk =
          std::min(section_bytes - done, std::max<uint64_t>(kIoChunkBytes / block_bytes, 1) * block_bytes);
      for (uint64_t b = 0; b < chunk; b += block_bytes) {
        Put32(header, Crc32c(bytes + done + b, static_cast<size_t>(std::min<uint64_t>(block_bytes, chunk - b))));
      }
      if (const int err = PwriteAll(fd, bytes + done, chunk, offset); err != 0) return fail(err, "write");
      done += chunk;
      offset += chunk;
      *total += chunk;
      if (progress) progress(*total);
    }
  }
  Put32(header, Crc32c(header.data(), header.size()));
  if (const int err = PwriteAll(fd, header.data(), header.size(), 0); err != 0) return fail(err, "write");
  *total += header.size();
  if (progress) progress(*total);
  if (fsync(fd) != 0) return fail(errno, "fsync");
  const int rc = close(fd);
  fd = -1;
  if (rc != 0) return fail(errno, "close");
  if (const int err = RenameNoReplace(temp, path); err != 0) {
    unlink(temp.c_str());
    if (err == EEXIST) {
      return AlreadyExists("checkpoint file {} already exists: checkpoint ids are never overwritten", path);
    }
    return IoError(err, fmt::format("cannot rename {} to {}", temp, path));
  }
  return Status::Ok();
}

Status DataLossAt(const std::string& path, std::string_view what) {
  return Status(StatusCode::kDataLoss, fmt::format("checkpoint file {}: {}", path, what));
}

// Reads and checks the header of the partition file `name` in `dir`.
Result<CheckpointReader::File> ReadHeader(const std::string& dir, const std::string& name, CheckpointMeta* meta,
                                          uint64_t* bytes_read) {
  const std::string path = dir + "/" + name;
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return IoError(errno, fmt::format("cannot open checkpoint file {}", path));
  struct Closer {
    int fd;
    ~Closer() { close(fd); }
  } closer{fd};
  struct stat st {};
  if (fstat(fd, &st) != 0) return IoError(errno, fmt::format("cannot stat checkpoint file {}", path));
  if (!S_ISREG(st.st_mode)) return DataLossAt(path, "not a regular file");
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < kPrefixBytes) {
    return DataLossAt(path, fmt::format("truncated: {} bytes, shorter than a checkpoint header", size));
  }
  char prefix[kPrefixBytes];
  if (const int err = PreadAll(fd, prefix, kPrefixBytes, 0); err != 0) {
    if (err < 0) return DataLossAt(path, "truncated while reading its header");
    return IoError(err, fmt::format("cannot read checkpoint file {}", path));
  }
  *bytes_read += kPrefixBytes;
  if (std::memcmp(prefix, kMagic, sizeof(kMagic)) != 0) {
    return DataLossAt(path, "not a Tandem checkpoint file (bad magic number)");
  }
  const uint64_t header_bytes = Get32(prefix + 12);
  if (header_bytes < kFixedHeaderBytes + 4 || header_bytes > size || header_bytes > kMaxHeaderBytes) {
    return DataLossAt(path, fmt::format("header length {} is impossible for a file of {} bytes (corrupt or truncated)",
                                        header_bytes, size));
  }
  std::string h(static_cast<size_t>(header_bytes), '\0');
  if (const int err = PreadAll(fd, h.data(), header_bytes, 0); err != 0) {
    if (err < 0) return DataLossAt(path, "truncated while reading its header");
    return IoError(err, fmt::format("cannot read checkpoint file {}", path));
  }
  *bytes_read += header_bytes;
  const uint32_t stored_crc = Get32(h.data() + header_bytes - 4);
  const uint32_t crc = Crc32c(h.data(), static_cast<size_t>(header_bytes - 4));
  if (stored_crc != crc) {
    return DataLossAt(path, fmt::format("header checksum mismatch (stored {:08x}, computed {:08x})", stored_crc, crc));
  }
  const uint32_t format_version = Get32(h.data() + 8);
  if (format_version > kCheckpointFormatVersion) {
    return FailedPrecondition(
        "checkpoint file {} is in format version {}, newer than this build of Tandem reads (up to {}): restore it "
        "with a newer Tandem",
        path, format_version, kCheckpointFormatVersion);
  }
  if (format_version == 0) return DataLossAt(path, "invalid format version 0");

  CheckpointReader::File file;
  file.name = name;
  file.partition_id = Get32(h.data() + 16);
  meta->state_buffers = Get32(h.data() + 20);
  file.begin = Get64(h.data() + 24);
  file.end = Get64(h.data() + 32);
  file.version = Get64(h.data() + 40);
  file.step = Get64(h.data() + 48);
  meta->step = Get64(h.data() + 56);
  meta->parameter_count = Get64(h.data() + 64);
  meta->tensor_fingerprint = Get64(h.data() + 72);
  file.block_bytes = Get32(h.data() + 80);
  const size_t lengths[3] = {Get16(h.data() + 84), Get16(h.data() + 86), Get16(h.data() + 88)};
  const uint16_t reserved = Get16(h.data() + 90);
  file.header_bytes = header_bytes;
  file.file_bytes = size;
  auto invalid = [&](std::string_view what) { return DataLossAt(path, fmt::format("invalid header: {}", what)); };
  if (reserved != 0) return invalid("reserved field is not zero");
  const uint64_t table_offset = TableOffset(lengths[0] + lengths[1] + lengths[2]);
  if (table_offset + 4 > header_bytes) return invalid("its strings run past the header");
  size_t at = kFixedHeaderBytes;
  meta->job_id.assign(h.data() + at, lengths[0]);
  at += lengths[0];
  meta->checkpoint_id.assign(h.data() + at, lengths[1]);
  at += lengths[1];
  meta->optimizer.assign(h.data() + at, lengths[2]);
  at += lengths[2];
  for (; at < table_offset; ++at) {
    if (h[at] != '\0') return invalid("padding is not zero");
  }
  if (Status s = CheckMeta(*meta); !s.ok()) return invalid(s.message());
  if (!CheckBlockBytes(file.block_bytes).ok()) {
    return invalid(
        fmt::format("checksum block size {} is not a multiple of 4 from 4 to {}", file.block_bytes, kMaxBlockBytes));
  }
  if (file.begin >= file.end || file.end > meta->parameter_count) {
    return invalid(fmt::format("range [{}, {}) is not a non-empty part of the {} parameters", file.begin, file.end,
                               meta->parameter_count));
  }
  const uint64_t elements = file.end - file.begin;
  const uint64_t sections = 1 + meta->state_buffers;
  const uint64_t blocks = SectionBlocks(elements, file.block_bytes) * sections;
  if (table_offset + 4 * blocks + 4 != header_bytes) {
    return invalid(fmt::format("length {} does not fit {} checksum blocks", header_bytes, blocks));
  }
  file.block_crcs.resize(static_cast<size_t>(blocks));
  for (uint64_t i = 0; i < blocks; ++i) file.block_crcs[i] = Get32(h.data() + table_offset + 4 * i);

  if (name != CheckpointFileName(file.partition_id, file.begin, file.end)) {
    return DataLossAt(path, fmt::format("its name does not match its header (partition {}, elements [{}, {}))",
                                        file.partition_id, file.begin, file.end));
  }
  const uint64_t expected = header_bytes + 4 * elements * sections;
  if (size != expected) {
    return DataLossAt(path, size < expected ? fmt::format("truncated: {} bytes, its header says {}", size, expected)
                                            : fmt::format("{} bytes, {} more than its header says (trailing garbage)",
                                                          size, size - expected));
  }
  return file;
}

// Names the first field two checkpoint metas disagree on, or returns empty.
std::string Disagreement(const CheckpointMeta& a, const CheckpointMeta& b) {
  if (a.job_id != b.job_id) return fmt::format("job \"{}\" vs \"{}\"", a.job_id, b.job_id);
  if (a.checkpoint_id != b.checkpoint_id) {
    return fmt::format("checkpoint id \"{}\" vs \"{}\"", a.checkpoint_id, b.checkpoint_id);
  }
  if (a.step != b.step) return fmt::format("step {} vs {}", a.step, b.step);
  if (a.parameter_count != b.parameter_count) {
    return fmt::format("parameter count {} vs {}", a.parameter_count, b.parameter_count);
  }
  if (a.tensor_fingerprint != b.tensor_fingerprint) {
    return fmt::format("tensor fingerprint {:016x} vs {:016x}", a.tensor_fingerprint, b.tensor_fingerprint);
  }
  if (a.optimizer != b.optimizer) return fmt::format("optimizer \"{}\" vs \"{}\"", a.optimizer, b.optimizer);
  if (a.state_buffers != b.state_buffers) {
    return fmt::format("optimizer state buffers {} vs {}", a.state_buffers, b.state_buffers);
  }
  return "";
}

}  // namespace

Status ValidateCheckpointId(std::string_view id) {
  const bool charset = std::all_of(id.begin(), id.end(), [](char c) {
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
           c == '-';
  });
  if (id.empty() || id.size() > kMaxCheckpointIdBytes || !charset || id == "." || id == "..") {
    return InvalidArgument("checkpoint id \"{}\" is not 1 to {} bytes of [A-Za-z0-9._-] (and not \".\" or \"..\")",
                           id.size() > 200 ? std::string(id.substr(0, 200)) + "..." : std::string(id),
                           kMaxCheckpointIdBytes);
  }
  return Status::Ok();
}

std::string DefaultCheckpointId(uint64_t step) {
  return fmt::format("step-{:010}", step);
}

std::string CheckpointFileName(uint32_t partition_id, uint64_t begin, uint64_t end) {
  return fmt::format("{}{:06}-{}-{}{}", kFilePrefix, partition_id, begin, end, kCheckpointFileSuffix);
}

Status WriteCheckpointFiles(const std::string& dir, const CheckpointMeta& meta,
                            const std::vector<const PartitionState*>& partitions,
                            const std::function<void(uint64_t)>& progress, uint64_t* bytes) {
  return WriteCheckpointFiles(dir, meta, partitions, progress, bytes, CheckpointWriteOptions{});
}

Status WriteCheckpointFiles(const std::string& dir, const CheckpointMeta& meta,
                            const std::vector<const PartitionState*>& partitions,
                            const std::function<void(uint64_t)>& progress, uint64_t* bytes,
                            const CheckpointWriteOptions& options) {
  if (bytes != nullptr) *bytes = 0;
  if (dir.empty()) return InvalidArgument("checkpoint directory is empty");
  TANDEM_RETURN_IF_ERROR(CheckMeta(meta));
  TANDEM_RETURN_IF_ERROR(CheckBlockBytes(options.block_bytes));
  std::vector<const PartitionState*> sorted;
  sorted.reserve(partitions.size());
  for (const PartitionState* p : partitions) {
    if (p == nullptr) return InvalidArgument("null partition in a checkpoint write");
    if (p->begin >= p->end || p->end > meta.parameter_count) {
      return InvalidArgument("partition {}: range [{}, {}) is not a non-empty part of the {} parameters", p->id,
                             p->begin, p->end, meta.parameter_count);
    }
    const std::vector<float>* buffers[3] = {&p->weights, &p->state0, &p->state1};
    for (uint32_t s = 0; s < 3; ++s) {
      const size_t want = s <= meta.state_buffers ? static_cast<size_t>(p->size()) : 0;
      if (buffers[s]->size() != want) {
        return InvalidArgument("partition {}: {} has {} elements, expected {} ({} elements, {} optimizer buffers)",
                               p->id, kSectionNames[s], buffers[s]->size(), want, p->size(), meta.state_buffers);
      }
    }
    sorted.push_back(p);
  }
  std::sort(sorted.begin(), sorted.end(),
            [](const PartitionState* a, const PartitionState* b) { return a->begin < b->begin; });
  std::vector<uint32_t> ids;
  ids.reserve(sorted.size());
  for (const PartitionState* p : sorted) ids.push_back(p->id);
  std::sort(ids.begin(), ids.end());
  if (auto dup = std::adjacent_find(ids.begin(), ids.end()); dup != ids.end()) {
    return InvalidArgument("partition {} is listed twice", *dup);
  }
  for (size_t i = 1; i < sorted.size(); ++i) {
    if (sorted[i]->begin < sorted[i - 1]->end) {
      return InvalidArgument("partitions {} [{}, {}) and {} [{}, {}) overlap", sorted[i - 1]->id, sorted[i - 1]->begin,
                             sorted[i - 1]->end, sorted[i]->id, sorted[i]->begin, sorted[i]->end);
    }
  }

  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return IoError(ec.value(), fmt::format("cannot create checkpoint directory {}", dir));
  if (!std::filesystem::is_directory(dir, ec)) return IoError(ENOTDIR, fmt::format("checkpoint directory {}", dir));
  std::vector<std::string> paths;
  for (const PartitionState* p : partitions) {
    paths.push_back(dir + "/" + CheckpointFileName(p->id, p->begin, p->end));
    struct stat st {};
    if (lstat(paths.back().c_str(), &st) == 0) {
      return AlreadyExists("checkpoint file {} already exists: checkpoint ids are never overwritten", paths.back());
    }
    if (errno != ENOENT) return IoError(errno, fmt::format("cannot stat {}", paths.back()));
  }

  // On failure, nothing this call wrote stays in place.
  uint64_t total = 0;
  size_t placed = 0;
  auto undo = [&](Status status) {
    for (size_t i = 0; i < placed; ++i) unlink(paths[i].c_str());
    if (placed > 0) (void)FsyncDir(dir);
    return status;
  };
  for (size_t i = 0; i < partitions.size(); ++i) {
    Status s = WritePartitionFile(paths[i], meta, *partitions[i], options.block_bytes, progress, &total);
    if (!s.ok()) return undo(std::move(s));
    ++placed;
  }
  if (Status s = FsyncDir(dir); !s.ok()) return undo(std::move(s));
  // The directory's own entry, in case this call created it.
  std::string parent = std::filesystem::path(dir).lexically_normal().parent_path().string();
  if (parent.empty()) parent = ".";
  if (Status s = FsyncDir(parent); !s.ok()) return undo(std::move(s));
  if (bytes != nullptr) *bytes = total;
  return Status::Ok();
}

Result<CheckpointReader> CheckpointReader::Open(const std::string& dir) {
  struct stat st {};
  if (stat(dir.c_str(), &st) != 0) {
    if (errno == ENOENT || errno == ENOTDIR) return NotFound("checkpoint directory {} does not exist", dir);
    return IoError(errno, fmt::format("cannot stat checkpoint directory {}", dir));
  }
  if (!S_ISDIR(st.st_mode)) return NotFound("checkpoint path {} is not a directory", dir);
  std::vector<std::string> names;
  {
    DIR* d = opendir(dir.c_str());
    if (d == nullptr) return IoError(errno, fmt::format("cannot list checkpoint directory {}", dir));
    errno = 0;
    while (const dirent* entry = readdir(d)) {
      uint32_t id = 0;
      uint64_t begin = 0;
      uint64_t end = 0;
      if (ParseFileName(entry->d_name, &id, &begin, &end)) names.emplace_back(entry->d_name);
      errno = 0;
    }
    const int err = errno;
    closedir(d);
    if (err != 0) return IoError(err, fmt::format("cannot list checkpoint directory {}", dir));
  }
  if (names.empty()) return NotFound("checkpoint directory {} holds no partition files (part-*.tpc)", dir);
  std::sort(names.begin(), names.end());

  CheckpointReader reader;
  reader.dir_ = dir;
  uint64_t bytes_read = 0;
  for (const std::string& name : names) {
    CheckpointMeta meta;
    Result<File> file = ReadHeader(dir, name, &meta, &bytes_read);
    if (!file.ok()) return file.status();
    if (reader.files_.empty()) {
      reader.meta_ = meta;
    } else if (const std::string diff = Disagreement(reader.meta_, meta); !diff.empty()) {
      return FailedPrecondition("checkpoint files {}/{} and {} are not from the same checkpoint: {}", dir,
                                reader.files_.front().name, name, diff);
    }
    reader.files_.push_back(std::move(file).value());
  }
  std::sort(reader.files_.begin(), reader.files_.end(), [](const File& a, const File& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < reader.files_.size(); ++i) {
    const File& a = reader.files_[i - 1];
    const File& b = reader.files_[i];
    if (b.begin < a.end) {
      return FailedPrecondition("checkpoint files {}/{} and {} overlap (elements [{}, {}) and [{}, {}))", dir, a.name,
                                b.name, a.begin, a.end, b.begin, b.end);
    }
  }
  reader.bytes_read_->store(bytes_read);
  return reader;
}

std::vector<std::pair<uint64_t, uint64_t>> CheckpointReader::Missing() const {
  std::vector<std::pair<uint64_t, uint64_t>> missing;
  uint64_t at = 0;
  for (const File& f : files_) {
    if (f.begin > at) missing.emplace_back(at, f.begin);
    at = std::max(at, f.end);
  }
  if (at < meta_.parameter_count) missing.emplace_back(at, meta_.parameter_count);
  return missing;
}

Status CheckpointReader::ReadSection(int fd, const File& file, int section, uint64_t begin, uint64_t end,
                                     float* out) const {
  const std::string path = dir_ + "/" + file.name;
  const uint64_t bb = file.block_bytes;
  const uint64_t section_bytes = 4 * (file.end - file.begin);
  const uint64_t section_offset = file.header_bytes + static_cast<uint64_t>(section) * section_bytes;
  const uint64_t table_base = static_cast<uint64_t>(section) * SectionBlocks(file.end - file.begin, file.block_bytes);
  const uint64_t a = 4 * (begin - file.begin);  // the bytes wanted, within the section
  const uint64_t b = 4 * (end - file.begin);
  char* dst = reinterpret_cast<char*>(out);
  std::vector<char> scratch;

  auto read = [&](char* to, uint64_t from, uint64_t n) -> Status {
    const int err = PreadAll(fd, to, n, section_offset + from);
    if (err < 0) return DataLossAt(path, "truncated (it ends before its header says)");
    if (err > 0) return IoError(err, fmt::format("cannot read checkpoint file {}", path));
    bytes_read_->fetch_add(n, std::memory_order_relaxed);
    return Status::Ok();
  };
  auto check = [&](uint64_t k, const char* data, uint64_t n) -> Status {
    if (Crc32c(data, static_cast<size_t>(n)) == file.block_crcs[table_base + k]) return Status::Ok();
    return DataLossAt(path,
                      fmt::format("checksum mismatch in {} block {} (file bytes [{}, {}))", kSectionNames[section], k,
                                  section_offset + k * bb, section_offset + k * bb + n));
  };

  uint64_t k = a / bb;
  const uint64_t last = (b - 1) / bb;
  while (k <= last) {
    const uint64_t ks = k * bb;
    const uint64_t ke = std::min(ks + bb, section_bytes);
    if (ks >= a && ke <= b) {
      // A run of whole blocks goes straight into the output, then is checked there.
      uint64_t run_end = ke;
      uint64_t k2 = k + 1;
      while (k2 <= last && std::min(k2 * bb + bb, section_bytes) <= b && run_end - ks < kIoChunkBytes) {
        run_end = std::min(k2 * bb + bb, section_bytes);
        ++k2;
      }
      TANDEM_RETURN_IF_ERROR(read(dst + (ks - a), ks, run_end - ks));
      for (uint64_t j = k; j < k2; ++j) {
        TANDEM_RETURN_IF_ERROR(check(j, dst + (j * bb - a), std::min(j * bb + bb, section_bytes) - j * bb));
      }
      k = k2;
    } else {
      // A block the range starts or ends inside: read all of it to check it, keep the part wanted.
      if (scratch.empty()) scratch.resize(static_cast<size_t>(bb));
      TANDEM_RETURN_IF_ERROR(read(scratch.data(), ks, ke - ks));
      TANDEM_RETURN_IF_ERROR(check(k, scratch.data(), ke - ks));
      const uint64_t from = std::max(a, ks);
      const uint64_t to = std::min(b, ke);
      std::memcpy(dst + (from - a), scratch.data() + (from - ks), static_cast<size_t>(to - from));
      ++k;
    }
  }
  return Status::Ok();
}

namespace {

// Opens a file of the checkpoint for reading and checks it still has the size its header gave.
Result<int> OpenForRead(const std::string& dir, const CheckpointReader::File& file) {
  const std::string path = dir + "/" + file.name;
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return DataLossAt(path, "removed since the checkpoint was opened");
    return IoError(errno, fmt::format("cannot open checkpoint file {}", path));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    return IoError(err, fmt::format("cannot stat checkpoint file {}", path));
  }
  if (static_cast<uint64_t>(st.st_size) != file.file_bytes) {
    close(fd);
    return DataLossAt(path, fmt::format("changed since the checkpoint was opened: {} bytes, was {}",
                                        static_cast<uint64_t>(st.st_size), file.file_bytes));
  }
  return fd;
}

}  // namespace

Result<PartitionState> CheckpointReader::Read(uint32_t id, uint64_t begin, uint64_t end, bool with_state) const {
  if (begin >= end || end > meta_.parameter_count) {
    return InvalidArgument("elements [{}, {}) are not a non-empty part of checkpoint {}'s {} parameters", begin, end,
                           meta_.checkpoint_id, meta_.parameter_count);
  }
  // The files overlapping [begin, end): sorted by begin and disjoint, so also sorted by end.
  auto first =
      std::upper_bound(files_.begin(), files_.end(), begin, [](uint64_t v, const File& f) { return v < f.end; });
  std::vector<const File*> covering;
  std::vector<std::pair<uint64_t, uint64_t>> gaps;
  uint64_t at = begin;
  for (auto it = first; it != files_.end() && it->begin < end; ++it) {
    if (it->begin > at) gaps.emplace_back(at, it->begin);
    at = it->end;
    covering.push_back(&*it);
  }
  if (at < end) gaps.emplace_back(at, end);
  if (!gaps.empty()) {
    return FailedPrecondition(
        "checkpoint {} ({}) does not cover elements {} of [{}, {}): their partition files are missing (a server "
        "did not complete its save?)",
        meta_.checkpoint_id, dir_, FormatRanges(gaps), begin, end);
  }
  for (const File* f : covering) {
    if (f->version != covering.front()->version || f->step != covering.front()->step) {
      return FailedPrecondition(
          "checkpoint files {}/{} (version {}, step {}) and {} (version {}, step {}) disagree on the state of "
          "elements [{}, {})",
          dir_, covering.front()->name, covering.front()->version, covering.front()->step, f->name, f->version, f->step,
          begin, end);
    }
  }

  PartitionState state;
  state.id = id;
  state.begin = begin;
  state.end = end;
  state.version = covering.front()->version;
  state.step = covering.front()->step;
  const uint32_t sections = with_state ? 1 + meta_.state_buffers : 1;
  std::vector<float>* out[3] = {&state.weights, &state.state0, &state.state1};
  for (uint32_t s = 0; s < sections; ++s) out[s]->resize(static_cast<size_t>(end - begin));
  for (const File* f : covering) {
    TANDEM_ASSIGN_OR_RETURN(const int fd, OpenForRead(dir_, *f));
    const uint64_t lo = std::max(begin, f->begin);
    const uint64_t hi = std::min(end, f->end);
    Status status;
    for (uint32_t s = 0; s < sections && status.ok(); ++s) {
      status = ReadSection(fd, *f, static_cast<int>(s), lo, hi, out[s]->data() + (lo - begin));
    }
    close(fd);
    TANDEM_RETURN_IF_ERROR(status);
  }
  return state;
}

Status CheckpointReader::Verify() const {
  for (const File& f : files_) {
    TANDEM_ASSIGN_OR_RETURN(const int fd, OpenForRead(dir_, f));
    // Whole blocks at a time, so that every read goes straight into the buffer.
    const uint64_t step = std::max<uint64_t>(kIoChunkBytes / f.block_bytes, 1) * f.block_bytes / 4;
    std::vector<float> buffer(static_cast<size_t>(std::min(step, f.end - f.begin)));
    Status status;
    for (int s = 0; s <= static_cast<int>(meta_.state_buffers) && status.ok(); ++s) {
      for (uint64_t lo = f.begin; lo < f.end && status.ok(); lo += step) {
        status = ReadSection(fd, f, s, lo, std::min(lo + step, f.end), buffer.data());
      }
    }
    close(fd);
    TANDEM_RETURN_IF_ERROR(status);
  }
  return Status::Ok();
}

uint64_t TensorTableFingerprint(const google::protobuf::RepeatedPtrField<v1::TensorSpec>& tensors) {
  uint64_t h = 14695981039346656037ull;
  auto mix = [&h](const void* data, size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < n; ++i) {
      h ^= p[i];
      h *= 1099511628211ull;
    }
  };
  for (const auto& t : tensors) {
    const uint64_t len = t.name().size();
    mix(&len, sizeof(len));
    mix(t.name().data(), t.name().size());
    const uint64_t dims = static_cast<uint64_t>(t.shape_size());
    mix(&dims, sizeof(dims));
    for (int64_t d : t.shape()) mix(&d, sizeof(d));
    const int32_t dtype = t.dtype();
    mix(&dtype, sizeof(dtype));
    const uint64_t glen = t.group().size();
    mix(&glen, sizeof(glen));
    mix(t.group().data(), t.group().size());
  }
  return h;
}

}  // namespace tandem::server
