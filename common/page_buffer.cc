#include "common/page_buffer.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

namespace tandem {
namespace {

size_t PageSize() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

}  // namespace

PageBuffer::PageBuffer(size_t size) : size_(size) {
  if (size == 0) return;
  const size_t page = PageSize();
  mapped_bytes_ = (size * sizeof(float) + page - 1) / page * page;
  void* p = mmap(nullptr, mapped_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    std::fprintf(stderr, "PageBuffer: cannot map %zu bytes: %s\n", mapped_bytes_, std::strerror(errno));
    std::abort();
  }
  data_ = static_cast<float*>(p);
}

PageBuffer::~PageBuffer() {
  if (data_ != nullptr) munmap(data_, mapped_bytes_);
}

PageBuffer::PageBuffer(PageBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      mapped_bytes_(std::exchange(other.mapped_bytes_, 0)) {}

PageBuffer& PageBuffer::operator=(PageBuffer&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) munmap(data_, mapped_bytes_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    mapped_bytes_ = std::exchange(other.mapped_bytes_, 0);
  }
  return *this;
}

size_t PageBuffer::ResidentBytes() const {
  if (data_ == nullptr) return 0;
  const size_t page = PageSize();
  std::vector<unsigned char> resident(mapped_bytes_ / page);
  if (mincore(data_, mapped_bytes_, resident.data()) != 0) return mapped_bytes_;
  size_t pages = 0;
  for (unsigned char r : resident) pages += r & 1;
  return pages * page;
}

void PageBuffer::Release(size_t begin, size_t end) {
  if (begin >= end) return;
  const size_t page = PageSize();
  const auto base = reinterpret_cast<uintptr_t>(data_);
  const uintptr_t from = base + begin * sizeof(float), to = base + end * sizeof(float);
  const uintptr_t first_page = (from + page - 1) / page * page, last_page = to / page * page;
  if (first_page >= last_page) {
    std::memset(reinterpret_cast<void*>(from), 0, to - from);
    return;
  }
  std::memset(reinterpret_cast<void*>(from), 0, first_page - from);
  std::memset(reinterpret_cast<void*>(last_page), 0, to - last_page);
  // Private anonymous pages read as zeros after MADV_DONTNEED.
  madvise(reinterpret_cast<void*>(first_page), last_page - first_page, MADV_DONTNEED);
}

}  // namespace tandem
