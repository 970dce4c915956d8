// CRC32C (Castagnoli, reflected polynomial 0x82F63B78) in portable software.
//
// Slice-by-8 table lookup: eight 256-entry tables let the loop consume 8 bytes per step.
// No CPU-specific instructions, so the build stays portable (no -march flags).
#pragma once
#include <cstddef>
#include <cstdint>

namespace moe_rl {

// Continue a CRC32C: pass 0 to start, pass the previous result to extend over more bytes.
// crc32c(crc32c(0, a, n), b, m) == crc32c(0, a||b, n+m).
uint32_t crc32c(uint32_t crc, const void* data, size_t n);

}  // namespace moe_rl
