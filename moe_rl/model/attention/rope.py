"""Rotary position embeddings: the tables of one forward and their application to a head.

``Rope`` is what a model's config fixes (rotated width, base, scaling); ``Rope.cos_sin``
makes the [N, dim] tables once per forward, shared by every layer that rotates. Two kinds of
tables: HF's default RoPE and YaRN (``rope_type: yarn``: per-frequency blend of interpolated
and extrapolated frequencies, cos/sin scaled by the attention factor; transformers'
``_compute_yarn_parameters``). Two layouts of the rotated dims: NeoX's halves (``rotate_half``,
HF's default) and interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's ``rope_interleave``),
whose output comes out de-interleaved as HF's.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # torch is imported where a table is made: the config checks rope_scaling without it
    import torch

ROPE_TYPES = ("default", "yarn")


@dataclass(frozen=True)
class Rope:
    """One model's rotary embedding. ``dim``: leading dims of a head that rotate (even);
    ``theta``: the base. YaRN fields carry HF's ``rope_parameters`` names and defaults."""

    dim: int
    theta: float
    rope_type: Literal["default", "yarn"] = "default"
    interleaved: bool = False
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf(cls, params: dict | None, dim: int, theta: float, interleaved: bool = False) -> "Rope":
        """From HF's ``rope_parameters`` / ``rope_scaling`` dict (None or rope_type default: plain
        RoPE). Raises ValueError naming what is not supported."""
        params = dict(params or {})
        rope_type = params.get("rope_type", params.get("type")) or "default"
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
        if rope_type == "default":
            return cls(dim, theta, interleaved=interleaved)
        missing = [k for k in ("factor", "original_max_position_embeddings") if params.get(k) is None]
        if missing:
            raise ValueError(f"rope_type yarn needs {' and '.join(missing)} in rope_parameters")
        return cls(dim, theta, "yarn", interleaved, float(params["factor"]),
                   int(params["original_max_position_embeddings"]),
                   float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1),
                   params.get("mscale"), params.get("mscale_all_dim"), params.get("attention_factor"),
                   bool(params.get("truncate", True)))

    # --- the frequencies ------------------------------------------------------------------
    def scale(self) -> float:
        """The factor cos and sin are multiplied by (YaRN's attention factor; 1 otherwise)."""
        if self.rope_type == "default":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        import torch

        return _inv_freq(self, torch.device(device))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables [N, dim] for the given positions, computed in fp32 and cast to
        ``dtype`` (HF's order: scaled before the cast)."""
        import torch

        freqs = positions.float()[:, None] * self.inv_freq(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        s = self.scale()
        cos, sin = emb.cos(), emb.sin()
        if s != 1.0:
            cos, sin = cos * s, sin * s
        return cos.to(dtype), sin.to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, cos, sin, self.interleaved)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@functools.lru_cache(maxsize=None)  # never evicted: captured decode graphs read this tensor's memory
def _inv_freq(rope: Rope, device: torch.device) -> torch.Tensor:
    import torch

    dim, base = rope.dim, rope.theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim)
    if rope.rope_type == "default":
        return 1.0 / pos_freqs

    # YaRN: frequencies that turn fewer than beta_slow times over the original context are
    # interpolated (divided by factor), those turning more than beta_fast times kept, a
    # linear ramp between them
    def turns_to_dim(turns: float) -> float:
        return dim * math.log(rope.original_max_position_embeddings / (turns * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = turns_to_dim(rope.beta_fast), turns_to_dim(rope.beta_slow)
    if rope.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float, device=device) - lo) / (hi - lo)).clamp(0, 1)
    keep = 1 - ramp  # share of the extrapolated (unchanged) frequency
    return (1.0 / (rope.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype):
    """Default-RoPE tables [N, rotary_dim] (``Rope(rotary_dim, theta).cos_sin``)."""
    return Rope(rotary_dim, theta).cos_sin(positions, dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """x [N, heads, head_dim], cos/sin [N, rot]. The first ``rot`` dims of each head rotate and
    the rest pass through (partial rotary). NeoX halves (rotate-half, as HF), or interleaved
    pairs whose result is laid out de-interleaved (HF's ``apply_rotary_pos_emb_interleave``)."""
    import torch

    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rot], cos, sin, interleaved), x[..., rot:]), dim=-1)
    if interleaved:
        c, s = cos[:, None, : rot // 2], sin[:, None, : rot // 2]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
