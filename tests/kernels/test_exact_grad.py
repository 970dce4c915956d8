"""The exact ops are differentiable: forward by the batch-invariant kernel, backward by plain
torch. Their gradients (fp32) against float64 autograd of independent plain-torch maths."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import moe_rl.kernels.exact as E


def _leaf(*shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).requires_grad_()


def _grads(fn, inputs, seed=99):
    """Gradients of sum(fn(*inputs) * r) (r fixed random) w.r.t. the inputs: fp32 as given, and
    the same maths on float64 copies."""
    out = fn(*inputs)
    r = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    got = torch.autograd.grad((out * r).sum(), inputs)
    return out, got, r


def _check(exact_fn, ref_fn, inputs, rtol=1e-4, atol=1e-5):
    out, got, r = _grads(exact_fn, inputs)
    ins64 = [t.detach().double().requires_grad_() for t in inputs]
    out64 = ref_fn(*ins64)
    want = torch.autograd.grad((out64 * r.double()).sum(), ins64)
    torch.testing.assert_close(out.double(), out64, rtol=rtol, atol=atol)
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a.double(), b, rtol=rtol, atol=atol, msg=f"input {i}")


def test_linear_grad():
    x, w, b = _leaf(3, 5, 24, seed=1), _leaf(16, 24, seed=2), _leaf(16, seed=3)
    _check(lambda x, w, b: E.linear(x, w, b), lambda x, w, b: x @ w.T + b, [x, w, b])


@pytest.mark.parametrize("K,N", [(16, 8), (12, 10)])  # torch._grouped_mm's alignment, and a loop
def test_grouped_linear_grad(K, N):
    x, w = _leaf(20, K, seed=1), _leaf(3, N, K, seed=2)
    offs = torch.tensor([6, 6, 20], dtype=torch.int32)

    def ref(x, w):
        return torch.cat([x[:6] @ w[0].T, x[6:6] @ w[1].T, x[6:] @ w[2].T])
    _check(lambda x, w: E.grouped_linear(x, w, offs), ref, [x, w])


def test_rms_norm_grad():
    x, w = _leaf(7, 33, seed=1, scale=2.0), _leaf(33, seed=2)

    def ref(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    _check(lambda x, w: E.rms_norm(x, w, 1e-6), ref, [x, w])


@pytest.mark.parametrize("which", ["log_softmax", "softmax", "token_logprobs"])
def test_softmax_family_grad(which):
    x = _leaf(6, 50, seed=1, scale=3.0)
    labels = torch.tensor([0, 49, 7, -100, 3, 3])
    if which == "token_logprobs":
        exact = lambda x: E.token_logprobs(x, labels)  # noqa: E731

        def ref(x):
            lp = torch.log_softmax(x, -1).gather(1, labels.clamp(min=0)[:, None])[:, 0]
            return lp * (labels >= 0)
    else:
        exact = getattr(E, which)
        ref = {"log_softmax": lambda x: torch.log_softmax(x, -1), "softmax": lambda x: torch.softmax(x, -1)}[which]
    _check(exact, ref, [x])


@pytest.mark.parametrize("window,with_sinks", [(0, False), (4, True)])
def test_packed_attention_grad(window, with_sinks):
    lens = [3, 11, 1]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    T, hq, hkv, d = int(cu[-1]), 4, 2, 8
    q, k, v = _leaf(T, hq, d, seed=1), _leaf(T, hkv, d, seed=2), _leaf(T, hkv, d, seed=3)
    inputs = [q, k, v] + ([_leaf(hq, seed=4)] if with_sinks else [])

    def exact(q, k, v, *sinks):
        return E.packed_attention(q, k, v, cu, window=window, sinks=sinks[0] if sinks else None)

    def ref(q, k, v, *sinks):  # per sequence, plain softmax attention with a repeated kv head
        outs = []
        for s in range(len(lens)):
            a, b = int(cu[s]), int(cu[s + 1])
            qs, ks, vs = q[a:b].transpose(0, 1), k[a:b].repeat_interleave(2, 1).transpose(0, 1), \
                v[a:b].repeat_interleave(2, 1).transpose(0, 1)
            sc = qs @ ks.transpose(1, 2) * d ** -0.5
            i = torch.arange(b - a)
            keep = (i[None, :] <= i[:, None]) & ((i[:, None] - i[None, :] < window) if window else True)
            sc = sc.masked_fill(~keep, float("-inf"))
            if sinks:
                sc = torch.cat([sc, sinks[0][:, None, None].expand(hq, b - a, 1)], -1)
            p = torch.softmax(sc, -1)[..., : b - a]
            outs.append((p @ vs).transpose(0, 1))
        return torch.cat(outs)
    _check(exact, ref, inputs)


def test_general_attention_grad_matches_the_packed_one():
    """The general form (keys in a [Sk, T] buffer, here the packed rows as one sequence each) has
    the dense reference as its backward; the packed form the padded one: the same gradients."""
    cu = torch.tensor([0, 4, 13], dtype=torch.int32)
    q, k, v = _leaf(13, 4, 8, seed=1), _leaf(13, 2, 8, seed=2), _leaf(13, 2, 8, seed=3)
    r = torch.randn(13, 4, 8, generator=torch.Generator().manual_seed(5))
    z = torch.zeros(2, dtype=torch.int32)
    g1 = torch.autograd.grad((E.packed_attention(q, k, v, cu, window=3) * r).sum(), (q, k, v))
    g2 = torch.autograd.grad((E.attention(q, k, v, cu, z, z.long(), cu[:-1].long(), window=3) * r).sum(), (q, k, v))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_combine_silu_sigmoid_grad():
    e, w = _leaf(10, 16, seed=1), _leaf(5, 2, seed=2)
    _check(lambda e, w: E.moe_combine(e, w), lambda e, w: (w[:, :, None] * e.view(5, 2, 16)).sum(1), [e, w])
    g, u = _leaf(6, 9, seed=3, scale=3.0), _leaf(6, 9, seed=4)
    _check(lambda g, u: E.silu_mul(g, u), lambda g, u: F.silu(g) * u, [g, u])
    _check(lambda g: E.sigmoid(g), torch.sigmoid, [g])


def test_no_graph_without_grad():
    x, w = _leaf(4, 8, seed=1), _leaf(3, 8, seed=2)
    with torch.no_grad():
        y = E.linear(x, w)
    assert y.grad_fn is None and not y.requires_grad
    assert E.linear(x, w).grad_fn is not None
