"""What the trainer loop needs from a training backend, and the native (torch) backend.

A backend owns the model, its parallel layout and its optimizer. The loop hands it packed
micro-batches (with the routing to replay), already on the backend's ``device``, and gets
differentiable per-token log-probs back, on that device (docs/architecture.md, "Devices");
it calls ``backward`` on its own loss and ``optimizer_step`` once per step. ``hf_tensors``
yields this rank's weights under HuggingFace names, which the weight-sync sender and the
checkpoint writer consume.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Iterator, Protocol

import torch
import torch.distributed as dist

from moe_rl.config import ConfigError
from moe_rl.model import MoEArch, MoEForCausalLM, expert_owner, iter_local_hf_tensors, load_hf_weights
from moe_rl.model.attention import longest_sequence
from moe_rl.model.ops import TORCH, model_ops
from moe_rl.train.main_params import MainParamsOptimizer

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class MicroBatch:
    """Several sequences packed into one row.

    input_ids [1, T]; cu_seqlens [S + 1]; labels [T] holds the next token where a loss is
    taken (response tokens) and -100 elsewhere; replay is one [T, top_k] tensor per MoE layer
    (Megatron's RouterReplay format) or None to let the router choose. ``max_seqlen``: the
    longest sequence, a host integer (flash-attn's varlen convention), taken from
    ``cu_seqlens`` when the batch is made on the host and carried to the device with it, so
    the forward never reads it back. ``padding``: the row's last ``padding`` tokens are filler
    (equal-length padding, a dummy micro-batch), not tokens of any sample: they are forwarded
    but never counted in the experts' load (the expert-bias update).
    """

    input_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    labels: torch.Tensor
    replay: list[torch.Tensor] | None = None
    max_seqlen: int | None = None
    padding: int = 0

    def __post_init__(self):
        if self.max_seqlen is None and self.cu_seqlens.device.type == "cpu":
            self.max_seqlen = longest_sequence(self.cu_seqlens, self.input_ids.shape[-1])

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


class TrainBackend(Protocol):
    arch: MoEArch
    ep_size: int
    device: torch.device  # where the model lives; the loop brings each micro-batch here
    # the EP collectives need every rank of an EP group to hold as many tokens in its micro-batch
    # m as the others: the loop pads them (moe_rl.train.loop.shard_micro_batches)
    equal_tokens_per_ep_rank: bool


    def logprobs(
        self, mb: MicroBatch, temperature: float, with_entropy: bool = False, record: list | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fp32 log-prob [T] of each label (0 where label is -100) and optionally entropy [T];
        differentiable when grad is enabled. ``record`` receives the experts used per layer."""

    def token_loss(
        self, mb: MicroBatch, rows: torch.Tensor, temperature: float, token_loss, with_entropy: bool = False,
        record: list | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The loss ``sum_t token_loss(logp, H)_t`` over the label rows ``rows`` [R] of ``mb``,
        fused into the LM head (moe_rl.kernels.fused_token_loss: d_hidden and d_weight made in
        the forward; call backward once): (loss, fp32 log-probs [R], entropies [R] or None),
        the last two detached."""

    def optimizer_step(self) -> dict[str, torch.Tensor]:
        """Reduces gradients over the data-parallel groups, clips, steps, zeroes grads. Its
        statistics (``grad_norm``) stay on the device: the loop reads them with the step's
        metrics, once."""

    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) for every tensor this rank holds: all dense tensors, and the
        experts of this EP rank under their global HF names."""

    def hf_source(self):
        """The same for the weight-sync sender (a ``moe_rl.sync.source`` object)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class DataParallelStep:
    """What both backends share: the LM head on the final hidden states (``logprobs``,
    ``token_loss``) and the optimizer step (gradients summed over the data-parallel groups by
    ``_reduce_grads``, clipped by their global norm, AdamW step). Subclasses set ``model``,
    ``device``, ``optimizer``, ``dense_params``, ``expert_params``, ``cfg``, ``ep_size``,
    ``_ep_group()``, ``hidden_states(mb, record)`` ([T, H]) and ``lm_head_weight``; ``ops``
    (``moe_rl.model.ops``) says how the LM head takes its log-probs: the fused kernels
    (``TORCH``), or the exact linear and log-softmax of ``true_on_policy`` (``EXACT``)."""

    ops = TORCH
    needs_dense_params = False  # set by _setup_optimizer: fused AdamW steps the parameters themselves
    stable_grads = False  # gradients kept in buffers of their own between steps (zeroed, not freed)
    equal_tokens_per_ep_rank = False  # the native EP exchange sends each rank's own token counts

    def logprobs(self, mb, temperature, with_entropy=False, record=None):
        return self.ops.lm_logprobs(self.hidden_states(mb, record), self.lm_head_weight,
                                    mb.labels.to(self.device, non_blocking=True), temperature, with_entropy)

    def token_loss(self, mb, rows, temperature, token_loss, with_entropy=False, record=None):
        dev = self.device
        hidden = self.hidden_states(mb, record)
        rows = rows.to(dev, non_blocking=True)
        return self.ops.lm_token_loss(hidden[rows], self.lm_head_weight, mb.labels.to(dev, non_blocking=True)[rows],
                                      token_loss, temperature, with_entropy)

    def _setup_optimizer(self) -> None:
        """Splits expert from dense parameters (they reduce over different groups); AdamW, over
        fp32 main copies where the trained weights are 16-bit (as megatron's distributed
        optimizer: a bf16 weight takes most of AdamW's small updates as no change at all).
        With LoRA (``self.lora``) only the adapters train: the base weights are frozen."""
        cfg = self.cfg
        lora = getattr(self, "lora", None)
        named = list(lora.named_parameters() if lora is not None else self.model.named_parameters())
        # model names: "...mlp.experts.gate_proj"; adapter names: "A.model__layers__0__mlp__experts__..."
        self.expert_params = [p for n, p in named if ".experts." in n or "__experts__" in n]
        expert_ids = {id(p) for p in self.expert_params}
        self.dense_params = [p for _, p in named if id(p) not in expert_ids]
        params = self.dense_params + self.expert_params
        # on a GPU the fused kernel: one launch for the step, and none of the foreach form's
        # temporaries (a full fp32 copy of the second moments, 11 GB on the large train preset)
        adamw = dict(lr=cfg.train.lr, betas=tuple(cfg.train.betas), eps=cfg.train.adam_eps,
                     weight_decay=cfg.train.weight_decay, fused=fused_adamw(params))
        if any(p.dtype != torch.float32 for p in params):
            self.optimizer = MainParamsOptimizer(params, **adamw)  # steps dense fp32 copies
        else:
            self.optimizer = torch.optim.AdamW(params, **adamw)
            # its fused kernel takes no strided parameter (as an expert stack over interleaved
            # HF tensors, in weight-sync buckets, would be: sync.bind_params)
            self.needs_dense_params = bool(adamw["fused"])

    def _fill_grads(self) -> None:
        """A zero gradient for every trained parameter that has none."""
        for p in self.dense_params + self.expert_params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    def optimizer_step(self) -> dict[str, torch.Tensor]:
        self._fill_grads()
        self._reduce_grads()
        stats = {}
        if self.cfg.train.grad_clip:
            stats["grad_norm"] = self._clip(self.cfg.train.grad_clip)  # 0-dim, on the device
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=not self.stable_grads)
        return stats

    def _clip(self, max_norm: float) -> torch.Tensor:
        """Global grad norm: expert grads are disjoint over the EP group, so their squares are
        summed there; dense grads are identical on every rank after the reduction."""
        dev = (self.dense_params or self.expert_params)[0].device
        dense_sq = _sum_of_squares([p.grad for p in self.dense_params], dev)
        expert_sq = _sum_of_squares([p.grad for p in self.expert_params], dev)
        if self.ep_size > 1:
            dist.all_reduce(expert_sq, group=self._ep_group())
        norm = (dense_sq + expert_sq).sqrt()
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self.dense_params + self.expert_params:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for dtype, grads in by_dtype.items():  # a scale of another dtype sends CUDA's kernel one tensor at a time
            torch._foreach_mul_(grads, scale.to(dtype))
        return norm


def fused_adamw(params: list[torch.Tensor]) -> bool | None:
    """AdamW's fused kernel on a GPU (None: torch's default form elsewhere)."""
    return True if params and params[0].is_cuda else None


def _sum_of_squares(tensors: list[torch.Tensor], device) -> torch.Tensor:
    """The sum of every element's square over ``tensors``, 0-dim fp32 on ``device``: one
    multi-tensor norm kernel (fp32 accumulation of bf16 grads), not three kernels per tensor."""
    if not tensors:
        return torch.zeros((), device=device)
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)).square().sum()


class NativeBackend(DataParallelStep):
    """The torch-native model: data parallel over the trainer pool, experts over the EP group.

    Losses are normalised by the global token count, so gradients are *summed*: dense ones over
    the whole trainer pool, expert ones over the expert-data-parallel group (the all-to-all's
    backward already summed the EP group's contributions to this rank's experts).
    """

    def __init__(self, cfg, groups=None):
        self.cfg = cfg
        self.groups = groups
        self.arch = cfg.model.arch()
        ep_group = groups.ep if groups is not None and cfg.train.ep_size > 1 else None
        self.ep_size = cfg.train.ep_size
        self.model = MoEForCausalLM(self.arch, ep_group=ep_group)
        if cfg.model.path:
            load_hf_weights(self.model, cfg.model.path)
        else:
            self.model.init_weights(cfg.model.init_seed, std=cfg.model.init_std)
        self.device = torch.device(cfg.train.device)
        self.model.to(device=self.device, dtype=DTYPES[cfg.model.dtype])
        self.ops = model_ops(cfg)  # true_on_policy: the engine's exact kernels (moe_rl.model.ops)
        self.model.use_ops(self.ops)
        self.lora = None
        if cfg.lora.enabled:
            from moe_rl.model.lora import build_lora

            self.lora = build_lora(self.model, cfg.lora)
            # the forward adds the adapters' rows, unmerged (the engine's form; docs/lora.md "Form"):
            # attached once, so a compiled block sees the same hooks on every call
            self.lora.attach()
        self.compiled = use_compile(cfg, log)
        if self.compiled:
            self.model.compile_blocks(cuda_graphs=cfg.train.cuda_graphs)
        self._setup_optimizer()
        if cfg.train.cuda_graphs:
            # a .grad first made by a graphed backward is that graph's output, which its next
            # replay (the next micro-batch) overwrites: every gradient gets a buffer of its own
            # before the first backward, accumulated into and zeroed after each step
            self.stable_grads = True
            self._fill_grads()
        self.bias_rate = cfg.train.expert_bias_update_rate
        if self.bias_rate:
            if self.arch.router != "sigmoid":
                raise ValueError(f"train.expert_bias_update_rate: model_type={self.arch.model_type!r} has no "
                                 "expert-score correction bias (a sigmoid router's)")
            self.model.track_expert_load()

    def optimizer_step(self) -> dict[str, torch.Tensor]:
        stats = super().optimizer_step()
        if self.bias_rate:  # the tokens of every trainer rank count (each forwarded its own)
            trainer = self.groups.trainer if self.groups is not None and len(self.groups.layout.trainer_ranks) > 1 else None
            self.model.update_expert_bias(self.bias_rate, group=trainer)
        return stats

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.lm_head.weight

    def hidden_states(self, mb, record=None):
        """The final hidden states [T, H] of a packed micro-batch."""
        dev = self.device  # no-ops for the loop's micro-batches; others are copied without a stream sync
        counted = self.model.expert_load_rows(mb.num_tokens - mb.padding) if mb.padding else contextlib.nullcontext()
        with counted:
            hidden = self.model.hidden_states(
                mb.input_ids.to(dev, non_blocking=True), cu_seqlens=mb.cu_seqlens.to(dev, non_blocking=True),
                max_seqlen=mb.max_seqlen,
                replay=None if mb.replay is None else [r.to(dev, non_blocking=True) for r in mb.replay], record=record,
            )
        return hidden.reshape(-1, hidden.shape[-1])

    def _reduce_grads(self) -> None:
        if self.groups is None or self.groups.layout.world_size == 1:
            return
        trainer_size = len(self.groups.layout.trainer_ranks)
        if trainer_size > 1:
            all_reduce_sum([p.grad for p in self.dense_params], self.groups.trainer)
        if self.groups.dp_size > 1:
            all_reduce_sum([p.grad for p in self.expert_params], self.groups.expert_dp)

    def _ep_group(self):
        return self.groups.ep

    def hf_tensors(self):
        """With LoRA: the merged weights (base + s*B@A), made afresh."""
        if self.lora is None:
            return iter_local_hf_tensors(self.model)
        return self._merged_hf_tensors()

    def _merged_hf_tensors(self):
        return self.lora.merged_hf_tensors()

    def hf_source(self):
        """This rank's weights for the weight-sync sender (views of the parameters); with
        LoRA the merged weights (lora.sync=merged) or the adapter tensors only (adapter)."""
        from moe_rl.sync.source import ModelSource, StreamSource

        if self.lora is None:
            return ModelSource(self.model)
        if self.cfg.lora.sync == "adapter":
            from moe_rl.model.lora import AdapterSource

            return AdapterSource(self.lora)
        return StreamSource(self.arch, self.device, DTYPES[self.cfg.model.dtype], self._merged_hf_tensors)

    def owner_ep_rank(self, name: str) -> int | None:
        return expert_owner(name, self.arch, self.ep_size)

    def state_dict(self) -> dict:
        out = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        if self.lora is not None:
            out["lora"] = self.lora.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        if self.lora is not None:
            if "lora" not in state:
                raise KeyError("checkpoint has no LoRA adapters but lora.enabled=true")
            self.lora.load_state_dict(state["lora"])
        self.optimizer.load_state_dict(state["optimizer"])


def use_compile(cfg, logger=None) -> bool:
    """Whether the native model's decoder blocks are compiled (``train.compile``; the choice is
    logged once through ``logger``): ``auto`` on CUDA with one expert-parallel rank, ``true``
    refuses what cannot be compiled, ``false`` never."""
    mode, t = cfg.train.compile, cfg.train
    why = None
    if cfg.true_on_policy:
        why = "true_on_policy (the exact kernels are not custom ops torch.compile can trace)"
    elif t.ep_size > 1:
        why = "train.ep_size > 1 (the all-to-all's split sizes are host integers)"
    elif mode == "auto" and t.device != "cuda":
        why = "train.compile=auto is off on the CPU (the compile costs more than a CPU run saves: docs/benchmarks.md)"
    elif mode is False:
        why = "train.compile=false"
    if mode is True and why:
        raise ConfigError(f"train.compile=true: {why}; set train.compile to auto or false")
    if logger is not None:
        if why:
            logger.info("decoder blocks run eagerly: %s", why)
        else:
            logger.info("decoder blocks compiled (train.compile=%s): torch.compile per block, fullgraph, dynamic "
                        "shapes; the first steps include the compile", str(mode).lower())
    return why is None


def all_reduce_sum(tensors: list[torch.Tensor], group) -> None:
    """One all-reduce over a flat copy instead of one per tensor (latency-bound on gloo)."""
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    parts = flat.split([t.numel() for t in tensors])
    torch._foreach_copy_(tensors, [part.view_as(t) for part, t in zip(parts, tensors)])

