"""moe_rl.kernels.gated_delta: the chunked gated delta rule over packed sequences against the
token-by-token recurrence in float64 (outputs, final states and every gradient: q, k, v, the
decay, beta, the initial state), both implementations of the chunk scan ("torch" always,
"triton" under TRITON_INTERPRET=1 as `make test` runs, or on a GPU). Packed sequences never see
each other's state. The Triton kernels' sm_90 build is checked in test_sm90_compile.py."""
from __future__ import annotations

import pytest
import torch

from moe_rl.kernels import gated_delta as gd

INTERP_OR_CUDA = gd.triton is not None and (gd.TRITON_INTERPRET or torch.cuda.is_available())
IMPLS = ["torch", pytest.param("triton", marks=[pytest.mark.skipif(
    not INTERP_OR_CUDA, reason="needs triton with TRITON_INTERPRET=1 or a GPU"),
    *([pytest.mark.gpu] if torch.cuda.is_available() else [])])]  # on a GPU: in `pytest -m gpu` (the GPU round)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
# an empty sequence, one shorter than a chunk, one of exactly a chunk, one over two chunks
LENS = [70, 0, 5, 64, 130]


def _inputs(lens, dtype, H=2, Dk=8, Dv=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q = gd.l2norm(torch.randn(T, H, Dk, generator=g, dtype=torch.float64)) * Dk ** -0.5
    k = gd.l2norm(torch.randn(T, H, Dk, generator=g, dtype=torch.float64))
    v = torch.randn(T, H, Dv, generator=g, dtype=torch.float64)
    decay = -torch.rand(T, H, generator=g, dtype=torch.float64) * 0.4
    beta = torch.rand(T, H, generator=g, dtype=torch.float64)
    s0 = torch.randn(len(lens), H, Dk, Dv, generator=g, dtype=torch.float64)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=DEV)
    return [t.to(DEV, dtype) for t in (q, k, v, decay, beta, s0)], cu


def _run(fn, ins, cu):
    ins = [t.detach().requires_grad_() for t in ins]
    o, final = fn(*ins[:5], cu, ins[5])
    g = torch.Generator().manual_seed(7)
    wo = torch.randn(o.shape, generator=g, dtype=torch.float64).to(o)
    wf = torch.randn(final.shape, generator=g, dtype=torch.float64).to(final)
    grads = torch.autograd.grad((o * wo).sum() + (final * wf).sum(), ins)
    return [o.detach(), final.detach(), *grads]


@pytest.mark.parametrize("impl", IMPLS)
def test_chunked_equals_the_recurrence_in_float64(impl):
    ins, cu = _inputs(LENS, torch.float64)
    got = _run(lambda *a: gd.chunk_gated_delta_rule(*a, impl=impl), ins, cu)
    want = _run(gd.gated_delta_rule_reference, ins, cu)
    names = ["o", "final", "dq", "dk", "dv", "dg", "dbeta", "ds0"]
    for name, a, b in zip(names, got, want):
        assert b.abs().max() > 0, name
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0, msg=name)


@pytest.mark.parametrize("impl", IMPLS)
def test_float32_within_rounding_of_float64(impl):
    ins, cu = _inputs(LENS, torch.float64)
    want = _run(gd.gated_delta_rule_reference, ins, cu)
    got = _run(lambda *a: gd.chunk_gated_delta_rule(*a, impl=impl), [t.float() for t in ins], cu)
    for a, b in zip(got, want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, atol=2e-5, rtol=2e-5)



@pytest.mark.skipif(not INTERP_OR_CUDA, reason="needs triton with TRITON_INTERPRET=1 or a GPU")
def test_triton_scan_over_several_key_tiles_and_value_blocks():
    """Heads wider than one tile of the Triton scan (Dk = 40: key tiles of 16, 16 and a ragged
    8; Dv = 40: value blocks of 16, 16 and a ragged 8 under the interpreter, of 32 and 8 on a
    GPU), so the state is carried through memory tile by tile: outputs, final states and every
    gradient equal the float64 recurrence."""
    ins, cu = _inputs([70, 5, 64], torch.float64, Dk=40, Dv=40, seed=3)
    bk, bv = gd._blocks(40, 40)
    assert 40 > 2 * bk and 40 > bv  # several tiles of each
    got = _run(lambda *a: gd.chunk_gated_delta_rule(*a, impl="triton"), ins, cu)
    want = _run(gd.gated_delta_rule_reference, ins, cu)
    for name, a, b in zip(["o", "final", "dq", "dk", "dv", "dg", "dbeta", "ds0"], got, want):
        assert b.abs().max() > 0, name
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0, msg=name)

@pytest.mark.skipif(gd.triton is None, reason="needs triton")
def test_scan_tiles_are_never_narrower_than_a_dot_allows():
    """Triton 3.6 (the GPU image's) refuses a ``tl.dot`` with a dimension below 16, which the
    interpreter and newer Triton accept: heads narrower than 16 (the tests' Dk = 8) run one
    masked 16-wide tile (compiled for sm_90 with Triton 3.6 on CPU at Dk = 8, Dv = 12)."""
    for dk in (1, 8, 12, 16, 40, 128, 256):
        for dv in (1, 8, 12, 16, 20, 40, 128, 256):
            bk, bv = gd._blocks(dk, dv)
            assert bk >= 16 and bv >= 16, (dk, dv, bk, bv)


def test_packed_sequences_never_see_each_other():
    """Each packed sequence equals the same sequence run alone; changing one sequence's inputs
    changes no other sequence's outputs or final state (bit for bit)."""
    ins, cu = _inputs(LENS, torch.float32)
    o, final = gd.chunk_gated_delta_rule(*ins[:5], cu, ins[5])
    for s, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        alone = gd.chunk_gated_delta_rule(*(t[a:b] for t in ins[:5]), cu.new_tensor([0, b - a]), ins[5][s : s + 1])
        torch.testing.assert_close(o[a:b], alone[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(final[s : s + 1], alone[1], atol=1e-6, rtol=0)
    changed = [t.clone() for t in ins]
    a, b = cu[3].item(), cu[4].item()  # the 64-token sequence
    changed[2][a:b] += 1.0
    changed[3][a:b] -= 0.3
    o2, final2 = gd.chunk_gated_delta_rule(*changed[:5], cu, changed[5])
    keep = torch.ones(o.shape[0], dtype=torch.bool)
    keep[a:b] = False
    assert torch.equal(o2[keep], o[keep]) and not torch.equal(o2[a:b], o[a:b])
    assert torch.equal(final2[[0, 1, 2, 4]], final[[0, 1, 2, 4]])


def test_recurrent_step_continues_the_chunked_state():
    """Decode: the chunked rule over a prefix, then one recurrent step per token from its final
    state, equals the chunked rule over the whole sequence (fp64, to rounding)."""
    ins, _ = _inputs([100], torch.float64)
    whole, final = gd.chunk_gated_delta_rule(*ins[:5], torch.tensor([0, 100], device=DEV), ins[5])
    _, state = gd.chunk_gated_delta_rule(*(t[:90] for t in ins[:5]), torch.tensor([0, 90], device=DEV), ins[5])
    for t in range(90, 100):
        o, state = gd.recurrent_step(*(x[t : t + 1] for x in ins[:5]), state)
        torch.testing.assert_close(o[0], whole[t], atol=1e-12, rtol=0)
    torch.testing.assert_close(state, final, atol=1e-12, rtol=0)


def test_impl_choice_is_checked():
    ins, cu = _inputs([3], torch.float32)
    with pytest.raises(ValueError, match="impl must be"):
        gd.chunk_gated_delta_rule(*ins[:5], cu, impl="cuda")
    if not INTERP_OR_CUDA and gd.triton is not None:
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            gd.chunk_gated_delta_rule(*ins[:5], cu, impl="triton")
