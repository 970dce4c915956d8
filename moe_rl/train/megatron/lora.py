"""LoRA on megatron-core's GPTModel: the native trainer's adapters, applied to Megatron's weights.

The adapter *parameters* are a native :class:`moe_rl.model.lora.LoraAdapters` built over a
shape-only (meta-device) native model of the same architecture and EP shard: same sites, same
A/B shapes, same seeded init, same names (``model.layers.L.<module>.lora_A|lora_B``). So the
optimizer, ``AdapterSource`` (adapter-only weight sync), ``save_peft`` (checkpoints) and the
engine's ``AdapterServing`` take them unchanged, and one seed gives both backends the same
adapters. Only the mapping of each adapter onto Megatron's parameters lives here:

=========================  ===================================================================
native target              Megatron weight it changes (decoder layer L)
=========================  ===================================================================
q_proj, k_proj, v_proj     ``self_attention.linear_qkv.weight``: the fused QKV is split by
                           query group (``convert.split_qkv``), each targeted part gets
                           W + s*B@A (the native op), and they are fused back
o_proj                     ``self_attention.linear_proj.weight``
q_a_proj, q_b_proj,        (multi-head latent attention) ``self_attention.linear_q_down_proj``,
kv_a_proj_with_mqa,        ``linear_q_up_proj``, ``linear_kv_down_proj``, ``linear_kv_up_proj``,
kv_b_proj, q_proj          ``linear_q_proj``: B's RoPE rows reordered as the weight's (convert)
router                     ``mlp.router.weight``
experts.gate_up_proj       each local expert's ``linear_fc1`` = [gate; up]: B's first I rows
                           adapt gate, the last I rows up, exactly fc1's row order (gpt-oss:
                           B's rows follow HF's interleaved columns, de-interleaved here)
experts.down_proj          each local expert's ``linear_fc2``
=========================  ===================================================================

Form: weight deltas, as natively. Inside ``applied()`` every adapted Megatron parameter is
replaced, for the forward, by W + s*B@A (differentiable in A and B); Megatron's modules read
``self.weight`` at call time, so its linears, router (and RouterReplay) run unchanged on the
adapted weights. A layer's experts are adapted by one ``baddbmm`` over the stacked expert
weights (all experts at once); the results are then put into Megatron's per-expert parameter
slots. Our CPU spec uses SequentialMLP (one MLP module per expert, looped over by Megatron
itself), and TEGroupedMLP also keeps one parameter per expert (``weight{j}``), so that last
assignment is a loop over slots, no compute.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import nn

from moe_rl.model import MoEArch, MoEForCausalLM
from moe_rl.model.lora import LoraAdapters, LoraError, per_expert, swapped_parameters

from .convert import MegatronLayout, _mla_rope_rows, expert_names, fuse_qkv, split_qkv

# multi-head latent attention: target -> the Megatron weight it changes (o_proj as for MHA)
MLA_TARGETS = {"q_proj": "linear_q_proj.weight", "q_a_proj": "linear_q_down_proj.weight",
               "q_b_proj": "linear_q_up_proj.weight", "kv_a_proj_with_mqa": "linear_kv_down_proj.weight",
               "kv_b_proj": "linear_kv_up_proj.weight"}


def build_native_adapters(arch: MoEArch, lora_cfg, ep_group, device, dtype) -> LoraAdapters:
    """The native adapters for this rank's EP shard, over a meta-device native model (no base
    weights are allocated), initialised with ``lora_cfg.seed`` as the native trainer does."""
    with torch.device("meta"):
        shadow = MoEForCausalLM(arch, ep_group=ep_group).to(dtype)
    adapters = LoraAdapters(shadow, lora_cfg.rank, lora_cfg.alpha, lora_cfg.targets, lora_cfg.layers,
                            lora_cfg.dropout, lora_cfg.experts_shared_outer)
    adapters.to_empty(device=device)
    return adapters.init_weights(lora_cfg.seed)


class MegatronLora:
    """Applies ``adapters`` (native layout) to a GPTModel built with ``layout``."""

    def __init__(self, model: nn.Module, adapters: LoraAdapters, arch: MoEArch, layout: MegatronLayout):
        if layout.tp_size > 1:
            raise LoraError("lora.enabled with train.backend=megatron: train.tp_size > 1 is not supported "
                            "(adapters on TP-sharded fused QKV / fc1 are not implemented)")
        if arch.family.hybrid:
            raise LoraError(f"lora.enabled with train.backend=megatron: model_type={arch.model_type!r} (adapters on "
                            "megatron's GatedDeltaNet and gated attention are not mapped; use train.backend=native)")
        shared = sorted({s.target for s in adapters.sites if s.target.startswith("shared_experts.")})
        if shared:
            raise LoraError(f"lora.targets {shared} with train.backend=megatron: adapters on megatron's "
                            "SharedExpertMLP are not implemented (use train.backend=native)")
        self.model, self.adapters, self.arch, self.layout = model, adapters, arch, layout
        self.params = dict(model.named_parameters())
        self.params.update((n, b) for n, b in model.named_buffers() if n.endswith(".router.expert_bias"))
        self.by_layer: dict[int, list] = {}
        for s in adapters.sites:
            self.by_layer.setdefault(s.layer, []).append(s)
        for p in model.parameters():
            p.requires_grad_(False)

    def _ab(self, key: str, like: torch.Tensor):
        a, b = self.adapters.A[key.replace(".", "__")], self.adapters.B[key.replace(".", "__")]
        return a.to(like.dtype), b.to(like.dtype)  # megatron may keep the router in fp32 in a bf16 model

    def layer_weights(self, layer: int, get: Callable[[str], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Megatron name -> W + s*B@A for every weight the adapters change in decoder ``layer``
        (differentiable in A and B when grad is enabled). ``get`` reads the base weights."""
        get = get or (lambda n: self.params[n])
        s_ = self.adapters.scaling
        p = f"decoder.layers.{layer}."
        out: dict[str, torch.Tensor] = {}
        qkv = {}
        for s in self.by_layer.get(layer, []):
            if self.arch.is_mla and s.target in MLA_TARGETS:  # one Megatron weight per HF one
                name = p + "self_attention." + MLA_TARGETS[s.target]
                A, B = self._ab(s.key, get(name))
                B = _mla_rope_rows(B, f"self_attn.{s.target}.weight", self.arch, to_megatron=True)
                out[name] = torch.addmm(get(name), B, A, alpha=s_)
            elif s.target in ("q_proj", "k_proj", "v_proj"):
                qkv[s.target[0]] = s
            elif s.target == "o_proj":
                name = p + "self_attention.linear_proj.weight"
                A, B = self._ab(s.key, get(name))
                out[name] = torch.addmm(get(name), B, A, alpha=s_)
            elif s.target == "router":
                name = p + "mlp.router.weight"
                A, B = self._ab(s.key, get(name))
                out[name] = torch.addmm(get(name), B, A, alpha=s_)
            else:  # experts: one baddbmm for all local experts of the layer
                E_local = self.arch.num_experts // self.layout.ep_size
                names = [expert_names(self.layout, layer, j)[0 if s.target == "experts.gate_up_proj" else 1]
                         for j in range(E_local)]
                base = torch.stack([get(n) for n in names])
                A, B = per_expert(*self._ab(s.key, base))
                if s.transposed and s.target == "experts.gate_up_proj":  # gpt-oss: B's rows interleaved, fc1's not
                    B = torch.cat((B[:, 0::2], B[:, 1::2]), dim=1)
                out.update(zip(names, torch.baddbmm(base, B, A, alpha=s_).unbind(0)))
        if qkv:
            name = p + "self_attention.linear_qkv.weight"
            parts = dict(zip("qkv", split_qkv(get(name), self.arch)))
            for x, s in qkv.items():
                A, B = self._ab(s.key, parts[x])
                parts[x] = torch.addmm(parts[x], B, A, alpha=s_)
            out[name] = fuse_qkv(parts["q"], parts["k"], parts["v"], self.arch)
        return out

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for layer in sorted(self.by_layer):
            yield from self.layer_weights(layer).items()

    @contextlib.contextmanager
    def applied(self):
        """Within the block the GPTModel computes with W + s*B@A in place of each adapted W;
        the base parameters are untouched and put back after (as ``LoraAdapters.applied``)."""
        def slots():
            for name, w in self.weights():
                module_name, attr = name.rsplit(".", 1)
                yield self.model.get_submodule(module_name), attr, w

        with swapped_parameters(slots()):
            yield

    def merged_getter(self) -> Callable[[str], torch.Tensor]:
        """Megatron name -> merged weight, made one decoder layer at a time (the previous layer's
        merged weights are dropped when the next layer's first adapted name is asked for), for
        ``convert.megatron_to_hf``, which reads in layer order."""
        made: dict[str, torch.Tensor] = {}
        made_layer = [None]

        def get(name: str) -> torch.Tensor:
            if name.startswith("decoder.layers."):
                layer = int(name.split(".")[2])
                if layer in self.by_layer:
                    if made_layer[0] != layer:
                        with torch.no_grad():
                            made.clear()
                            made.update(self.layer_weights(layer))
                        made_layer[0] = layer
                    if name in made:
                        return made[name]
            return self.params[name].detach()

        return get
