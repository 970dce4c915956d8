// The batch-invariant kernels of exact_avx2.cpp, built with AVX-512F/VL enabled: the same 8-lane
// operations (the same bits), with 32 vector registers instead of 16, and a linear kernel that
// runs two outputs' 8 lanes in one 16-lane register (lanes 0-7: column n, lanes 8-15: column
// n + 1, the input row repeated in both halves): each lane still accumulates the same products
// in the same order with the same fused multiply-add, in half the instructions. exact.cpp calls
// it only on a CPU that has AVX-512F and AVX-512VL.
#include <cstdint>
#include <immintrin.h>

#include "exact.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,avx512f,avx512vl"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512vl")
#endif

#include "exact_vec_avx2.h"

// GCC 12's AVX-512 headers pass an undefined vector to the builtins behind these intrinsics and
// then warn about it (GCC bug 105593, fixed in GCC 13)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace {

inline __m512 dup256(Vec a) {  // [a | a]
  return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(a.v)));
}
inline __m512 join256(Vec lo, Vec hi) {  // [lo | hi]: 128-bit pieces 0, 1 of lo, then 0, 1 of hi
  return _mm512_castpd_ps(_mm512_shuffle_f64x2(_mm512_zextpd256_pd512(_mm256_castps_pd(lo.v)),
                                               _mm512_zextpd256_pd512(_mm256_castps_pd(hi.v)), 0x44));
}
inline Vec lo256(__m512 a) { return {_mm512_castps512_ps256(a)}; }
inline Vec hi256(__m512 a) { return {_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1))}; }

template <class T>
inline Vec load8_part(const T* p, int64_t n);  // defined after exact_kernels.h's vload_part

// out[i][j] = the 8-lane dot of x row i and w row j over K (csrc/exact.h), two columns per
// 16-lane register
template <int MR, int NR, class T>
void linear_block_pairs(const T* x, int64_t sx, const T* w, int64_t sw, int64_t K, float (&out)[MR][NR]);

}  // namespace

#define MOE_RL_LIN_MR 4
#define MOE_RL_LIN_NR 8
#define MOE_RL_LINEAR_BLOCK_PAIRS linear_block_pairs
#include "exact_kernels.h"

namespace {

template <class T>
inline Vec load8_part(const T* p, int64_t n) {
  return vload_part(p, n, 0.f);
}

template <int MR, int NR, class T>
void linear_block_pairs(const T* x, int64_t sx, const T* w, int64_t sw, int64_t K, float (&out)[MR][NR]) {
  constexpr int NP = NR / 2;
  __m512 acc[MR][NP];
  for (int i = 0; i < MR; ++i)
    for (int q = 0; q < NP; ++q) acc[i][q] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m512 xv[MR];
    for (int i = 0; i < MR; ++i) xv[i] = dup256(vload(x + i * sx + k));
    for (int q = 0; q < NP; ++q) {
      const __m512 wv = join256(vload(w + (2 * q) * sw + k), vload(w + (2 * q + 1) * sw + k));
      for (int i = 0; i < MR; ++i) acc[i][q] = _mm512_fmadd_ps(xv[i], wv, acc[i][q]);
    }
  }
  if (k < K) {
    const int64_t n = K - k;
    __m512 xv[MR];
    for (int i = 0; i < MR; ++i) xv[i] = dup256(load8_part(x + i * sx + k, n));
    for (int q = 0; q < NP; ++q) {
      const __m512 wv = join256(load8_part(w + (2 * q) * sw + k, n), load8_part(w + (2 * q + 1) * sw + k, n));
      for (int i = 0; i < MR; ++i) acc[i][q] = _mm512_fmadd_ps(xv[i], wv, acc[i][q]);
    }
  }
  Vec lanes[MR * NR];
  for (int i = 0; i < MR; ++i)
    for (int q = 0; q < NP; ++q) {
      lanes[i * NR + 2 * q] = lo256(acc[i][q]);
      lanes[i * NR + 2 * q + 1] = hi256(acc[i][q]);
    }
  float* res = &out[0][0];
  int c = 0;
  for (; c + 8 <= MR * NR; c += 8) hsum8(lanes + c, res + c);
  for (; c < MR * NR; ++c) res[c] = hsum(lanes[c]);
}

}  // namespace

namespace moe_rl {
namespace exact {
MOE_RL_EXACT_ISA(isa_avx512, "avx512")
}  // namespace exact
}  // namespace moe_rl

#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif
