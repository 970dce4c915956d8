#include "bitpack.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <vector>

namespace moe_rl {
namespace {

template <int B>
struct Group {
  static constexpr int kWords = (8 * B + 63) / 64;  // 64-bit words spanned by 8 ids
  static constexpr uint64_t kMask = (uint64_t(1) << B) - 1;
};

template <typename T>
inline uint64_t as_unsigned(T v) {
  return static_cast<uint64_t>(static_cast<std::make_unsigned_t<T>>(v));
}

// Packs 8 ids into `kWords` words; returns the max (unsigned) id.
template <int B, typename T>
inline uint64_t pack8(const T* in, uint64_t* w) {
  constexpr int NW = Group<B>::kWords;
  uint64_t mx = 0;
  for (int i = 0; i < NW; ++i) w[i] = 0;
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    const uint64_t raw = as_unsigned(in[j]);
    mx = raw > mx ? raw : mx;
    const uint64_t v = raw & Group<B>::kMask;
    const int s = j * B, wi = s >> 6, off = s & 63;
    w[wi] |= v << off;
    if (off + B > 64) w[wi + 1] |= v >> (64 - off);
  }
  return mx;
}

template <int B, typename O>
inline void unpack8(const uint64_t* w, O* out) {
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    const int s = j * B, wi = s >> 6, off = s & 63;
    uint64_t v = w[wi] >> off;
    if (off + B > 64) v |= w[wi + 1] << (64 - off);
    out[j] = static_cast<O>(v & Group<B>::kMask);
  }
}

template <int B, typename T>
uint64_t pack_impl(const T* in, size_t n, uint8_t* out) {
  constexpr int NW = Group<B>::kWords;
  const size_t nbytes = packed_bytes(n, B);
  const size_t groups = n / 8;
  // Groups whose full-word store stays inside the output: the spill past B bytes is zeros and
  // is overwritten by the next group's store.
  const size_t fast = nbytes >= size_t(NW * 8) ? std::min(groups, (nbytes - NW * 8) / B + 1) : 0;
  uint64_t mx = 0;
  uint64_t w[NW];
  size_t g = 0;
  for (; g < fast; ++g) {
    const uint64_t m = pack8<B>(in + 8 * g, w);
    mx = m > mx ? m : mx;
    std::memcpy(out + g * B, w, NW * 8);
  }
  for (; g < groups; ++g) {
    const uint64_t m = pack8<B>(in + 8 * g, w);
    mx = m > mx ? m : mx;
    std::memcpy(out + g * B, w, B);
  }
  const size_t rem = n - groups * 8;
  if (rem) {
    T tmp[8] = {};
    for (size_t j = 0; j < rem; ++j) tmp[j] = in[groups * 8 + j];
    const uint64_t m = pack8<B>(tmp, w);
    mx = m > mx ? m : mx;
    std::memcpy(out + groups * B, w, nbytes - groups * B);
  }
  return mx;
}

// Loads group g (8 ids) into words, reading only bytes inside the stream.
template <int B>
inline void load_group(const uint8_t* in, size_t nbytes, size_t g, uint64_t* w) {
  constexpr int NW = Group<B>::kWords;
  const size_t at = g * B;
  if (at + NW * 8 <= nbytes) {
    std::memcpy(w, in + at, NW * 8);
  } else {
    for (int i = 0; i < NW; ++i) w[i] = 0;
    const size_t avail = at < nbytes ? std::min<size_t>(B, nbytes - at) : 0;
    std::memcpy(w, in + at, avail);
  }
}

template <int B, typename O>
void unpack_impl(const uint8_t* in, size_t nbytes, size_t first, size_t n, O* out) {
  constexpr int NW = Group<B>::kWords;
  uint64_t w[NW];
  O tmp[8];
  size_t i = first;
  const size_t end = first + n;
  // Head: ids before the first group boundary.
  if (i % 8 && i < end) {
    load_group<B>(in, nbytes, i / 8, w);
    unpack8<B>(w, tmp);
    const size_t stop = std::min(end, (i / 8 + 1) * 8);
    for (; i < stop; ++i) *out++ = tmp[i % 8];
  }
  // Body: whole groups. Full-word loads while they stay inside the stream.
  const size_t g_end = end / 8;
  size_t g = i / 8;
  const size_t fast_end =
      nbytes >= size_t(NW * 8) ? std::min(g_end, (nbytes - NW * 8) / B + 1) : 0;
  for (; g < fast_end; ++g) {
    std::memcpy(w, in + g * B, NW * 8);
    unpack8<B>(w, out);
    out += 8;
  }
  for (; g < g_end; ++g) {
    load_group<B>(in, nbytes, g, w);
    unpack8<B>(w, out);
    out += 8;
  }
  i = std::max(i, g_end * 8);
  // Tail.
  if (i < end) {
    load_group<B>(in, nbytes, i / 8, w);
    unpack8<B>(w, tmp);
    for (size_t j = 0; i < end; ++i, ++j) *out++ = tmp[j];
  }
}

template <typename T>
using PackFn = uint64_t (*)(const T*, size_t, uint8_t*);
template <typename O>
using UnpackFn = void (*)(const uint8_t*, size_t, size_t, size_t, O*);

template <typename T, int... Bs>
constexpr PackFn<T> pack_table_entry(int b, std::integer_sequence<int, Bs...>) {
  PackFn<T> fns[] = {&pack_impl<Bs + 1, T>...};
  return fns[b - 1];
}
template <typename O, int... Bs>
constexpr UnpackFn<O> unpack_table_entry(int b, std::integer_sequence<int, Bs...>) {
  UnpackFn<O> fns[] = {&unpack_impl<Bs + 1, O>...};
  return fns[b - 1];
}

void check_bits(int bits) {
  if (bits < 1 || bits > kMaxBits) throw std::invalid_argument("bits must be in [1, 16]");
}

}  // namespace

int bits_for(int64_t num_experts) {
  if (num_experts < 1 || num_experts > (int64_t(1) << kMaxBits))
    throw std::invalid_argument("num_experts must be in [1, 65536]");
  int b = 1;
  while ((int64_t(1) << b) < num_experts) ++b;
  return b;
}

template <typename T>
uint64_t pack(const T* in, size_t n, int bits, uint8_t* out) {
  check_bits(bits);
  return pack_table_entry<T>(bits, std::make_integer_sequence<int, kMaxBits>{})(in, n, out);
}

template <typename O>
void unpack(const uint8_t* in, size_t nbytes, size_t first, size_t n, int bits, O* out) {
  check_bits(bits);
  if (packed_bytes(first + n, bits) > nbytes) throw std::out_of_range("unpack past end of stream");
  unpack_table_entry<O>(bits, std::make_integer_sequence<int, kMaxBits>{})(in, nbytes, first, n,
                                                                           out);
}

// Rows of a compile-time width K: compare each id with the ones 1..K/2 places further round
// the row, which covers every pair; branch-free so the compiler can vectorise it.
template <int K, typename T>
int64_t first_duplicate_row_k(const T* in, size_t rows) {
  constexpr size_t kBlock = 16;
  for (size_t r0 = 0; r0 < rows; r0 += kBlock) {
    const size_t r1 = std::min(rows, r0 + kBlock);
    bool any = false;
    for (size_t r = r0; r < r1; ++r) {
      const T* row = in + r * K;
      bool dup = false;
#pragma GCC unroll 16
      for (int s = 1; s <= K / 2; ++s)
#pragma GCC unroll 16
        for (int j = 0; j < K; ++j) dup |= row[j] == row[(j + s) % K];
      any |= dup;
    }
    if (any) {
      for (size_t r = r0; r < r1; ++r) {
        const T* row = in + r * K;
        for (int a = 1; a < K; ++a)
          for (int b = 0; b < a; ++b)
            if (row[a] == row[b]) return int64_t(r);
      }
    }
  }
  return -1;
}

template <typename T>
int64_t first_duplicate_row(const T* in, size_t rows, size_t k) {
  switch (k) {
    case 0:
    case 1: return -1;
    case 2: return first_duplicate_row_k<2>(in, rows);
    case 4: return first_duplicate_row_k<4>(in, rows);
    case 6: return first_duplicate_row_k<6>(in, rows);
    case 8: return first_duplicate_row_k<8>(in, rows);
    case 10: return first_duplicate_row_k<10>(in, rows);
    case 12: return first_duplicate_row_k<12>(in, rows);
    case 16: return first_duplicate_row_k<16>(in, rows);
  }
  for (size_t r = 0; r < rows; ++r) {
    const T* row = in + r * k;
    bool dup = false;
    for (size_t a = 1; a < k; ++a)
      for (size_t b = 0; b < a; ++b) dup |= row[a] == row[b];
    if (dup) return int64_t(r);
  }
  return -1;
}

template <typename T>
int64_t first_out_of_range(const T* in, size_t n, int64_t bound) {
  for (size_t i = 0; i < n; ++i) {
    if (as_unsigned(in[i]) >= uint64_t(bound)) return int64_t(i);
  }
  return -1;
}

#define MOE_RL_INSTANTIATE_IN(T)                                                   \
  template uint64_t pack<T>(const T*, size_t, int, uint8_t*);                      \
  template int64_t first_duplicate_row<T>(const T*, size_t, size_t);               \
  template int64_t first_out_of_range<T>(const T*, size_t, int64_t);
MOE_RL_INSTANTIATE_IN(int8_t)
MOE_RL_INSTANTIATE_IN(uint8_t)
MOE_RL_INSTANTIATE_IN(int16_t)
MOE_RL_INSTANTIATE_IN(uint16_t)
MOE_RL_INSTANTIATE_IN(int32_t)
MOE_RL_INSTANTIATE_IN(uint32_t)
MOE_RL_INSTANTIATE_IN(int64_t)
MOE_RL_INSTANTIATE_IN(uint64_t)
#undef MOE_RL_INSTANTIATE_IN

template void unpack<int32_t>(const uint8_t*, size_t, size_t, size_t, int, int32_t*);
template void unpack<int64_t>(const uint8_t*, size_t, size_t, size_t, int, int64_t*);

}  // namespace moe_rl
