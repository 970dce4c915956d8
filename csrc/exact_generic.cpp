// The batch-invariant kernels on eight plain floats: the same operations as exact_avx2.cpp,
// lane by lane (fmaf for the fused multiply-add), for a CPU without AVX2, and as the reference
// the AVX2 build is tested against.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "exact.h"

namespace {

struct Vec {
  float v[8];
};
struct Mask {
  bool v[8];
};

#define MOE_RL_LANES(expr) \
  Vec r;                   \
  for (int i = 0; i < 8; ++i) r.v[i] = (expr);    \
  return r

inline Vec vzero() { MOE_RL_LANES(0.f); }
inline Vec vset1(float a) { MOE_RL_LANES(a); }
inline Vec vadd(Vec a, Vec b) { MOE_RL_LANES(a.v[i] + b.v[i]); }
inline Vec vsub(Vec a, Vec b) { MOE_RL_LANES(a.v[i] - b.v[i]); }
inline Vec vmul(Vec a, Vec b) { MOE_RL_LANES(a.v[i] * b.v[i]); }
inline Vec vdiv(Vec a, Vec b) { MOE_RL_LANES(a.v[i] / b.v[i]); }
inline Vec vfma(Vec a, Vec b, Vec c) { MOE_RL_LANES(std::fmaf(a.v[i], b.v[i], c.v[i])); }
inline Vec vmax(Vec a, Vec b) { MOE_RL_LANES(a.v[i] > b.v[i] ? a.v[i] : b.v[i]); }
inline Vec vmin(Vec a, Vec b) { MOE_RL_LANES(a.v[i] < b.v[i] ? a.v[i] : b.v[i]); }
inline Vec vround(Vec a) { MOE_RL_LANES(std::nearbyintf(a.v[i])); }
inline Vec vselect(Mask m, Vec t, Vec f) { MOE_RL_LANES(m.v[i] ? t.v[i] : f.v[i]); }
inline Vec vload(const float* p) { MOE_RL_LANES(p[i]); }
inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline Vec vload(const uint16_t* p) { MOE_RL_LANES(bits_to_float(uint32_t(p[i]) << 16)); }
inline Vec vldexp(Vec y, Vec n) {
  Vec r;
  for (int i = 0; i < 8; ++i) {
    const int32_t ni = int32_t(n.v[i]), h = ni >> 1;
    r.v[i] = (y.v[i] * bits_to_float(uint32_t(h + 127) << 23)) * bits_to_float(uint32_t(ni - h + 127) << 23);
  }
  return r;
}
#undef MOE_RL_LANES

inline Mask vlt(Vec a, Vec b) {
  Mask m;
  for (int i = 0; i < 8; ++i) m.v[i] = a.v[i] < b.v[i];
  return m;
}
inline Mask vgt(Vec a, Vec b) {
  Mask m;
  for (int i = 0; i < 8; ++i) m.v[i] = a.v[i] > b.v[i];
  return m;
}
inline Mask visnan(Vec a) {
  Mask m;
  for (int i = 0; i < 8; ++i) m.v[i] = a.v[i] != a.v[i];
  return m;
}
inline void vstore(float* p, Vec a) {
  for (int i = 0; i < 8; ++i) p[i] = a.v[i];
}
inline uint16_t bf16_bits(float f) {
  const uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  return uint16_t((u + ((u >> 16) & 1u) + 0x7fffu) >> 16);
}
inline void vstore(uint16_t* p, Vec a) {
  for (int i = 0; i < 8; ++i) p[i] = bf16_bits(a.v[i]);
}
inline Vec vround_bf16(Vec a) {
  Vec r;
  for (int i = 0; i < 8; ++i) r.v[i] = bits_to_float(uint32_t(bf16_bits(a.v[i])) << 16);
  return r;
}
inline float hsum(Vec a) {
  const float* l = a.v;
  return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}
inline void hsum8(const Vec* a, float* out) {
  for (int i = 0; i < 8; ++i) out[i] = hsum(a[i]);
}
inline float hmax(Vec a) {
  float m = a.v[0];
  for (int i = 1; i < 8; ++i) m = a.v[i] > m ? a.v[i] : m;
  return m;
}

}  // namespace

#define MOE_RL_LIN_MR 4
#define MOE_RL_LIN_NR 2
#include "exact_kernels.h"

namespace moe_rl {
namespace exact {
MOE_RL_EXACT_ISA(isa_generic, "generic")
}  // namespace exact
}  // namespace moe_rl
