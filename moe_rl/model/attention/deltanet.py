"""Gated DeltaNet (Qwen3-Next, Qwen3.5-MoE): a linear-attention kind with a recurrent state.

Per layer: projections of x to q/k/v (grouped: ``linear_num_key_heads`` q/k heads, each serving
``linear_num_value_heads / linear_num_key_heads`` consecutive value heads), an output gate z, and
per value head b, a; a causal depthwise conv (kernel ``linear_conv_kernel_dim``, no bias) + SiLU
over [q; k; v]; q, k L2-normalised (q scaled by Dk^-1/2); beta = sigmoid(b), the log decay
g = -exp(A_log) * softplus(a + dt_bias) (fp32); the gated delta rule
(``moe_rl.kernels.gated_delta``); a gated RMSNorm per value head (plain ``w * x_hat``, times
SiLU(z), in fp32) and ``out_proj``.

Two projection layouts, one kind each: ``DeltaNetQKVZ`` (Qwen3-Next: ``in_proj_qkvz`` grouped
per key head as [q, k, v (r heads), z (r heads)] and ``in_proj_ba`` per key head as [b (r), a
(r)]) and ``DeltaNet`` (Qwen3.5: ``in_proj_qkv`` = [all q; all k; all v], ``in_proj_z``,
``in_proj_b``, ``in_proj_a``).

The layout (``attend.scan``) says how the tokens run. Whole sequences (training; an engine
step's prefills) go through the conv with each sequence's own left context and the chunked rule
(packed sequences never see each other's state); in an engine step the sequences start from
their slot's conv and recurrent state (``RecurrentState``; zeros for a sequence at position 0)
and leave theirs there. One-token steps (decode) take the conv window and the recurrence one
step. Both conv paths sum the kernel taps in the same order, in fp32.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from moe_rl.kernels.gated_delta import chunk_gated_delta_rule, compute_dtype, l2norm, recurrent_step

from ..ops import Linear
from .base import Mixer
from .state import RecurrentSpec

if TYPE_CHECKING:  # annotations only: arch.py imports the mixers
    from ..arch import MoEArch


class GatedRMSNorm(nn.Module):
    """RMSNorm of x (plain ``w * x_hat``, normalised in fp32 and cast back first), times
    SiLU(z) in fp32 (HF's ``Qwen3NextRMSNormGated``, SGLang's ``RMSNormGated(norm_before_gate)``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return (h * F.silu(z.float())).to(x.dtype)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor,
                initial: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """SiLU of the causal depthwise conv of each packed sequence: x [M, C], weight [C, K],
    ``cu_seqlens`` [S + 1]; ``initial`` [S, C, K - 1]: the inputs before each sequence (None:
    zeros). Returns (out [M, C], the last K - 1 inputs of each sequence [S, C, K - 1]).

    Each sequence is laid out after its K - 1 earlier inputs (one gather per kernel tap, no
    loop over tokens or sequences)."""
    M, C = x.shape
    K = weight.shape[-1]
    S = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.long()
    tok = torch.arange(M, device=x.device)
    # the sequence of each token: cu[0] = 0 <= tok, so searching all of cu counts one more than cu[1:]
    # (a slice as the sorted sequence fails Inductor's searchsorted lowering in torch 2.11)
    seq = (torch.searchsorted(cu, tok, right=True) - 1).clamp(max=max(S - 1, 0))
    tok_rows = tok + (seq + 1) * (K - 1)  # row of each token in [before_0, seq_0, before_1, seq_1, ...]
    ext = x.new_zeros(M + S * (K - 1), C).index_copy(0, tok_rows, x)
    j = torch.arange(K - 1, device=x.device)
    before_rows = (cu[:-1] + torch.arange(S, device=x.device) * (K - 1))[:, None] + j  # [S, K - 1]
    if initial is not None:
        ext = ext.index_copy(0, before_rows.reshape(-1), initial.transpose(1, 2).reshape(-1, C).to(x.dtype))
    taps = torch.stack([ext.index_select(0, tok_rows - (K - 1) + i) for i in range(K)], -1)  # [M, C, K]
    out = F.silu((taps.float() * weight.float()).sum(-1)).to(x.dtype)
    last_rows = (cu[1:] + torch.arange(S, device=x.device) * (K - 1))[:, None] + j
    last = ext.index_select(0, last_rows.reshape(-1)).view(S, K - 1, C).transpose(1, 2)
    return out, last


def conv_step(x: torch.Tensor, weight: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: x [B, C] after the inputs ``window`` [B, C, K - 1] -> (out [B, C],
    the new window), the taps summed as ``causal_conv`` sums them."""
    taps = torch.cat([window.to(x.dtype), x[:, :, None]], -1)  # [B, C, K]
    return F.silu((taps.float() * weight.float()).sum(-1)).to(x.dtype), taps[:, :, 1:]


class DeltaNet(Mixer):
    """Gated DeltaNet with Qwen3.5-MoE's projections (see the module docstring)."""

    hf_name = "linear_attn"
    lora_targets = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")

    def __init__(self, arch: MoEArch, layer: int):
        super().__init__(arch, layer)
        self.hk, self.hv = arch.linear_num_key_heads, arch.linear_num_value_heads
        self.dk, self.dv = arch.linear_key_head_dim, arch.linear_value_head_dim
        self.kernel = arch.linear_conv_kernel_dim
        H = arch.hidden_size
        self.conv_dim = 2 * self.hk * self.dk + self.hv * self.dv
        self._projections(H)
        self.conv1d = nn.Module()  # HF's nn.Conv1d holds weight [C, 1, K]: the name and shape kept
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, self.kernel))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.norm = GatedRMSNorm(self.dv, arch.rms_norm_eps)
        self.out_proj = Linear(self.hv * self.dv, H, bias=False)

    def _projections(self, H: int) -> None:
        self.in_proj_qkv = Linear(H, self.conv_dim, bias=False)
        self.in_proj_z = Linear(H, self.hv * self.dv, bias=False)
        self.in_proj_b = Linear(H, self.hv, bias=False)
        self.in_proj_a = Linear(H, self.hv, bias=False)

    def project(self, x: torch.Tensor):
        """x [N, H] -> (conv input [N, conv_dim] = [q; k; v], z [N, Hv, Dv], b [N, Hv], a [N, Hv])."""
        N = x.shape[0]
        return self.in_proj_qkv(x), self.in_proj_z(x).view(N, self.hv, self.dv), self.in_proj_b(x), self.in_proj_a(x)

    @classmethod
    def _proj_specs(cls, arch: MoEArch) -> list[tuple[str, tuple[int, ...]]]:
        H, hk, hv = arch.hidden_size, arch.linear_num_key_heads, arch.linear_num_value_heads
        dk, dv = arch.linear_key_head_dim, arch.linear_value_head_dim
        return [("in_proj_qkv.weight", (2 * hk * dk + hv * dv, H)), ("in_proj_z.weight", (hv * dv, H)),
                ("in_proj_b.weight", (hv, H)), ("in_proj_a.weight", (hv, H))]

    @classmethod
    def hf_specs(cls, arch: MoEArch, layer: int) -> list[tuple[str, tuple[int, ...]]]:
        H, hk, hv = arch.hidden_size, arch.linear_num_key_heads, arch.linear_num_value_heads
        dk, dv = arch.linear_key_head_dim, arch.linear_value_head_dim
        conv = 2 * hk * dk + hv * dv
        return [("conv1d.weight", (conv, 1, arch.linear_conv_kernel_dim))] + cls._proj_specs(arch) + [
            ("dt_bias", (hv,)), ("A_log", (hv,)), ("norm.weight", (dv,)), ("out_proj.weight", (H, hv * dv))]

    @classmethod
    def state_spec(cls, arch: MoEArch, layer: int) -> RecurrentSpec:
        conv = 2 * arch.linear_num_key_heads * arch.linear_key_head_dim + arch.linear_num_value_heads * arch.linear_value_head_dim
        return RecurrentSpec(conv, arch.linear_conv_kernel_dim, arch.linear_num_value_heads, arch.linear_key_head_dim,
                             arch.linear_value_head_dim)

    def init_special(self, generator: torch.Generator) -> None:
        # HF's / Megatron's: A in U(1, 16), dt_bias 1; the conv as torch's default (fan-in K)
        with torch.no_grad():
            self.A_log.copy_(torch.empty(self.hv).uniform_(1.0, 16.0, generator=generator).log())
            self.dt_bias.fill_(1.0)
            bound = 1.0 / math.sqrt(self.kernel)
            self.conv1d.weight.copy_(torch.empty(self.conv1d.weight.shape).uniform_(-bound, bound, generator=generator))

    # --- forward --------------------------------------------------------------------------
    def _qkv(self, mixed: torch.Tensor):
        """Conv output [M, conv_dim] -> q, k [M, Hv, Dk] (normalised, q scaled, in the compute
        dtype; each key head repeated for its value heads), v [M, Hv, Dv]."""
        M = mixed.shape[0]
        cd = compute_dtype(mixed.dtype)
        q, k, v = mixed.split([self.hk * self.dk, self.hk * self.dk, self.hv * self.dv], dim=-1)
        r = self.hv // self.hk
        q = l2norm(q.reshape(M, self.hk, self.dk).to(cd)).repeat_interleave(r, 1) * self.dk ** -0.5
        k = l2norm(k.reshape(M, self.hk, self.dk).to(cd)).repeat_interleave(r, 1)
        return q, k, v.reshape(M, self.hv, self.dv)

    def forward(self, x, cos, sin, attend):
        N = x.shape[0]
        mixed, z, b, a = self.project(x)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        weight = self.conv1d.weight[:, 0]
        scan, state = attend.scan(x.device), attend.state(self.layer)
        parts = []  # (rows or None for all, output [rows, Hv, Dv])
        seqs, steps = scan.sequences, scan.steps
        if seqs is not None:
            rows = seqs.rows
            pick = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
            conv0 = ssm0 = None
            if state is not None:
                conv0, ssm0 = state.start(seqs.slots, seqs.resume)
            h, conv_last = causal_conv(pick(mixed), weight, seqs.cu_seqlens, conv0)
            q, k, v = self._qkv(h)
            o, final = chunk_gated_delta_rule(q, k, v, pick(g), pick(beta), seqs.cu_seqlens, ssm0)
            if state is not None:
                state.store(seqs.slots, conv_last, final)
            parts.append((rows, o))
        if steps is not None:
            rows = steps.rows
            pick = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
            conv0, ssm0 = state.start(steps.slots)
            h, window = conv_step(pick(mixed), weight, conv0)
            q, k, v = self._qkv(h)
            o, ssm = recurrent_step(q, k, v, pick(g), pick(beta), ssm0)
            state.store(steps.slots, window, ssm)
            parts.append((rows, o))
        if len(parts) == 1 and parts[0][0] is None:
            core = parts[0][1].to(x.dtype)
        else:
            core = x.new_zeros(N, self.hv, self.dv)
            for rows, o in parts:
                core = core.index_copy(0, rows, o.to(x.dtype))
        out = self.norm(core, z)
        return self.out_proj(out.reshape(N, self.hv * self.dv))


class DeltaNetQKVZ(DeltaNet):
    """Gated DeltaNet with Qwen3-Next's fused projections, grouped per key head."""

    lora_targets = ("in_proj_qkvz", "in_proj_ba", "out_proj")

    def _projections(self, H: int) -> None:
        r = self.hv // self.hk
        self.in_proj_qkvz = Linear(H, self.hk * (2 * self.dk + 2 * r * self.dv), bias=False)
        self.in_proj_ba = Linear(H, self.hk * 2 * r, bias=False)

    def project(self, x: torch.Tensor):
        N = x.shape[0]
        r = self.hv // self.hk
        qkvz = self.in_proj_qkvz(x).view(N, self.hk, 2 * self.dk + 2 * r * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
        b, a = self.in_proj_ba(x).view(N, self.hk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(N, -1), k.reshape(N, -1), v.reshape(N, -1)], dim=-1)
        return mixed, z.reshape(N, self.hv, self.dv), b.reshape(N, self.hv), a.reshape(N, self.hv)

    @classmethod
    def _proj_specs(cls, arch: MoEArch) -> list[tuple[str, tuple[int, ...]]]:
        H, hk, hv = arch.hidden_size, arch.linear_num_key_heads, arch.linear_num_value_heads
        dk, dv = arch.linear_key_head_dim, arch.linear_value_head_dim
        return [("in_proj_qkvz.weight", (2 * hk * dk + 2 * hv * dv, H)), ("in_proj_ba.weight", (2 * hv, H))]
