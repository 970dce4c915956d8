"""RMSNorm as HF's MoE families compute it."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .ops import TORCH


class RMSNorm(nn.Module):
    """``zero_centered``: Gemma's form (Qwen3-Next, Qwen3.5), the scale is 1 + weight (weight
    initialised at 0) and multiplies in fp32 before the cast back."""

    ops = TORCH  # its model's ops (moe_rl.model.ops): HF's order, fp32 inside

    def __init__(self, dim: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.zero_centered:
            return (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * (self.weight.float() + 1)).to(x.dtype)
        return self.ops.rms_norm(x, self.weight, self.eps)
