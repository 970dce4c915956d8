"""Triton kernels (with plain-torch fallbacks), installed as ``moe_rl.kernels``."""
