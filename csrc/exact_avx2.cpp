// The batch-invariant kernels on AVX2 + FMA registers (8 float lanes). Only this file is built
// for AVX2 (the pragma below, after the system headers); exact.cpp calls it only on a CPU that
// has AVX2 and FMA.
#include <cstdint>
#include <immintrin.h>

#include "exact.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif

#include "exact_vec_avx2.h"

// output tiles of the linear kernel: 4 rows x 2 columns (8 accumulators: one hsum8)
#define MOE_RL_LIN_MR 4
#define MOE_RL_LIN_NR 2
#include "exact_kernels.h"

namespace moe_rl {
namespace exact {
MOE_RL_EXACT_ISA(isa_avx2, "avx2")
}  // namespace exact
}  // namespace moe_rl

#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif
