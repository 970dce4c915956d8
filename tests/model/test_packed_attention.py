"""Packed causal attention (padded [S, L_max] layout, and the block-mask fallback) against
plain attention of each sequence on its own."""
import pytest
import torch
import torch.nn.functional as F

from moe_rl.model.attention import PackedCausal


def separate(cu, q, k, v):
    outs = []
    bounds = cu.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[s:e].transpose(0, 1) for t in (q, k, v))
        ks, vs = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=0) for t in (ks, vs))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("cu,padded", [([0, 3, 7, 12], True), ([0, 6], True), ([0, 1, 2, 3, 20], False)])
def test_packed_equals_separate(cu, padded):
    cu = torch.tensor(cu)
    total = int(cu[-1])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(total, 4, 8, generator=g, requires_grad=True)
    k, v = torch.randn(total, 2, 8, generator=g), torch.randn(total, 2, 8, generator=g)
    attend = PackedCausal(cu, total)
    assert attend.padded == padded
    out = attend(0, q, k, v)
    ref = separate(cu, q, k, v)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    grad = torch.randn(out.shape, generator=g)
    (gq,) = torch.autograd.grad((out * grad).sum(), q)
    (rq,) = torch.autograd.grad((ref * grad).sum(), q)
    torch.testing.assert_close(gq, rq, atol=1e-6, rtol=1e-5)
