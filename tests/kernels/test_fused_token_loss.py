"""moe_rl.kernels.fused_token_loss (the LM-head loss with its gradients made in the forward).

1. A generic nonlinear per-token loss of the log-prob and the entropy against an fp64
   materialised reference: loss, log-probs, entropies, d_hidden, d_weight; both
   implementations ("triton" under the interpreter), fp32 and bf16, one slab and several.
2. The policy loss: fused_token_loss + TokenLoss against the plain loss loop, i.e. the general
   path (fused_logprobs, then policy_loss, then backward) for every loss / aggregation / option
   TokenLoss claims (tests/algo/test_token_loss.py's grid) with the torch implementation, and a
   set covering each option once with the Triton kernels: loss value, d_hidden, d_weight, and
   the metrics policy_loss reports from the log-probs each path returns.
"""
from __future__ import annotations

import pytest
import torch

from moe_rl.algo import policy_loss
from moe_rl.algo.token_loss import TokenLoss
from moe_rl.config import AlgoConfig
from moe_rl.kernels import fused_logprobs, fused_token_loss
from moe_rl.kernels.fused_logprobs import Plan
from moe_rl.kernels.fused_token_loss import _FUSED_MIN_ROWS, _plan_fused, fused_scratch_bytes

from tests.algo.test_token_loss import GRID, WEIGHTS, T, _inputs
from tests.distributed import run_distributed
from tests.kernels.test_fused_logprobs import IMPLS, TOL, make_inputs, reference, rel_err


def _generic_loss(n, seed=3, device="cpu"):
    """A per-token loss with nonlinear dependence on both the log-prob and the entropy."""
    g = torch.Generator().manual_seed(seed)
    a, b, c = (torch.randn(n, generator=g).to(device) for _ in range(3))

    def token_loss(logp, ent, rows):
        out = a[rows].to(logp.dtype) * logp + b[rows].to(logp.dtype) * torch.exp(logp)
        if ent is not None:
            out = out + c[rows].to(logp.dtype) * ent * ent
        return out

    return token_loss


def check_generic(impl, n, h, v, dtype, temperature, plan=None, shift=0.0, entropy=True, ignore_every=5):
    hidden, weight, labels = make_inputs(n, h, v, dtype, shift=shift, ignore_every=ignore_every)
    tl = _generic_loss(n)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, logp, ent = fused_token_loss(h1, w1, labels, tl, temperature, return_entropy=entropy, impl=impl,
                                       plan=plan)
    loss.backward()
    h2, w2 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref_logp, ref_ent = reference(h2, w2, labels, temperature)
    keep = labels != -100
    ref_loss = torch.where(keep, tl(ref_logp, ref_ent if entropy else None, slice(0, n)), 0.0).sum()
    ref_loss.backward()

    tol_lp, tol_ent, tol_grad = TOL[dtype]
    scale = max(1.0, abs(shift) / temperature) if dtype == torch.float32 else 1.0  # fp32 logits of size |z|
    assert logp.dtype == torch.float32 and not logp.requires_grad
    torch.testing.assert_close(logp.double(), ref_logp.detach(), atol=tol_lp * scale, rtol=0)
    if entropy:
        torch.testing.assert_close(ent.double(), ref_ent.detach(), atol=tol_ent * scale, rtol=0)
    else:
        assert ent is None
    torch.testing.assert_close(loss.double(), ref_loss.detach(), atol=tol_lp * scale * n, rtol=1e-5)
    assert h1.grad.dtype == dtype and w1.grad.dtype == dtype
    assert rel_err(h1.grad, h2.grad) <= tol_grad * scale, rel_err(h1.grad, h2.grad)
    assert rel_err(w1.grad, w2.grad) <= tol_grad * scale, rel_err(w1.grad, w2.grad)
    assert torch.count_nonzero(h1.grad[~keep]) == 0  # no gradient from an ignored row


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("plan", [None, Plan(rows=16, vocab=0)], ids=["one_slab", "slabs"])
def test_generic_token_loss_matches_reference(impl, dtype, plan):
    # N=37 is not a multiple of any row block; V=1000 not a multiple of any vocab tile.
    check_generic(impl, 37, 64, 1000, dtype, 0.7, plan=plan)


@pytest.mark.parametrize("impl", IMPLS)
def test_without_entropy_ragged_last_tile(impl):
    # 1100 = 4 * 256 + 76: the last 256-wide tile is ragged and the second of its two 128-column
    # statistics groups does not exist, as at V = 151936 = 593 * 256 + 128 (the interpreter
    # would take a minute over the real vocabulary; the torch path runs it below)
    check_generic(impl, 21, 32, 1100, torch.bfloat16, 1.0, entropy=False, ignore_every=3)


def test_qwen_vocab_torch():
    check_generic("torch", 5, 32, 151936, torch.bfloat16, 1.0, ignore_every=3)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shift", [-150.0, 150.0])
def test_extreme_logits_bf16_several_slabs(impl, shift):
    # A large common logit offset: the stored exp(z - m) and the bf16 d_logits must not leave
    # an error along the shared weight component (the row-sum compensation).
    check_generic(impl, 19, 32, 1000, torch.bfloat16, 1.3, plan=Plan(rows=8, vocab=0), shift=shift)


@pytest.mark.parametrize("impl", IMPLS)
def test_frozen_weight_grad_scale_and_single_backward(impl):
    hidden, weight, labels = make_inputs(13, 32, 300, torch.float32)
    tl = _generic_loss(13)
    h1 = hidden.clone().requires_grad_()
    loss, _, _ = fused_token_loss(h1, weight, labels, tl, 0.7, return_entropy=True, impl=impl)
    (3.0 * loss).backward()  # d_weight not computed (weight is frozen); the grad is scaled
    h2 = hidden.clone().requires_grad_()
    loss2, _, _ = fused_token_loss(h2, weight, labels, tl, 0.7, return_entropy=True, impl=impl)
    loss2.backward()
    torch.testing.assert_close(h1.grad, 3.0 * h2.grad)
    with pytest.raises(RuntimeError, match="backward once"):
        loss2.backward()


def test_bad_token_loss_and_labels():
    hidden, weight, labels = make_inputs(4, 32, 100, torch.float32)
    with pytest.raises(ValueError, match="one loss per token"):
        fused_token_loss(hidden, weight, labels, lambda lp, en, rows: lp.sum())
    with pytest.raises(ValueError, match="labels must be in"):
        fused_token_loss(hidden, weight, torch.tensor([0, 1, 100, 2]), _generic_loss(4))


def test_plan_bounds_slabs_and_buffer():
    n, h, v = 8192, 4096, 151936
    plan = _plan_fused(n, h, v, 2)
    assert plan.rows == _FUSED_MIN_ROWS and n // plan.rows == 8  # 8 slabs of 1024 rows
    assert fused_scratch_bytes(plan, n, h, v, 2) < 0.07 * n * v * 4  # ~6.9% of the fp32 logits
    big = _plan_fused(65536, h, v, 2)
    assert fused_scratch_bytes(big, 65536, h, v, 2) <= 2**30 and big.rows % 128 == 0
    assert _plan_fused(300, h, v, 2).rows == 300


# ---------------------------------------------------------------------------------------------
# the policy loss: fused path against the plain loss loop (general path)
# ---------------------------------------------------------------------------------------------
N_TOK, N_SEQ = 57, 9  # the step's global counts


def _policy_case(loss, agg, prox_kind, weights, tis_level, kl, ent_coef, impl, dtype=torch.float32, plan=None,
                 device="cpu", h=32, v=300):
    logp0, prox, behav, adv, mask, seq_ids, ref, _ = (t.to(device) for t in _inputs())
    cfg = AlgoConfig(policy_loss=loss, loss_agg=agg, ratio_anchor="behaviour" if prox_kind == "behaviour" else "proximal",
                     tis_level=tis_level, kl_coef=kl, entropy_coef=ent_coef, loss_norm_tokens=64, **WEIGHTS[weights])
    hidden, weight, labels = (t.to(device) for t in make_inputs(T, h, v, dtype, ignore_every=0))
    # the old log-probs near this policy's own, so ratios straddle the clip and IcePop bounds
    with torch.no_grad():
        cur = fused_logprobs(hidden, weight, labels, 0.9).double()
    prox, behav, ref = cur + (prox - logp0), cur + (behav - logp0), cur + (ref - logp0)
    prox_arg = None if prox_kind == "self" else prox
    with_ent = ent_coef > 0

    # the plain loss loop
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = fused_logprobs(h1, w1, labels, 0.9, return_entropy=with_ent, impl=impl)
    logp, ent = out if with_ent else (out, None)
    want, want_m = policy_loss(logp, logp.detach() if prox_arg is None else prox, behav, adv, mask, seq_ids, cfg,
                               ref_logp=ref, entropy=ent, num_tokens_global=N_TOK, num_seqs_global=N_SEQ)
    want.backward()

    # the fused loss, and policy_loss (no grad) on its log-probs for the metrics
    tl = TokenLoss(cfg, behav, adv, mask, seq_ids, proximal_logp=prox_arg, ref_logp=ref,
                   num_tokens_global=N_TOK, num_seqs_global=N_SEQ)
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    got, lp, en = fused_token_loss(h2, w2, labels, tl, 0.9, return_entropy=with_ent, impl=impl, plan=plan)
    got.backward()
    with torch.no_grad():
        got_value, got_m = policy_loss(lp, lp if prox_arg is None else prox, behav, adv, mask, seq_ids, cfg,
                                       ref_logp=ref, entropy=en, num_tokens_global=N_TOK, num_seqs_global=N_SEQ)

    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), want.detach().double(), rtol=tol, atol=tol * 1e-2)
    torch.testing.assert_close(got_value.double(), want.detach().double(), rtol=tol, atol=tol * 1e-2)
    assert rel_err(h2.grad, h1.grad) <= tol, rel_err(h2.grad, h1.grad)
    assert rel_err(w2.grad, w1.grad) <= tol, rel_err(w2.grad, w1.grad)
    assert set(got_m) == set(want_m)
    for k in want_m:
        # floats: pytest >= 9.2's approx iterates a 0-d tensor expected value (TypeError)
        assert float(got_m[k]) == pytest.approx(float(want_m[k]), rel=tol, abs=tol * 1e-2), k


@pytest.mark.parametrize("loss,agg,prox_kind,weights,tis_level,kl,ent_coef", GRID)
def test_policy_loss_fused_matches_general_path_torch(loss, agg, prox_kind, weights, tis_level, kl, ent_coef):
    _policy_case(loss, agg, prox_kind, weights, tis_level, kl, ent_coef, "torch", plan=Plan(rows=16, vocab=0))


# each option at least once, several slabs, fp32 and bf16
TRITON_CASES = [
    ("ppo", "token", "self", "tis_icepop", "token", 0.0, 0.0, torch.float32),
    ("ppo", "sequence", "given", "tis_icepop", "sequence", 0.3, 0.05, torch.float32),
    ("cispo", "token_sum_norm", "behaviour", "plain", "token", 0.3, 0.05, torch.float32),
    ("cispo", "sequence", "self", "tis_icepop", "token", 0.0, 0.05, torch.bfloat16),
    ("ppo", "token", "given", "plain", "token", 0.3, 0.0, torch.bfloat16),
]


@pytest.mark.parametrize("case", TRITON_CASES, ids=lambda c: "-".join(map(str, c[:7])) + ("-bf16" if c[7] == torch.bfloat16 else ""))
@pytest.mark.parametrize("impl", [p for p in IMPLS if p != "torch"])
def test_policy_loss_fused_matches_general_path_triton(case, impl):
    *opts, dtype = case
    _policy_case(*opts, impl, dtype=dtype, plan=Plan(rows=16, vocab=0))


def test_matches_liger_grpo_dapo_where_installed():
    # An independent implementation of the same loss: Liger's fused linear GRPO loss, "dapo"
    # (PPO clip against the old log-probs, token mean) = TokenLoss with the behaviour anchor
    # and no TIS/IcePop. Also pins the layout the bench hands Liger.
    liger = pytest.importorskip("liger_kernel.chunked_loss")
    from moe_rl.kernels.bench.logprobs import loss_inputs

    n, seqs = 64, 4
    hidden, weight, labels = make_inputs(n, 32, 700, torch.float32, ignore_every=0)
    li = loss_inputs(hidden, weight, labels, 1.0, seqs)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, _, _ = fused_token_loss(h1, w1, labels, li["token_loss"], 1.0, impl="torch")
    loss.backward()
    fn = liger.LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="dapo", epsilon_low=0.2,
                                        epsilon_high=0.28, temperature=1.0, compiled=False)
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    shape = (seqs, n // seqs)
    want, _ = fn(h2.view(*shape, -1), w2, labels.view(shape), li["mask"].view(shape),
                 li["adv"].view(shape)[:, 0].contiguous(), old_per_token_logps=li["behav"].view(shape))
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    assert rel_err(h1.grad, h2.grad) <= 1e-5 and rel_err(w1.grad, w2.grad) <= 1e-5


# ---------------------------------------------------------------------------------------------
# vocab-parallel: 2 gloo ranks, unequal contiguous shards
# ---------------------------------------------------------------------------------------------
def _tp_worker(rank, world, impls):
    import torch.distributed as dist

    n, h, v, temperature = 23, 32, 1000, 0.7
    bounds = [0, 600, 1000]
    hidden, weight, labels = make_inputs(n, h, v, torch.float32, ignore_every=4)
    labels[1], labels[2] = 599, 600  # labels on both sides of the shard boundary
    tl = _generic_loss(n)
    h2, w2 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref_logp, ref_ent = reference(h2, w2, labels, temperature)
    ref_loss = torch.where(labels != -100, tl(ref_logp, ref_ent, slice(0, n)), 0.0).sum()
    ref_loss.backward()
    lo, hi = bounds[rank], bounds[rank + 1]
    for impl in impls:
        for plan in (Plan(rows=8, vocab=0),):  # several slabs: the statistics are merged per slab
            h1, w1 = hidden.clone().requires_grad_(), weight[lo:hi].clone().requires_grad_()
            loss, logp, ent = fused_token_loss(h1, w1, labels, tl, temperature, return_entropy=True,
                                               tp_group=dist.group.WORLD, impl=impl, plan=plan)
            loss.backward()
            torch.testing.assert_close(logp.double(), ref_logp.detach(), atol=1e-5, rtol=0)
            torch.testing.assert_close(ent.double(), ref_ent.detach(), atol=1e-5, rtol=0)
            torch.testing.assert_close(loss.double(), ref_loss.detach(), atol=1e-4, rtol=1e-5)
            assert rel_err(h1.grad, h2.grad) <= 1e-5, (impl, rel_err(h1.grad, h2.grad))
            assert rel_err(w1.grad, w2.grad[lo:hi]) <= 1e-5, (impl, rel_err(w1.grad, w2.grad[lo:hi]))


def test_vocab_parallel_two_gloo_ranks():
    from tests.kernels.test_fused_logprobs import TRITON_OK

    run_distributed(_tp_worker, 2, ["torch"] + (["triton"] if TRITON_OK else []), timeout=180)


# ---------------------------------------------------------------------------------------------
# GPU (skipped without CUDA)
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("case", TRITON_CASES, ids=lambda c: "-".join(map(str, c[:7])) + ("-bf16" if c[7] == torch.bfloat16 else ""))
def test_gpu_policy_loss_fused_matches_general_path(case):
    *opts, dtype = case
    _policy_case(*opts, "triton", dtype=dtype, plan=Plan(rows=16, vocab=0), device="cuda", h=256, v=151936)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,h,v", [(333, 512, 151936), (2100, 1024, 32000)])
def test_gpu_generic_token_loss(dtype, n, h, v):
    hidden, weight, labels = make_inputs(n, h, v, dtype)
    hidden, weight, labels = hidden.cuda(), weight.cuda(), labels.cuda()
    token_loss = _generic_loss(n, device="cuda")
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, logp, ent = fused_token_loss(h1, w1, labels, token_loss, 0.7, return_entropy=True,
                                       plan=Plan(rows=1024, vocab=0))
    loss.backward()
    h2, w2 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref_logp, ref_ent = reference(h2, w2, labels, 0.7)
    ref_loss = torch.where(labels != -100, token_loss(ref_logp, ref_ent, slice(0, n)), 0.0).sum()
    ref_loss.backward()
    tol_lp, tol_ent, tol_grad = TOL[dtype]
    if dtype == torch.float32:
        tol_lp, tol_ent = 2e-5, 2e-5  # cuBLAS-level fp32 GEMM rounding at these widths
    torch.testing.assert_close(logp.double(), ref_logp.detach(), atol=tol_lp, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent.detach(), atol=tol_ent, rtol=0)
    assert rel_err(h1.grad, h2.grad) <= tol_grad and rel_err(w1.grad, w2.grad) <= tol_grad
