"""Torch-native MoE models (Qwen3-MoE, GLM-4.5, gpt-oss) with routing record/replay and expert parallelism."""
from .arch import MoEArch
from .hf_io import (
    expert_owner,
    hf_dtype,
    hf_param_specs,
    hf_state_dict,
    bind_hf_views,
    dequantize_mxfp4,
    iter_local_hf_tensors,
    load_hf,
    load_hf_weights,
    local_hf_tensor,
    parse_expert_name,
    save_hf,
    stacked_expert_rows,
)
from .attention import PackedCausal, PaddedCausal, packed_positions
from .transformer import MoEForCausalLM, RoutingError

__all__ = [
    "MoEArch",
    "MoEForCausalLM",
    "RoutingError",
    "PaddedCausal",
    "PackedCausal",
    "packed_positions",
    "load_hf",
    "load_hf_weights",
    "save_hf",
    "hf_state_dict",
    "hf_param_specs",
    "iter_local_hf_tensors",
    "bind_hf_views",
    "local_hf_tensor",
    "expert_owner",
    "hf_dtype",
    "parse_expert_name",
    "stacked_expert_rows",
    "dequantize_mxfp4",
]
