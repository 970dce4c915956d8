"""Batch-invariant linear layer: ``y = x @ w.T (+ bias)``, each output's reduction over K in an
order fixed by K alone, never by the number of rows.

* CPU (``moe_rl._C.exact_linear``): every output is its own fp32 accumulator, eight lanes over
  K with fused multiply-adds, the lanes summed in a fixed tree (csrc/exact.h), then the bias
  added; threads split row x column tiles. A row's result is the same alone, among any other
  rows, at any thread count, on AVX2 or the portable build.
* GPU (Triton): one program per (row tile, column tile) with one fixed tile config per dtype,
  the whole K loop in that program with an fp32 accumulator (no split-K, no autotuning), the
  bias added in fp32 in the epilogue. A row's result depends only on its own data: the tile
  shape never changes with M.

``linear`` is differentiable (plain-torch backward: gradients are ordinary, not bit-exact).
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import _common as C

if C.triton is not None:
    triton, tl = C.triton, C.tl

    @triton.jit(do_not_specialize=["M"])  # the row count changes every step: one build for all
    def _exact_linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                             HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < M
        n_mask = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            a = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None],
                        mask=n_mask[None, :] & k_mask[:, None], other=0.0)
            if DOT_FP32:  # the interpreter's 16-bit dot is wrong: the same maths in fp32
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _blocks(dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): one config per dtype, for every M."""
    if C.TRITON_INTERPRET:
        return 16, 32, 16, 1, 1
    if dtype == torch.float32:
        return 64, 64, 32, 4, 3
    return 128, 128, 64, 8, 3


def _linear_triton(x2: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    M, K = x2.shape
    N = w.shape[0]
    y = x2.new_empty(M, N)
    if M == 0 or N == 0:
        return y
    bm, bn, bk, warps, stages = _blocks(x2.dtype)
    grid = (C.cdiv(M, bm), C.cdiv(N, bn))
    _exact_linear_kernel[grid](x2, w, b if b is not None else w, y, M, N, K, x2.stride(0), w.stride(0), y.stride(0),
                               HAS_BIAS=b is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PRECISION="ieee",
                               DOT_FP32=C.TRITON_INTERPRET, num_warps=warps, num_stages=stages)
    return y


def _linear_cpu(x2: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    M, K = x2.shape
    N = w.shape[0]
    y = x2.new_empty(M, N)
    C._C.exact_linear(x2.data_ptr(), x2.stride(0), w.data_ptr(), w.stride(0), 0, 0 if b is None else b.data_ptr(),
                      y.data_ptr(), N, M, N, K, C.CODE[x2.dtype], 0, 0, C.num_threads())
    return y


def _forward(x: Tensor, w: Tensor, b: Tensor | None, impl: str | None) -> Tensor:
    if impl is None and x.is_cpu and x.dim() == 2 and w.dim() == 2:  # the common case, with few checks
        code = C.CODE.get(x.dtype)
        (M, K), (N, Kw) = x.shape, w.shape
        if (code is not None and w.dtype == x.dtype and K == Kw and x.stride(1) == 1 and w.stride(1) == 1
                and (b is None or (b.dtype == x.dtype and b.shape == (N,) and b.stride(0) == 1))):
            y = x.new_empty((M, N))
            C._C.exact_linear(x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0), 0, 0 if b is None else b.data_ptr(),
                              y.data_ptr(), N, M, N, K, code, 0, 0, C.num_threads())
            return y
    impl = C.pick_impl("exact.linear", x, impl)
    C.check_dtype("exact.linear", "x", x)
    C.check_dtype("exact.linear", "weight", w, x.dtype)
    if w.dim() != 2 or w.shape[1] != x.shape[-1]:
        raise ValueError(f"exact.linear: weight must be [N, {x.shape[-1]}], got {tuple(w.shape)}")
    if w.stride(1) != 1:
        w = w.contiguous()
    if b is not None:
        C.check_dtype("exact.linear", "bias", b, x.dtype)
        if b.shape != (w.shape[0],):
            raise ValueError(f"exact.linear: bias must be [{w.shape[0]}], got {tuple(b.shape)}")
        b = b.contiguous()
    x2 = C.rows(x)
    y = (_linear_cpu if impl == "cpu" else _linear_triton)(x2, w, b)
    return y.view(*x.shape[:-1], w.shape[0])


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, impl):
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        return _forward(x, w, b, impl)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = dy @ w
        if ctx.needs_input_grad[1]:
            dw = dy.reshape(-1, dy.shape[-1]).T @ x.reshape(-1, x.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.reshape(-1, dy.shape[-1]).sum(0)
        return dx, dw, db, None


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, impl: str | None = None) -> Tensor:
    """``x [..., K] @ weight[N, K].T (+ bias [N])`` -> ``[..., N]`` in x's dtype (float32 or
    bfloat16, all three alike), accumulated in fp32. Each row's output is bit-identical however
    many rows are computed with it and at any thread count (``impl``: "cpu" for CPU tensors,
    "triton" for CUDA ones). Differentiable; the backward is plain torch."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return _Linear.apply(x, weight, bias, impl)
    return _forward(x, weight, bias, impl)


def linear_reference(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """Plain torch (not batch-invariant): the same maths."""
    return torch.nn.functional.linear(x, weight, bias)
