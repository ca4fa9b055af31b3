// The training data: a text file seen as overlapping byte windows
// (docs/training.md, "Data and the distributed sampler").
//
// A TextDataset holds the bytes of one file (read into memory once; the
// reference model reads bytes as tokens, so no tokenizer is involved) and
// exposes them as samples of a fixed context length T and stride S:
//
//   sample i = bytes [i·S, i·S + T + 1)
//   inputs   = its first T bytes      (bytes [i·S,     i·S + T))
//   targets  = its last T bytes       (bytes [i·S + 1, i·S + T + 1))
//
// so targets[t] is the byte that follows inputs[t]. size() is the number of
// full windows, (bytes - (T + 1)) / S + 1; a trailing partial window is
// dropped. The stride defaults to T (consecutive samples share one byte: the
// last target of one is the first input of the next).
//
// The default corpus is English-like prose the project generates itself,
// deterministically, from word lists and sentence templates driven by
// mt19937_64 with a fixed seed (no downloaded or copied text): the same bytes
// on every machine and in every build. DefaultCorpus() returns it,
// WriteDefaultCorpus() writes it to a file, TextDataset::Default() wraps it.
//
// Thread safety: a TextDataset is immutable after creation; any number of
// threads may read it. Spans it returns stay valid while it lives (moving it
// keeps them valid: the bytes do not move).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "common/status.h"

namespace tandem::data {

// The size of the built-in corpus in bytes (48 KiB).
inline constexpr size_t kDefaultCorpusBytes = 48 * 1024;

// The built-in corpus: `bytes` bytes of generated prose (exactly that many),
// the same for the same `bytes` and `seed`.
std::string DefaultCorpus(size_t bytes = kDefaultCorpusBytes, uint64_t seed = 0x74616e64656dULL);

// Writes DefaultCorpus(bytes) to `path` (created or truncated).
Status WriteDefaultCorpus(const std::string& path, size_t bytes = kDefaultCorpusBytes);

// One sample: T input bytes and the T bytes that follow each of them.
struct Sample {
  std::span<const uint8_t> inputs;
  std::span<const uint8_t> targets;
};

class TextDataset {
 public:
  // Reads the whole file at `path`. Errors name the file: NOT_FOUND when it
  // does not exist, PERMISSION_DENIED when it cannot be read, INVALID_ARGUMENT
  // when it is not a regular file or is shorter than context + 1 bytes, or
  // when context is 0. stride 0 means stride = context.
  static Result<TextDataset> Open(const std::string& path, size_t context, size_t stride = 0);

  // The same over bytes already in memory; `name` is used in error messages.
  static Result<TextDataset> FromBytes(std::string bytes, size_t context, size_t stride = 0,
                                       std::string name = "<memory>");

  // The built-in corpus (DefaultCorpus()) as a dataset.
  static Result<TextDataset> Default(size_t context, size_t stride = 0);

  // The number of samples (full windows).
  size_t size() const { return count_; }
  size_t context() const { return context_; }
  size_t stride() const { return stride_; }
  // The file path (or the name given to FromBytes / "<default corpus>").
  const std::string& name() const { return name_; }
  // All the bytes.
  std::span<const uint8_t> bytes() const;

  // Sample i. REQUIRES: i < size().
  Sample Get(size_t i) const;
  // Sample i's whole window, context + 1 bytes. REQUIRES: i < size().
  std::span<const uint8_t> Window(size_t i) const;

 private:
  TextDataset(std::string name, std::unique_ptr<std::string> bytes, size_t context, size_t stride);

  std::string name_;
  std::unique_ptr<std::string> bytes_;  // on the heap so spans survive a move
  size_t context_ = 0;
  size_t stride_ = 0;
  size_t count_ = 0;
};

}  // namespace tandem::data
