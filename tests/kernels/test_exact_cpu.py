"""The batch-invariant CPU kernels (moe_rl.kernels.exact, C++ in csrc/exact*.cpp).

For every kernel: a row computed alone equals, bit for bit (torch.equal), the same row computed
among 15-39 other rows of other values (and, for attention, other sequence lengths) at 1-3
threads; every instruction-set build gives the same bits; the results agree with float64 within
fp32 tolerance. The same comparison applied to the plain torch op shows a difference where
torch's CPU op is batch-variant on this machine (F.linear: its M=1 path; F.silu/sigmoid: the
vectorised body vs the scalar tail; SDPA: decode vs prefill; F.rms_norm: one 65536-wide row
split over 2 threads). torch's CPU log_softmax, softmax and the combine's bmm gave the same bits
at every shape tried (rows 1-2000, widths 2-10^6, 1-2 threads, fp32/bf16): for those the check's
ability to fail is shown on a one-bit change instead.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import moe_rl.kernels.exact as E
from moe_rl import _C

from .exact_cases import BATCHES, THREADS, isa, one_ulp_off, row_mismatches, rows_differing, threads, used_threads

ISAS = _C.exact_supported_isas()


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed=0, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(dtype)


# --- linear ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_row_alone_equals_batched(dtype, bias):
    K, N = 256, 200
    w, b = _randn(N, K, seed=1, dtype=dtype), (_randn(N, seed=2, dtype=dtype) if bias else None)
    row, others = _randn(1, K, seed=3, dtype=dtype), _randn(60, K, seed=4, dtype=dtype)
    assert row_mismatches(lambda x: E.linear(x, w, b), row, others) == []
    assert used_threads() > 1  # the last batched call (40 rows, 3 threads) did use threads


def test_linear_torch_op_is_batch_variant():
    bad = []
    for K, N in ((64, 64), (512, 512)):
        w = _randn(N, K, seed=1)
        bad += row_mismatches(lambda x: F.linear(x, w), _randn(1, K, seed=3), _randn(60, K, seed=4), exact=False,
                              thread_counts=(1,))
    assert bad, "F.linear gave a row the same bits alone and batched at every size"


@pytest.mark.parametrize("K", [7, 64, 1000])
def test_linear_accuracy(K):
    x, w, b = _randn(33, K, seed=1), _randn(45, K, seed=2), _randn(45, seed=3)
    want = x.double() @ w.double().T + b.double()
    torch.testing.assert_close(E.linear(x, w, b).double(), want, rtol=1e-5, atol=2e-6 * K ** 0.5)
    # bf16: within a bf16 rounding of the fp32-accumulated result of the same bf16 inputs
    xb, wb, bb = x.bfloat16(), w.bfloat16(), b.bfloat16()
    want = xb.double() @ wb.double().T + bb.double()
    got = E.linear(xb, wb, bb).double()
    assert ((got - want).abs() <= 2 ** -8 * want.abs() + 1e-5 * K ** 0.5).all()


def test_linear_leading_dims_and_strided_input():
    x = _randn(3, 5, 40, seed=1)
    w = _randn(24, 40, seed=2)
    y = E.linear(x, w)
    assert y.shape == (3, 5, 24)
    assert torch.equal(y[1, 2], E.linear(x[1, 2:3], w)[0])
    wide = _randn(7, 80, seed=3)[:, ::2]  # a non-contiguous last dim: copied, same maths
    torch.testing.assert_close(E.linear(wide, w), wide @ w.T, rtol=1e-5, atol=1e-5)


# --- grouped expert GEMM --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_row_independent_of_its_group_and_the_others(dtype):
    """A row alone in its group equals the same row in a group of 20 among other groups, and
    equals the dense exact linear with that group's weights."""
    E_, K, N = 4, 96, 72
    w = _randn(E_, N, K, seed=1, dtype=dtype)
    row = _randn(1, K, seed=2, dtype=dtype)
    alone = E.grouped_linear(row, w[2:3], torch.tensor([1], dtype=torch.int32))[0]
    assert torch.equal(alone, E.linear(row, w[2])[0])
    others = _randn(60, K, seed=3, dtype=dtype)
    for sizes in ((5, 0, 20, 9), (0, 16, 1, 30), (15, 15, 15, 14)):
        start = sum(sizes[:2])
        x = torch.cat([others[:start], row, others[start: sum(sizes) - 1]])
        offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
        for t in THREADS:
            with threads(t):
                got = E.grouped_linear(x, w, offs)
            assert torch.equal(got[start], alone), (sizes, t)


def test_grouped_accuracy_and_bad_offsets():
    from moe_rl.kernels.grouped_gemm import grouped_gemm_reference

    x, w = _randn(45, 24, seed=1), _randn(4, 40, 24, seed=2)
    offs = torch.tensor([10, 10, 33, 45], dtype=torch.int32)
    torch.testing.assert_close(E.grouped_linear(x, w, offs).double(),
                               grouped_gemm_reference(x.double(), w.double(), offs), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="non-decreasing"):
        E.grouped_linear(x, w, torch.tensor([10, 9, 33, 45], dtype=torch.int32))
    with pytest.raises(ValueError, match="must equal the rows"):
        E.grouped_linear(x, w, torch.tensor([10, 10, 33, 44], dtype=torch.int32))


# --- RMSNorm --------------------------------------------------------------------------------
@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_rms_norm_row_alone_equals_batched(x_dtype, w_dtype):
    H = 3000
    w = (1 + 0.1 * _randn(H, seed=1)).to(w_dtype)
    row, others = _randn(1, H, seed=2, dtype=x_dtype), _randn(300, H, seed=3, dtype=x_dtype)
    assert row_mismatches(lambda x: E.rms_norm(x, w, 1e-6), row, others, batches=BATCHES + (300,)) == []
    assert used_threads() > 1


def test_rms_norm_torch_op_is_batch_variant_for_one_wide_row():
    """torch splits a lone row's reduction over its threads: at 2 threads some 65536-wide rows
    differ alone from the same rows in a batch of 17; the exact kernel's do not."""
    H = 65536
    x = _randn(17, H, seed=0)
    assert rows_differing(lambda t: F.rms_norm(t, (H,), eps=1e-6), x, torch_threads=2) > 0
    with threads(2):
        assert rows_differing(lambda t: E.rms_norm(t, torch.ones(H), 1e-6), x) == 0


def test_rms_norm_accuracy_and_hf_cast_order():
    x, w = _randn(9, 777, seed=1, scale=3.0), 1 + 0.1 * _randn(777, seed=2)
    torch.testing.assert_close(E.rms_norm(x, w, 1e-6).double(), E.rms_norm_reference(x.double(), w.double(), 1e-6),
                               rtol=1e-5, atol=1e-6)
    # bf16: the normalised row is rounded to bf16 before the weight multiplies it (HF), so the
    # result is the weight times a bf16 value: at most one bf16 step from HF's own bf16 result
    xb, wb = x.bfloat16(), w.bfloat16()
    got, hf = E.rms_norm(xb, wb, 1e-6), E.rms_norm_reference(xb, wb, 1e-6)
    assert got.dtype == hf.dtype == torch.bfloat16
    assert ((got.double() - hf.double()).abs() <= 2 ** -7 * hf.double().abs()).all()
    assert E.rms_norm(xb, w, 1e-6).dtype == torch.float32  # weight * normed promotes, as in HF


# --- softmax, log-softmax, token log-probs ---------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V", [64, 5003])
def test_log_softmax_softmax_rows_alone_equal_batched(dtype, V):
    row, others = _randn(1, V, seed=1, dtype=dtype, scale=4.0), _randn(200, V, seed=2, dtype=dtype, scale=4.0)
    assert row_mismatches(E.softmax, row, others) == []
    assert row_mismatches(E.log_softmax, row, others, batches=BATCHES + (200,)) == []
    assert used_threads() > 1 or V < 1000
    labels = torch.randint(0, V, (201,), generator=_gen(3))
    x = torch.cat([row, others])
    assert torch.equal(E.token_logprobs(x, labels), E.log_softmax(x).gather(1, labels[:, None])[:, 0])


def test_softmax_comparison_can_fail():
    """torch's own CPU (log-)softmax and the combine's bmm gave the same bits at every shape we
    tried, so they cannot show this check failing; a one-bit change does."""
    row, others = _randn(1, 64, seed=1, scale=4.0), _randn(20, 64, seed=2, scale=4.0)
    alone = E.log_softmax(row)[0]
    batched = E.log_softmax(torch.cat([others[:5], row, others[5:]]))[5]
    assert torch.equal(batched, alone)
    assert not torch.equal(one_ulp_off(batched[None])[0], alone)


def test_log_softmax_accuracy_and_labels():
    x = _randn(7, 3001, seed=1, scale=10.0)
    torch.testing.assert_close(E.log_softmax(x).double(), torch.log_softmax(x.double(), -1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(E.softmax(x).double(), torch.softmax(x.double(), -1), rtol=1e-5, atol=1e-7)
    labels = torch.tensor([0, 3000, -100, 5, 6, 7, 8])
    got = E.token_logprobs(x, labels)
    assert got[2] == 0  # ignored
    assert E.log_softmax(x.bfloat16()).dtype == torch.float32
    with pytest.raises(ValueError, match="labels"):
        E.token_logprobs(x, labels.int())


def test_exp_accuracy():
    """The kernels' own exp (softmax, attention, SiLU): within 2 fp32 ulps over the whole range
    it is used on, 0 below (no subnormals), inf above, NaN kept."""
    x = torch.linspace(-87.3, 88.7, 200001)
    y = torch.empty_like(x)
    _C.exact_exp(x.data_ptr(), y.data_ptr(), x.numel())
    want = x.double().exp()
    assert ((y.double() - want).abs() / want <= 2 * 2 ** -23).all()
    edge = torch.tensor([-float("inf"), -100.0, 0.0, 89.0, float("inf"), float("nan"), -0.0, 1.0])
    out = torch.empty_like(edge)
    _C.exact_exp(edge.data_ptr(), out.data_ptr(), edge.numel())
    assert out[:5].tolist() == [0.0, 0.0, 1.0, float("inf"), float("inf")] and out[5].isnan()
    assert out[6] == 1.0 and abs(out[7].item() - 2.718281828) < 1e-6


# --- attention ------------------------------------------------------------------------------
def _cache(slots, hkv, ctx, d, dtype, seed):
    return (_randn(slots, hkv, ctx, d, seed=seed, dtype=dtype), _randn(slots, hkv, ctx, d, seed=seed + 1, dtype=dtype))


def _decode_vs_prefill(dtype, window=0, sinks=None, hq=4, hkv=2, d=16, dv=16, L=70, impl=None):
    """One request's tokens, decoded one at a time against the cache among 17 other requests
    of other lengths (positions < L), equal the full prefill of the whole sequence."""
    slots, ctx = 20, 96
    kc = _randn(slots, hkv, ctx, d, seed=1, dtype=dtype)
    vc = _randn(slots, hkv, ctx, dv, seed=2, dtype=dtype)
    q_all = _randn(L, hq, d, seed=3, dtype=dtype)
    slot = 7
    kw = dict(window=window, sinks=sinks, impl=impl)
    full = E.packed_attention(q_all, kc[slot].transpose(0, 1)[:L], vc[slot].transpose(0, 1)[:L],
                              torch.tensor([0, L], dtype=torch.int32), **kw)
    other_slots = [s for s in range(slots) if s != slot][:17]
    other_pos = torch.randint(0, ctx, (17,), generator=_gen(4)).tolist()
    bad = []
    for p in range(L):
        # the watched request at row 5 of a decode batch of 18
        sl = other_slots[:5] + [slot] + other_slots[5:]
        pos = other_pos[:5] + [p] + other_pos[5:]
        q = torch.cat([_randn(5, hq, d, seed=100 + p, dtype=dtype), q_all[p:p + 1],
                       _randn(12, hq, d, seed=200 + p, dtype=dtype)])
        out = E.cached_attention(q, kc, vc, torch.arange(19, dtype=torch.int32), torch.tensor(sl),
                                 torch.tensor(pos, dtype=torch.int32), **kw)
        if not torch.equal(out[5], full[p]):
            bad.append(p)
    return bad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_decode_equals_prefill(dtype):
    assert _decode_vs_prefill(dtype) == []


def test_attention_decode_equals_prefill_window_sinks_mla_dims():
    sinks = _randn(4, seed=9)
    assert _decode_vs_prefill(torch.float32, window=13, sinks=sinks) == []
    assert _decode_vs_prefill(torch.float32, d=24, dv=20, hq=6, hkv=3, L=33) == []


def test_attention_torch_decode_differs_from_prefill():
    """The engine's torch path today: SDPA over the whole prompt (is_causal) vs one masked SDPA
    per decode step over the cache."""
    L, hq, hkv, d = 70, 4, 2, 16
    q, k, v = _randn(1, hq, L, d, seed=1), _randn(1, hkv, L, d, seed=2), _randn(1, hkv, L, d, seed=3)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ctx = 96
    kc, vc = torch.zeros(1, hkv, ctx, d), torch.zeros(1, hkv, ctx, d)
    kc[:, :, :L], vc[:, :, :L] = k, v
    bad = 0
    for p in range(L):
        mask = (torch.arange(ctx) <= p)[None, None, None, :]
        o = F.scaled_dot_product_attention(q[:, :, p:p + 1], kc, vc, attn_mask=mask, enable_gqa=True)
        bad += not torch.equal(o[0, :, 0], full[0, :, p])
    assert bad > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_chunked_prefill_and_packed_batch_equal_full(dtype):
    """A sequence prefilled in chunks of 7 and of 29 against the cache, and packed among 15
    other sequences of other lengths at 1-3 threads, equals its own full prefill."""
    hq, hkv, d, L = 4, 2, 16, 90
    q, k, v = _randn(L, hq, d, seed=1, dtype=dtype), _randn(L, hkv, d, seed=2, dtype=dtype), \
        _randn(L, hkv, d, seed=3, dtype=dtype)
    full = E.packed_attention(q, k, v, torch.tensor([0, L], dtype=torch.int32))
    kc = torch.zeros(3, hkv, 128, d, dtype=dtype)
    vc = torch.zeros_like(kc)
    kc[1, :, :L], vc[1, :, :L] = k.transpose(0, 1), v.transpose(0, 1)
    for chunk in (7, 29):
        parts = []
        for c0 in range(0, L, chunk):
            n = min(chunk, L - c0)
            parts.append(E.cached_attention(q[c0:c0 + n], kc, vc, torch.tensor([0, n], dtype=torch.int32),
                                            torch.tensor([1]), torch.tensor([c0], dtype=torch.int32)))
        assert torch.equal(torch.cat(parts), full), chunk
    lens = torch.randint(1, 120, (15,), generator=_gen(5)).tolist()
    others = [(_randn(n, hq, d, seed=10 + i, dtype=dtype), _randn(n, hkv, d, seed=40 + i, dtype=dtype),
               _randn(n, hkv, d, seed=70 + i, dtype=dtype)) for i, n in enumerate(lens)]
    seqs = others[:6] + [(q, k, v)] + others[6:]
    cu = torch.tensor([0] + [s[0].shape[0] for s in seqs]).cumsum(0).to(torch.int32)
    qs, ks, vs = (torch.cat([s[i] for s in seqs]) for i in range(3))
    for t in THREADS:
        with threads(t):
            out = E.packed_attention(qs, ks, vs, cu)
        assert torch.equal(out[cu[6]:cu[7]], full), t
    assert used_threads() > 1


@pytest.mark.parametrize("window,with_sinks,dims", [(0, False, (16, 16)), (5, True, (16, 16)), (0, True, (24, 12)),
                                                    (70, False, (64, 64))])
def test_attention_accuracy(window, with_sinks, dims):
    dq, dv = dims
    lens = [1, 9, 65, 130]
    cu = torch.tensor([0] + lens).cumsum(0).to(torch.int32)
    T, hq, hkv = int(cu[-1]), 6, 2
    q, k, v = _randn(T, hq, dq, seed=1), _randn(T, hkv, dq, seed=2), _randn(T, hkv, dv, seed=3)
    sinks = _randn(hq, seed=4) if with_sinks else None
    got = E.packed_attention(q, k, v, cu, window=window, sinks=sinks)
    z = torch.zeros(len(lens), dtype=torch.int32)
    want = E.attention_reference(q.double(), k.double(), v.double(), cu, z, z.long(), cu[:-1].long(), dq ** -0.5,
                                 window, None if sinks is None else sinks.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-6)


def test_attention_bad_input():
    q, kc, vc = _randn(1, 4, 16), *_cache(2, 2, 32, 16, torch.float32, 1)
    one = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(IndexError, match="outside the key buffers"):
        E.cached_attention(q, kc, vc, one, torch.tensor([0]), torch.tensor([32], dtype=torch.int32))
    with pytest.raises(IndexError, match="outside the key buffers"):
        E.cached_attention(q, kc, vc, one, torch.tensor([2]), torch.tensor([3], dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple of Hkv|do not fit"):
        E.cached_attention(_randn(1, 3, 16), kc, vc, one, torch.tensor([0]), torch.tensor([3], dtype=torch.int32))
    with pytest.raises(TypeError, match="must be torch.float32"):
        E.cached_attention(q, kc.bfloat16(), vc, one, torch.tensor([0]), torch.tensor([3], dtype=torch.int32))


# --- MoE combine, SiLU-mul, sigmoid ---------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_combine_token_alone_equals_batched_and_is_slot_ordered_fp32(dtype):
    k, H = 4, 3000
    e_row, w_row = _randn(k, H, seed=1, dtype=dtype), torch.rand(1, k, generator=_gen(2))
    e_others, w_others = _randn(60 * k, H, seed=3, dtype=dtype), torch.rand(60, k, generator=_gen(4))
    alone = E.moe_combine(e_row, w_row)
    for n in BATCHES:
        at = n // 3
        e = torch.cat([e_others[:at * k], e_row, e_others[at * k:(n - 1) * k]])
        w = torch.cat([w_others[:at], w_row, w_others[at:n - 1]])
        for t in THREADS:
            with threads(t):
                assert torch.equal(E.moe_combine(e, w)[at], alone[0]), (n, t)
    # the definition: slot 0, 1, 2, 3 in order, each a fused multiply-add in fp32, one rounding
    acc = torch.zeros(H, dtype=torch.float64)
    for s in range(k):
        acc = (w_row[0, s].double() * e_row[s].double() + acc).float().double()  # fma: one rounding per slot
    assert torch.equal(alone[0], acc.to(dtype))
    # torch's bmm of the same (what the model runs) is invariant here too: the check can fail
    assert not torch.equal(one_ulp_off(alone), alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_and_sigmoid_do_not_depend_on_where_an_element_sits(dtype):
    """Rows of 127 (a row alone ends in a tail that torch computes with scalar code; in a batch
    the same elements fall in its vectorised body): each row alone equals it in the batch of 60,
    and one row equals itself among 15-39 others at 1-3 threads."""
    C = 127
    g, u = _randn(61, C, seed=1, dtype=dtype, scale=3.0), _randn(61, C, seed=2, dtype=dtype)
    assert rows_differing(lambda t: E.silu_mul(t[:, :C].contiguous(), t[:, C:].contiguous()),
                          torch.cat([g, u], 1)) == 0
    assert rows_differing(E.sigmoid, g) == 0
    assert row_mismatches(lambda t: E.silu_mul(t, t * 0.5), g[:1], g[1:]) == []
    # torch: the same elements, other bits in the tail (its vectorised kernels; ATEN_CPU_CAPABILITY=default
    # runs scalar code only, with no tail to differ)
    if dtype == torch.float32 and torch.backends.cpu.get_cpu_capability() != "DEFAULT":
        assert rows_differing(F.silu, g) > 0 and rows_differing(torch.sigmoid, g) > 0


def test_elementwise_accuracy():
    g, u = _randn(40, 77, seed=1, scale=5.0), _randn(40, 77, seed=2)
    torch.testing.assert_close(E.silu_mul(g, u).double(), F.silu(g.double()) * u.double(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(E.sigmoid(g).double(), torch.sigmoid(g.double()), rtol=1e-6, atol=1e-7)
    gb, ub = g.bfloat16(), u.bfloat16()
    got, want = E.silu_mul(gb, ub), F.silu(gb) * ub  # torch's rounding order: silu to bf16, then the product
    assert ((got.double() - want.double()).abs() <= 2 ** -7 * want.double().abs()).all()


def test_moe_combine_bad_input():
    with pytest.raises(ValueError, match="tokens \\* k"):
        E.moe_combine(_randn(7, 16), torch.rand(4, 2))


# --- across instruction sets ----------------------------------------------------------------
def test_every_instruction_set_gives_the_same_bits():
    """AVX-512VL, AVX2 and the portable build (plain floats, fmaf) of each kernel agree."""
    if len(ISAS) < 2:
        pytest.skip("this CPU has only the portable build")
    torch.manual_seed(0)
    w = _randn(50, 77, seed=1)
    x = _randn(37, 77, seed=2, scale=3.0)
    wg, offs = _randn(3, 40, 77, seed=3), torch.tensor([10, 10, 37], dtype=torch.int32)
    q, k, v = _randn(40, 4, 24, seed=4), _randn(40, 2, 24, seed=5), _randn(40, 2, 20, seed=6)
    cu = torch.tensor([0, 3, 40], dtype=torch.int32)
    e, cw = _randn(74, 77, seed=7), torch.rand(37, 2, generator=_gen(8))

    def run():
        return [E.linear(x, w), E.linear(x.bfloat16(), w.bfloat16()), E.grouped_linear(x, wg, offs),
                E.rms_norm(x, w[0], 1e-6), E.rms_norm(x.bfloat16(), w[0].bfloat16(), 1e-6), E.log_softmax(x),
                E.softmax(x.bfloat16()), E.packed_attention(q, k, v, cu, window=9, sinks=_randn(4, seed=9)),
                E.moe_combine(e, cw), E.silu_mul(x, x * 0.5), E.sigmoid(x.bfloat16())]

    results = {}
    for name in ISAS:
        with isa(name):
            results[name] = run()
    for name in ISAS[1:]:
        for i, (a, b) in enumerate(zip(results[ISAS[0]], results[name])):
            assert torch.equal(a, b), (name, i)


def test_bad_dtype_and_impl():
    x = _randn(4, 8)
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        E.linear(x.double(), x.double())
    with pytest.raises(TypeError, match="as the input"):
        E.linear(x, x.bfloat16())
    with pytest.raises(ValueError, match="impl must be one of"):
        E.rms_norm(x, torch.ones(8), 1e-6, impl="cuda")
    with pytest.raises(ValueError, match="weight must be"):
        E.linear(x, _randn(3, 5))
