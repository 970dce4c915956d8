"""Triton kernels (with plain-torch fallbacks), installed as ``moe_rl.kernels``."""
from .bucket_pack import pack as bucket_pack, unpack as bucket_unpack
from .fused_logprobs import fused_logprobs
from .fused_token_loss import fused_token_loss

__all__ = ["fused_logprobs", "fused_token_loss"]
