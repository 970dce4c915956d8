// The batch-invariant kernels, written once over an 8-lane vector type `Vec` that the including
// file defines (exact_avx2.cpp: AVX2 registers; exact_generic.cpp: eight floats), with:
//   vzero, vset1, vadd, vsub, vmul, vdiv, vfma(a, b, c) = a * b + c rounded once,
//   vmax/vmin(a, b) = a > b ? a : b / a < b ? a : b, vround (to nearest, ties to even),
//   vldexp(y, n) = y * 2^floor(n/2) * 2^(n - floor(n/2)) for integral n in [-126, 128],
//   vlt/vgt/visnan -> Mask, vselect(mask, t, f), vload/vstore for float and bf16 (uint16_t,
//   round to nearest even, NaN -> 0x7fc0), vround_bf16, hsum (the tree in exact.h) and hsum8
//   (eight of them at once), hmax. The including file also sets the linear kernel's output
//   tile, MOE_RL_LIN_MR x MOE_RL_LIN_NR (a multiple of 8 accumulators), and may name a faster
//   block function for an even number of columns (MOE_RL_LINEAR_BLOCK_PAIRS) that performs the
//   same operations for every output.
// Each function below performs the same operations, in the same order, on either Vec, so the
// two builds agree bit for bit (tests/kernels/test_exact_cpu.py checks it).
// Everything here has internal linkage: each build keeps its own copy.
#pragma once

namespace {

using moe_rl::exact::AttentionArgs;
using moe_rl::exact::CombineArgs;
using moe_rl::exact::EltwiseArgs;
using moe_rl::exact::LinearArgs;
using moe_rl::exact::LinearTask;
using moe_rl::exact::RmsNormArgs;
using moe_rl::exact::SoftmaxArgs;
using bf16 = uint16_t;

constexpr float kInf = __builtin_inff();

inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
  uint32_t u = uint32_t(x) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

// lanes [0, n) from p, the rest `fill`; and the converse store
template <class T>
inline Vec vload_part(const T* p, int64_t n, float fill) {
  alignas(32) float t[8];
  for (int i = 0; i < 8; ++i) t[i] = i < n ? to_float(p[i]) : fill;
  return vload(static_cast<const float*>(t));
}
inline void vstore_part(float* p, Vec v, int64_t n) {
  alignas(32) float t[8];
  vstore(t, v);
  for (int64_t i = 0; i < n; ++i) p[i] = t[i];
}
inline void vstore_part(bf16* p, Vec v, int64_t n) {
  alignas(16) bf16 t[8];
  vstore(t, v);
  for (int64_t i = 0; i < n; ++i) p[i] = t[i];
}

// exp(x) within ~2 ulp for x in [-87.33, 88.72] (Cody-Waite reduction by ln 2, degree-6
// polynomial); 0 below (no subnormal results), +inf above, NaN for NaN.
inline Vec vexp(Vec x) {
  const Vec lo = vset1(-87.3365478515625f), hi = vset1(88.7228317260742f);
  Vec xc = vmin(vmax(x, lo), hi);
  Vec n = vround(vmul(xc, vset1(1.44269504088896341f)));
  Vec r = vfma(n, vset1(-0.693359375f), xc);
  r = vfma(n, vset1(2.12194440e-4f), r);
  Vec p = vset1(1.9875691500e-4f);
  p = vfma(p, r, vset1(1.3981999507e-3f));
  p = vfma(p, r, vset1(8.3334519073e-3f));
  p = vfma(p, r, vset1(4.1665795894e-2f));
  p = vfma(p, r, vset1(1.6666665459e-1f));
  p = vfma(p, r, vset1(5.0000001201e-1f));
  Vec y = vadd(vfma(p, vmul(r, r), r), vset1(1.0f));
  y = vldexp(y, n);
  y = vselect(vlt(x, lo), vzero(), y);
  y = vselect(vgt(x, hi), vset1(kInf), y);
  return vselect(visnan(x), x, y);
}

inline float exp1(float x) {
  alignas(32) float t[8];
  vstore(t, vexp(vset1(x)));
  return t[0];
}

// sum_k a[k] * b[k] over n elements in the lane order of exact.h
template <class TA, class TB>
inline float dot(const TA* a, const TB* b, int64_t n) {
  Vec acc = vzero();
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) acc = vfma(vload(a + k), vload(b + k), acc);
  if (k < n) acc = vfma(vload_part(a + k, n - k, 0.f), vload_part(b + k, n - k, 0.f), acc);
  return hsum(acc);
}

// ---- linear -------------------------------------------------------------------------------
// An MR x NR block of outputs, each its own accumulator: the same operations for an output
// whichever block size computes it.
template <int MR, int NR, class T>
inline void linear_block(const T* x, int64_t sx, const T* w, int64_t sw, int64_t K, float (&out)[MR][NR]) {
  Vec acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = vzero();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    Vec xv[MR];
    for (int i = 0; i < MR; ++i) xv[i] = vload(x + i * sx + k);
    for (int j = 0; j < NR; ++j) {
      Vec wv = vload(w + j * sw + k);
      for (int i = 0; i < MR; ++i) acc[i][j] = vfma(xv[i], wv, acc[i][j]);
    }
  }
  if (k < K) {
    const int64_t n = K - k;
    Vec xv[MR];
    for (int i = 0; i < MR; ++i) xv[i] = vload_part(x + i * sx + k, n, 0.f);
    for (int j = 0; j < NR; ++j) {
      Vec wv = vload_part(w + j * sw + k, n, 0.f);
      for (int i = 0; i < MR; ++i) acc[i][j] = vfma(xv[i], wv, acc[i][j]);
    }
  }
  // reduce the accumulators eight at a time where there are eight: the same tree as hsum
  Vec* flat = &acc[0][0];
  float* res = &out[0][0];
  int c = 0;
  for (; c + 8 <= MR * NR; c += 8) hsum8(flat + c, res + c);
  for (; c < MR * NR; ++c) res[c] = hsum(flat[c]);
}

inline void store1(float* p, float v) { *p = v; }
inline void store1(bf16* p, float v) {
  alignas(16) bf16 t[8];
  vstore(t, vset1(v));
  *p = t[0];
}

template <int MR, int NR, class T>
inline void linear_store(const T* x, int64_t sx, const T* w, int64_t sw, const T* bias, T* y, int64_t sy,
                         int64_t K) {
  float out[MR][NR];
#ifdef MOE_RL_LINEAR_BLOCK_PAIRS  // the including file's faster block: the same operations per output
  if constexpr (NR % 2 == 0)
    MOE_RL_LINEAR_BLOCK_PAIRS<MR, NR, T>(x, sx, w, sw, K, out);
  else
#endif
    linear_block<MR, NR, T>(x, sx, w, sw, K, out);
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) store1(y + i * sy + j, bias ? out[i][j] + to_float(bias[j]) : out[i][j]);
}

constexpr int LIN_MR = MOE_RL_LIN_MR, LIN_NR = MOE_RL_LIN_NR;

template <class T>
void linear_tasks_t(const LinearArgs& a, const LinearTask* tasks, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    const LinearTask& tk = tasks[t];
    const T* w = static_cast<const T*>(a.w) + tk.group * a.swe;
    const T* bias = a.bias ? static_cast<const T*>(a.bias) : nullptr;
    const T* x = static_cast<const T*>(a.x);
    T* y = static_cast<T*>(a.y);
    const int64_t m_end = tk.m0 + tk.rows, n_end = tk.n0 + tk.cols;
    int64_t n = tk.n0;
    for (; n + LIN_NR <= n_end; n += LIN_NR) {
      const T* wn = w + n * a.sw;
      const T* bn = bias ? bias + n : nullptr;
      int64_t m = tk.m0;
      for (; m + LIN_MR <= m_end; m += LIN_MR)
        linear_store<LIN_MR, LIN_NR, T>(x + m * a.sx, a.sx, wn, a.sw, bn, y + m * a.sy + n, a.sy, a.K);
      for (; m < m_end; ++m) linear_store<1, LIN_NR, T>(x + m * a.sx, a.sx, wn, a.sw, bn, y + m * a.sy + n, a.sy, a.K);
    }
    for (; n < n_end; ++n) {
      const T* wn = w + n * a.sw;
      const T* bn = bias ? bias + n : nullptr;
      int64_t m = tk.m0;
      for (; m + LIN_MR <= m_end; m += LIN_MR)
        linear_store<LIN_MR, 1, T>(x + m * a.sx, a.sx, wn, a.sw, bn, y + m * a.sy + n, a.sy, a.K);
      for (; m < m_end; ++m) linear_store<1, 1, T>(x + m * a.sx, a.sx, wn, a.sw, bn, y + m * a.sy + n, a.sy, a.K);
    }
  }
}

void linear_tasks(const LinearArgs& a, const LinearTask* tasks, int64_t t0, int64_t t1) {
  if (a.dtype == moe_rl::exact::BF16)
    linear_tasks_t<bf16>(a, tasks, t0, t1);
  else
    linear_tasks_t<float>(a, tasks, t0, t1);
}

// ---- RMSNorm ------------------------------------------------------------------------------
template <class TX, class TW, class TY>
void rms_norm_t(const RmsNormArgs& a, int64_t r0, int64_t r1) {
  const int64_t H = a.H;
  const TW* w = static_cast<const TW*>(a.w);
  for (int64_t r = r0; r < r1; ++r) {
    const TX* x = static_cast<const TX*>(a.x) + r * a.sx;
    TY* y = static_cast<TY*>(a.y) + r * a.sy;
    const float mean = dot(x, x, H) / float(H);
    const Vec rstd = vset1(1.0f / __builtin_sqrtf(mean + a.eps));
    const bool round_x = sizeof(TX) == 2;
    int64_t k = 0;
    for (; k + 8 <= H; k += 8) {
      Vec n = vmul(vload(x + k), rstd);
      if (round_x) n = vround_bf16(n);
      vstore(y + k, vmul(vload(w + k), n));
    }
    if (k < H) {
      Vec n = vmul(vload_part(x + k, H - k, 0.f), rstd);
      if (round_x) n = vround_bf16(n);
      vstore_part(y + k, vmul(vload_part(w + k, H - k, 0.f), n), H - k);
    }
  }
}

void rms_norm_rows(const RmsNormArgs& a, int64_t r0, int64_t r1) {
  using moe_rl::exact::BF16;
  const int key = (a.x_dtype == BF16) * 4 + (a.w_dtype == BF16) * 2 + (a.y_dtype == BF16);
  switch (key) {
    case 0: return rms_norm_t<float, float, float>(a, r0, r1);
    case 2: return rms_norm_t<float, bf16, float>(a, r0, r1);
    case 4: return rms_norm_t<bf16, float, float>(a, r0, r1);
    case 7: return rms_norm_t<bf16, bf16, bf16>(a, r0, r1);
    default: return;  // rejected by the dispatcher
  }
}

// ---- (log-)softmax per row ----------------------------------------------------------------
template <class T>
void softmax_t(const SoftmaxArgs& a, int64_t r0, int64_t r1) {
  const int64_t V = a.V;
  for (int64_t r = r0; r < r1; ++r) {
    const T* x = static_cast<const T*>(a.x) + r * a.sx;
    Vec mv = vset1(-kInf);
    int64_t k = 0;
    for (; k + 8 <= V; k += 8) mv = vmax(vload(x + k), mv);
    if (k < V) mv = vmax(vload_part(x + k, V - k, -kInf), mv);
    const float m = hmax(mv);
    const Vec mm = vset1(m);
    Vec sv = vzero();
    for (k = 0; k + 8 <= V; k += 8) sv = vadd(sv, vexp(vsub(vload(x + k), mm)));
    if (k < V) sv = vadd(sv, vexp(vsub(vload_part(x + k, V - k, -kInf), mm)));
    const float s = hsum(sv);
    float* y = a.y + r * a.sy;
    if (a.log) {
      const float ls = __builtin_logf(s);
      if (a.labels) {  // one value: the same operations as the full row's element
        const int64_t lab = a.labels[r];
        y[0] = (lab >= 0 && lab < V) ? (to_float(x[lab]) - m) - ls : 0.f;
        continue;
      }
      const Vec lv = vset1(ls);
      for (k = 0; k + 8 <= V; k += 8) vstore(y + k, vsub(vsub(vload(x + k), mm), lv));
      if (k < V) vstore_part(y + k, vsub(vsub(vload_part(x + k, V - k, 0.f), mm), lv), V - k);
    } else {
      const Vec sd = vset1(s);
      for (k = 0; k + 8 <= V; k += 8) vstore(y + k, vdiv(vexp(vsub(vload(x + k), mm)), sd));
      if (k < V) vstore_part(y + k, vdiv(vexp(vsub(vload_part(x + k, V - k, 0.f), mm)), sd), V - k);
    }
  }
}

void softmax_rows(const SoftmaxArgs& a, int64_t r0, int64_t r1) {
  if (a.dtype == moe_rl::exact::BF16)
    softmax_t<bf16>(a, r0, r1);
  else
    softmax_t<float>(a, r0, r1);
}

// ---- attention ----------------------------------------------------------------------------
using moe_rl::exact::MAX_HEAD_DIM;

template <class T>
inline Vec vload_n(const T* p, int64_t n) {
  return n >= 8 ? vload(p) : vload_part(p, n, 0.f);
}
inline void vstore_n(float* p, Vec v, int64_t n) {
  if (n >= 8)
    vstore(p, v);
  else
    vstore_part(p, v, n);
}

// The scores of n keys (rows of kt, stride sk): sc[j] = dot(q, k_j) * scale, eight keys'
// lane sums reduced at once (hsum8: the same tree as dot's hsum).
template <class T>
inline void attn_scores(const float* qf, const T* kt, int64_t sk, int64_t n, int64_t D, float scale, float* sc) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    Vec acc[8];
    for (int u = 0; u < 8; ++u) acc[u] = vzero();
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
      const Vec qv = vload(qf + d);
      for (int u = 0; u < 8; ++u) acc[u] = vfma(qv, vload(kt + (j + u) * sk + d), acc[u]);
    }
    if (d < D) {
      const Vec qv = vload_part(qf + d, D - d, 0.f);
      for (int u = 0; u < 8; ++u) acc[u] = vfma(qv, vload_part(kt + (j + u) * sk + d, D - d, 0.f), acc[u]);
    }
    hsum8(acc, sc + j);
  }
  for (; j < n; ++j) sc[j] = dot(qf, kt + j * sk, D);
  const Vec sv = vset1(scale);
  for (j = 0; j + 8 <= n; j += 8) vstore(sc + j, vmul(vload(sc + j), sv));
  for (; j < n; ++j) sc[j] = sc[j] * scale;
}

// acc[0:D] = acc * alpha + sum_j p[j] * v_j over n keys: key j into partial sum j % 4 by fused
// multiply-adds in key order, the partials combined as (s0 + s1) + (s2 + s3). W columns of
// acc at a time (W / 8 vectors; the last chunk of a head may be narrower: loaded in part).
template <int NV, bool FULL, class T>
inline void attn_values_chunk(const float* p, const T* v, int64_t sv, int64_t n, int64_t width, Vec al, float* acc) {
  Vec s[4][NV];
  for (int i = 0; i < 4; ++i)
    for (int u = 0; u < NV; ++u) s[i][u] = vzero();
  auto load = [&](const T* ptr, int u) {
    if (FULL) return vload(ptr + 8 * u);
    return vload_part(ptr + 8 * u, imax(0, imin(8, width - 8 * u)), 0.f);
  };
  int64_t j = 0;
  for (; j + 4 <= n; j += 4)
    for (int i = 0; i < 4; ++i) {
      const Vec pj = vset1(p[j + i]);
      for (int u = 0; u < NV; ++u) s[i][u] = vfma(pj, load(v + (j + i) * sv, u), s[i][u]);
    }
  for (int i = 0; j < n; ++j, ++i) {
    const Vec pj = vset1(p[j]);
    for (int u = 0; u < NV; ++u) s[i][u] = vfma(pj, load(v + j * sv, u), s[i][u]);
  }
  for (int u = 0; u < NV; ++u) {
    const Vec blk = vadd(vadd(s[0][u], s[1][u]), vadd(s[2][u], s[3][u]));
    const int64_t w = imin(8, width - 8 * u);
    if (w <= 0) break;
    if (w == 8)
      vstore(acc + 8 * u, vadd(vmul(vload(acc + 8 * u), al), blk));
    else
      vstore_part(acc + 8 * u, vadd(vmul(vload_part(acc + 8 * u, w, 0.f), al), blk), w);
  }
}

template <class T>
inline void attn_values(const float* p, const T* vt, int64_t sv, int64_t n, int64_t D, float alpha, float* acc) {
  const Vec al = vset1(alpha);
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) attn_values_chunk<2, true>(p, vt + d, sv, n, 16, al, acc + d);
  if (d < D) attn_values_chunk<2, false>(p, vt + d, sv, n, D - d, al, acc + d);
}

template <class T>
void attention_t(const AttentionArgs& a, int64_t i0, int64_t i1) {
  constexpr int64_t B = moe_rl::exact::ATTN_BLOCK;
  const int64_t G = a.Hq / a.Hkv, Dqk = a.Dqk, Dv = a.Dv;
  alignas(32) float qf[MAX_HEAD_DIM], acc[MAX_HEAD_DIM], sc[B];
  int64_t s = 0;
  for (int64_t item = i0; item < i1; ++item) {
    const int64_t i = item / a.Hq, h = item % a.Hq, hk = h / G;
    while (s > 0 && a.cu_q[s] > i) --s;  // items arrive in order: a short walk from the last one
    while (a.cu_q[s + 1] <= i) ++s;
    const int64_t p = a.pos0[s] + (i - a.cu_q[s]);
    const int64_t lo = a.window > 0 ? imax(0, p - a.window + 1) : 0;
    const T* kb = static_cast<const T*>(a.k) + a.kv_seq[s] * a.sk_s + a.kv_start[s] * a.sk_t + hk * a.sk_h;
    const T* vb = static_cast<const T*>(a.v) + a.kv_seq[s] * a.sv_s + a.kv_start[s] * a.sv_t + hk * a.sv_h;
    const T* q = static_cast<const T*>(a.q) + i * a.sq_n + h * a.sq_h;
    for (int64_t d = 0; d < Dqk; ++d) qf[d] = to_float(q[d]);
    for (int64_t d = 0; d < Dv; ++d) acc[d] = 0.f;
    float m = -kInf, l = 0.f;
    for (int64_t b0 = (lo / B) * B; b0 <= p; b0 += B) {
      const int64_t t_first = imax(b0, lo), n = imin(b0 + B - 1, p) - t_first + 1;
      attn_scores(qf, kb + t_first * a.sk_t, a.sk_t, n, Dqk, a.scale, sc);
      Vec mv = vset1(-kInf);  // the block's max (exact in any order)
      int64_t c = 0;
      for (; c + 8 <= n; c += 8) mv = vmax(vload(sc + c), mv);
      if (c < n) mv = vmax(vload_part(sc + c, n - c, -kInf), mv);
      const float mb = hmax(mv);
      const float mn = m > mb ? m : mb;
      const float alpha = exp1(m - mn);
      const Vec mnv = vset1(mn);
      Vec lv = vzero();
      int64_t j = 0;
      for (; j + 8 <= n; j += 8) {
        Vec e = vexp(vsub(vload(sc + j), mnv));
        vstore(sc + j, e);
        lv = vadd(lv, e);
      }
      if (j < n) {
        Vec e = vexp(vsub(vload_part(sc + j, n - j, -kInf), mnv));
        vstore_part(sc + j, e, n - j);
        lv = vadd(lv, e);
      }
      l = l * alpha + hsum(lv);
      attn_values(sc, vb + t_first * a.sv_t, a.sv_t, n, Dv, alpha, acc);
      m = mn;
    }
    if (a.sinks) {  // a virtual last key with logit sinks[h] and a zero value
      const float sk = a.sinks[h], mn = m > sk ? m : sk;
      const float alpha = exp1(m - mn);
      l = l * alpha + exp1(sk - mn);
      attn_values(sc, vb, a.sv_t, 0, Dv, alpha, acc);
    }
    T* o = static_cast<T*>(a.out) + i * a.so_n + h * a.so_h;
    const Vec lv = vset1(l);
    int64_t d = 0;
    for (; d + 8 <= Dv; d += 8) vstore(o + d, vdiv(vload(acc + d), lv));
    if (d < Dv) vstore_part(o + d, vdiv(vload_part(acc + d, Dv - d, 0.f), lv), Dv - d);
  }
}

void attention_items(const AttentionArgs& a, int64_t i0, int64_t i1) {
  if (a.dtype == moe_rl::exact::BF16)
    attention_t<bf16>(a, i0, i1);
  else
    attention_t<float>(a, i0, i1);
}

// ---- elementwise: silu(g) * u, sigmoid(g) --------------------------------------------------
template <class T>
inline Vec eltwise_vec(Vec g, Vec u, int op) {
  const Vec one = vset1(1.0f);
  const Vec den = vadd(one, vexp(vsub(vzero(), g)));
  if (op == 1) return vdiv(one, den);
  Vec s = vdiv(g, den);
  if (sizeof(T) == 2) s = vround_bf16(s);  // F.silu's output in g's dtype, then the product
  return vmul(s, u);
}

template <class T>
void eltwise_t(const EltwiseArgs& a, int64_t r0, int64_t r1) {
  const int64_t C = a.cols;
  for (int64_t r = r0; r < r1; ++r) {
    const T* g = static_cast<const T*>(a.g) + r * a.sg;
    const T* u = a.op == 0 ? static_cast<const T*>(a.u) + r * a.su : g;
    T* y = static_cast<T*>(a.y) + r * a.sy;
    int64_t c = 0;
    for (; c + 8 <= C; c += 8) vstore(y + c, eltwise_vec<T>(vload(g + c), vload(u + c), a.op));
    if (c < C)
      vstore_part(y + c, eltwise_vec<T>(vload_part(g + c, C - c, 0.f), vload_part(u + c, C - c, 0.f), a.op), C - c);
  }
}

void eltwise_rows(const EltwiseArgs& a, int64_t r0, int64_t r1) {
  if (a.dtype == moe_rl::exact::BF16)
    eltwise_t<bf16>(a, r0, r1);
  else
    eltwise_t<float>(a, r0, r1);
}

// ---- MoE combine --------------------------------------------------------------------------
template <class T, class TW>
void combine_t(const CombineArgs& a, int64_t r0, int64_t r1) {
  const int64_t H = a.H, k = a.k;
  for (int64_t t = r0; t < r1; ++t) {
    const TW* w = static_cast<const TW*>(a.w) + t * a.sw;
    const T* e = static_cast<const T*>(a.e) + t * k * a.se;
    T* y = static_cast<T*>(a.y) + t * a.sy;
    int64_t h = 0;
    for (; h + 8 <= H; h += 8) {
      Vec acc = vzero();
      for (int64_t s = 0; s < k; ++s) acc = vfma(vset1(to_float(w[s])), vload(e + s * a.se + h), acc);
      vstore(y + h, acc);
    }
    if (h < H) {
      Vec acc = vzero();
      for (int64_t s = 0; s < k; ++s) acc = vfma(vset1(to_float(w[s])), vload_part(e + s * a.se + h, H - h, 0.f), acc);
      vstore_part(y + h, acc, H - h);
    }
  }
}

void combine_rows(const CombineArgs& a, int64_t r0, int64_t r1) {
  using moe_rl::exact::BF16;
  if (a.dtype == BF16)
    return a.w_dtype == BF16 ? combine_t<bf16, bf16>(a, r0, r1) : combine_t<bf16, float>(a, r0, r1);
  return a.w_dtype == BF16 ? combine_t<float, bf16>(a, r0, r1) : combine_t<float, float>(a, r0, r1);
}

void exp_array(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) vstore(y + i, vexp(vload(x + i)));
  if (i < n) vstore_part(y + i, vexp(vload_part(x + i, n - i, 0.f)), n - i);
}

}  // namespace

#define MOE_RL_EXACT_ISA(fn_name, label)                                                              \
  const moe_rl::exact::Isa& fn_name() {                                                               \
    static const moe_rl::exact::Isa isa{label,        linear_tasks,    rms_norm_rows, softmax_rows,   \
                                        attention_items, eltwise_rows, combine_rows,  exp_array};    \
    return isa;                                                                                       \
  }
