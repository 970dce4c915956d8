"""Routing replay (R3): the routing-record log, SGLang interop, alignment to trainer ranks.

- :class:`ReplayLog`: records ``[tokens, moe_layers, top_k]`` keyed by sample uid, bit-packed
  and CRC-checked on disk (C++ store in ``csrc/``, one writer, many readers).
- :func:`decode_routed_experts`, :func:`record_from_responses`, :func:`merge_partial`:
  SGLang's ``meta_info["routed_experts"]`` to records, partial rollouts joined.
- :func:`align_replay` with :func:`padded_layout` / :func:`packed_layout`: the per-layer
  ``[local_tokens, top_k]`` tensors for ``RouterReplay.set_replay_data`` and the native model.
- :func:`moe_layer_indices`, :class:`RoutingSpec`: which layers route (Qwen3-MoE rule).
"""
from moe_rl.replay.align import (TokenLayout, align_replay, filler_ids, packed_layout,
                                 padded_layout, sequence_major_positions,
                                 sequence_parallel_range)
from moe_rl.replay.codec import bits_for, pack, pack_numpy, packed_bytes, unpack, unpack_numpy
from moe_rl.replay.layers import RoutingSpec, moe_layer_indices
from moe_rl.replay.log import FORMAT_VERSION, CorruptRecordError, ReplayLog
from moe_rl.replay.sglang import (check_record, decode_routed_experts, merge_partial,
                                  record_from_responses, routed_rows, routing_covers)

__all__ = [
    "ReplayLog", "CorruptRecordError", "FORMAT_VERSION",
    "bits_for", "packed_bytes", "pack", "unpack", "pack_numpy", "unpack_numpy",
    "RoutingSpec", "moe_layer_indices",
    "decode_routed_experts", "merge_partial", "record_from_responses", "check_record", "routed_rows", "routing_covers",
    "TokenLayout", "padded_layout", "packed_layout", "sequence_parallel_range",
    "sequence_major_positions", "filler_ids", "align_replay",
]
