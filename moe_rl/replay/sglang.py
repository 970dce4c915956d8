"""SGLang interop: ``meta_info["routed_experts"]`` to routing records, and partial rollouts.

SGLang (``--enable-return-routed-experts`` plus ``"return_routed_experts": true``) returns, per
request, base64 of flattened little-endian int32 with shape
``[seqlen - 1, num_hidden_layers, top_k]``: one row per forwarded token (the last token was
never forwarded), covering every decoder layer, dense ones included. A record keeps the MoE
layers only (:class:`~moe_rl.replay.layers.RoutingSpec`); rows of dense layers are not looked at
(engines write garbage, -1 or 0 there).
"""
from __future__ import annotations

import base64
import binascii
from typing import Mapping, Sequence

import numpy as np

from moe_rl import _C
from moe_rl.replay.layers import RoutingSpec

__all__ = ["decode_routed_experts", "merge_partial", "record_from_responses",
           "check_record", "routed_rows", "routing_covers"]


def check_record(ids: np.ndarray, num_experts: int, *, what: str = "record",
                 layer_names: Sequence[int] | None = None) -> None:
    """Raises ValueError unless every row of ``ids`` [tokens, layers, top_k] holds distinct ids in
    ``[0, num_experts)``. The message names the token row, the layer (``layer_names[l]`` if
    given, e.g. hidden-layer indices) and the value."""
    ids = np.ascontiguousarray(ids)
    _, n_layers, k = ids.shape
    names = list(layer_names) if layer_names is not None else list(range(n_layers))
    i = int(_C.first_out_of_range(ids, int(num_experts)))
    if i >= 0:
        t, rest = divmod(i, n_layers * k)
        l, j = divmod(rest, k)
        hint = " (-1 means the engine did not capture this layer)" if ids.flat[i] == -1 else ""
        raise ValueError(f"{what}: token row {t}, layer {names[l]}, slot {j} has expert id "
                         f"{int(ids.flat[i])}, outside [0, {num_experts}){hint}")
    r = int(_C.first_duplicate_row(ids, k)) if k > 1 else -1
    if r >= 0:
        t, l = divmod(r, n_layers)
        raise ValueError(f"{what}: token row {t}, layer {names[l]} repeats an expert id "
                         f"{ids[t, l].tolist()} (a router's top-k ids are distinct; all-zero rows "
                         f"mean the engine did not capture routing)")


def decode_routed_experts(routed_experts, spec: RoutingSpec, *, num_tokens: int | None = None,
                          start: int = 0, what: str = "routed_experts") -> np.ndarray:
    """Decodes SGLang's ``meta_info["routed_experts"]`` into a record.

    Args:
        routed_experts: the base64 string/bytes (or an already decoded int array).
        spec: the model's routing shape; dense layers are dropped by ``spec.moe_layers``.
        num_tokens: if given, the request's full sequence length (prompt + output tokens); the
            payload must then have exactly ``num_tokens - 1 - start`` rows.
        start: the first token the payload covers (SGLang's ``routed_experts_start_len``).

    Returns int32 ``[rows, spec.num_moe_layers, spec.top_k]``. ValueError if the payload's size
    does not fit the model, or a MoE-layer row has -1, an out-of-range or a repeated id.
    """
    per_row = spec.num_hidden_layers * spec.top_k
    if isinstance(routed_experts, (str, bytes, bytearray)):
        try:
            raw = base64.b64decode(routed_experts, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"{what}: not valid base64 ({e})") from None
        if len(raw) % 4:
            raise ValueError(f"{what}: {len(raw)} bytes is not a whole number of int32")
        flat = np.frombuffer(raw, dtype="<i4")
    else:
        flat = np.asarray(routed_experts).reshape(-1)
        if flat.dtype.kind not in "iu":
            raise ValueError(f"{what}: expected integer ids, got dtype {flat.dtype}")
    if flat.size % per_row:
        raise ValueError(f"{what}: {flat.size} ids is not a multiple of num_hidden_layers x top_k "
                         f"= {spec.num_hidden_layers} x {spec.top_k}; wrong model config?")
    rows = flat.size // per_row
    if num_tokens is not None:
        expect = int(num_tokens) - 1 - int(start)
        if rows != expect:
            raise ValueError(f"{what}: {rows} rows, expected {expect} (seqlen {num_tokens} - 1"
                             f"{f' - start {start}' if start else ''})")
    full = flat.reshape(rows, spec.num_hidden_layers, spec.top_k)
    if len(spec.moe_layers) == spec.num_hidden_layers:
        ids = np.ascontiguousarray(full, dtype=np.int32)
    else:
        ids = np.ascontiguousarray(full[:, list(spec.moe_layers), :], dtype=np.int32)
    check_record(ids, spec.num_experts, what=what, layer_names=spec.moe_layers)
    return ids


def routed_rows(routed_experts, spec: RoutingSpec) -> int | None:
    """Rows (tokens) in SGLang's ``meta_info["routed_experts"]`` without checking them; None
    when the response carries none (SGLang: a request aborted while queued)."""
    if routed_experts is None:
        return None
    if isinstance(routed_experts, (str, bytes, bytearray)):
        try:
            n = len(base64.b64decode(routed_experts, validate=True)) // 4
        except (binascii.Error, ValueError):
            return None
    else:
        n = np.asarray(routed_experts).size
    return n // (spec.num_hidden_layers * spec.top_k)


def routing_covers(meta: dict, spec: RoutingSpec, input_len: int, new_tokens: int, start: int) -> bool:
    """Whether a response's routed_experts has a row for every token it covers: positions
    ``[start, input_len + new_tokens - 1)``, as SGLang's routed_experts_start_len defines them."""
    return routed_rows(meta.get("routed_experts"), spec) == input_len + new_tokens - 1 - start


def merge_partial(segments: Sequence, *, starts: Sequence[int] | None = None,
                  num_tokens: int | None = None) -> np.ndarray:
    """Joins the routing of one sample generated in several segments (partial rollout).

    A request aborted for a weight update is resubmitted with prompt + partial output as its
    new prompt, so each response's routing covers its whole input again: segment ``i`` holds
    rows for token positions ``[starts[i], starts[i] + len(segments[i]))`` (``starts`` default to
    0). The result covers positions ``[0, end)`` exactly once, where ``end`` is the furthest
    position any segment reaches; if ``num_tokens`` (the final sequence length) is given,
    ``end`` must equal ``num_tokens - 1``.

    Where segments overlap, the **earliest** segment's row is kept. Row ``p`` is the routing of
    the forward pass at position ``p``, the one that produced the logits for token ``p + 1``;
    the earliest segment covering ``p`` is the one that actually sampled token ``p + 1`` (later
    segments only re-forwarded it as part of their prompt, under newer weights). Keeping it
    means each response token's behaviour log-prob and its replayed routing come from the same
    forward pass. (It is also what SGLang returns itself for prefix rows served from its radix
    cache, and what a resumed request asking for ``routed_experts_start_len`` gets.)

    ValueError if the segments leave a gap, shrink, or disagree in shape.
    """
    if not segments:
        raise ValueError("merge_partial: no segments")
    segs = [np.asarray(s) for s in segments]
    starts = [0] * len(segs) if starts is None else [int(s) for s in starts]
    if len(starts) != len(segs):
        raise ValueError("merge_partial: starts and segments differ in length")
    shape = segs[0].shape[1:]
    parts, covered = [], 0
    for i, (seg, s) in enumerate(zip(segs, starts)):
        if seg.ndim != 3 or seg.shape[1:] != shape:
            raise ValueError(f"merge_partial: segment {i} has shape {seg.shape}, expected "
                             f"[rows, {shape[0]}, {shape[1]}]")
        end = s + seg.shape[0]
        if s > covered:
            raise ValueError(f"merge_partial: segment {i} starts at token {s} but tokens "
                             f"[{covered}, {s}) are not covered by any earlier segment")
        if end < covered:
            raise ValueError(f"merge_partial: segment {i} ends at token {end}, before the "
                             f"{covered} tokens already covered; segments must be in order")
        parts.append(seg[covered - s:])
        covered = end
    if num_tokens is not None and covered != int(num_tokens) - 1:
        raise ValueError(f"merge_partial: segments cover {covered} tokens, expected "
                         f"{int(num_tokens) - 1} (num_tokens - 1)")
    return np.ascontiguousarray(np.concatenate(parts, axis=0))


def record_from_responses(meta_infos: Sequence[Mapping], spec: RoutingSpec, *,
                          num_tokens: int | None = None,
                          starts: Sequence[int] | None = None) -> np.ndarray:
    """The record of one sample from the ``meta_info`` of each of its SGLang responses (one,
    or several for a partial rollout, in order). Each response's row count is checked against
    its ``prompt_tokens + completion_tokens`` when SGLang reports them; segments are joined
    with :func:`merge_partial`."""
    starts = [0] * len(meta_infos) if starts is None else list(starts)
    segs = []
    for i, (mi, s) in enumerate(zip(meta_infos, starts)):
        if "routed_experts" not in mi or mi["routed_experts"] is None:
            raise ValueError(f"response {i} has no meta_info['routed_experts'] (start SGLang "
                             f"with --enable-return-routed-experts and send "
                             f"return_routed_experts=true)")
        seqlen = None
        if "prompt_tokens" in mi and "completion_tokens" in mi:
            seqlen = int(mi["prompt_tokens"]) + int(mi["completion_tokens"])
        segs.append(decode_routed_experts(mi["routed_experts"], spec, num_tokens=seqlen,
                                          start=s, what=f"response {i} routed_experts"))
    return merge_partial(segs, starts=starts, num_tokens=num_tokens)
