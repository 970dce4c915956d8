// pybind11 bindings of the batch-invariant kernels: moe_rl._C.exact_*. Tensors cross as data
// pointers (integers) with their shapes and strides in elements, checked by the Python wrappers
// in moe_rl.kernels.exact, which own the memory; every kernel runs without the GIL.
#include <pybind11/pybind11.h>

#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "exact.h"

namespace py = pybind11;
using namespace moe_rl::exact;

namespace {

template <class T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

}  // namespace

void bind_exact(py::module_& m) {
  using nogil = py::call_guard<py::gil_scoped_release>;
  m.def("exact_isa", [] { return std::string(isa_name()); }, "the instruction set the exact kernels use");
  m.def("exact_set_isa", [](const std::string& n) { set_isa(n.c_str()); }, py::arg("name"),
        "'avx512', 'avx2' or 'generic' (tests: all give the same bits)");
  m.def("exact_last_threads", &last_threads, "threads the last exact kernel call ran on (tests)");
  m.def("exact_supported_isas", [] {
    std::vector<std::string> out{"generic"};
    if (avx2_supported()) out.push_back("avx2");
    if (avx512_supported()) out.push_back("avx512");
    return out;
  });
  m.def(
      "exact_linear",
      [](uintptr_t x, int64_t sx, uintptr_t w, int64_t sw, int64_t swe, uintptr_t bias, uintptr_t y, int64_t sy,
         int64_t M, int64_t N, int64_t K, int dtype, uintptr_t offs, int64_t groups, int threads) {
        linear({ptr<const void>(x), sx, ptr<const void>(w), sw, swe, ptr<const void>(bias), ptr<void>(y), sy, M, N, K,
                dtype, ptr<const int32_t>(offs), groups},
               threads);
      },
      nogil());
  m.def(
      "exact_rms_norm",
      [](uintptr_t x, int64_t sx, uintptr_t w, uintptr_t y, int64_t sy, int64_t M, int64_t H, float eps, int xd, int wd,
         int yd, int threads) {
        rms_norm({ptr<const void>(x), sx, ptr<const void>(w), ptr<void>(y), sy, M, H, eps, xd, wd, yd}, threads);
      },
      nogil());
  m.def(
      "exact_softmax",
      [](uintptr_t x, int64_t sx, uintptr_t y, int64_t sy, int64_t M, int64_t V, int dtype, int log, uintptr_t labels,
         int threads) {
        softmax({ptr<const void>(x), sx, ptr<float>(y), sy, M, V, dtype, log, ptr<const int64_t>(labels)}, threads);
      },
      nogil());
  m.def(
      "exact_attention",
      [](uintptr_t q, int64_t sq_n, int64_t sq_h, uintptr_t k, int64_t sk_s, int64_t sk_t, int64_t sk_h, uintptr_t v,
         int64_t sv_s, int64_t sv_t, int64_t sv_h, uintptr_t out, int64_t so_n, int64_t so_h, uintptr_t cu_q,
         uintptr_t pos0, uintptr_t kv_seq, uintptr_t kv_start, int64_t S, int64_t Nq, int64_t Hq, int64_t Hkv,
         int64_t Dqk, int64_t Dv, int64_t Sk, int64_t T, float scale, int64_t window, uintptr_t sinks, int dtype, int threads) {
        attention({ptr<const void>(q), sq_n, sq_h, ptr<const void>(k), sk_s, sk_t, sk_h, ptr<const void>(v), sv_s, sv_t,
                   sv_h, ptr<void>(out), so_n, so_h, ptr<const int32_t>(cu_q), ptr<const int32_t>(pos0),
                   ptr<const int64_t>(kv_seq), ptr<const int64_t>(kv_start), S, Nq, Hq, Hkv, Dqk, Dv, Sk, T, scale, window,
                   ptr<const float>(sinks), dtype},
                  threads);
      },
      nogil());
  m.def(
      "exact_eltwise",
      [](uintptr_t g, int64_t sg, uintptr_t u, int64_t su, uintptr_t y, int64_t sy, int64_t rows, int64_t cols,
         int dtype, int op, int threads) {
        eltwise({ptr<const void>(g), sg, ptr<const void>(u), su, ptr<void>(y), sy, rows, cols, dtype, op}, threads);
      },
      nogil());
  m.def(
      "exact_combine",
      [](uintptr_t e, int64_t se, uintptr_t w, int64_t sw, uintptr_t y, int64_t sy, int64_t T, int64_t k, int64_t H,
         int dtype, int wd, int threads) {
        combine({ptr<const void>(e), se, ptr<const void>(w), sw, ptr<void>(y), sy, T, k, H, dtype, wd}, threads);
      },
      nogil());
  m.def(
      "exact_exp", [](uintptr_t x, uintptr_t y, int64_t n) { exp(ptr<const float>(x), ptr<float>(y), n); }, nogil());
  m.def(
      "exact_gumbel_argmax",
      [](uintptr_t logp, int64_t sl, int64_t R, int64_t V, uintptr_t seed, uintptr_t pos, uintptr_t out, int threads) {
        gumbel_argmax(ptr<const float>(logp), sl, R, V, ptr<const int64_t>(seed), ptr<const int64_t>(pos),
                      ptr<int64_t>(out), threads);
      },
      nogil());
  m.def(
      "exact_gumbel_uniform",
      [](uintptr_t seed, uintptr_t pos, int64_t R, int64_t V, uintptr_t out) {
        gumbel_uniform(ptr<const int64_t>(seed), ptr<const int64_t>(pos), R, V, ptr<float>(out));
      },
      nogil());
}
