"""A torch-native MoE decoder, numerically HF's ``Qwen3MoeForCausalLM`` / ``Glm4MoeForCausalLM`` /
``GptOssForCausalLM``.

The family's differences are read from the ``MoEArch`` fields (and its ``Family``) in a few
places: the router (``GATES``: ``SoftmaxGate`` / ``SigmoidGate`` / ``TopKSoftmaxGate``), the
experts' layout and activation (``EXPERTS``), the shared-expert MLP of a MoE block, which layers
are dense, the norms, and each layer's attention kind (a ``moe_rl.model.attention`` mixer, chosen
by ``MoEArch.layer_kinds``).

Tokens travel flat ([N, H]) through the layers; attention is delegated to an ``Attention``
layout (causal over [B, T], packed by ``cu_seqlens``, or the engine's per-slot decode state),
so one model serves training and generation. Each MoE block can record its top-k expert ids or
replay given ones (R3), and can shard its experts over an expert-parallel group.

The arithmetic (projections, norms, routers, experts, combine, attention) is the model's ops
object's (``moe_rl.model.ops``, set by ``use_ops``): torch's ops in HF's order, or the exact
batch-invariant kernels of ``true_on_policy``, with which the engine and the trainer compute a
token's log-prob to the same bits.

Parameter names equal HF's for every dense tensor; experts are stored stacked per layer
(``mlp.experts.{gate,up,down}_proj`` [local_experts, ...]) and ``hf_io`` maps them to HF's
per-expert names.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .arch import MoEArch
from .attention import Attention, PackedCausal, PaddedCausal, mixer_class, packed_positions
from .attention.layouts import ExactPacked
from .grouped import dispatch, group_align, grouped_mm, permute, permute_rows, unpermute, unpermute_rows
from .norm import RMSNorm
from .ops import TORCH, Linear


# graphs compile_blocks lets DecoderLayer.forward have (dynamo's recompile limit, default 8):
# dense or MoE x grad or no_grad x replay or not x input requiring grad or not (LoRA freezes the
# embedding) x attention layout (several sequences, one, the block mask) is at most 48; the
# trainer's test with all of them made 16
BLOCK_GRAPHS = 64


class RoutingError(ValueError):
    """A replay record that cannot be applied to this model."""


class DenseMLP(nn.Module):
    ops = TORCH  # its model's ops (moe_rl.model.ops)

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(self.ops.silu_mul(self.gate_proj(x), self.up_proj(x)))


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with variable splits; its gradient is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(grad.contiguous(), in_splits, out_splits, ctx.group), None, None, None


class Experts(nn.Module):
    """This rank's experts, stacked: gate/up [E_local, I, H], down [E_local, H, I].

    The stacked parameters are read through the module attributes on every call (so a
    parametrization, e.g. an expert LoRA delta, applies). ``lora``, when set, adds a LoRA
    adapter's rows in the forward (``moe_rl.model.lora.ExpertLora``: two more grouped GEMMs
    of rank r per projection over the same expert-sorted rows; W itself is not changed)."""

    lora = None
    ops = TORCH  # its model's ops (moe_rl.model.ops)

    def __init__(self, num_local: int, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(num_local, inter, hidden))
        self.up_proj = nn.Parameter(torch.empty(num_local, inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_local, hidden, inter))

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """x [rows, H] grouped by expert (``offs``: int32 end row of each expert's group).

        Gate and up are two grouped GEMMs over the same rows, not one over the two weights
        concatenated: a concatenation would copy every expert's gate and up weights on each
        forward (and inside every captured decode graph), for the same FLOPs."""
        ops = self.ops
        gate = ops.grouped_mm(x, self.gate_proj, offs)
        up = ops.grouped_mm(x, self.up_proj, offs)
        if self.lora is not None:
            gate, up = self.lora.add_gate_up(gate, up, x, offs, ops)
        h = ops.silu_mul(gate, up)
        out = ops.grouped_mm(h, self.down_proj, offs)
        return out if self.lora is None else self.lora.add_down(out, h, offs, ops)

    # HF names each expert's projections apart: ``mlp.experts.{e}.{gate,up,down}_proj.weight``
    per_expert_hf = True

    @classmethod
    def build(cls, arch: MoEArch, num_local: int) -> "Experts":
        return cls(num_local, arch.hidden_size, arch.moe_intermediate_size)

    @classmethod
    def hf_specs(cls, arch: MoEArch) -> list[tuple[str, tuple[int, ...]]]:
        """HF tensors of a layer's experts (names relative to ``mlp.experts.``, full shapes)."""
        H, I = arch.hidden_size, arch.moe_intermediate_size
        return [spec for e in range(arch.num_experts)
                for spec in ((f"{e}.gate_proj.weight", (I, H)), (f"{e}.up_proj.weight", (I, H)),
                             (f"{e}.down_proj.weight", (H, I)))]


class ClampedSwiGLUExperts(nn.Module):
    """gpt-oss's experts, in HF's layout, which is also HF's names: ``gate_up_proj`` [E_local,
    H, 2I] with gate and up *interleaved* along the last dim (column 2i is gate i, 2i + 1 up
    i), ``gate_up_proj_bias`` [E_local, 2I], ``down_proj`` [E_local, I, H], ``down_proj_bias``
    [E_local, H]. Per row of expert e: ``gu = x @ gate_up_proj[e] + bias``, ``g = min(gate,
    limit)``, ``u = clamp(up, -limit, limit)``, ``h = (u + 1) * g * sigmoid(alpha * g)``,
    ``out = h @ down_proj[e] + down_proj_bias[e]``.

    The [E, in, out] weights are the grouped GEMM's [E, out, in] operand transposed (a view,
    no copy). A LoRA adapter (``lora``) adds its rows to ``gu`` in HF's column order, so the
    adapter is PEFT's on this parameter."""

    lora = None
    per_expert_hf = False

    def __init__(self, num_local: int, hidden: int, inter: int, alpha: float, limit: float):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_local, hidden, 2 * inter))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_local, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(num_local, inter, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(num_local, hidden))
        self.alpha, self.limit = alpha, limit

    @classmethod
    def build(cls, arch: MoEArch, num_local: int) -> "ClampedSwiGLUExperts":
        return cls(num_local, arch.hidden_size, arch.moe_intermediate_size, arch.swiglu_alpha, arch.swiglu_limit)

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        """x [rows, H] grouped by expert (``offs``: int32 end row of each expert's group)."""
        # each row's expert; rows after the last group (a padded buffer's tail) get index E_local,
        # a zero bias row outside the parameters, so nothing there reaches the biases' gradients
        expert = torch.searchsorted(offs, torch.arange(x.shape[0], device=x.device, dtype=offs.dtype), right=True)
        gate_up = grouped_mm(x, self.gate_up_proj.transpose(1, 2), offs) + F.pad(self.gate_up_proj_bias, (0, 0, 0, 1))[expert]
        if self.lora is not None:
            gate_up = self.lora.add_fused_gate_up(gate_up, x, offs)
        gate = gate_up[:, 0::2].clamp(max=self.limit)
        up = gate_up[:, 1::2].clamp(-self.limit, self.limit)
        h = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        out = grouped_mm(h, self.down_proj.transpose(1, 2), offs) + F.pad(self.down_proj_bias, (0, 0, 0, 1))[expert]
        return out if self.lora is None else self.lora.add_down(out, h, offs)

    @classmethod
    def hf_specs(cls, arch: MoEArch) -> list[tuple[str, tuple[int, ...]]]:
        E, H, I = arch.num_experts, arch.hidden_size, arch.moe_intermediate_size
        return [("gate_up_proj", (E, H, 2 * I)), ("gate_up_proj_bias", (E, 2 * I)), ("down_proj", (E, I, H)),
                ("down_proj_bias", (E, H))]


# the experts' layout and activation of each family (``Family.experts``)
EXPERTS = {"swiglu": Experts, "clamped_swiglu": ClampedSwiGLUExperts}


class SoftmaxGate(Linear):
    """Qwen3-MoE / Mixtral router: softmax over all experts (fp32), top-k, optionally
    renormalised. HF name: ``mlp.gate.weight``."""

    hf_name = "gate"  # the router's module name in HF's MoE block

    def __init__(self, arch: MoEArch):
        super().__init__(arch.hidden_size, arch.num_experts, bias=False)
        self.top_k, self.norm_topk_prob = arch.num_experts_per_tok, arch.norm_topk_prob

    @classmethod
    def hf_specs(cls, arch: MoEArch) -> list[tuple[str, tuple[int, ...]]]:
        """The router's HF tensors (relative to ``mlp.<hf_name>.``, full shapes)."""
        return [("weight", (arch.num_experts, arch.hidden_size))]

    def route(self, x: torch.Tensor, ids: torch.Tensor | None):
        """(expert ids [N, k], weights [N, k] fp32); ``ids`` given (replay): the weights are the
        probabilities at those ids, renormalised as the router would."""
        probs = self.ops.softmax(self(x))
        if ids is None:
            weights, ids = torch.topk(probs, self.top_k, dim=-1)
        else:
            weights = probs.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / self.ops.row_sum(weights)
        return ids, weights


class SigmoidGate(Linear):
    """GLM-4.5 / DeepSeek-V3 router: sigmoid scores; experts chosen by score + the expert-score
    correction bias (DeepSeek-V3's auxiliary-loss-free balancing) within the ``topk_group``
    best of ``n_group`` groups (a group scores the sum of its two best); weights are the
    unbiased scores of the chosen experts, renormalised if ``norm_topk_prob``, times
    ``routed_scaling_factor``. HF names: ``mlp.gate.weight``, ``mlp.gate.e_score_correction_bias``.

    Logits are computed in fp32 whatever the model's dtype (as HF), and the bias is a buffer (not
    trained) kept in fp32 when the model is cast to a 16-bit dtype, as HF and SGLang keep it:
    a rounded bias would choose other experts. ``load``, when set (``MoEForCausalLM.
    track_expert_load``), sums the tokens routed to each expert in forwards that build a graph,
    for ``MoEForCausalLM.update_expert_bias``."""

    hf_name = "gate"

    def __init__(self, arch: MoEArch):
        super().__init__(arch.hidden_size, arch.num_experts, bias=False)
        self.top_k, self.norm_topk_prob = arch.num_experts_per_tok, arch.norm_topk_prob
        self.n_group, self.topk_group = arch.n_group, arch.topk_group
        self.scaling = arch.routed_scaling_factor
        self.register_buffer("e_score_correction_bias", torch.zeros(arch.num_experts))
        self.load: torch.Tensor | None = None  # tokens per expert since the last bias update
        self.load_rows: int | None = None  # count only the first rows (MoEForCausalLM.expert_load_rows)

    @classmethod
    def hf_specs(cls, arch: MoEArch) -> list[tuple[str, tuple[int, ...]]]:
        return [("weight", (arch.num_experts, arch.hidden_size)), ("e_score_correction_bias", (arch.num_experts,))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x.float(), self.weight.float())

    def route(self, x: torch.Tensor, ids: torch.Tensor | None):
        scores = self.ops.sigmoid(self(x))
        if ids is None:
            ids = self.select(scores)
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (self.ops.row_sum(weights) + 1e-20)
        weights = weights * self.scaling
        if self.load is not None and torch.is_grad_enabled():
            counted = ids if self.load_rows is None else ids[: self.load_rows]
            self.load.index_add_(0, counted.reshape(-1), torch.ones_like(counted, dtype=self.load.dtype).reshape(-1))
        return ids, weights

    def select(self, scores: torch.Tensor) -> torch.Tensor:
        """Group-limited top-k over score + bias, as batched tensor ops: [N, E] -> ids [N, k]."""
        choice = scores + self.e_score_correction_bias
        if self.n_group > 1:
            N, E = choice.shape
            grouped = choice.view(N, self.n_group, E // self.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, n_group]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(
                1, group_scores.topk(self.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(N, E)
        return choice.topk(self.top_k, dim=-1).indices

    def _apply(self, fn, recurse=True):
        bias = self.e_score_correction_bias
        super()._apply(fn, recurse)
        moved = self.e_score_correction_bias
        if moved.dtype in (torch.float16, torch.bfloat16):
            self.e_score_correction_bias = bias.to(device=moved.device, dtype=torch.float32)
        if self.load is not None:
            self.load = self.load.to(device=moved.device)
        return self


class TopKSoftmaxGate(Linear):
    """gpt-oss router: logits ``x W^T + b``, the top-k logits chosen, the weights a softmax over
    those k (fp32), which equals softmax over all experts, top-k, renormalised; the bias shifts
    both the choice and the weights. HF names: ``mlp.router.weight``, ``mlp.router.bias``."""

    hf_name = "router"

    def __init__(self, arch: MoEArch):
        super().__init__(arch.hidden_size, arch.num_experts, bias=True)
        self.top_k = arch.num_experts_per_tok

    @classmethod
    def hf_specs(cls, arch: MoEArch) -> list[tuple[str, tuple[int, ...]]]:
        return [("weight", (arch.num_experts, arch.hidden_size)), ("bias", (arch.num_experts,))]

    def route(self, x: torch.Tensor, ids: torch.Tensor | None):
        """``ids`` given (replay): the softmax over this router's current logits at those ids."""
        logits = self(x)
        if ids is None:
            ids = logits.topk(self.top_k, dim=-1).indices
        return ids, F.softmax(logits.gather(1, ids), dim=-1, dtype=torch.float)


GATES = {"softmax": SoftmaxGate, "sigmoid": SigmoidGate, "topk_softmax": TopKSoftmaxGate}


class SparseMoE(nn.Module):
    """Router + experts (+ shared experts), the experts optionally sharded over an
    expert-parallel group.

    The (token, slot) rows are sorted by expert once per layer, run through grouped GEMMs
    (gate, up, down), and brought back with one gather and a weighted sum over
    the k slots (``ops.combine``: a batched [1, k] x [k, H] product, or the exact combine in
    slot order; deterministic unlike an atomic scatter-add).
    Shared experts (GLM) are one dense MLP of ``n_shared_experts x moe_intermediate_size``
    over every token, added to the routed output (HF: ``mlp.shared_experts``).
    """

    ops = TORCH  # its model's ops (moe_rl.model.ops)

    def __init__(self, arch: MoEArch, layer: int, ep_group=None):
        super().__init__()
        self.layer = layer
        self.num_experts, self.top_k = arch.num_experts, arch.num_experts_per_tok
        self.ep_group = ep_group
        self.ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
        self.ep_rank = dist.get_rank(ep_group) if ep_group is not None else 0
        if self.num_experts % self.ep_size:
            raise ValueError(f"num_experts={self.num_experts} is not divisible by ep_size={self.ep_size}")
        self.num_local = self.num_experts // self.ep_size
        gate = GATES[arch.router](arch)
        self.add_module(gate.hf_name, gate)  # HF's name: mlp.gate, or gpt-oss's mlp.router
        if gate.hf_name != "gate":
            self.__dict__["gate"] = gate  # the same module as ``self.gate`` (not registered twice)
        self.experts = EXPERTS[arch.family.experts].build(arch, self.num_local)
        self.shared_experts = (DenseMLP(arch.hidden_size, arch.moe_intermediate_size * arch.n_shared_experts)
                               if arch.n_shared_experts else None)
        if arch.shared_expert_intermediate_size:  # Qwen3-Next / Qwen3.5: one shared expert, sigmoid-gated
            self.shared_expert = DenseMLP(arch.hidden_size, arch.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(arch.hidden_size, 1, bias=False)
        else:
            self.shared_expert = None

    def route(self, x: torch.Tensor, replay: torch.Tensor | None):
        """Returns (top-k expert ids [N, k], gate weights [N, k] in fp32; ``ops.combine`` takes
        them to the dtype it sums in).

        Under replay the ids are given; the weights are this router's weights at those ids,
        computed from its current scores as it computes them for its own choice (softmax
        probabilities renormalised; sigmoid scores without the bias, renormalised, scaled), so
        the router still gets gradients (R3; Megatron-core's RouterReplay does the same).
        ``replay`` as ``_check_replay`` returns it (the model checks each record once per
        forward, outside the decoder blocks, which may be compiled).
        """
        return self.gate.route(x, replay)

    def _check_replay(self, ids: torch.Tensor, n_tokens: int, device) -> torch.Tensor:
        """Validates a replay record. A host-side record (the usual case: it comes from the
        replay log) is checked on the host before it is copied over, so the device never syncs;
        a device-resident one is checked by an asynchronous device assert."""
        where = f"replay record for MoE layer {self.layer}"
        if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise RoutingError(f"{where}: expected an integer tensor, got {getattr(ids, 'dtype', type(ids))}")
        if tuple(ids.shape) != (n_tokens, self.top_k):
            raise RoutingError(f"{where}: shape {tuple(ids.shape)}, expected [tokens={n_tokens}, top_k={self.top_k}]")
        if not n_tokens:
            return ids.to(device=device, dtype=torch.long)
        srt = ids.sort(dim=1).values
        dup = (srt[:, 1:] == srt[:, :-1]).any(dim=1)
        if ids.device.type != "cpu":
            ok = (srt[:, 0] >= 0).all() & (srt[:, -1] < self.num_experts).all() & ~dup.any()
            torch._assert_async(ok, f"{where}: expert id out of range [0, {self.num_experts}) or duplicated")
            return ids.to(device=device, dtype=torch.long)
        lo, hi = int(srt[:, 0].min()), int(srt[:, -1].max())
        if lo < 0 or hi >= self.num_experts:
            raise RoutingError(f"{where}: expert id out of range [0, {self.num_experts}): min {lo}, max {hi}")
        if bool(dup.any()):
            row = int(dup.nonzero()[0])
            raise RoutingError(f"{where}: token {row} has a duplicate expert id: {ids[row].tolist()}")
        return ids.to(device=device, dtype=torch.long, non_blocking=True)

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None):
        ids, weights = self.route(x, replay)
        k = ids.shape[1]
        if self.ep_size == 1:
            d = dispatch(ids.reshape(-1), self.num_local, group_align(x))
            expert_out = unpermute(self.experts(permute(x, d, k), d.offs), d)
        else:
            expert_out = self._ep_compute(x, ids)
        out = self.ops.combine(expert_out, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out, ids

    def _ep_compute(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Sends each (token, slot) row to the rank owning its expert, computes there, brings
        it back; returns [N * k, H] in the flat (token, slot) order. The split sizes of the
        all-to-all are host integers, so this path syncs once per layer (as Megatron's does)."""
        N, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # grouped by expert, hence by owning rank
        sorted_ids = flat[order]
        send = torch.bincount(sorted_ids // self.num_local, minlength=self.ep_size)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.ep_group)
        send, recv = send.tolist(), recv.tolist()
        M = order.shape[0]
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(M, device=order.device))
        remote_rows = _AllToAll.apply(permute_rows(x, order, inverse, M, k), recv, send, self.ep_group)
        remote_ids = sorted_ids.new_empty(sum(recv))
        dist.all_to_all_single(remote_ids, sorted_ids.contiguous(), recv, send, group=self.ep_group)
        d = dispatch(remote_ids - self.ep_rank * self.num_local, self.num_local, group_align(x))
        computed = unpermute(self.experts(permute(remote_rows, d), d.offs), d)
        back = _AllToAll.apply(computed, send, recv, self.ep_group)  # in `order`'s order
        return unpermute_rows(back, order, inverse)


def decoder_norm(arch: MoEArch) -> RMSNorm:
    """A decoder RMSNorm of width hidden_size in the family's form (gpt-oss: scaled in fp32;
    Qwen3-Next / Qwen3.5: Gemma's 1 + weight)."""
    fam = arch.family
    return RMSNorm(arch.hidden_size, arch.rms_norm_eps, fam.norm_scale_fp32, zero_centered=fam.zero_centered_norm)


class DecoderLayer(nn.Module):
    def __init__(self, arch: MoEArch, layer: int, ep_group=None):
        super().__init__()
        mixer = mixer_class(arch, layer)
        self.mixer_name = mixer.hf_name  # HF's name of the token mixer (self_attn, ...)
        self.add_module(self.mixer_name, mixer(arch, layer))
        self.is_moe = arch.is_moe_layer(layer)
        if self.is_moe:
            self.mlp = SparseMoE(arch, layer, ep_group)
        else:
            self.mlp = DenseMLP(arch.hidden_size, arch.intermediate_size)
        self.input_layernorm = decoder_norm(arch)
        self.post_attention_layernorm = decoder_norm(arch)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attention,
                replay: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """h [N, H] -> (h after this block, the block's top-k expert ids [N, k] or None for a
        dense block). ``replay``: checked expert ids to use (``SparseMoE._check_replay``). The
        unit that ``MoEForCausalLM.compile_blocks`` compiles: no host read, no data-dependent
        branch (with one expert-parallel rank)."""
        h = h + self.mixer(self.input_layernorm(h), cos, sin, attend)
        x = self.post_attention_layernorm(h)
        if not self.is_moe:
            return h + self.mlp(x), None
        out, ids = self.mlp(x, replay)
        return h + out, ids


    @property
    def mixer(self) -> nn.Module:
        """This layer's attention (``moe_rl.model.attention``), whatever HF names it."""
        return getattr(self, self.mixer_name)


class Backbone(nn.Module):
    def __init__(self, arch: MoEArch, ep_group=None):
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch, i, ep_group) for i in range(arch.num_hidden_layers))
        self.norm = decoder_norm(arch)


class MoEForCausalLM(nn.Module):
    """MoE causal LM of any family in ``moe_rl.model.arch.FAMILIES``. ``model(input_ids)`` -> logits [B, T, V].

    Routing: ``replay`` is a list with one integer tensor [tokens, top_k] per MoE layer, in
    layer order (Megatron-core's ``RouterReplay.set_replay_data`` format), tokens ordered as
    the row-major flattening of ``input_ids``. ``record`` is a list that receives the same.
    """

    ops = TORCH  # the arithmetic of every layer (moe_rl.model.ops); ``use_ops`` switches it

    def __init__(self, arch: MoEArch, ep_group=None):
        super().__init__()
        self.arch = arch
        self.rope = arch.rope()
        self.ep_group = ep_group
        self.model = Backbone(arch, ep_group)
        self.lm_head = Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.moe_layers = [i for i, layer in enumerate(self.model.layers) if layer.is_moe]
        self._graphed_blocks = False  # compile_blocks(cuda_graphs=True)

    # ------------------------------------------------------------------------------------
    def init_weights(self, seed: int, std: float = 0.02) -> "MoEForCausalLM":
        """Seeded random init, identical on every EP rank for shared tensors; each rank's
        experts are the slice of one global draw, so EP=1 and EP=n models agree."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(0.0 if getattr(self.get_submodule(name.rsplit(".", 1)[0]), "zero_centered", False) else 1.0)
                elif ".experts." in name:
                    mlp = self._moe_of(name)
                    full = torch.empty((mlp.num_experts,) + tuple(p.shape[1:])).normal_(0, std, generator=g)
                    lo = mlp.ep_rank * mlp.num_local
                    p.copy_(full[lo : lo + mlp.num_local])
                else:
                    p.copy_(torch.empty(p.shape).normal_(0, std, generator=g))
            for layer in self.model.layers:
                layer.mixer.init_special(g)
        return self

    def use_ops(self, ops) -> "MoEForCausalLM":
        """Every layer computes with ``ops`` from now on (``moe_rl.model.ops``: ``TORCH``, or
        ``EXACT`` under ``true_on_policy``). A layer whose attention kind has no exact path
        (``Mixer.exact_path``) is refused for ``EXACT``."""
        if ops.exact:
            kinds = self.arch.layer_kinds()
            missing = sorted({kinds[i] for i, l in enumerate(self.model.layers) if not l.mixer.exact_path})
            if missing:
                raise ValueError(f"true_on_policy: model_type={self.arch.model_type!r} has attention kinds without an "
                                 f"exact (batch-invariant) path: {missing}; set true_on_policy=false")
        for module in self.modules():
            if hasattr(type(module), "ops"):
                module.ops = ops
        return self

    # --- the expert-score correction bias (sigmoid routers) --------------------------------
    def _sigmoid_gates(self) -> list[SigmoidGate]:
        return [l.mlp.gate for l in self.model.layers if l.is_moe and isinstance(l.mlp.gate, SigmoidGate)]

    def track_expert_load(self, on: bool = True) -> None:
        """Count the tokens each expert receives in forwards that build a graph (training;
        replayed routings count as routed), for ``update_expert_bias``."""
        for g in self._sigmoid_gates():
            g.load = torch.zeros(g.out_features, dtype=torch.float64, device=g.weight.device) if on else None

    @contextlib.contextmanager
    def expert_load_rows(self, rows: int):
        """Inside: the expert load counts only the first ``rows`` tokens of each forward (a packed
        row's filler after them is not a sample's token)."""
        gates = self._sigmoid_gates()
        for g in gates:
            g.load_rows = rows
        try:
            yield
        finally:
            for g in gates:
                g.load_rows = None

    @torch.no_grad()
    def update_expert_bias(self, rate: float, group=None) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing (as Megatron-core's
        ``get_updated_expert_bias``): per MoE layer, ``bias += rate * sign(mean_load - load)``
        over the loads counted since the last call, summed over ``group`` (the ranks that
        forwarded different tokens); the counts restart. Identical on every rank of ``group``.
        One all-reduce, one batched update: no host sync."""
        gates = [g for g in self._sigmoid_gates() if g.load is not None]
        if not gates:
            return
        load = torch.stack([g.load for g in gates])  # [layers, E]
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(load, group=group)
        delta = (load.mean(dim=-1, keepdim=True) - load).sign().mul_(rate)
        torch._foreach_add_([g.e_score_correction_bias for g in gates],
                            list(delta.to(gates[0].e_score_correction_bias.dtype).unbind(0)))
        torch._foreach_zero_([g.load for g in gates])

    def _moe_of(self, param_name: str) -> SparseMoE:
        return self.model.layers[int(param_name.split(".")[2])].mlp

    def compile_blocks(self, cuda_graphs: bool = False, **options) -> None:
        """``torch.compile`` each decoder block in place (torchtitan's per-block compile:
        ``nn.Module.compile``, so parameter names and the state dict stay HF's), with
        ``fullgraph=True`` (a graph break is an error) and dynamic shapes, so packed batches of
        any length share one graph; ``options`` go to ``torch.compile``. Blocks with
        expert parallelism are refused: their all-to-all splits are host integers.
        ``cuda_graphs``: Inductor replays each block's forward and backward as CUDA graphs (CUDA
        graph trees, one recording per distinct length), and anything that would make it skip
        them (a CPU tensor in the graph, an input mutation) is an error, not a silent eager run."""
        if self.ops.exact:
            raise ValueError("compile_blocks: the exact kernels (true_on_policy) are not registered as custom ops "
                             "torch.compile can trace; run the blocks eagerly")
        if any(getattr(l.mlp, "ep_size", 1) > 1 for l in self.model.layers):
            raise ValueError("compile_blocks: expert parallelism (ep_size > 1) reads the all-to-all split sizes "
                             "on the host, which a compiled block cannot; compile with ep_size=1 only")
        options = {"fullgraph": True, "dynamic": True, **options}
        if cuda_graphs:
            inductor = {"triton.cudagraphs": True}
            if hasattr(torch._inductor.config.triton, "cudagraph_or_error"):  # torch >= 2.7
                inductor["triton.cudagraph_or_error"] = True
            options["options"] = {**options.get("options", {}), **inductor}
        self._graphed_blocks = cuda_graphs
        # one graph per kind of call, not per batch (BLOCK_GRAPHS); the limit is process-wide
        cfg = torch._dynamo.config
        name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"  # torch < 2.7
        setattr(cfg, name, max(getattr(cfg, name), BLOCK_GRAPHS))
        for layer in self.model.layers:
            layer.compile(**options)

    def forward_tokens(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attend: Attention,
        replay: list[torch.Tensor] | None = None,
        record: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Flat forward: input_ids/positions [N] -> final normed hidden states [N, H]."""
        N = input_ids.shape[0]
        if replay is not None:
            if len(replay) != len(self.moe_layers):
                raise RoutingError(
                    f"replay record has {len(replay)} layers, the model has {len(self.moe_layers)} MoE layers"
                )
            replay = [self.model.layers[i].mlp._check_replay(r, N, input_ids.device)
                      for i, r in zip(self.moe_layers, replay)]
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rope.cos_sin(positions, h.dtype)
        moe_i = 0
        for layer in self.model.layers:
            ids = None
            if layer.is_moe and replay is not None:
                ids = replay[moe_i]
            h, ids = layer(h, cos, sin, attend, ids)
            if layer.is_moe:
                moe_i += 1
                if record is not None:  # a graph's output is overwritten by its next replay: kept as a copy
                    record.append(ids.detach().clone() if self._graphed_blocks else ids.detach())
        return self.model.norm(h)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        replay: list[torch.Tensor] | None = None,
        record: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """[B, T] ids -> final normed hidden [B, T, H]. With ``cu_seqlens`` the batch is one
        packed row [1, total] of several sequences (positions restart in each); ``max_seqlen``,
        its longest sequence, spares a host read of ``cu_seqlens`` (``PackedCausal``)."""
        B, T = input_ids.shape
        if cu_seqlens is None:
            positions = torch.arange(T, device=input_ids.device).repeat(B)
            attend: Attention = (ExactPacked.padded(B, T, input_ids.device) if self.ops.exact
                                 else PaddedCausal(B, T))
        else:
            if B != 1:
                raise ValueError("packed input (cu_seqlens) must have batch size 1")
            positions = packed_positions(cu_seqlens, T)
            attend = (ExactPacked(cu_seqlens, max_seqlen) if self.ops.exact
                      else PackedCausal(cu_seqlens, T, max_seqlen))
        h = self.forward_tokens(input_ids.reshape(-1), positions, attend, replay, record)
        return h.view(B, T, -1)

    def forward(self, input_ids: torch.Tensor, **kw) -> torch.Tensor:
        return self.lm_head(self.hidden_states(input_ids, **kw))
