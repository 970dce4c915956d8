"""Rollout engines: the embedded engine, its SGLang-protocol server, and the client.

``EngineClient`` is how the rest of the stack talks to engines (embedded or real SGLang).
The engine and server (``moe_rl.engine.engine``, ``moe_rl.engine.server``) import torch and
are imported where they run. ``moe_rl.engine.gateway`` serves the embedded engine's OpenAI
endpoints and episode records before an SGLang server (agents on SGLang engines).
"""
from .client import EngineClient, EngineError, EngineHTTPError
from .protocol import (
    RequestError,
    decode_routed_experts,
    encode_routed_experts,
    output_logprobs,
    token_weight_versions,
)

__all__ = [
    "EngineClient",
    "EngineError",
    "EngineHTTPError",
    "RequestError",
    "decode_routed_experts",
    "encode_routed_experts",
    "output_logprobs",
    "token_weight_versions",
]
