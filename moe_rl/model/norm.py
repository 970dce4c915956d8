"""RMSNorm as HF's MoE families compute it."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .ops import TORCH


class RMSNorm(nn.Module):
    """HF's usual order through the model's ops: normalise in fp32, cast back, then scale.
    ``scale_fp32``: the weight multiplies the fp32 normalised input before the cast back
    (gpt-oss; HF keeps those norms in fp32). ``zero_centered``: Gemma's form (Qwen3-Next,
    Qwen3.5), the scale is 1 + weight (weight initialised at 0), multiplied in fp32 before the
    cast back. Neither form has an exact path (true_on_policy refuses those families)."""

    ops = TORCH  # its model's ops (moe_rl.model.ops): HF's order, fp32 inside

    def __init__(self, dim: int, eps: float, scale_fp32: bool = False, zero_centered: bool = False):
        super().__init__()
        self.zero_centered = zero_centered
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))
        self.eps = eps
        self.scale_fp32 = scale_fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.zero_centered or self.scale_fp32):
            return self.ops.rms_norm(x, self.weight, self.eps)
        scale = self.weight.float() + 1 if self.zero_centered else self.weight.float()
        return (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * scale).to(x.dtype)
