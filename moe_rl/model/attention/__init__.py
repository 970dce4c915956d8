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

from .base import Mixer
from .deltanet import DeltaNet, DeltaNetQKVZ
from .gated import GatedAttention
from .layouts import (Attention, PackedCausal, PaddedCausal, Scan, Sequences, Steps, decode_sdpa, longest_sequence,
                      packed_positions, sdpa, visible)
from .mha import MHAttention, SlidingAttention
from .mla import MLAttention
from .rope import Rope, apply_rope, rope_cos_sin
from .state import KVCache, KVSpec, RecurrentSpec, RecurrentState, RingKVCache, RingKVSpec

MIXERS: dict[str, type[Mixer]] = {
    "mha": MHAttention,
    "swa": SlidingAttention,  # gpt-oss's sliding-window layers
    "gated_attention": GatedAttention,  # Qwen3-Next / Qwen3.5 full-attention layers
    "deltanet": DeltaNet,  # Gated DeltaNet, Qwen3.5's projections
    "deltanet_qkvz": DeltaNetQKVZ,  # Gated DeltaNet, Qwen3-Next's projections
    "mla": MLAttention,
}


def mixer_class(arch: MoEArch, layer: int) -> type[Mixer]:
    kind = arch.layer_kinds()[layer]
    if kind not in MIXERS:
        raise ValueError(f"layer {layer}: unknown attention kind {kind!r} (known: {sorted(MIXERS)})")
    return MIXERS[kind]


def state_specs(arch: MoEArch) -> list:
    """Each layer's decode state spec (``state.py``), in layer order."""
    return [mixer_class(arch, i).state_spec(arch, i) for i in range(arch.num_hidden_layers)]


__all__ = ["MIXERS", "Mixer", "MHAttention", "MLAttention", "mixer_class", "state_specs", "Attention", "PaddedCausal",
           "PackedCausal", "sdpa", "decode_sdpa", "longest_sequence", "packed_positions", "Rope", "apply_rope",
           "rope_cos_sin", "KVSpec", "KVCache", "RecurrentSpec", "RecurrentState", "Scan", "Sequences", "Steps",
           "GatedAttention", "DeltaNet", "DeltaNetQKVZ", "SlidingAttention", "RingKVSpec", "RingKVCache", "visible"]
