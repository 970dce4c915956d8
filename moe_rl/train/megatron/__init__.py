"""``train.backend: megatron``: megatron-core's GPTModel as a TrainBackend (needs megatron-core).

``convert`` (HF <-> Megatron names, shapes and tensors) is pure torch and imports without
megatron-core; ``MegatronBackend`` imports megatron-core when first accessed.
"""
from .convert import MegatronLayout, hf_to_megatron, megatron_param_specs, megatron_to_hf

__all__ = ["MegatronBackend", "MegatronLayout", "hf_to_megatron", "megatron_to_hf", "megatron_param_specs"]


def __getattr__(name):
    if name == "MegatronBackend":
        try:
            from .backend import MegatronBackend
        except ImportError as e:
            raise ImportError(
                f"train.backend=megatron needs megatron-core ({e}); install it with "
                "`pip install 'moe-rl[megatron]'` (docs/megatron.md)"
            ) from e
        return MegatronBackend
    raise AttributeError(name)
