"""Torch-native MoE models (Qwen3-MoE, GLM-4.5, DeepSeek-V3, gpt-oss, Qwen3-Next and Qwen3.5-MoE) with
routing record/replay and expert parallelism; attention kinds and their decode states in attention/.

The names below load with the module that defines them, on first use: the config
(``moe_rl.config``) reads ``moe_rl.model.arch`` alone, so a process that only reads a config
(``moe-rl validate``, ``moe-rl keys``, the ``moe-rl train`` launcher) loads neither torch's
model code nor the Triton kernels.
"""
import importlib

from .arch import MoEArch

_LAZY = {  # name -> the submodule that defines it
    **dict.fromkeys(("expert_owner", "hf_dtype", "hf_param_specs", "hf_state_dict", "bind_hf_views",
                     "dequantize_mxfp4", "iter_local_hf_tensors", "load_hf", "load_hf_weights", "local_hf_tensor",
                     "parse_expert_name", "save_hf", "stacked_expert_rows"), ".hf_io"),
    **dict.fromkeys(("PackedCausal", "PaddedCausal", "packed_positions"), ".attention"),
    **dict.fromkeys(("MoEForCausalLM", "RoutingError"), ".transformer"),
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # later look-ups find it without this function
    return value


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
