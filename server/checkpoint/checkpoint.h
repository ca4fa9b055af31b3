// Parameter-server checkpoint files (docs/checkpoints.md): one self-describing
// file per partition, written atomically, with CRC-32C checksums over the
// header and over the payload in fixed-size blocks. A checkpoint is the set of
// files that every server wrote into one directory for the same step; the
// reader assembles any element range from whichever files cover it, so a
// checkpoint restores onto any number of servers and any partition size.
//
// Thread safety: WriteCheckpointFiles may run concurrently with itself (for
// distinct partitions). A CheckpointReader is immutable after Open: Read,
// Verify and the accessors may be called from any number of threads at once.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"
#include "server/partition_state.h"
#include "tandem/v1/types.pb.h"

namespace tandem::server {

// The format version this build writes, and the newest it reads.
inline constexpr uint32_t kCheckpointFormatVersion = 1;
// Partition files end in this; temporary files (being written) in kCheckpointTempSuffix.
inline constexpr std::string_view kCheckpointFileSuffix = ".tpc";
inline constexpr std::string_view kCheckpointTempSuffix = ".tmp";
// Payload bytes per checksum block, unless CheckpointWriteOptions says otherwise.
inline constexpr uint32_t kCheckpointDefaultBlockBytes = 1u << 20;

struct CheckpointMeta {
  std::string job_id;            // 1..128 bytes
  std::string checkpoint_id;     // 1..128 bytes of [A-Za-z0-9._-]
  uint64_t step = 0;             // the step boundary saved
  uint64_t parameter_count = 0;  // the whole flattened space, 1..2^60
  // Hash of the job's tensor table (names, shapes, dtypes, groups), computed by the caller.
  uint64_t tensor_fingerprint = 0;
  std::string optimizer;       // "sgd", "adam", "adamw" (1..32 bytes of [a-z0-9_-])
  uint32_t state_buffers = 0;  // 0..2, how many of state0/state1 are stored

  friend bool operator==(const CheckpointMeta&, const CheckpointMeta&) = default;
};

struct CheckpointWriteOptions {
  // Payload bytes per checksum block: a multiple of 4 from 4 bytes to 64 MiB.
  uint32_t block_bytes = kCheckpointDefaultBlockBytes;
};

// The fingerprint of a tensor table (FNV-1a over names, shapes, dtypes and
// groups) that CheckpointMeta::tensor_fingerprint records: the servers
// compute it from the job's table, and a checkpoint restores only onto the
// same table.
uint64_t TensorTableFingerprint(const google::protobuf::RepeatedPtrField<v1::TensorSpec>& tensors);

// Validates a checkpoint id (INVALID_ARGUMENT naming it): 1..128 bytes of
// [A-Za-z0-9._-], and neither "." nor "..".
Status ValidateCheckpointId(std::string_view id);

// The id of a checkpoint saved without one: "step-" and the step zero-padded to 10 digits.
std::string DefaultCheckpointId(uint64_t step);

// The name of a partition's file: "part-000012-<begin>-<end>.tpc".
std::string CheckpointFileName(uint32_t partition_id, uint64_t begin, uint64_t end);

// Writes one file per partition into `dir` (created with parents if missing), each atomically: write to a
// temporary name in the same directory, fsync, rename, fsync the directory. A partition file that already
// exists with the same name -> ALREADY_EXISTS (checkpoint ids are never overwritten), nothing written.
// On any error, temporary files are removed, so are the files this call already put in place, and the error
// names the file and errno text (a full disk is RESOURCE_EXHAUSTED). INVALID_ARGUMENT for a bad meta or a
// partition whose range or buffers do not match it (nothing written).
// `progress` (may be null) is called with the running total of bytes written; *bytes (may be null) gets the
// total.
Status WriteCheckpointFiles(const std::string& dir, const CheckpointMeta& meta,
                            const std::vector<const PartitionState*>& partitions,
                            const std::function<void(uint64_t)>& progress, uint64_t* bytes);
Status WriteCheckpointFiles(const std::string& dir, const CheckpointMeta& meta,
                            const std::vector<const PartitionState*>& partitions,
                            const std::function<void(uint64_t)>& progress, uint64_t* bytes,
                            const CheckpointWriteOptions& options);

class CheckpointReader {
 public:
  // One partition file of the checkpoint, as its header describes it.
  struct File {
    std::string name;  // file name inside the directory
    uint32_t partition_id = 0;
    uint64_t begin = 0;
    uint64_t end = 0;
    uint64_t version = 0;
    uint64_t step = 0;
    uint32_t block_bytes = 0;
    uint64_t header_bytes = 0;
    uint64_t file_bytes = 0;
    // CRC-32C of each payload block: the weights' blocks, then state0's, then state1's.
    std::vector<uint32_t> block_crcs;
  };

  // Scans `dir` for partition files, reads and checks their headers (magic, format version, header checksum,
  // that all agree on job, checkpoint id, step, parameter_count, fingerprint, optimizer), and builds the index
  // of element ranges. NOT_FOUND if dir does not exist or holds no partition file; DATA_LOSS naming the file
  // for a corrupt header (or a file whose size does not match its header); FAILED_PRECONDITION for files that
  // disagree or overlap (naming both), or a file in a newer format version.
  static Result<CheckpointReader> Open(const std::string& dir);

  CheckpointReader(CheckpointReader&&) noexcept = default;
  CheckpointReader& operator=(CheckpointReader&&) noexcept = default;

  const CheckpointMeta& meta() const { return meta_; }
  const std::string& dir() const { return dir_; }
  // The partition files, sorted by begin (their ranges do not overlap).
  const std::vector<File>& files() const { return files_; }

  // Elements not covered by any file, as "[a, b)" ranges (empty when complete).
  std::vector<std::pair<uint64_t, uint64_t>> Missing() const;

  // The state of elements [begin, end) as a PartitionState with the given id: weights, and state0/state1 when
  // with_state (else empty), version and step from the covering files (they must agree:
  // FAILED_PRECONDITION otherwise), assembled from every file that overlaps the range; every overlapping
  // file's payload checksums are verified (DATA_LOSS naming the file and which section). FAILED_PRECONDITION
  // naming the uncovered element ranges if the files do not cover [begin, end); INVALID_ARGUMENT unless
  // begin < end <= parameter_count. Reads only the bytes needed (pread), plus whole checksummed blocks they
  // fall in.
  Result<PartitionState> Read(uint32_t id, uint64_t begin, uint64_t end, bool with_state) const;

  // Reads every byte of every file and checks every checksum: DATA_LOSS naming the first bad file and
  // section. Says nothing about coverage (see Missing).
  Status Verify() const;

  uint64_t bytes_read() const { return bytes_read_->load(std::memory_order_relaxed); }  // total so far

 private:
  CheckpointReader() = default;

  // Reads elements [begin, end) of `section` (0 weights, 1 state0, 2 state1) of `file` (open as `fd`) into `out`
  // (end - begin floats), verifying every block it touches.
  Status ReadSection(int fd, const File& file, int section, uint64_t begin, uint64_t end, float* out) const;

  std::string dir_;
  CheckpointMeta meta_;
  std::vector<File> files_;
  std::unique_ptr<std::atomic<uint64_t>> bytes_read_ = std::make_unique<std::atomic<uint64_t>>(0);
};

}  // namespace tandem::server
