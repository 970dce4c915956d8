"""Triton kernels (with plain-torch fallbacks), installed as ``moe_rl.kernels``."""
from .fused_logprobs import fused_logprobs

__all__ = ["fused_logprobs"]
