"""GRPO group advantages.

A group is the n samples drawn for one prompt. The baseline is the group's mean reward; with
``std_normalize`` the centred rewards are divided by the group's standard deviation.

Choice of std: the *population* std (``unbiased=False``). It is defined for a group of one
(giving 0, not NaN), and it makes the normalised advantages of every non-constant group have
unit root-mean-square exactly, whatever n is. (DeepSeek's GRPO and TRL use the unbiased std;
the two differ by the constant factor sqrt((n-1)/n), which Adam largely absorbs.)

A group whose rewards are all equal carries no signal: its advantages are exactly zero, never
NaN or ``eps``-amplified rounding noise.
"""
from __future__ import annotations

import torch
from torch import Tensor


def grpo_advantages(rewards: Tensor, std_normalize: bool = True, eps: float = 1e-6) -> Tensor:
    """rewards [G, n] (G groups of n samples) -> advantages [G, n], same dtype (float).

    adv = r - mean_g(r), divided by (std_g(r) + eps) when ``std_normalize``; constant
    groups get zeros.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, samples], got shape {tuple(rewards.shape)}")
    r = rewards if rewards.is_floating_point() else rewards.float()
    centred = r - r.mean(dim=1, keepdim=True)
    if std_normalize:
        centred = centred / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    constant = (r == r[:, :1]).all(dim=1, keepdim=True)
    return torch.where(constant, torch.zeros_like(centred), centred)


def grpo_advantages_by_group(
    rewards: Tensor, group_ids: Tensor, std_normalize: bool = True, eps: float = 1e-6
) -> Tensor:
    """The same for ragged groups (e.g. after failed samples were dropped).

    rewards [N] and group_ids [N] (any integer ids) -> advantages [N]; each sample is
    compared with the other samples that share its group id.
    """
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError("rewards and group_ids must be 1-D tensors of the same length")
    r = rewards if rewards.is_floating_point() else rewards.float()
    _, inv = torch.unique(group_ids, return_inverse=True)
    G = int(inv.max()) + 1 if inv.numel() else 0
    count = torch.zeros(G, dtype=r.dtype, device=r.device).index_add_(0, inv, torch.ones_like(r))
    mean = torch.zeros(G, dtype=r.dtype, device=r.device).index_add_(0, inv, r) / count
    centred = r - mean[inv]
    if std_normalize:
        var = torch.zeros(G, dtype=r.dtype, device=r.device).index_add_(0, inv, centred**2) / count
        centred = centred / (var.sqrt()[inv] + eps)
    # constant group <=> every member equals the group's max and min
    gmax = torch.full((G,), -torch.inf, dtype=r.dtype, device=r.device).scatter_reduce_(0, inv, r, "amax")
    gmin = torch.full((G,), torch.inf, dtype=r.dtype, device=r.device).scatter_reduce_(0, inv, r, "amin")
    constant = (gmax == gmin)[inv]
    return torch.where(constant, torch.zeros_like(centred), centred)
