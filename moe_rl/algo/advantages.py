"""Group advantages (GRPO, Dr. GRPO, RLOO) and DAPO's overlong reward shaping.

``compute_advantages`` is the entry point the rollout path uses; ``algo.advantage`` picks:

* ``grpo``:   (r - mean_g) / (std_g + eps) with ``algo.std_normalize`` (else r - mean_g);
* ``drgrpo``: r - mean_g, never divided by a std (Dr. GRPO: the std favours easy/hard prompts);
* ``rloo``:   r_i - mean of the *other* members of its group = n/(n-1) * (r_i - mean_g).

A group of one sample gets 0 under all three (it has no baseline but itself).

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

from ..config import AlgoConfig

STD_EPS = 1e-6


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


def _group_index(group_ids: Tensor) -> tuple[Tensor, int]:
    _, inv = torch.unique(group_ids, return_inverse=True)
    return inv, (int(inv.max()) + 1 if inv.numel() else 0)


def compute_advantages(rewards: Tensor, group_ids: Tensor, cfg: AlgoConfig) -> Tensor:
    """rewards [N], group_ids [N] (ragged groups allowed) -> advantages [N] per ``cfg.advantage``.

    Constant groups (including groups of one) get exact zeros under every estimator.
    """
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError("rewards and group_ids must be 1-D tensors of the same length")
    if cfg.advantage == "grpo":
        return grpo_advantages_by_group(rewards, group_ids, std_normalize=cfg.std_normalize, eps=STD_EPS)
    if cfg.advantage not in ("drgrpo", "rloo"):
        raise ValueError(f"algo.advantage={cfg.advantage!r}: expected 'grpo', 'drgrpo' or 'rloo'")
    r = rewards if rewards.is_floating_point() else rewards.float()
    inv, G = _group_index(group_ids)
    zeros = torch.zeros(G, dtype=r.dtype, device=r.device)
    count = zeros.index_add(0, inv, torch.ones_like(r))
    total = zeros.index_add(0, inv, r)
    if cfg.advantage == "drgrpo":
        adv = r - (total / count)[inv]
    else:  # leave-one-out mean of the others; a group of one has no others
        n = count[inv]
        adv = torch.where(n > 1, r - (total[inv] - r) / (n - 1).clamp(min=1), torch.zeros_like(r))
    gmax = torch.full((G,), -torch.inf, dtype=r.dtype, device=r.device).scatter_reduce_(0, inv, r, "amax")
    gmin = torch.full((G,), torch.inf, dtype=r.dtype, device=r.device).scatter_reduce_(0, inv, r, "amin")
    return torch.where((gmax == gmin)[inv], torch.zeros_like(adv), adv)


def constant_groups(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """The group ids (sorted) whose rewards are all equal: no advantage signal (DAPO drops them)."""
    inv, G = _group_index(group_ids)
    r = rewards.to(torch.float64)
    gmax = torch.full((G,), -torch.inf, dtype=r.dtype).scatter_reduce_(0, inv, r, "amax")
    gmin = torch.full((G,), torch.inf, dtype=r.dtype).scatter_reduce_(0, inv, r, "amin")
    return torch.unique(group_ids)[gmax == gmin]


def overlong_penalty(lengths: Tensor, max_len: int, cfg: AlgoConfig) -> Tensor:
    """DAPO's soft overlong punishment, a reward term [N] (<= 0) for responses of ``lengths``.

    With buffer b = ``algo.overlong_buffer`` and p = ``algo.overlong_penalty``: a response of
    length L in (max_len - b, max_len] gets -((L - (max_len - b)) / b) * p, rising linearly to
    the full -p for one cut at max_len; 0 outside the buffer and when b == 0 (off). A response
    longer than max_len (a prompt with its own, larger limit) gets the full -p.
    """
    b = cfg.overlong_buffer
    out = torch.zeros(lengths.shape, dtype=torch.float64, device=lengths.device)
    if b == 0:
        return out
    if b > max_len:
        raise ValueError(f"algo.overlong_buffer={b} exceeds the maximum response length {max_len}")
    over = (lengths.to(torch.float64) - (max_len - b)).clamp(min=0.0, max=float(b))
    return out - over / b * cfg.overlong_penalty
