"""Attention layouts: how the tokens of one forward sit in sequences, and softmax attention over them.

A layout is the ``attend`` object a forward hands every layer (``Attention``). The training
layouts are here: ``PaddedCausal`` ([B, T], causal) and ``PackedCausal`` (several sequences
in one row, ``cu_seqlens``). The engine's layouts (``moe_rl.engine``) attend over the
per-slot decode state that each layer's kind declares (``moe_rl.model.attention.state``).

Every layout answers two questions for a layer:
* ``attend(layer, q, k, v, scale=None, sinks=None, window=None)``: causal softmax attention of
  q [N, Hq, Dk] over the keys k [N, Hkv, Dk] / values v [N, Hkv, Dv] of the same sequence (Hq a
  multiple of Hkv, Dv may differ from Dk; ``scale`` None: 1/sqrt(Dk)) -> [N, Hq, Dv];
  ``window``: only the last ``window`` keys, the query's own included (HF's sliding window);
  ``sinks`` [Hq]: a learned logit per query head that joins each softmax's denominator and
  attends to nothing (gpt-oss's attention sinks);
* ``attend.state(layer)``: the layer's per-slot decode state in an engine step (a kind that
  caches something other than K/V, or keeps a recurrent state, works on it directly), None in
  training;
* ``attend.scan(device)``: how the tokens group into sequences (``Scan``), for a kind that
  carries a state along each sequence instead of attending (a recurrent kind).

The attention arithmetic itself is in two functions here, ``sdpa`` (whole sequences) and
``decode_sdpa`` (one query row per sequence over cached keys), the one place to change it;
under ``true_on_policy`` (the model's ops exact) in two more, ``packed_sdpa`` (a training
batch: ``ExactPacked``) and ``cached_sdpa`` (an engine step over its KV cache, the step's
keys written first: ``moe_rl.engine.decode.ExactStepAttention``), both the batch-invariant
kernel of ``moe_rl.kernels.exact``, which reduces a query's keys in one order in a prefill, a
decode step and the trainer's forward. Which key a query sees is ``visible``'s rule, for every
layout.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from moe_rl.kernels import exact


class Attention(Protocol):
    """The ``attend`` object of one forward (see the module docstring)."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                 scale: float | None = None, sinks: torch.Tensor | None = None,
                 window: int | None = None) -> torch.Tensor: ...

    def state(self, layer: int): ...

    def scan(self, device) -> "Scan": ...


@dataclass
class Sequences:
    """Whole sequences of a forward, run chunk by chunk: the flat ``rows`` they occupy,
    sequence after sequence (None: all rows of the forward, in order), ``cu_seqlens`` [S + 1]
    their boundaries within those rows; in an engine step also each sequence's cache ``slots``
    [S] and ``resume`` [S] (True: it continues the slot's state; False: it starts at position
    0, and the slot's old state is not read)."""

    rows: torch.Tensor | None
    cu_seqlens: torch.Tensor
    slots: torch.Tensor | None = None
    resume: torch.Tensor | None = None


@dataclass
class Steps:
    """Rows that each advance one cache slot's state by one token (decode): ``rows`` (None:
    all rows of the forward) and their ``slots``."""

    rows: torch.Tensor | None
    slots: torch.Tensor


@dataclass
class Scan:
    """A forward's tokens for a recurrent kind: whole ``sequences`` (training; an engine
    step's prefills) and one-token ``steps`` (an engine step's decodes); either may be None."""

    sequences: Sequences | None
    steps: Steps | None = None


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Which keys each query sees (True), from positions that broadcast (e.g. [T, 1] and
    [1, S]): the key is written (position >= 0), not ahead of the query, and within the
    query's ``window`` (HF's count: ``q - window < k <= q``)."""
    seen = (k_pos <= q_pos) & (k_pos >= 0)
    return seen if window is None else seen & (k_pos > q_pos - window)


# SDPA's flash kernel takes head dims up to 256 on CUDA. Above that (MLA's absorbed latent head,
# kv_lora_rank + qk_rope_head_dim = 576 on DeepSeek-V3, 128 query heads over one latent head)
# the memory-efficient kernel takes no grouped K/V heads, so a causal call falls to the math
# backend, which holds every (query head, query, key) score at once (128 x 8192 x 8192 fp32 is
# 34 GB), and a masked one needs K/V repeated per query head. Such calls fold the query heads of
# each kv group into the rows (one K/V head, an explicit mask: the memory-efficient kernel takes
# it) and go in chunks of query rows that keep a call's scores, or its mask, under this.
FUSED_HEAD_DIM_MAX = 256
MATH_SCORES_BYTES = 1 << 30


def math_backend_rows(q, n_keys: int) -> int | None:
    """Query rows per SDPA call of q [B, Hq, T, D] over ``n_keys`` keys where the head is too wide
    for flash on the GPU (folded, in chunks), so that a call's fp32 scores stay under
    MATH_SCORES_BYTES even on the math backend; None where SDPA gets the call as it is (flash
    takes D, or the CPU, whose kernel is blocked)."""
    B, Hq, T, D = q.shape
    if q.device.type != "cuda" or D <= FUSED_HEAD_DIM_MAX:
        return None
    return max(1, MATH_SCORES_BYTES // (4 * B * Hq * n_keys))


def _sdpa_in_row_chunks(q, k, v, mask, scale, rows: int):
    """``sdpa`` (an explicit mask, no sinks) ``rows`` query rows at a time, the query heads of
    each kv group folded into the rows so that K/V are never repeated: each row's softmax is over
    the same keys as in one call; only the scores of one chunk exist at once. ``mask``
    broadcasts to [B, Hq, T, S] with no copy (each of its dims 1 or full), as ``visible`` gives."""
    B, Hq, T, D = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    rep = Hq // Hkv
    mask = mask.expand(B, Hq, T, S).view(B, Hkv, rep, T, S)
    out = q.new_empty(B, Hq, T, Dv)
    for a in range(0, T, rows):
        r = min(rows, T - a)
        qc = q[:, :, a : a + r].reshape(B, Hkv, rep * r, D)
        o = F.scaled_dot_product_attention(qc, k, v, attn_mask=mask[..., a : a + r, :].reshape(B, Hkv, rep * r, S),
                                           scale=scale)
        out[:, :, a : a + r] = o.view(B, Hq, r, Dv)
    return out


def sdpa(q, k, v, mask=None, is_causal=False, scale=None, *, sinks=None, window=None):
    """q [B, Hq, T, Dk], k [B, Hkv, S, Dk], v [B, Hkv, S, Dv] -> [B, Hq, T, Dv] (grouped K/V
    heads: query head h reads kv head h // (Hq / Hkv)). ``mask`` (bool, True: attend) or
    ``is_causal`` (query i sees keys j <= i); ``window`` narrows ``is_causal`` (an explicit mask
    carries its own, ``visible``); ``sinks`` [Hq]: see the module docstring. A head too wide for
    SDPA's flash kernel goes in chunks of query rows, query heads folded (``math_backend_rows``)."""
    T, S = q.shape[2], k.shape[2]
    if window is not None:
        if not is_causal:
            raise ValueError("sdpa: window applies to is_causal; put it in an explicit mask (visible())")
        mask = visible(torch.arange(T, device=q.device)[:, None], torch.arange(S, device=q.device)[None, :], window)
        is_causal = False
    rows = math_backend_rows(q, S) if sinks is None else None
    if rows is not None:
        if mask is None:
            ones = torch.ones(T, S, dtype=torch.bool, device=q.device)
            mask = ones.tril() if is_causal else ones  # SDPA's is_causal: query i sees keys j <= i
        return _sdpa_in_row_chunks(q, k, v, mask, scale, rows)
    if sinks is not None:
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if mask is None and is_causal:
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril()
        q, k, v, mask = _with_sink_key(q, k, v, mask, sinks, scale)
        is_causal = False
    rep = q.shape[1] // k.shape[1]
    if mask is None:  # causal: the flash kernels take grouped K/V heads as they are
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=rep > 1)
    if rep > 1:  # with a mask, the kernels that take one (memory-efficient, cuDNN) need K/V per query head
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def decode_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale=None, *,
                sinks=None) -> torch.Tensor:
    """One query row per sequence: q [B, Hq, Dk] over k [B, Hkv, S, Dk] / v [B, Hkv, S, Dv],
    mask [B, S] (True: attend; ``visible``) -> [B, Hq, Dv]; ``sinks`` [Hq] as in ``sdpa``.

    The query heads of a kv group are folded into the query-length dimension (head h reads kv
    head h // (Hq / Hkv), as a repeat would give), so K/V are never repeated and SDPA's
    fused kernels that take a mask but no GQA (memory-efficient, cuDNN) can run."""
    B, Hq, Dv = q.shape[0], q.shape[1], v.shape[-1]
    Hkv = k.shape[1]
    q = q[:, :, None]  # [B, Hq, 1, D]
    mask = mask[:, None, None, :]
    if sinks is not None:
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        q, k, v, mask = _with_sink_key(q, k, v, mask, sinks, scale)
    o = F.scaled_dot_product_attention(q.view(B, Hkv, Hq // Hkv, q.shape[-1]), k, v, attn_mask=mask, scale=scale)
    return o.reshape(B, Hq, Dv)


def _with_sink_key(q, k, v, mask, sinks, scale):
    """Attention sinks as one more key that every query sees, with a zero value: its logit for
    query head h is ``sinks[h]``, so it only joins the softmax's denominator (exact; HF's eager
    gpt-oss appends the logit column and drops it after the softmax). The query heads of a kv
    group share that key, so each query head gets a one-hot feature (its index r in the group)
    and the sink key holds ``sinks[g * rep + r] / scale`` in feature r: q . k_sink * scale =
    sinks[h]. The one-hot features are padded to a multiple of 8 (the fused kernels' alignment);
    the real keys have zeros there. q [B, Hq, T, D], k [B, Hkv, S, D], mask broadcastable to [B, Hq, T, S] (bool)
    -> (q, k, v) with S + 1 keys and D + pad features, and the mask with a True column."""
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    rep = Hq // Hkv
    extra = -(-rep // 8) * 8
    onehot = torch.eye(rep, extra, dtype=q.dtype, device=q.device).repeat(Hkv, 1)  # [Hq, extra]
    q = torch.cat((q, onehot[None, :, None, :].expand(B, Hq, T, extra)), dim=-1)
    sink_key = torch.cat((k.new_zeros(Hkv, D), (sinks.float() / scale).to(k.dtype).view(Hkv, rep),
                          k.new_zeros(Hkv, extra - rep)), dim=-1)  # [Hkv, D + extra]
    k = torch.cat((torch.cat((k, k.new_zeros(B, Hkv, S, extra)), dim=-1),
                   sink_key[None, :, None, :].expand(B, Hkv, 1, D + extra)), dim=2)
    v = torch.cat((v, v.new_zeros(B, Hkv, 1, v.shape[-1])), dim=2)
    mask = torch.cat((mask, mask.new_ones(mask.shape[:-1] + (1,))), dim=-1)
    return q, k, v, mask


def packed_sdpa(q, k, v, cu_seqlens, max_seqlen=None, scale=None):
    """Exact causal attention inside each packed sequence: q [total, Hq, Dk], k [total, Hkv, Dk],
    v [total, Hkv, Dv], sequence s at rows cu_seqlens[s]:cu_seqlens[s+1] -> [total, Hq, Dv]."""
    return exact.packed_attention(q, k, v, cu_seqlens, scale=scale, max_seqlen=max_seqlen)


def cached_sdpa(q, cache, cu_seqlens_q, slots, pos0, scale=None):
    """Exact attention of an engine step over its KV cache (``state.KVCache``, the step's keys
    already written): sequence s's queries q[cu_seqlens_q[s]:cu_seqlens_q[s+1]] sit in cache slot
    ``slots[s]`` from position ``pos0[s]`` on -> [N, Hq, Dv]."""
    return exact.cached_attention(q, cache.k, cache.v, cu_seqlens_q, slots, pos0, scale=scale)


class _Training:
    """Training layouts hold no decode state."""

    def state(self, layer: int) -> None:
        return None


class PaddedCausal(_Training):
    """Causal attention over a [B, T] batch (right padding is harmless under a causal mask)."""

    def __init__(self, batch: int, seqlen: int):
        self.batch, self.seqlen = batch, seqlen

    def __call__(self, layer, q, k, v, *, scale=None, sinks=None, window=None):
        B, T = self.batch, self.seqlen
        q, k, v = (t.view(B, T, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
        out = sdpa(q, k, v, is_causal=True, scale=scale, sinks=sinks, window=window)
        return out.transpose(1, 2).reshape(B * T, out.shape[1], out.shape[3])

    def scan(self, device) -> Scan:
        T = self.seqlen
        return Scan(Sequences(None, torch.arange(0, self.batch * T + 1, max(T, 1), device=device)[: self.batch + 1]))


class PackedCausal(_Training):
    """Causal attention inside each packed sequence of a [1, total] batch (cu_seqlens).

    The sequences are laid out as a right-padded [S, L_max] batch and attended with
    ``is_causal`` (S x L_max^2 work instead of total^2, and the fast causal kernels); when
    padding would exceed the packed length (very uneven lengths) a [total, total] block mask
    is used instead. ``max_seqlen`` (L_max, a host integer, as flash-attn's varlen API takes
    it) comes with the batch, which is packed on the host; without it L_max is read from
    ``cu_seqlens``, one host read per micro-batch where they are on a device. Everything a
    layer uses is made here, once per micro-batch, as device tensors and host integers, so a
    compiled decoder block takes it without a graph break."""

    def __init__(self, cu_seqlens: torch.Tensor, total: int, max_seqlen: int | None = None):
        self.cu_seqlens, self.total = cu_seqlens, total
        num_seqs = max(cu_seqlens.shape[0] - 1, 1)
        longest = (max_seqlen if max_seqlen is not None else longest_sequence(cu_seqlens, total)) if total else 0
        self.padded = total > 0 and num_seqs * longest <= 2 * total
        self._seq_id = torch.searchsorted(cu_seqlens[1:-1], torch.arange(total, device=cu_seqlens.device),
                                          right=True)  # the sequence of each token
        if self.padded:
            self.shape = (num_seqs, longest)
            self.slot = self._seq_id * longest + packed_positions(cu_seqlens, total)  # its row in [S * L_max]
        else:
            self.mask = self.mask  # made now: a compiled block reads it as a plain attribute

    @functools.cached_property
    def mask(self) -> torch.Tensor:
        """[total, total] bool, True where attention is allowed (same sequence, not ahead)."""
        seq_id, pos = self._seq_id, torch.arange(self.total, device=self._seq_id.device)
        return (seq_id[:, None] == seq_id[None, :]) & (pos[:, None] >= pos[None, :])

    def __call__(self, layer, q, k, v, *, scale=None, sinks=None, window=None):
        if not self.padded:
            q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            mask = self.mask
            if window is not None:  # same sequence and within the window (token distance = position distance)
                i = torch.arange(self.total, device=mask.device)
                mask = mask & visible(i[:, None], i[None, :], window)
            out = sdpa(q, k, v, mask=mask, scale=scale, sinks=sinks)
            return out.squeeze(0).transpose(0, 1)
        S, L = self.shape

        def pad(t):  # [total, heads, D] -> [S, heads, L, D], zero rows after each sequence
            buf = t.new_zeros(S * L, t.shape[1], t.shape[2]).index_copy(0, self.slot, t)
            return buf.view(S, L, t.shape[1], t.shape[2]).transpose(1, 2)

        out = sdpa(pad(q), pad(k), pad(v), is_causal=True, scale=scale, sinks=sinks, window=window)
        return out.transpose(1, 2).reshape(S * L, out.shape[1], out.shape[3]).index_select(0, self.slot)

    def scan(self, device) -> Scan:
        # tokens past cu_seqlens[-1] count to the last sequence (as in packed_positions)
        cu = self.cu_seqlens
        cu = torch.cat([cu[:-1], cu.new_full((1,), self.total)]) if cu.shape[0] > 1 else cu.new_tensor([0, self.total])
        return Scan(Sequences(None, cu))


class ExactPacked(_Training):
    """The training layout of ``true_on_policy``: every sequence of a packed batch (or every row
    of a [B, T] batch) through ``packed_sdpa``. ``max_seqlen`` spares the backward a host read."""

    def __init__(self, cu_seqlens: torch.Tensor, max_seqlen: int | None = None):
        self.cu_seqlens = cu_seqlens.to(torch.int32)
        self.max_seqlen = max_seqlen

    @classmethod
    def padded(cls, batch: int, seqlen: int, device) -> "ExactPacked":
        """A [B, T] batch: B sequences of T tokens (right padding is harmless under causality)."""
        return cls(torch.arange(batch + 1, device=device) * seqlen, seqlen)

    def __call__(self, layer, q, k, v, *, scale=None):
        return packed_sdpa(q, k, v, self.cu_seqlens, self.max_seqlen, scale)


def longest_sequence(cu_seqlens: torch.Tensor, total: int) -> int:
    """L_max of a packed batch (tokens past ``cu_seqlens[-1]`` count to the last sequence, as in
    ``packed_positions``): a host read where ``cu_seqlens`` is on a device."""
    starts = cu_seqlens[:-1]
    if not starts.numel():
        return total
    return int(torch.diff(starts, append=starts.new_full((1,), total)).max())


def packed_positions(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position of every token inside its own packed sequence."""
    pos = torch.arange(total, device=cu_seqlens.device)
    starts = torch.zeros(total, dtype=torch.long, device=cu_seqlens.device)
    starts[cu_seqlens[:-1].clamp(max=total - 1)] = cu_seqlens[:-1]
    return pos - starts.cummax(0).values
