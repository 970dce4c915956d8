"""Batch-invariant MoE pieces: the grouped expert GEMM, the combine over the top-k slots, and the
elementwise SiLU-and-multiply and sigmoid.

* ``grouped_linear``: rows sorted by expert, ``y[r] = x[r] @ w[g].T`` for row r of group g. On
  CPU the linear kernel of ``linear.py`` per group (each output its own fixed-order fp32
  reduction over K), so a row's result does not depend on its group's size or on the other
  groups; on GPU ``moe_rl.kernels.grouped_gemm``'s Triton kernel (one tile config per dtype,
  the whole K loop per tile, no split-K: a row's result depends only on its own data).
* ``moe_combine``: ``y[t] = sum_s w[t, s] * e[t * k + s]`` over the slots in slot order, in fp32
  with fused multiply-adds, rounded once to e's dtype (CPU kernel; Triton on GPU). No atomics.
* ``silu_mul`` (``F.silu(g) * u`` in g's dtype) and ``sigmoid``: torch's CPU kernels compute an
  element by vectorised or scalar code depending on where it falls in the buffer (a tail, a
  thread's chunk), which changes the last bit; these use the C++ kernels' own exp for every
  element. On a GPU torch's elementwise kernels apply one function to every element and are
  used as they are.

All differentiable; the backward is plain torch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _common as C
from ..grouped_gemm import _grouped_mm_wgrad_op, grouped_gemm

if C.triton is not None:
    triton, tl = C.triton, C.tl

    @triton.jit
    def _exact_combine_kernel(e_ptr, w_ptr, y_ptr, H, K_SLOTS, stride_e, stride_w, stride_y, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < H
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(0, K_SLOTS):
            w = tl.load(w_ptr + t * stride_w + s).to(tl.float32)
            e = tl.load(e_ptr + (t * K_SLOTS + s) * stride_e + offs, mask=mask, other=0.0).to(tl.float32)
            acc = tl.fma(e, w, acc)
        tl.store(y_ptr + t * stride_y + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


# --- grouped expert GEMM --------------------------------------------------------------------
def _grouped_cpu(x2: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    M, K = x2.shape
    E, N, _ = w.shape
    y = x2.new_empty(M, N)
    C._C.exact_linear(x2.data_ptr(), x2.stride(0), w.data_ptr(), w.stride(1), w.stride(0), 0, y.data_ptr(), N, M, N,
                      K, C.CODE[x2.dtype], offs.data_ptr(), E, C.num_threads())
    return y


def _grouped_forward(x: Tensor, w: Tensor, offs: Tensor, impl: str | None) -> Tensor:
    if impl is None and x.is_cpu and x.dim() == 2 and w.dim() == 3:  # the common case, with few checks
        code = C.CODE.get(x.dtype)
        (M, K), (E_, N, Kw) = x.shape, w.shape
        if (code is not None and w.dtype == x.dtype and K == Kw and x.stride(1) == 1 and w.stride(2) == 1
                and offs.dtype == torch.int32 and offs.shape == (E_,) and offs.is_cpu and offs.is_contiguous()):
            y = x.new_empty((M, N))
            C._C.exact_linear(x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(1), w.stride(0), 0, y.data_ptr(), N, M,
                              N, K, code, offs.data_ptr(), E_, C.num_threads())
            return y
    op = "exact.grouped_linear"
    impl = C.pick_impl(op, x, impl)
    C.check_dtype(op, "x", x)
    C.check_dtype(op, "w", w, x.dtype)
    if x.dim() != 2 or w.dim() != 3 or w.shape[2] != x.shape[1] or offs.shape != (w.shape[0],):
        raise ValueError(f"{op}: expected x [rows, K], w [E, N, K], offs [E]; got {tuple(x.shape)}, "
                         f"{tuple(w.shape)}, {tuple(offs.shape)}")
    if offs.dtype != torch.int32:
        raise TypeError(f"{op}: offs must be int32, got {offs.dtype}")
    if impl == "triton":
        return grouped_gemm(x, w, offs, impl="triton")
    if w.stride(2) != 1:
        w = w.contiguous()
    return _grouped_cpu(C.rows(x), w, offs.contiguous())  # the C++ checks offs


class _Grouped(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offs, impl):
        ctx.save_for_backward(x, w, offs)
        return _grouped_forward(x, w, offs, impl)

    @staticmethod
    def backward(ctx, dy):
        x, w, offs = ctx.saved_tensors
        dy = dy.contiguous()
        if dy.is_cuda or _aligned(x, dy):  # the grouped GEMMs of moe_rl.kernels.grouped_gemm
            impl = "triton" if dy.is_cuda else "torch"
            dx = grouped_gemm(dy, w.transpose(1, 2), offs, impl=impl) if ctx.needs_input_grad[0] else None
            dw = _grouped_mm_wgrad_op(dy, x, offs, impl) if ctx.needs_input_grad[1] else None
            return dx, dw, None, None
        # torch._grouped_mm (CPU) wants 16-byte row strides: other widths take a loop over the
        # groups (host reads of offs)
        dx = torch.zeros_like(x) if ctx.needs_input_grad[0] else None
        dw = torch.zeros_like(w) if ctx.needs_input_grad[1] else None
        start = 0
        for g, end in enumerate(offs.tolist()):
            if dx is not None:
                dx[start:end] = dy[start:end] @ w[g]
            if dw is not None:
                dw[g] = dy[start:end].T @ x[start:end]
            start = end
        return dx, dw, None, None


def _aligned(x: Tensor, dy: Tensor) -> bool:
    per = 16 // x.element_size()
    return x.shape[1] % per == 0 and dy.shape[1] % per == 0


def grouped_linear(x: Tensor, w: Tensor, offs: Tensor, *, impl: str | None = None) -> Tensor:
    """x [rows, K] sorted by group, w [E, N, K] (``nn.Linear`` layout per group), offs int32 [E]
    (end row of each group, the last = rows) -> [rows, N] in x's dtype (float32 or bfloat16).
    Row r's result is bit-identical whatever its group's size and the other groups' rows."""
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return _Grouped.apply(x, w, offs, impl)
    return _grouped_forward(x, w, offs, impl)


# --- combine --------------------------------------------------------------------------------
def _combine_forward(e: Tensor, w: Tensor, impl: str | None) -> Tensor:
    if impl is None and e.is_cpu and e.dim() == 2 and w.dim() == 2:  # the common case, with few checks
        code, wc = C.CODE.get(e.dtype), C.CODE.get(w.dtype)
        (T, k), (R, H) = w.shape, e.shape
        if code is not None and wc is not None and R == T * k and e.stride(1) == 1 and w.stride(1) == 1:
            y = e.new_empty((T, H))
            C._C.exact_combine(e.data_ptr(), e.stride(0), w.data_ptr(), w.stride(0), y.data_ptr(), H, T, k, H, code, wc,
                               C.num_threads())
            return y
    op = "exact.moe_combine"
    impl = C.pick_impl(op, e, impl)
    C.check_dtype(op, "expert_out", e)
    C.check_dtype(op, "weights", w)
    T, k = w.shape
    if e.dim() != 2 or e.shape[0] != T * k:
        raise ValueError(f"{op}: expert_out must be [tokens * k = {T * k}, H], got {tuple(e.shape)}")
    H = e.shape[1]
    if e.stride(1) != 1:
        e = e.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    y = e.new_empty(T, H)
    if T == 0:
        return y
    if impl == "cpu":
        C._C.exact_combine(e.data_ptr(), e.stride(0), w.data_ptr(), w.stride(0), y.data_ptr(), y.stride(0), T, k, H,
                           C.CODE[e.dtype], C.CODE[w.dtype], C.num_threads())
    else:
        _combine_triton(e, w, y)
    return y


def _combine_triton(e: Tensor, w: Tensor, y: Tensor) -> None:
    (T, k), H = w.shape, e.shape[1]
    block = min(1024, C.next_pow2(H))
    _exact_combine_kernel[(T, C.cdiv(H, block))](e, w, y, H, k, e.stride(0), w.stride(0), y.stride(0), BLOCK=block,
                                                 num_warps=4)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, e, w, impl):
        ctx.save_for_backward(e, w)
        return _combine_forward(e, w, impl)

    @staticmethod
    def backward(ctx, dy):
        e, w = ctx.saved_tensors
        T, k = w.shape
        de = dw = None
        if ctx.needs_input_grad[0]:
            de = (w.float()[:, :, None] * dy.float()[:, None, :]).reshape(T * k, -1).to(e.dtype)
        if ctx.needs_input_grad[1]:
            dw = torch.einsum("tkh,th->tk", e.float().view(T, k, -1), dy.float()).to(w.dtype)
        return de, dw, None


def moe_combine(expert_out: Tensor, weights: Tensor, *, impl: str | None = None) -> Tensor:
    """``expert_out [tokens * k, H]`` (rows in (token, slot) order), ``weights [tokens, k]``
    (float32, or bfloat16) -> ``[tokens, H]`` in expert_out's dtype: each token's slots summed in
    slot order in fp32, rounded once."""
    if torch.is_grad_enabled() and (expert_out.requires_grad or weights.requires_grad):
        return _Combine.apply(expert_out, weights, impl)
    return _combine_forward(expert_out, weights, impl)


# --- elementwise ----------------------------------------------------------------------------
def _eltwise_forward(g: Tensor, u: Tensor | None, op_code: int, impl: str | None) -> Tensor:
    if impl is None and g.is_cpu and g.dim() == 2:  # the common case, with few checks
        code = C.CODE.get(g.dtype)
        uu = g if u is None else u
        if code is not None and uu.dtype == g.dtype and uu.shape == g.shape and g.stride(1) == 1 and uu.stride(1) == 1:
            R, Cn = g.shape
            y = g.new_empty((R, Cn))
            C._C.exact_eltwise(g.data_ptr(), g.stride(0), uu.data_ptr(), uu.stride(0), y.data_ptr(), Cn, R, Cn, code,
                               op_code, C.num_threads())
            return y
    op = "exact.silu_mul" if op_code == 0 else "exact.sigmoid"
    impl = C.pick_impl(op, g, impl)
    C.check_dtype(op, "input", g)
    if u is not None:
        C.check_dtype(op, "up", u, g.dtype)
        if u.shape != g.shape:
            raise ValueError(f"{op}: gate {tuple(g.shape)} and up {tuple(u.shape)} differ")
    if impl == "triton":  # one function per element on a GPU: torch's own kernels
        return F.silu(g) * u if op_code == 0 else torch.sigmoid(g)
    g2 = C.rows(g)
    u2 = C.rows(u) if u is not None else g2
    y = torch.empty(g2.shape, dtype=g.dtype)
    C._C.exact_eltwise(g2.data_ptr(), g2.stride(0), u2.data_ptr(), u2.stride(0), y.data_ptr(), y.stride(0),
                       g2.shape[0], g2.shape[1], C.CODE[g.dtype], op_code, C.num_threads())
    return y.view(g.shape)


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, u, impl):
        ctx.save_for_backward(g, u)
        return _eltwise_forward(g, u, 0, impl)

    @staticmethod
    def backward(ctx, dy):
        g, u = ctx.saved_tensors
        with torch.enable_grad():
            gg, uu = g.detach().requires_grad_(), u.detach().requires_grad_()
            dg, du = torch.autograd.grad(F.silu(gg) * uu, (gg, uu), dy)
        return dg, du, None


class _Sigmoid(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, impl):
        y = _eltwise_forward(x, None, 1, impl)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return dy * y * (1 - y), None


def silu_mul(gate: Tensor, up: Tensor, *, impl: str | None = None) -> Tensor:
    """``F.silu(gate) * up`` (float32 or bfloat16, the SiLU rounded to the dtype before the
    product, as torch does), each element computed the same way wherever it sits."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SiluMul.apply(gate, up, impl)
    return _eltwise_forward(gate, up, 0, impl)


def sigmoid(x: Tensor, *, impl: str | None = None) -> Tensor:
    """``torch.sigmoid(x)`` (float32 or bfloat16), each element computed the same way wherever it
    sits (the sigmoid router's scores)."""
    if x.requires_grad and torch.is_grad_enabled():
        return _Sigmoid.apply(x, impl)
    return _eltwise_forward(x, None, 1, impl)
