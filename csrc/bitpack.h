// Bit-packing of expert ids: each id takes `bits` bits (bits = ceil(log2(num_experts))).
//
// Format: ids are laid out as one little-endian bit stream, id i occupying bits
// [i*bits, (i+1)*bits), least significant bit first. Any 8 consecutive ids starting at an
// index that is a multiple of 8 therefore fill exactly `bits` whole bytes, which is what the
// fast paths work on: each group of 8 ids is assembled in (at most two) 64-bit words with shifts
// whose amounts are compile-time constants. The last partial group is zero-padded up to a
// whole byte, so a stream of n ids takes ceil(n*bits/8) bytes.
#pragma once
#include <cstddef>
#include <cstdint>

namespace moe_rl {

constexpr int kMaxBits = 16;  // up to 65536 experts

// ceil(log2(num_experts)), at least 1. num_experts must be in [1, 65536].
int bits_for(int64_t num_experts);

inline size_t packed_bytes(size_t n, int bits) { return (n * size_t(bits) + 7) / 8; }

// Packs n ids into out (packed_bytes(n, bits) bytes, all written). Returns the largest id
// seen, read as unsigned (a negative id shows up as a huge value), so the caller can check the
// range with one compare. Ids are masked to `bits` bits while packing.
template <typename T>
uint64_t pack(const T* in, size_t n, int bits, uint8_t* out);

// Decodes ids [first, first+n) from a stream of nbytes bytes into out.
template <typename O>
void unpack(const uint8_t* in, size_t nbytes, size_t first, size_t n, int bits, O* out);

// Index of the first row (of `k` consecutive ids) holding a repeated id, or -1.
template <typename T>
int64_t first_duplicate_row(const T* in, size_t rows, size_t k);

// Index of the first id that is negative or >= bound, or -1.
template <typename T>
int64_t first_out_of_range(const T* in, size_t n, int64_t bound);

}  // namespace moe_rl
