"""Token mixers (attention kinds), their decode state, rope and the attention layouts.

One module per kind (``mha.py``: softmax attention with grouped K/V heads; ``mla.py``:
multi-head latent attention; ``gated.py``: softmax attention with a per-head output gate;
``deltanet.py``: Gated DeltaNet, a recurrent kind), each a ``Mixer``
(``base.py``) registered in ``MIXERS`` under the name a family's ``Family.attention`` gives a
layer (``MoEArch.layer_kinds``). ``rope.py``: rotary tables; ``layouts.py``: the ``attend``
objects of training and the attention arithmetic; ``state.py``: the per-slot decode state
the engine keeps for a layer (``state_specs``). docs/models.md says how a kind is added.
"""
from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: arch.py imports the mixers
    from ..arch import MoEArch
    from .base import Mixer

# The names below load with the module that defines them, on first use: the config reads
# ``rope`` alone (MoEArch checks rope_scaling), so it loads none of the mixers (moe_rl.model's docstring).
_LAZY = {  # name -> the submodule that defines it
    "Mixer": ".base", "DeltaNet": ".deltanet", "DeltaNetQKVZ": ".deltanet", "GatedAttention": ".gated",
    **dict.fromkeys(("Attention", "PackedCausal", "PaddedCausal", "Scan", "Sequences", "Steps", "decode_sdpa",
                     "longest_sequence", "packed_positions", "sdpa", "visible"), ".layouts"),
    "MHAttention": ".mha", "SlidingAttention": ".mha", "MLAttention": ".mla",
    **dict.fromkeys(("Rope", "apply_rope", "rope_cos_sin"), ".rope"),
    **dict.fromkeys(("KVCache", "KVSpec", "RecurrentSpec", "RecurrentState", "RingKVCache", "RingKVSpec"), ".state"),
}


@functools.cache
def _mixers() -> dict:
    """``MIXERS``: attention kind -> its ``Mixer`` class."""
    from .deltanet import DeltaNet, DeltaNetQKVZ
    from .gated import GatedAttention
    from .mha import MHAttention, SlidingAttention
    from .mla import MLAttention

    return {
        "mha": MHAttention,
        "swa": SlidingAttention,  # gpt-oss's sliding-window layers
        "gated_attention": GatedAttention,  # Qwen3-Next / Qwen3.5 full-attention layers
        "deltanet": DeltaNet,  # Gated DeltaNet, Qwen3.5's projections
        "deltanet_qkvz": DeltaNetQKVZ,  # Gated DeltaNet, Qwen3-Next's projections
        "mla": MLAttention,
    }


def __getattr__(name: str):
    if name == "MIXERS":
        return _mixers()
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # later look-ups find it without this function
    return value


def mixer_class(arch: MoEArch, layer: int) -> type[Mixer]:
    mixers = _mixers()
    kind = arch.layer_kinds()[layer]
    if kind not in mixers:
        raise ValueError(f"layer {layer}: unknown attention kind {kind!r} (known: {sorted(mixers)})")
    return mixers[kind]


def state_specs(arch: MoEArch) -> list:
    """Each layer's decode state spec (``state.py``), in layer order."""
    return [mixer_class(arch, i).state_spec(arch, i) for i in range(arch.num_hidden_layers)]


__all__ = ["MIXERS", "Mixer", "MHAttention", "MLAttention", "mixer_class", "state_specs", "Attention", "PaddedCausal",
           "PackedCausal", "sdpa", "decode_sdpa", "longest_sequence", "packed_positions", "Rope", "apply_rope",
           "rope_cos_sin", "KVSpec", "KVCache", "RecurrentSpec", "RecurrentState", "Scan", "Sequences", "Steps",
           "GatedAttention", "DeltaNet", "DeltaNetQKVZ", "SlidingAttention", "RingKVSpec", "RingKVCache", "visible"]
