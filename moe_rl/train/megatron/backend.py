"""``train.backend: megatron``: megatron-core's GPTModel (MoE, expert parallel) as a TrainBackend.

Same contract as the native backend (moe_rl.train.backend): packed micro-batches in,
differentiable fp32 per-token log-probs out (from the final hidden states through
``moe_rl.kernels.fused_logprobs`` with the output layer's weight, never materialising the
logits), summed gradients reduced over megatron's data-parallel groups, HF-named tensors out.

Weights always enter as an HF state (a checkpoint, or the native model's seeded init, so both
backends start from identical weights for one seed) and leave through ``hf_tensors``, one
tensor at a time via ``convert.megatron_to_hf``.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Iterator

import torch

from moe_rl.model import (MoEForCausalLM, PackedCausal, dequantize_mxfp4, hf_state_dict, packed_positions,
                          parse_expert_name)
from moe_rl.model.hf_io import _checkpoint_files
from moe_rl.train.backend import DataParallelStep, all_reduce_sum

from .convert import MegatronLayout, hf_to_megatron, megatron_expert_owner, megatron_to_hf
from .model import (
    MegatronOptions,
    RouterReplayControl,
    build_gpt_model,
    init_parallel_state,
    transformer_config,
)

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def initial_hf_state(cfg, arch):
    """HF tensors to start from: a name -> tensor getter over cfg.model.path's safetensors
    (read lazily, so each rank reads only what it holds), or the native model's seeded init."""
    if cfg.model.path:
        return _checkpoint_getter(Path(cfg.model.path))
    return hf_state_dict(MoEForCausalLM(arch).init_weights(cfg.model.init_seed))


def _checkpoint_getter(path: Path):
    from safetensors import safe_open

    files = {}
    for f in _checkpoint_files(path):
        with safe_open(str(f), framework="pt") as sf:
            files.update({k: f for k in sf.keys()})

    def get(name: str) -> torch.Tensor:
        if name in files:
            with safe_open(str(files[name]), framework="pt") as sf:
                return sf.get_tensor(name)
        if name + "_blocks" in files and name + "_scales" in files:  # gpt-oss's MXFP4 experts, dequantized
            parts = {}
            for part in ("blocks", "scales"):
                with safe_open(str(files[f"{name}_{part}"]), framework="pt") as sf:
                    parts[part] = sf.get_tensor(f"{name}_{part}")
            return dequantize_mxfp4(parts["blocks"], parts["scales"], name=name, where=str(files[name + "_blocks"]))
        parsed = parse_expert_name(name)
        if parsed is not None:  # transformers v5 stacked experts: [E, 2I, H] / [E, H, I]
            layer, e, proj = parsed
            kind = "down_proj" if proj == "down_proj" else "gate_up_proj"
            key = f"model.layers.{layer}.mlp.experts.{kind}"
            if key in files:
                with safe_open(str(files[key]), framework="pt") as sf:
                    t = sf.get_slice(key)[e]
                return t if kind == "down_proj" else t.chunk(2, dim=0)[0 if proj == "gate_proj" else 1]
        raise KeyError(f"{path}: checkpoint has no tensor {name!r}")

    return get


class MegatronBackend(DataParallelStep):
    """megatron-core GPTModel with MoE layers, expert parallelism over the trainer pool."""

    def __init__(self, cfg, groups=None, hf_state=None):
        """``hf_state``: HF tensors to start from (a mapping or a name -> tensor getter);
        default: cfg.model.path, else the native model's seeded init (same seed, same weights)."""
        self.cfg = cfg
        self.groups = groups
        self.arch = cfg.model.arch()
        self.ep_size = cfg.train.ep_size
        self.tp_size = cfg.train.tp_size
        if self.tp_size > 1:
            raise NotImplementedError(
                "train.tp_size > 1 with train.backend=megatron: the HF <-> Megatron conversion shards for TP, "
                "but the training step's TP gradient reduction (sequence-parallel norms, clipping over TP) "
                "is not implemented yet; use train.tp_size=1 (expert parallelism via train.ep_size)"
            )
        self.opts = MegatronOptions.from_config(cfg)
        # megatron's allgather dispatcher all-gathers each rank's [T, H] block over the EP group, so
        # T must be equal there; its alltoall dispatcher exchanges the ranks' token counts first
        self.equal_tokens_per_ep_rank = self.opts.dispatcher == "allgather" and self.ep_size > 1
        self.device = torch.device(cfg.train.device)
        self.dtype = DTYPES[cfg.model.dtype]
        if self.device.type != "cuda":
            log.warning("megatron backend on %s: megatron-core's forward moves tensors to CUDA; on CPU only "
                        "building and weight conversion work (tests/megatron shims the CUDA calls)", self.device)

        trainer_ranks = groups.layout.trainer_ranks if groups is not None else None
        init_parallel_state(self.tp_size, self.ep_size, trainer_ranks, seed=cfg.train.seed,
                            cuda=self.device.type == "cuda")
        from megatron.core import parallel_state as ps

        self.ps = ps
        self.ep_rank = ps.get_expert_model_parallel_rank()
        self.layout: MegatronLayout = self.opts.layout(ep_size=self.ep_size, ep_rank=self.ep_rank)
        log.info(
            "megatron backend: %s layer spec (%s), attention: %s, experts: %s, dispatcher %s, EP %d (rank %d), "
            "recompute %s, replay %s",
            "Transformer Engine" if self.opts.use_te else "local (megatron-core modules)",
            "transformer_engine imports" if self.opts.use_te else "transformer_engine not used",
            "TEDotProductAttention" if self.opts.use_te else
            "TorchSDPAttention (fused SDPA per packed sequence, in place of megatron's DotProductAttention)",
            self.experts_desc(), self.opts.dispatcher,
            self.ep_size, self.ep_rank, self.opts.recompute, self.opts.replay,
        )

        RouterReplayControl.reset()
        self.tconfig = transformer_config(self.arch, self.opts, dtype=self.dtype, tp_size=self.tp_size,
                                          ep_size=self.ep_size, cpu_init=self.device.type != "cuda")
        self.model = build_gpt_model(self.arch, self.opts, self.tconfig)
        # the MicroBatch.padding of the micro-batch forwarded last: kept after its forward, for the
        # recompute in its backward (megatron_recompute), which runs before the next forward
        self._filler_rows = 0
        for module in self.model.modules():
            if getattr(module, "enable_expert_bias", False) and hasattr(module, "local_tokens_per_expert"):
                module.register_forward_hook(self._uncount_filler)
        if self.arch.family.hybrid:
            log.info("megatron backend: Gated DeltaNet layers are megatron-core's GatedDeltaNet with %s",
                     "flash-linear-attention's kernels" if self.opts.use_te else
                     "moe-rl's conv and chunked rule (torch on CPU, its Triton scan on CUDA)")
        self.replay = (
            RouterReplayControl(len(self.arch.moe_layers), self.arch.num_experts_per_tok, self.arch.num_experts,
                                self.opts.recompute)
            if not self.opts.router_fusion else None
        )
        self.load_hf_state(hf_state if hf_state is not None else initial_hf_state(cfg, self.arch))
        self.model.to(self.device)
        self.lora = self._megatron_lora = None
        if cfg.lora.enabled:  # base frozen; the optimizer below holds only the adapters
            from .lora import MegatronLora, build_native_adapters

            ep_group = ps.get_expert_model_parallel_group() if self.ep_size > 1 else None
            self.lora = build_native_adapters(self.arch, cfg.lora, ep_group, self.device, self.dtype)
            self._megatron_lora = MegatronLora(self.model, self.lora, self.arch, self.layout)

        self._setup_optimizer()  # bf16: fp32 main params and Adam state, as megatron's distributed optimizer

    def experts_desc(self) -> str:
        """The expert module and, for ours, the grouped GEMM it runs (named in the log)."""
        name = self.opts.experts
        if name == "TorchGroupedMLP":
            from .experts import grouped_kernel_name

            kernel = grouped_kernel_name(self.device, self.dtype)
            if kernel.startswith("padded"):
                log.warning("megatron backend: TorchGroupedMLP experts on %s %s fall back to a %s", self.device,
                            self.dtype, kernel)
            return f"{name} ({kernel}; megatron-core's GroupedMLP needs the grouped_gemm package, "\
                   "TEGroupedMLP Transformer Engine)"
        if name == "SequentialMLP":
            return f"{name} (train.megatron_grouped_gemm=false: a Python loop over experts)"
        return name

    # --- weights ------------------------------------------------------------------------
    def load_hf_state(self, hf) -> None:
        """Copies HF tensors (full, global names; a mapping or a getter) into this rank's
        Megatron parameters."""
        state = hf_to_megatron(hf, self.arch, self.layout)
        params = self._tensors()
        unknown = sorted(set(state) - set(params))
        missing = sorted(set(params) - set(state))
        if unknown or missing:
            raise RuntimeError(f"HF -> Megatron names do not match the GPTModel: missing {missing[:4]}, "
                               f"unexpected {unknown[:4]}")
        with torch.no_grad():
            for name, t in state.items():
                p = params[name]
                if tuple(p.shape) != tuple(t.shape):
                    raise RuntimeError(f"{name}: converted shape {tuple(t.shape)}, GPTModel has {tuple(p.shape)}")
                p.copy_(t)

    def _tensors(self) -> dict[str, torch.Tensor]:
        """The GPTModel's parameters and its routers' expert-bias buffers (GLM's correction bias)."""
        out = dict(self.model.named_parameters())
        out.update((n, b) for n, b in self.model.named_buffers() if n.endswith(".router.expert_bias"))
        return out

    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's weights under HF names; with LoRA the merged weights (base + s*B@A)."""
        params = self._tensors()
        # inputs are detached, so no autograd graph is built; no `with no_grad()` around the
        # yield, which would leave autograd off in the caller while the generator is suspended
        get = self._megatron_lora.merged_getter() if self._megatron_lora is not None else (lambda n: params[n].detach())
        yield from megatron_to_hf(get, self.arch, self.layout)

    def hf_source(self):
        """Megatron -> HF conversion streamed to the weight-sync sender, one tensor at a time;
        with LoRA the merged weights (lora.sync=merged) or the adapter tensors only (adapter),
        under the native trainer's names."""
        from moe_rl.sync.source import StreamSource

        if self.lora is not None and self.cfg.lora.sync == "adapter":
            from moe_rl.model.lora import AdapterSource

            return AdapterSource(self.lora)

        dtype = next(self.model.parameters()).dtype
        return StreamSource(self.arch, self.device, dtype, self.hf_tensors)

    def owner_ep_rank(self, name: str) -> int | None:
        return megatron_expert_owner(name, self.arch, self.ep_size)

    # --- forward ------------------------------------------------------------------------
    def hidden_states(self, mb, record: list | None = None) -> torch.Tensor:
        """Final normed hidden states [T, H] of a packed micro-batch (routing replayed if given)."""
        ids = mb.input_ids.to(self.device, non_blocking=True)  # the loop's micro-batches are there already
        if ids.shape[0] != 1:
            raise ValueError("megatron backend: micro-batches are one packed row [1, T]")
        T = ids.shape[1]
        cu = mb.cu_seqlens.to(self.device, non_blocking=True)
        pos = packed_positions(cu, T)[None]
        kwargs = {}
        if self.opts.use_te:
            from megatron.core.packed_seq_params import PackedSeqParams

            cu32 = cu.to(torch.int32)
            longest = int((cu32[1:] - cu32[:-1]).max())
            kwargs["packed_seq_params"] = PackedSeqParams(
                qkv_format="thd", cu_seqlens_q=cu32, cu_seqlens_kv=cu32, max_seqlen_q=longest, max_seqlen_kv=longest
            )
            mask = None
        else:
            # the local spec's attention takes a boolean mask, True = masked; RoPE positions run over
            # the whole row, which leaves attention inside each sequence unchanged (relative positions)
            mask = ~PackedCausal(cu, T).mask[None, None]
        ctx = self.replay.forward(mb.replay, T, self.device, record) if self.replay is not None else _no_replay(mb, record)
        self.model.post_process = False  # GPTModel then returns the decoder output: no logits
        self._filler_rows = mb.padding
        try:
            with ctx, (self._megatron_lora.applied() if self._megatron_lora is not None else contextlib.nullcontext()):
                hidden = self.model(input_ids=ids, position_ids=pos, attention_mask=mask, **kwargs)
        finally:
            self.model.post_process = True
        return hidden.reshape(T, -1)  # [s, b=1, h] -> [T, H]

    def _uncount_filler(self, router, inputs, output) -> None:
        """A router's forward hook: takes the filler rows (the last ``MicroBatch.padding`` of the
        packed row) back out of the expert load it has just counted, under the condition it
        counts (megatron's ``_apply_expert_bias``: grad enabled, so in the backward's recompute
        too). megatron-core's own ``padding_mask`` would do it, but its expert-bias count fails to
        broadcast the mask ([N] against [N, E]) in 0.16 and 0.19."""
        if self._filler_rows and torch.is_grad_enabled():
            routing_map = output[1]  # [T, E]: the rows are the packed row's tokens (TP = 1, batch 1)
            with torch.no_grad():
                router.local_tokens_per_expert -= routing_map[-self._filler_rows:].sum(0).to(
                    router.local_tokens_per_expert.dtype)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.output_layer.weight

    # --- step ---------------------------------------------------------------------------
    def _reduce_grads(self) -> None:
        """Sums gradients: dense ones over megatron's data-parallel group (the whole trainer
        pool at TP=1), expert ones over its expert-data-parallel group."""
        ps = self.ps
        if ps.get_data_parallel_world_size() > 1:
            all_reduce_sum([p.grad for p in self.dense_params], ps.get_data_parallel_group())
        if ps.get_expert_data_parallel_world_size() > 1:
            all_reduce_sum([p.grad for p in self.expert_params], ps.get_expert_data_parallel_group())

    def optimizer_step(self) -> dict[str, torch.Tensor]:
        stats = super().optimizer_step()
        if self.arch.router == "sigmoid":
            self._update_expert_bias()
        if self.replay is not None:
            pending = self.replay.pending_backward()
            self.replay.end_step()
            if pending:
                log.warning("routing replay: %d recomputed forwards were never run by a backward this step", pending)
        return stats

    def _update_expert_bias(self) -> None:
        """train.expert_bias_update_rate > 0: megatron-core's own update of the routers' expert
        bias from the step's token counts, all-reduced over the trainer pool (its
        ``_update_router_expert_bias``, what finalize_model_grads runs); the counts restart
        every step either way (its ``reset_model_temporary_tensors``)."""
        from megatron.core.distributed.finalize_model_grads import (
            _update_router_expert_bias,
            reset_model_temporary_tensors,
        )

        rate = self.cfg.train.expert_bias_update_rate
        if rate:
            self.tconfig.moe_router_bias_update_rate = rate
            _update_router_expert_bias([self.model], self.tconfig)
        reset_model_temporary_tensors(self.tconfig, [self.model])

    def _ep_group(self):
        return self.ps.get_expert_model_parallel_group()

    # --- state --------------------------------------------------------------------------
    def state_dict(self) -> dict:
        model = {k: v for k, v in self.model.state_dict().items() if not k.endswith("_extra_state")}
        out = {"model": model, "optimizer": self.optimizer.state_dict()}
        if self.lora is not None:
            out["lora"] = self.lora.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        missing, unexpected = self.model.load_state_dict(state["model"], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"megatron state does not fit this model: missing {missing[:4]}, unexpected {unexpected[:4]}")
        if self.lora is not None:
            if "lora" not in state:
                raise KeyError("checkpoint has no LoRA adapters but lora.enabled=true")
            self.lora.load_state_dict(state["lora"])
        self.optimizer.load_state_dict(state["optimizer"])


class _no_replay:
    """Context used with the fused router, which has no RouterReplay: no replay, no recording."""

    def __init__(self, mb, record):
        if mb.replay is not None or record is not None:
            raise ValueError("routing replay and recording need megatron's RouterReplay, which the fused router "
                             "(train.megatron_router_fusion=true) bypasses; set megatron_router_fusion=false")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
