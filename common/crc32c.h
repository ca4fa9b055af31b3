// CRC-32C (Castagnoli): the checksum of the coordinator's log records and
// snapshots and of the parameter servers' checkpoints. Reflected polynomial 0x82F63B78, initial value and final xor
// 0xFFFFFFFF, as in iSCSI (RFC 3720), ext4 and LevelDB, so
// Crc32c("123456789", 9) == 0xE3069283.
//
// Thread safety: thread-safe (a pure function over constant tables).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace tandem {

// The CRC-32C of `n` bytes at `data`. Pass the CRC of the bytes before them as
// `crc` to checksum data that arrives in pieces:
// Crc32c(b, nb, Crc32c(a, na)) == Crc32c(a followed by b).
uint32_t Crc32c(const void* data, size_t n, uint32_t crc = 0);

inline uint32_t Crc32c(std::string_view bytes, uint32_t crc = 0) {
  return Crc32c(bytes.data(), bytes.size(), crc);
}

}  // namespace tandem
