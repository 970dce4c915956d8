"""RMSNorm as HF's MoE families compute it."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .ops import TORCH


class RMSNorm(nn.Module):
    """``scale_fp32``: the weight multiplies the fp32 normalised input before the cast back
    (gpt-oss; HF keeps those norms in fp32); otherwise HF's usual order, cast then scale,
    through the model's ops."""

    ops = TORCH  # its model's ops (moe_rl.model.ops): HF's order, fp32 inside

    def __init__(self, dim: int, eps: float, scale_fp32: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.scale_fp32 = scale_fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale_fp32:  # gpt-oss, which has no exact path (true_on_policy refuses it)
            normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
            return (self.weight.float() * normed).to(x.dtype)
        return self.ops.rms_norm(x, self.weight, self.eps)
