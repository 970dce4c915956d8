"""RMSNorm as HF's MoE families compute it."""
from __future__ import annotations

import torch
from torch import nn

from .ops import TORCH


class RMSNorm(nn.Module):
    ops = TORCH  # its model's ops (moe_rl.model.ops): HF's order, fp32 inside

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)
