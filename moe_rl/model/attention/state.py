"""Per-request decode state of one layer, as the engine keeps it (one entry per cache slot).

A layer's kind says what it keeps per slot with a *state spec*: an object with
``bytes_per_slot(ctx, element_size)`` (memory planning, ``moe_rl.placement``) and
``allocate(slots, ctx, dtype, device)``, which makes the layer's state for ``slots`` slots of
up to ``ctx`` positions. The engine allocates every layer's state once, hands slot i to one
request at a time, and reuses it after that request finishes or is retracted. Contract for
every kind: a step that forwards a request from position 0 (a new request, or the re-prefill
after a retract) must not read what the slot held before, so a slot needs no clearing; and a
step's reads and writes are device ops on the state's fixed tensors (no host reads, no
reallocation), so a decode step can be captured as a CUDA graph.

``KVSpec`` / ``KVCache`` is the state of softmax-attention kinds: keys and values per slot
and position. ``v_in_k``: the values are the keys' first ``v_dim`` features and only the
keys are stored (multi-head latent attention caches its compressed latent this way).
``RingKVSpec`` / ``RingKVCache``: the same for a sliding-window layer, which needs only the
last ``window`` keys of a request: position p lives at entry p % window of its slot, so a slot
holds ``min(window, ctx)`` positions instead of ``ctx``.

Both answer the engine's layouts the same way: ``write_rows`` (a decode row each), ``gather``
(the keys a decode step reads) with ``key_positions`` (where each gathered key sits in its
sequence; negative: never written), and ``span`` (a prefill's keys written, and the keys its
queries may read, with their positions); which of them a query sees is ``layouts.visible``'s rule.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVSpec:
    """Keys [heads, k_dim] and values [heads, v_dim] of every position of a slot."""

    heads: int
    k_dim: int
    v_dim: int
    v_in_k: bool = False

    def __post_init__(self):
        if self.v_in_k and self.v_dim > self.k_dim:
            raise ValueError(f"v_in_k: v_dim={self.v_dim} exceeds k_dim={self.k_dim}")

    def bytes_per_token(self, element_size: int) -> int:
        return self.heads * (self.k_dim + (0 if self.v_in_k else self.v_dim)) * element_size

    def bytes_per_slot(self, ctx: int, element_size: int) -> int:
        return ctx * self.bytes_per_token(element_size)

    def allocate(self, slots: int, ctx: int, dtype: torch.dtype, device) -> "KVCache":
        k = torch.zeros(slots, self.heads, ctx, self.k_dim, dtype=dtype, device=device)
        v = k[..., : self.v_dim] if self.v_in_k else torch.zeros(slots, self.heads, ctx, self.v_dim, dtype=dtype,
                                                                   device=device)
        return KVCache(self, k, v)


@dataclass
class KVCache:
    """k [slots, heads, ctx, k_dim], v [slots, heads, ctx, v_dim] (a view of k under v_in_k)."""

    spec: KVSpec
    k: torch.Tensor
    v: torch.Tensor

    def write_rows(self, slots: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """Row i of k [n, heads, k_dim] (and v) at position pos[i] of slot slots[i]."""
        self.k[slots, :, pos] = k
        if not self.spec.v_in_k:
            self.v[slots, :, pos] = v

    def write_span(self, slot: int, start: int, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """k [n, heads, k_dim] (and v) at positions start .. start + n - 1 of one slot."""
        n = k.shape[0]
        self.k[slot, :, start : start + n] = k.transpose(0, 1)
        if not self.spec.v_in_k:
            self.v[slot, :, start : start + n] = v.transpose(0, 1)

    def gather(self, slots: torch.Tensor, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``ctx`` positions of each slot: [B, heads, ctx, k_dim], [B, heads, ctx, v_dim]."""
        ks = self.k[:, :, :ctx].index_select(0, slots)
        vs = ks[..., : self.spec.v_dim] if self.spec.v_in_k else self.v[:, :, :ctx].index_select(0, slots)
        return ks, vs

    def prefix(self, slot: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions 0 .. end - 1 of one slot, [1, heads, end, dim] views."""
        return self.k[slot : slot + 1, :, :end], self.v[slot : slot + 1, :, :end]

    def key_positions(self, pos: torch.Tensor, n: int) -> torch.Tensor:
        """Positions of the ``n`` keys ``gather`` returns, for queries at ``pos`` [B]: [1, n]."""
        return torch.arange(n, device=pos.device)[None, :]

    def span(self, slot: int, start: int, k: torch.Tensor, v: torch.Tensor | None):
        """Writes k [n, heads, k_dim] (and v) at positions start .. start + n - 1 of one slot and
        returns the keys those queries may read, [1, heads, S, dim] each, with their positions [S]."""
        n = k.shape[0]
        self.write_span(slot, start, k, v)
        ks, vs = self.prefix(slot, start + n)
        return ks, vs, torch.arange(start + n, device=k.device)


@dataclass(frozen=True)
class RingKVSpec:
    """Keys and values of the last ``window`` positions of a slot (a sliding-window layer)."""

    heads: int
    k_dim: int
    v_dim: int
    window: int

    def bytes_per_token(self, element_size: int) -> int:
        return self.heads * (self.k_dim + self.v_dim) * element_size

    def bytes_per_slot(self, ctx: int, element_size: int) -> int:
        return min(ctx, self.window) * self.bytes_per_token(element_size)

    def allocate(self, slots: int, ctx: int, dtype: torch.dtype, device) -> "RingKVCache":
        size = min(ctx, self.window)
        return RingKVCache(self, torch.zeros(slots, self.heads, size, self.k_dim, dtype=dtype, device=device),
                           torch.zeros(slots, self.heads, size, self.v_dim, dtype=dtype, device=device))


@dataclass
class RingKVCache:
    """k [slots, heads, size, k_dim], v [slots, heads, size, v_dim]: position p of a slot at
    entry p % size (size = min(window, ctx): every position a query can see is kept)."""

    spec: RingKVSpec
    k: torch.Tensor
    v: torch.Tensor

    @property
    def size(self) -> int:
        return self.k.shape[2]

    def write_rows(self, slots: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        at = pos % self.size
        self.k[slots, :, at] = k
        self.v[slots, :, at] = v

    def gather(self, slots: torch.Tensor, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first min(ctx, size) entries of each slot (queries below position ctx see no others)."""
        n = min(ctx, self.size)
        return self.k[:, :, :n].index_select(0, slots), self.v[:, :, :n].index_select(0, slots)

    def key_positions(self, pos: torch.Tensor, n: int) -> torch.Tensor:
        """Entry j holds the latest position <= pos that is j modulo size: [B, n]."""
        p = pos[:, None]
        return p - (p - torch.arange(n, device=pos.device)[None, :]) % self.size

    def span(self, slot: int, start: int, k: torch.Tensor, v: torch.Tensor):
        """As ``KVCache.span``: the slot's entries before ``start`` (read before they are
        overwritten) and the n new keys; the last min(n, size) new ones stay in the ring."""
        n, size = k.shape[0], self.size
        new_k, new_v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        new_pos = torch.arange(start, start + n, device=k.device)
        if start > 0:
            old_pos = self.key_positions(torch.full((1,), start - 1, device=k.device), size)[0]
            ks = torch.cat((self.k[slot : slot + 1], new_k), dim=2)
            vs = torch.cat((self.v[slot : slot + 1], new_v), dim=2)
            kpos = torch.cat((old_pos, new_pos))
        else:
            ks, vs, kpos = new_k, new_v, new_pos
        keep = min(n, size)
        at = new_pos[n - keep :] % size
        self.k[slot, :, at] = k[n - keep :].transpose(0, 1)
        self.v[slot, :, at] = v[n - keep :].transpose(0, 1)
        return ks, vs, kpos


@dataclass(frozen=True)
class RecurrentSpec:
    """A recurrent kind's state (Gated DeltaNet): per slot, the last ``conv_kernel - 1`` inputs
    of its causal depthwise convolution over ``conv_channels`` channels (model dtype) and a
    recurrent state [heads, k_dim, v_dim] (at least fp32, whatever the model's dtype: it sums
    over the whole sequence). Neither grows with the context."""

    conv_channels: int
    conv_kernel: int
    heads: int
    k_dim: int
    v_dim: int

    def bytes_per_slot(self, ctx: int, element_size: int) -> int:
        conv = self.conv_channels * (self.conv_kernel - 1) * element_size
        return conv + self.heads * self.k_dim * self.v_dim * max(element_size, 4)

    def allocate(self, slots: int, ctx: int, dtype: torch.dtype, device) -> "RecurrentState":
        conv = torch.zeros(slots, self.conv_channels, self.conv_kernel - 1, dtype=dtype, device=device)
        ssm = torch.zeros(slots, self.heads, self.k_dim, self.v_dim, dtype=torch.promote_types(dtype, torch.float32),
                          device=device)
        return RecurrentState(self, conv, ssm)


@dataclass
class RecurrentState:
    """conv [slots, channels, kernel - 1] (oldest input first), ssm [slots, heads, k_dim, v_dim].

    A forward from position 0 starts from zeros (``start``'s ``resume`` False), never from what
    the slot held; reads and writes are index_select / index_copy_ on these fixed tensors."""

    spec: RecurrentSpec
    conv: torch.Tensor
    ssm: torch.Tensor

    def start(self, slots: torch.Tensor, resume: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The (conv, ssm) states the rows of ``slots`` continue from: the slot's where
        ``resume`` (None: all), zeros elsewhere (a selection, so whatever the slot held, even a
        NaN, is not read)."""
        conv, ssm = self.conv.index_select(0, slots), self.ssm.index_select(0, slots)
        if resume is None:
            return conv, ssm
        return (torch.where(resume[:, None, None], conv, torch.zeros_like(conv)),
                torch.where(resume[:, None, None, None], ssm, torch.zeros_like(ssm)))

    def store(self, slots: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        self.conv.index_copy_(0, slots, conv.to(self.conv.dtype))
        self.ssm.index_copy_(0, slots, ssm.to(self.ssm.dtype))
