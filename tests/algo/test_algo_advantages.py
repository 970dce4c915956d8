import math

import torch

from moe_rl.algo import grpo_advantages, grpo_advantages_by_group


def test_mean_baseline_without_std():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]])
    adv = grpo_advantages(r, std_normalize=False)
    assert torch.allclose(adv, torch.tensor([[0.5, -0.5, -0.5, 0.5], [-0.25, -0.25, -0.25, 0.75]]))


def test_std_normalisation_uses_population_std():
    r = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    # mean 0.25, population std sqrt(0.1875)
    std = math.sqrt(0.1875)
    adv = grpo_advantages(r, std_normalize=True, eps=0.0)
    assert torch.allclose(adv, torch.tensor([[-0.25, -0.25, -0.25, 0.75]]) / std)
    # unit root-mean-square in every non-constant group
    adv = grpo_advantages(torch.tensor([[1.0, 2.0, 4.0], [3.0, -1.0, 0.5]]), True, eps=0.0)
    assert torch.allclose(adv.pow(2).mean(1), torch.ones(2))


def test_constant_groups_get_exact_zeros():
    r = torch.tensor([[0.3, 0.3, 0.3], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    for std in (True, False):
        adv = grpo_advantages(r, std_normalize=std)
        assert torch.isfinite(adv).all()
        assert (adv[:3] == 0).all()
        assert adv[3].abs().sum() > 0
    # a group of one
    assert (grpo_advantages(torch.tensor([[5.0]]), True) == 0).all()
    # integer rewards are accepted
    assert grpo_advantages(torch.tensor([[0, 1]]), False).dtype.is_floating_point


def test_ragged_groups_match_dense():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    flat = r.reshape(-1)
    gid = torch.arange(3).repeat_interleave(4) * 7  # arbitrary ids
    perm = torch.tensor([5, 0, 11, 3, 8, 1, 10, 2, 7, 4, 9, 6])
    for std in (True, False):
        dense = grpo_advantages(r, std).reshape(-1)
        rag = grpo_advantages_by_group(flat[perm], gid[perm], std)
        assert torch.allclose(rag, dense[perm])
    # uneven group sizes: group 0 has 3, group 1 has 1 member
    adv = grpo_advantages_by_group(torch.tensor([1.0, 0.0, 0.0, 9.0]), torch.tensor([0, 0, 0, 1]), False)
    assert torch.allclose(adv, torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0]))
