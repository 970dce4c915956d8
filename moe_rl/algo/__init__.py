"""Advantages and losses: group advantages (GRPO, Dr. GRPO, RLOO), DAPO's overlong shaping,
and the policy loss (decoupled PPO, GSPO or CISPO, with TIS, IcePop masking, k3 KL, entropy
bonus) under token / sequence / token-sum-normalised aggregation."""
from .advantages import (compute_advantages, constant_groups, grpo_advantages, grpo_advantages_by_group,
                         overlong_penalty)
from .loss import k3, loss_normalisers, mismatch_metrics, policy_loss

__all__ = [
    "compute_advantages",
    "constant_groups",
    "overlong_penalty",
    "grpo_advantages",
    "grpo_advantages_by_group",
    "policy_loss",
    "mismatch_metrics",
    "loss_normalisers",
    "k3",
]
