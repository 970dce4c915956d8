// The 8-lane vector of the batch-invariant kernels on AVX2 + FMA registers, for
// exact_avx2.cpp and exact_avx512.cpp (the same instructions; AVX-512VL only adds registers).
// Included after the files' target pragmas; everything has internal linkage.
#pragma once

#include <immintrin.h>

namespace {

struct Vec {
  __m256 v;
};
using Mask = __m256;

inline Vec vzero() { return {_mm256_setzero_ps()}; }
inline Vec vset1(float a) { return {_mm256_set1_ps(a)}; }
inline Vec vadd(Vec a, Vec b) { return {_mm256_add_ps(a.v, b.v)}; }
inline Vec vsub(Vec a, Vec b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline Vec vmul(Vec a, Vec b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline Vec vdiv(Vec a, Vec b) { return {_mm256_div_ps(a.v, b.v)}; }
inline Vec vfma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
// MAXPS/MINPS: the first operand where the comparison holds, else the second
inline Vec vmax(Vec a, Vec b) { return {_mm256_max_ps(a.v, b.v)}; }
inline Vec vmin(Vec a, Vec b) { return {_mm256_min_ps(a.v, b.v)}; }
inline Vec vround(Vec a) { return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
inline Mask vlt(Vec a, Vec b) { return _mm256_cmp_ps(a.v, b.v, _CMP_LT_OQ); }
inline Mask vgt(Vec a, Vec b) { return _mm256_cmp_ps(a.v, b.v, _CMP_GT_OQ); }
inline Mask visnan(Vec a) { return _mm256_cmp_ps(a.v, a.v, _CMP_UNORD_Q); }
inline Vec vselect(Mask m, Vec t, Vec f) { return {_mm256_blendv_ps(f.v, t.v, m)}; }
inline Vec vldexp(Vec y, Vec n) {
  const __m256i ni = _mm256_cvtps_epi32(n.v);
  const __m256i h = _mm256_srai_epi32(ni, 1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, bias), 23));
  const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, h), bias), 23));
  return {_mm256_mul_ps(_mm256_mul_ps(y.v, f1), f2)};
}
inline Vec vload(const float* p) { return {_mm256_loadu_ps(p)}; }
inline Vec vload(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16))};
}
inline void vstore(float* p, Vec a) { _mm256_storeu_ps(p, a.v); }
// fp32 -> bf16 bits in the low half of each lane: round to nearest even, NaN -> 0x7fc0
inline __m256i bf16_bits(Vec a) {
  const __m256i u = _mm256_castps_si256(a.v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
}
inline void vstore(uint16_t* p, Vec a) {
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_bits(a), bf16_bits(a)), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
inline Vec vround_bf16(Vec a) { return {_mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(a), 16))}; }
// ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), for one vector and for eight at once
inline float hsum(Vec a) {
  const __m256 h = _mm256_hadd_ps(a.v, a.v);
  const __m256 q = _mm256_hadd_ps(h, h);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(q), _mm256_extractf128_ps(q, 1)));
}
inline void hsum8(const Vec* a, float* out) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0].v, a[1].v), _mm256_hadd_ps(a[2].v, a[3].v));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4].v, a[5].v), _mm256_hadd_ps(a[6].v, a[7].v));
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
}
inline float hmax(Vec a) {
  const __m128 s4 = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  const __m128 s2 = _mm_max_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_max_ss(s2, _mm_movehdup_ps(s2)));
}

}  // namespace
