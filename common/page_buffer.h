// PageBuffer: a fixed-size array of floats in its own anonymous memory
// mapping, whose pages can be handed back to the kernel (Release): they then
// read as zeros and take no memory until written again. Used for a model's
// parameters and gradients, so that the sharded placement keeps only the
// layers in use resident.
//
// Thread safety: a value; Release may run while other threads read or write
// other pages of the buffer.
#pragma once

#include <cstddef>
#include <span>

namespace tandem {

class PageBuffer {
 public:
  PageBuffer() = default;
  // `size` floats, all zero. Aborts if the address space cannot be mapped
  // (as std::vector would throw std::bad_alloc).
  explicit PageBuffer(size_t size);
  ~PageBuffer();
  PageBuffer(PageBuffer&& other) noexcept;
  PageBuffer& operator=(PageBuffer&& other) noexcept;
  PageBuffer(const PageBuffer&) = delete;
  PageBuffer& operator=(const PageBuffer&) = delete;

  float* data() { return data_; }
  const float* data() const { return data_; }
  size_t size() const { return size_; }
  operator std::span<float>() { return {data_, size_}; }
  operator std::span<const float>() const { return {data_, size_}; }

  // Elements [begin, end) read as zero from now on; the whole pages inside
  // the range go back to the kernel (the partial pages at its ends are
  // zeroed in place). REQUIRES: begin <= end <= size().
  void Release(size_t begin, size_t end);
  // Release(0, size()).
  void Zero() { Release(0, size_); }
  // Bytes of the buffer in memory now (whole pages, as the kernel reports
  // them with mincore).
  size_t ResidentBytes() const;

 private:
  float* data_ = nullptr;
  size_t size_ = 0;
  size_t mapped_bytes_ = 0;
};

}  // namespace tandem
