"""RMSNorm as HF's MoE families compute it."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """``scale_fp32``: the weight multiplies the fp32 normalised input before the cast back
    (gpt-oss; HF keeps those norms in fp32); otherwise HF's usual order, cast then scale."""

    def __init__(self, dim: int, eps: float, scale_fp32: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.scale_fp32 = scale_fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)  # normalise in fp32 (one fused op)
        if self.scale_fp32:
            return (self.weight.float() * normed).to(x.dtype)
        return self.weight * normed.to(x.dtype)
