// Batch-invariant CPU kernels (moe_rl._C.exact_*): every reduction runs in an order fixed by the
// shape of one row, never by the number of rows, the thread count or the instruction set.
//
// The order, for every dot product, sum of squares and sum of exponentials over n elements:
// eight lanes, lane j accumulating elements j, j + 8, j + 16, ... in increasing index (the last
// partial group of eight padded with zeros), then the lanes summed as
// ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)). Products are accumulated with a fused
// multiply-add. Each instruction set (AVX2+FMA, and a portable build of the same templates)
// implements exactly these operations, so they agree bit for bit; threads split rows, tiles or
// (query, head) pairs, never one output's reduction.
#pragma once

#include <cstdint>

namespace moe_rl {
namespace exact {

enum DType : int { F32 = 0, BF16 = 1 };

// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), fp32 accumulation; x, w, bias, y of one dtype.
// Grouped (offs != nullptr): rows [offs[g-1], offs[g]) use w + g * swe (rows sorted by group).
struct LinearArgs {
  const void* x;
  int64_t sx;  // row stride of x (elements); the K dimension is contiguous
  const void* w;
  int64_t sw;   // row stride of w
  int64_t swe;  // group stride of w (grouped only)
  const void* bias;  // [N] or nullptr
  void* y;
  int64_t sy;
  int64_t M, N, K;
  int dtype;
  const int32_t* offs;  // [groups] end row of each group, or nullptr
  int64_t groups;
};

// One unit of linear work: rows [m0, m0 + rows) x columns [n0, n0 + cols) of group g.
struct LinearTask {
  int64_t m0, n0;
  int32_t rows, cols, group;
};

// RMSNorm, HF's cast order: y = w * to_x_dtype(x * rsqrt(mean(x^2) + eps)), the product in
// fp32 and rounded to y's dtype (the promotion of w's and x's dtypes).
struct RmsNormArgs {
  const void* x;
  int64_t sx;
  const void* w;
  void* y;
  int64_t sy;
  int64_t M, H;
  float eps;
  int x_dtype, w_dtype, y_dtype;
};

// Per row of x [M, V] (fp32 or bf16): log_softmax (log = 1), softmax (log = 0), into y (fp32).
// With labels (log only): y[m] = log_softmax(x[m])[labels[m]] (0 where labels[m] < 0).
struct SoftmaxArgs {
  const void* x;
  int64_t sx;
  float* y;
  int64_t sy;
  int64_t M, V;
  int dtype;
  int log;
  const int64_t* labels;
};

// Causal attention with an online softmax over key blocks of ATTN_BLOCK keys aligned to
// position 0 of each sequence. Query i of sequence s (rows cu_q[s] <= i < cu_q[s+1]) sits at
// position p = pos0[s] + i - cu_q[s] and attends keys t in [max(0, p - window + 1), p]
// (window 0: all) of its key sequence, at k + kv_seq[s] * sk_s + (kv_start[s] + t) * sk_t
// (kv_seq[s] < Sk, kv_start[s] + p < T for every query: checked before any read).
// q, k, v, out share one dtype; sinks (optional, fp32 [Hq]) add exp(sink) to the denominator.
constexpr int ATTN_BLOCK = 64;
constexpr int64_t MAX_HEAD_DIM = 512;
struct AttentionArgs {
  const void* q;
  int64_t sq_n, sq_h;
  const void* k;
  int64_t sk_s, sk_t, sk_h;
  const void* v;
  int64_t sv_s, sv_t, sv_h;
  void* out;
  int64_t so_n, so_h;
  const int32_t* cu_q;  // [S + 1]
  const int32_t* pos0;  // [S]
  const int64_t* kv_seq;    // [S]
  const int64_t* kv_start;  // [S]
  int64_t S, Nq, Hq, Hkv, Dqk, Dv;
  int64_t Sk, T;  // the key buffers' sequences and tokens per sequence
  float scale;
  int64_t window;
  const float* sinks;
  int dtype;
};

// Elementwise: silu_mul y = to_dtype(to_dtype(silu(g)) * u) (F.silu(g) * u in g's dtype);
// sigmoid y = sigmoid(g) (u unused). Rows of `cols` elements with row strides.
struct EltwiseArgs {
  const void* g;
  int64_t sg;
  const void* u;
  int64_t su;
  void* y;
  int64_t sy;
  int64_t rows, cols;
  int dtype;
  int op;  // 0 silu_mul, 1 sigmoid
};

// MoE combine: y[t, :] = sum over slots s = 0..k-1, in order, of w[t, s] * e[t * k + s, :],
// accumulated in fp32 with fused multiply-adds, rounded once to y's dtype (e's dtype).
struct CombineArgs {
  const void* e;
  int64_t se;
  const void* w;
  int64_t sw;
  void* y;
  int64_t sy;
  int64_t T, k, H;
  int dtype, w_dtype;
};

// One instruction set's implementation of every kernel, over a range of work items.
struct Isa {
  const char* name;
  void (*linear)(const LinearArgs&, const LinearTask*, int64_t t0, int64_t t1);
  void (*rms_norm)(const RmsNormArgs&, int64_t r0, int64_t r1);
  void (*softmax)(const SoftmaxArgs&, int64_t r0, int64_t r1);
  void (*attention)(const AttentionArgs&, int64_t i0, int64_t i1);  // items: (query, kv head)
  void (*eltwise)(const EltwiseArgs&, int64_t r0, int64_t r1);
  void (*combine)(const CombineArgs&, int64_t r0, int64_t r1);
  void (*exp)(const float* x, float* y, int64_t n);  // the kernels' exp, for tests
};

const Isa& isa_avx512();   // exact_avx512.cpp (AVX-512VL: more registers, the same operations)
const Isa& isa_avx2();     // exact_avx2.cpp
const Isa& isa_generic();  // exact_generic.cpp

// The dispatch (exact.cpp): the instruction set in use, the thread pool, the entry points.
bool avx2_supported();
bool avx512_supported();
const char* isa_name();
int last_threads();  // threads the last kernel call ran on (tests)
void set_isa(const char* name);  // "avx512", "avx2" or "generic"; throws if unsupported

void linear(const LinearArgs& a, int threads);
void rms_norm(const RmsNormArgs& a, int threads);
void softmax(const SoftmaxArgs& a, int threads);
void attention(const AttentionArgs& a, int threads);
void eltwise(const EltwiseArgs& a, int threads);
void combine(const CombineArgs& a, int threads);
void exp(const float* x, float* y, int64_t n);

// Seeded Gumbel-max sampling: row r picks argmax_v(logp[r, v] + g(seed[r], pos[r], v)), the
// first index on ties; g = -log(-log(u)), u a uniform in (0, 1) from a 32-bit hash of
// (seed, position, v). Rows with no finite logp pick 0.
void gumbel_argmax(const float* logp, int64_t sl, int64_t R, int64_t V, const int64_t* seed,
                   const int64_t* pos, int64_t* out, int threads);
// The uniforms themselves, [R, V] (tests and the GPU path's cross-check).
void gumbel_uniform(const int64_t* seed, const int64_t* pos, int64_t R, int64_t V, float* out);

}  // namespace exact
}  // namespace moe_rl
