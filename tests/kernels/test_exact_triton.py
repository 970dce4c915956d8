"""The exact ops' Triton kernels (the GPU path), under Triton's interpreter on CPU
(TRITON_INTERPRET=1, as `make test` runs) or on a GPU: a row alone equals the same row among 15
others, a decode step equals the prefill, chunked prefill equals the whole, and the results agree
with float64. Small sizes: the interpreter runs each program in numpy."""
from __future__ import annotations

import pytest
import torch

import moe_rl.kernels.exact as E
from moe_rl.kernels.exact import _common as C

pytestmark = [pytest.mark.skipif(C.triton is None or not (C.TRITON_INTERPRET or torch.cuda.is_available()),
                                 reason="needs triton with TRITON_INTERPRET=1 or a GPU"),
              # on a GPU they are GPU tests: `pytest -m gpu` (the GPU round) runs them; on CPU the interpreter does
              *([pytest.mark.gpu] if torch.cuda.is_available() else [])]
DEV = "cuda" if torch.cuda.is_available() else "cpu"
T = "triton"


def _randn(*shape, seed, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEV)


def _alone_vs_among(fn, row, others, ats=(0, 7, 15)):
    """row alone vs row at index `at` of [row + 15 others]: positions that land in other tiles."""
    alone = fn(row)[0]
    return [at for at in ats if not torch.equal(fn(torch.cat([others[:at], row, others[at:]]))[at], alone)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear(dtype):
    K, N = 40, 50  # K and N cut the 16 x 32 x 16 interpreter tiles unevenly
    w, b = _randn(N, K, seed=1, dtype=dtype), _randn(N, seed=2, dtype=dtype)
    row, others = _randn(1, K, seed=3, dtype=dtype), _randn(15, K, seed=4, dtype=dtype)
    assert _alone_vs_among(lambda x: E.linear(x, w, b, impl=T), row, others) == []
    x = torch.cat([row, others])
    want = x.double() @ w.double().T + b.double()
    got = E.linear(x, w, b, impl=T).double()
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    assert ((got - want).abs() <= tol * (want.abs() + 1)).all()


def test_grouped_linear():
    K, N = 24, 40
    w = _randn(3, N, K, seed=1)
    row, others = _randn(1, K, seed=2), _randn(30, K, seed=3)
    alone = E.grouped_linear(row, w[1:2], torch.tensor([1], dtype=torch.int32, device=DEV), impl=T)[0]
    for sizes in ((5, 20, 6), (0, 1, 30)):
        x = torch.cat([others[:sizes[0]], row, others[sizes[0]:sum(sizes) - 1]])
        offs = torch.tensor(sizes, device=DEV).cumsum(0).to(torch.int32)
        assert torch.equal(E.grouped_linear(x, w, offs, impl=T)[sizes[0]], alone), sizes


def test_rms_norm_and_softmax_family():
    H = 70
    w = _randn(H, seed=1)
    row, others = _randn(1, H, seed=2, scale=3.0), _randn(15, H, seed=3, scale=3.0)
    for fn in (lambda x: E.rms_norm(x, w, 1e-6, impl=T), lambda x: E.log_softmax(x, impl=T),
               lambda x: E.softmax(x, impl=T)):
        assert _alone_vs_among(fn, row, others, ats=(0, 9)) == []
    x = torch.cat([row, others])
    torch.testing.assert_close(E.rms_norm(x, w, 1e-6, impl=T).double(),
                               E.rms_norm_reference(x.double(), w.double(), 1e-6), rtol=1e-5, atol=1e-6)
    lp = E.log_softmax(x, impl=T)
    torch.testing.assert_close(lp.double(), torch.log_softmax(x.double(), -1), rtol=1e-6, atol=1e-6)
    labels = torch.arange(16, device=DEV) * 4
    assert torch.equal(E.token_logprobs(x, labels, impl=T), lp.gather(1, labels[:, None])[:, 0])
    xb = x.bfloat16()
    assert _alone_vs_among(lambda t: E.rms_norm(t, w.bfloat16(), 1e-6, impl=T), xb[:1], xb[1:], ats=(9,)) == []


def _attention_case(window, sinks, L=34, hq=2, hkv=1, d=16):
    kc = torch.zeros(3, hkv, 48, d, device=DEV)
    vc = torch.zeros_like(kc)
    q, k, v = _randn(L, hq, d, seed=1), _randn(L, hkv, d, seed=2), _randn(L, hkv, d, seed=3)
    kc[2, :, :L], vc[2, :, :L] = k.transpose(0, 1), v.transpose(0, 1)
    kw = dict(window=window, sinks=sinks, impl=T)
    full = E.packed_attention(q, k, v, torch.tensor([0, L], dtype=torch.int32, device=DEV), **kw)
    return q, kc, vc, full, kw


@pytest.mark.parametrize("window,with_sinks", [(0, False), (9, True)])
def test_attention_decode_and_chunked_prefill_equal_full_prefill(window, with_sinks):
    sinks = _randn(2, seed=5) if with_sinks else None
    q, kc, vc, full, kw = _attention_case(window, sinks)
    L = full.shape[0]
    one = torch.tensor([0, 1], dtype=torch.int32, device=DEV)
    for p in range(L):  # decode: each position alone against the cache (a tile of one query)
        out = E.cached_attention(q[p:p + 1], kc, vc, one, torch.tensor([2], device=DEV),
                                 torch.tensor([p], dtype=torch.int32, device=DEV), **kw)
        assert torch.equal(out[0], full[p]), p
    parts = []
    for c0 in range(0, L, 11):  # chunks that start mid-tile
        n = min(11, L - c0)
        parts.append(E.cached_attention(q[c0:c0 + n], kc, vc, torch.tensor([0, n], dtype=torch.int32, device=DEV),
                                        torch.tensor([2], device=DEV), torch.tensor([c0], dtype=torch.int32,
                                                                                     device=DEV), **kw))
    assert torch.equal(torch.cat(parts), full)
    z = torch.zeros(1, dtype=torch.int32, device=DEV)
    cu = torch.tensor([0, L], dtype=torch.int32, device=DEV)
    want = E.attention_reference(q.double(), kc[2].transpose(0, 1)[:L].double(), vc[2].transpose(0, 1)[:L].double(),
                                 cu, z, z.long(), z.long(), 16 ** -0.5, window,
                                 None if sinks is None else sinks.double())
    torch.testing.assert_close(full.double(), want, rtol=1e-5, atol=2e-6)


def test_attention_decode_batch_of_16_requests():
    """The watched request decodes among 15 others of other lengths, in one call."""
    q, kc, vc, full, kw = _attention_case(0, None, L=20)
    slots = torch.zeros(16, dtype=torch.long, device=DEV)  # the others read slot 0 (random lengths)
    kc[0], vc[0] = _randn(*kc[0].shape, seed=7), _randn(*vc[0].shape, seed=8)
    slots[6] = 2
    pos = torch.randint(0, 48, (16,), generator=torch.Generator().manual_seed(9)).to(torch.int32).to(DEV)
    for p in (5, 19):
        pos[6] = p
        qs = torch.cat([_randn(6, 2, 16, seed=10 + p), q[p:p + 1], _randn(9, 2, 16, seed=20 + p)])
        out = E.cached_attention(qs, kc, vc, torch.arange(17, dtype=torch.int32, device=DEV), slots, pos, **kw)
        assert torch.equal(out[6], full[p]), p


def test_combine():
    k, H = 2, 40
    e_row, w_row = _randn(k, H, seed=1), torch.rand(1, k).to(DEV)
    e_oth, w_oth = _randn(15 * k, H, seed=2), torch.rand(15, k).to(DEV)
    alone = E.moe_combine(e_row, w_row, impl=T)[0]
    got = E.moe_combine(torch.cat([e_oth[:8], e_row, e_oth[8:]]), torch.cat([w_oth[:4], w_row, w_oth[4:]]), impl=T)
    assert torch.equal(got[4], alone)
    want = (w_row.double()[0, :, None] * e_row.double()).sum(0)
    torch.testing.assert_close(alone.double(), want, rtol=1e-6, atol=1e-6)
