// CRC32C (Castagnoli polynomial, the checksum of iSCSI, ext4 metadata and Google's storage
// systems): checkpoints record one per rank file and per stored piece, so a flipped byte is caught
// on load. Incremental: crc32c(crc32c(0, a), b) == crc32c(0, a + b).
#pragma once
#include <cstddef>
#include <cstdint>

namespace mt {

uint32_t crc32c(uint32_t crc, const void* data, size_t n);

}  // namespace mt
