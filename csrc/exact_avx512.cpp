// The batch-invariant kernels of exact_avx2.cpp, built with AVX-512VL enabled: the same 8-lane
// AVX2 operations (the same bits), with 32 vector registers instead of 16, which lets the
// linear kernel keep a 4 x 4 tile of accumulators in registers. exact.cpp calls it only on a
// CPU that has AVX-512F and AVX-512VL.
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

#define MOE_RL_LIN_MR 4
#define MOE_RL_LIN_NR 4
#include "exact_kernels.h"

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
