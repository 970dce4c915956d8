"""Advantages and losses: GRPO group advantages and the decoupled-PPO policy loss
(proximal-policy clipping, TIS, IcePop masking, k3 KL, entropy bonus)."""
from .advantages import grpo_advantages, grpo_advantages_by_group
from .loss import k3, loss_normalisers, mismatch_metrics, policy_loss

__all__ = [
    "grpo_advantages",
    "grpo_advantages_by_group",
    "policy_loss",
    "mismatch_metrics",
    "loss_normalisers",
    "k3",
]
