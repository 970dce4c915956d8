"""Batch-invariant softmax, log-softmax and token log-probs over the last dimension, in fp32.

Per row: ``m = max(x)``, ``s = sum(exp(x - m))``, ``log_softmax = (x - m) - log(s)``,
``softmax = exp(x - m) / s``; ``token_logprobs(x, labels)[r]`` is ``log_softmax(x)[r, labels[r]]``
bit for bit, without writing the row.

* CPU (``moe_rl._C.exact_softmax``): the max is exact in any order; the sum of exponentials in
  the lane order of csrc/exact.h (eight lanes over the row, a fixed tree), with the kernels' own
  vectorised exp (the same bits on AVX2 and the portable build); ``log`` of the sum by libm.
* GPU (Triton): one program per row, three passes over fixed BLOCK-wide chunks of the row
  (BLOCK fixed by the row's length): the max, the sum of exponentials in a BLOCK-wide vector,
  then the write; the vector reduced by ``tl.max``/``tl.sum`` (a fixed tree).

Temperature: divide the logits first (an elementwise op, batch-invariant already).
Differentiable; the backward is plain torch.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import _common as C

if C.triton is not None:
    triton, tl = C.triton, C.tl

    @triton.jit
    def _exact_softmax_kernel(x_ptr, y_ptr, labels_ptr, V, stride_x, stride_y,
                              LOG: tl.constexpr, LABELS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_x
        mv = tl.full((BLOCK,), float("-inf"), tl.float32)
        for v0 in range(0, V, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            mv = tl.maximum(mv, tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32))
        m = tl.max(mv, axis=0)
        sv = tl.zeros((BLOCK,), dtype=tl.float32)
        for v0 in range(0, V, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            sv += tl.exp(x - m)
        s = tl.sum(sv, axis=0)
        if LABELS:
            lab = tl.load(labels_ptr + row)
            ok = (lab >= 0) & (lab < V)
            xl = tl.load(x_row + lab, mask=ok, other=0.0).to(tl.float32)
            tl.store(y_ptr + row, tl.where(ok, (xl - m) - tl.log(s), 0.0))
        else:
            for v0 in range(0, V, BLOCK):
                offs = v0 + tl.arange(0, BLOCK)
                mask = offs < V
                x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
                if LOG:
                    out = (x - m) - tl.log(s)
                else:
                    out = tl.div_rn(tl.exp(x - m), s)
                tl.store(y_ptr + row * stride_y + offs, out, mask=mask)


def _block(V: int) -> int:
    return min(1024, C.next_pow2(V))


def _forward(x: Tensor, log: bool, labels: Tensor | None, impl: str | None, op: str) -> Tensor:
    if impl is None and labels is None and x.is_cpu and x.dim() == 2:  # the common case, with few checks
        code = C.CODE.get(x.dtype)
        if code is not None and x.stride(1) == 1:
            M, V = x.shape
            y = x.new_empty((M, V), dtype=torch.float32)
            C._C.exact_softmax(x.data_ptr(), x.stride(0), y.data_ptr(), V, M, V, code, int(log), 0, C.num_threads())
            return y
    impl = C.pick_impl(op, x, impl)
    C.check_dtype(op, "x", x)
    x2 = C.rows(x)
    M, V = x2.shape
    if labels is not None:
        if labels.shape != x.shape[:-1] or labels.dtype != torch.long:
            raise ValueError(f"{op}: labels must be int64 of shape {tuple(x.shape[:-1])}, got {labels.dtype} "
                             f"{tuple(labels.shape)}")
        labels = labels.reshape(-1).contiguous()
        y = torch.empty(M, dtype=torch.float32, device=x.device)
    else:
        y = torch.empty(M, V, dtype=torch.float32, device=x.device)
    if impl == "cpu":
        C._C.exact_softmax(x2.data_ptr(), x2.stride(0), y.data_ptr(), y.stride(0), M, V, C.CODE[x2.dtype], int(log),
                           0 if labels is None else labels.data_ptr(), C.num_threads())
    elif M:
        _softmax_triton(x2, y, labels, log)
    return y.view(x.shape[:-1]) if labels is not None else y.view(x.shape)


def _softmax_triton(x2: Tensor, y: Tensor, labels: Tensor | None, log: bool) -> None:
    M, V = x2.shape
    _exact_softmax_kernel[(M,)](x2, y, labels if labels is not None else y, V, x2.stride(0),
                                y.stride(0) if labels is None else 1, LOG=log, LABELS=labels is not None,
                                BLOCK=_block(V), num_warps=4)


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, log, impl):
        y = _forward(x, log, None, impl, "exact.log_softmax" if log else "exact.softmax")
        ctx.save_for_backward(y)
        ctx.log, ctx.dtype = log, x.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        if ctx.log:
            dx = dy - y.exp() * dy.sum(-1, keepdim=True)
        else:
            dx = y * (dy - (dy * y).sum(-1, keepdim=True))
        return dx.to(ctx.dtype), None, None


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, labels, impl):
        ctx.save_for_backward(x, labels)
        return _forward(x, True, labels, impl, "exact.token_logprobs")

    @staticmethod
    def backward(ctx, dy):
        x, labels = ctx.saved_tensors
        p = torch.softmax(x.float(), dim=-1)
        onehot = torch.zeros_like(p).scatter_(-1, labels.clamp(min=0).unsqueeze(-1), 1.0)
        g = dy * (labels >= 0)
        return ((onehot - p) * g.unsqueeze(-1)).to(x.dtype), None, None


def log_softmax(x: Tensor, *, impl: str | None = None) -> Tensor:
    """fp32 log-softmax over the last dimension of ``x`` (float32 or bfloat16). Each row is
    bit-identical however many rows come with it and at any thread count."""
    if x.requires_grad and torch.is_grad_enabled():
        return _Softmax.apply(x, True, impl)
    return _forward(x, True, None, impl, "exact.log_softmax")


def softmax(x: Tensor, *, impl: str | None = None) -> Tensor:
    """fp32 softmax over the last dimension (the router's), batch-invariant like ``log_softmax``."""
    if x.requires_grad and torch.is_grad_enabled():
        return _Softmax.apply(x, False, impl)
    return _forward(x, False, None, impl, "exact.softmax")


def token_logprobs(x: Tensor, labels: Tensor, *, impl: str | None = None) -> Tensor:
    """``log_softmax(x)`` at ``labels`` (int64, shape ``x.shape[:-1]``; a negative label gives 0):
    fp32, bit-identical to ``log_softmax(x).gather(-1, labels[..., None])``."""
    if C.needs_grad(x):
        return _TokenLogprobs.apply(x, labels, impl)
    return _forward(x, True, labels, impl, "exact.token_logprobs")
