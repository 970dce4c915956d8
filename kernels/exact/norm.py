"""Batch-invariant RMSNorm, in HF's cast order: ``weight * to(x.dtype)(x * rsqrt(mean(x^2) + eps))``
with x in fp32, the product in the promotion of weight's and x's dtypes.

* CPU (``moe_rl._C.exact_rms_norm``): one row at a time, the sum of squares in the lane order of
  csrc/exact.h (fixed by the row's length), ``1 / sqrt`` correctly rounded.
* GPU (Triton): one program per row, the squares summed in a fixed BLOCK-wide vector over the
  row's chunks (BLOCK fixed by the row's length), then ``tl.sum``; IEEE sqrt and division.

Differentiable; the backward is plain torch (the reference recomputed under autograd).
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import _common as C

if C.triton is not None:
    triton, tl = C.triton, C.tl

    @triton.jit
    def _exact_rms_norm_kernel(x_ptr, w_ptr, y_ptr, H, stride_x, stride_y, eps,
                               ROUND_X: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for h0 in range(0, H, BLOCK):
            offs = h0 + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + row * stride_x + offs, mask=offs < H, other=0.0).to(tl.float32)
            acc = tl.fma(x, x, acc)
        mean = tl.div_rn(tl.sum(acc, axis=0), H.to(tl.float32))
        rstd = tl.div_rn(1.0, tl.sqrt_rn(mean + eps))
        for h0 in range(0, H, BLOCK):
            offs = h0 + tl.arange(0, BLOCK)
            mask = offs < H
            xv = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
            n = xv.to(tl.float32) * rstd
            if ROUND_X:
                n = n.to(xv.dtype).to(tl.float32)
            w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_ptr + row * stride_y + offs, (w * n).to(y_ptr.dtype.element_ty), mask=mask)


def _block(H: int) -> int:
    return min(1024, C.next_pow2(H))


def _forward(x: Tensor, w: Tensor, eps: float, impl: str | None) -> Tensor:
    if impl is None and x.is_cpu and x.dim() == 2:  # the common case, with few checks
        xc, wc = C.CODE.get(x.dtype), C.CODE.get(w.dtype)
        M, H = x.shape
        if xc is not None and wc is not None and w.shape == (H,) and x.stride(1) == 1 and w.stride(0) == 1:
            yd = x.dtype if xc == wc else torch.float32
            y = x.new_empty((M, H), dtype=yd)
            C._C.exact_rms_norm(x.data_ptr(), x.stride(0), w.data_ptr(), y.data_ptr(), H, M, H, float(eps), xc, wc,
                                C.CODE[yd], C.num_threads())
            return y
    impl = C.pick_impl("exact.rms_norm", x, impl)
    C.check_dtype("exact.rms_norm", "x", x)
    C.check_dtype("exact.rms_norm", "weight", w)
    H = x.shape[-1]
    if w.shape != (H,):
        raise ValueError(f"exact.rms_norm: weight must be [{H}], got {tuple(w.shape)}")
    out_dtype = torch.promote_types(w.dtype, x.dtype)
    w = w.contiguous()
    x2 = C.rows(x)
    y = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    M = x2.shape[0]
    if impl == "cpu":
        C._C.exact_rms_norm(x2.data_ptr(), x2.stride(0), w.data_ptr(), y.data_ptr(), H, M, H, float(eps),
                            C.CODE[x2.dtype], C.CODE[w.dtype], C.CODE[out_dtype], C.num_threads())
    elif M:
        _rms_norm_triton(x2, w, y, eps)
    return y.view(x.shape)


def _rms_norm_triton(x2: Tensor, w: Tensor, y: Tensor, eps: float) -> None:
    M, H = x2.shape
    _exact_rms_norm_kernel[(M,)](x2, w, y, H, x2.stride(0), y.stride(0), float(eps),
                                 ROUND_X=x2.dtype != torch.float32, BLOCK=_block(H), num_warps=4)


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Plain torch, HF's order (not batch-invariant)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class _RmsNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps, impl):
        ctx.save_for_backward(x, w)
        ctx.eps = eps
        return _forward(x, w, eps, impl)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        with torch.enable_grad():
            xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
            y = rms_norm_reference(xg, wg, ctx.eps)
            dx, dw = torch.autograd.grad(y, (xg, wg), dy)
        return dx, dw, None, None


def rms_norm(x: Tensor, weight: Tensor, eps: float, *, impl: str | None = None) -> Tensor:
    """RMSNorm over the last dimension of ``x`` (float32 or bfloat16) with ``weight`` [H]
    (float32 or bfloat16; the result has their promoted dtype, as ``weight * normed`` in HF).
    Each row is bit-identical however many rows come with it and at any thread count.
    Supported dtype pairs (x, weight): (fp32, fp32), (fp32, bf16), (bf16, fp32), (bf16, bf16)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RmsNorm.apply(x, weight, eps, impl)
    return _forward(x, weight, eps, impl)
