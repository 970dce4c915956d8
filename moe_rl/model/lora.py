"""LoRA adapters for the native MoE model: attention, router, routed and shared experts.

An adapter on a weight W [out, in] is a pair A [r, in], B [out, r]; the adapted weight is
W + (alpha / r) * B @ A. On a layer's experts (stacked [E, out, in]) there is one pair per
expert, A [E, r, in], B [E, out, r], and all experts are adapted by one batched matmul
(``baddbmm``), never a loop over experts.

Forms: ``in_forward()`` / ``attach()`` add the adapters' rows in the forward, unmerged
(y = x W^T + s (x A^T) B^T; experts through two more grouped GEMMs of rank r over the same
expert-sorted rows, ``Experts.lora``): the trainer and the embedded engine both use it, so an
adapter sync only writes A and B, and no full-size W' is made (measured in ``moe-rl bench sync
--lora``, docs/lora.md). ``applied()`` puts W' = W + s B@A in place of each adapted weight (one
``addmm`` / ``baddbmm`` per weight, all experts at once); ``merged_hf_tensors`` uses the same op
for the merged sync and the HF export. Dropout is not implemented (``dropout`` must be 0).

Shared outer factors (``experts_shared_outer``, SGLang's "shared outer" MoE LoRA): the factors
on the hidden side are shared by a layer's experts, gate_up's A [1, r, H] and down's B [1, H, r],
and only the factors on the expert-width side stay per expert (gate_up's B [E, 2I, r], down's A
[E, r, I]). At Qwen3-30B-A3B widths that is ~0.8% of the expert weights at rank 16 instead of
~2.3% (docs/lora.md). The shared factor is broadcast over the experts (``expand``), so every
form below computes the same function as a per-expert adapter whose A (or B) is equal across
experts, which is how it is written to PEFT's and SGLang's per-expert files.

Names: HF (transformers >= 5) fuses an expert's gate and up projections into
``experts.gate_up_proj`` [E, 2I, H]; PEFT adapts that 3-D parameter with ``target_parameters``
and one A per expert shared by gate and up. The native model keeps gate and up apart, so the
``experts.gate_up_proj`` target holds one A [E, r, H] and one B [E, 2I, r], whose first I rows
adapt ``gate_proj`` and last I rows ``up_proj``: the same function as PEFT's adapter, so it
saves and loads losslessly in PEFT's file format (``save_peft`` / ``load_peft``). gpt-oss's
experts are HF's [E, in, out] parameters themselves (``gate_up_proj`` [E, H, 2I], gate and up
interleaved): the adapter is A [E, r, in], B [E, out, r] with B's rows in the parameter's column
order, and the adapted weight W + s (B A)^T per expert, as PEFT adapts a transposed expert
parameter. Biases (attention, router, experts) are never adapted: they stay frozen.
"""
from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from .attention import MIXERS
from .grouped import in_groups
from .ops import TORCH
from .hf_io import atomic_dir, iter_local_hf_tensors, parse_expert_name
from .transformer import MoEForCausalLM

# target name -> where it sits in a decoder layer; attention targets are the projections of
# each layer's attention kind (Mixer.lora_targets), of whichever kinds the model has
ATTENTION_TARGETS = tuple(dict.fromkeys(t for m in MIXERS.values() for t in m.lora_targets))
SHARED_EXPERT_TARGETS = ("shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj")  # GLM
DENSE_TARGETS = ATTENTION_TARGETS + SHARED_EXPERT_TARGETS  # nn.Linear modules (PEFT target_modules)
EXPERT_TARGETS = ("experts.gate_up_proj", "experts.down_proj")
ROUTER_TARGET = "router"
TARGETS = ATTENTION_TARGETS + (ROUTER_TARGET,) + EXPERT_TARGETS + SHARED_EXPERT_TARGETS


class LoraError(ValueError):
    """An adapter file or setting that does not fit this model."""


@dataclass
class _Site:
    """One adapted weight (or, for gate_up, a pair of weights sharing A)."""

    key: str  # HF module path, e.g. model.layers.0.self_attn.q_proj / model.layers.0.mlp.experts
    target: str  # one of TARGETS
    layer: int
    module: nn.Module
    attrs: tuple[str, ...]  # parameter names on ``module`` this adapter changes
    split: int | None  # for gate_up: rows of B for the first attr
    transposed: bool = False  # experts stored [E, in, out] (gpt-oss), not [E, out, in]


def _projections(mixer) -> list[str]:
    """The projections of ``mixer`` a LoRA adapter may target that this model has (an MLA layer
    with ``q_lora_rank`` has q_a_proj and q_b_proj, no q_proj)."""
    return [t for t in mixer.lora_targets if getattr(mixer, t, None) is not None]


def _sites(model: MoEForCausalLM, targets: list[str], layers: list[int] | None) -> list[_Site]:
    sites = []
    for i, layer in enumerate(model.model.layers):
        if layers is not None and i not in layers:
            continue
        p = f"model.layers.{i}."
        for t in targets:
            if t in ATTENTION_TARGETS:
                if t in _projections(layer.mixer):
                    sites.append(_Site(f"{p}{layer.mixer_name}.{t}", t, i, getattr(layer.mixer, t), ("weight",), None))
            elif not layer.is_moe:
                continue  # router and experts exist only in MoE layers
            elif t in SHARED_EXPERT_TARGETS:
                if layer.mlp.shared_experts is not None:
                    proj = t.split(".")[1]
                    sites.append(_Site(p + "mlp." + t, t, i, getattr(layer.mlp.shared_experts, proj), ("weight",), None))
            elif t == ROUTER_TARGET:
                gate = layer.mlp.gate
                sites.append(_Site(f"{p}mlp.{gate.hf_name}", t, i, gate, ("weight",), None))
            elif t in EXPERT_TARGETS and not layer.mlp.experts.per_expert_hf:  # HF's [E, in, out] parameter itself
                proj = t.split(".")[1]
                sites.append(_Site(f"{p}mlp.{t}", t, i, layer.mlp.experts, (proj,), None, transposed=True))
            elif t == "experts.gate_up_proj":
                ex = layer.mlp.experts
                sites.append(_Site(p + "mlp.experts.gate_up_proj", t, i, ex, ("gate_proj", "up_proj"),
                                   ex.gate_proj.shape[1]))
            elif t == "experts.down_proj":
                sites.append(_Site(p + "mlp.experts.down_proj", t, i, layer.mlp.experts, ("down_proj",), None))
            else:
                raise LoraError(f"lora.targets: unknown target {t!r}; valid: {list(TARGETS)}")
    absent = [t for t in targets if t in ATTENTION_TARGETS and not any(s.target == t for s in sites)]
    if absent:
        raise LoraError(f"lora.targets: {absent} is not a projection of this model's attention "
                        f"(its layers have {sorted({t for l in model.model.layers for t in _projections(l.mixer)})})")
    return sites


def _ab_shapes(site: _Site, rank: int, shared_outer: bool = False) -> tuple[tuple[int, ...], tuple[int, ...]]:
    ws = [getattr(site.module, a) for a in site.attrs]
    if ws[0].dim() == 2:
        out, inp = ws[0].shape
        return (rank, inp), (out, rank)
    if site.transposed:
        E, inp, out = ws[0].shape
    else:
        E, _, inp = ws[0].shape
        out = sum(w.shape[1] for w in ws)
    gate_up = site.target == "experts.gate_up_proj"
    return ((1 if shared_outer and gate_up else E, rank, inp),
            (1 if shared_outer and not gate_up else E, out, rank))


def per_expert(A: torch.Tensor, B: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert adapter's factors as [E, ...] stacks: a shared factor (leading dim 1) is
    broadcast over the experts (a view; autograd sums its gradient over them)."""
    E = max(A.shape[0], B.shape[0])
    return A.expand(E, -1, -1), B.expand(E, -1, -1)


def _unshare(t: torch.Tensor, like: torch.Tensor, where: str, what: str) -> torch.Tensor:
    """A per-expert stack read from a file, for a factor held as ``like``: a shared factor needs
    every expert's copy equal."""
    if like.shape[0] == 1 and t.shape[0] != 1:
        if not torch.equal(t, t[:1].expand_as(t)):
            raise LoraError(f"{where}: {what} differs between experts, but lora.experts_shared_outer holds one "
                            "copy for all experts")
        return t[:1]
    return t


class LoraAdapters(nn.Module):
    """The adapters of one model (this EP rank's experts). Not a submodule of the model: the
    model keeps its HF parameter names and its state dict; adapters have their own."""

    def __init__(self, model: MoEForCausalLM, rank: int, alpha: float, targets: list[str],
                 layers: list[int] | None = None, dropout: float = 0.0, shared_outer: bool = False):
        super().__init__()
        if dropout:
            raise LoraError("lora.dropout: must be 0; adapter dropout is not implemented (and the merged "
                            "weights W + s*B@A of the merged sync and export have no equivalent of it)")
        if rank < 1:
            raise LoraError(f"lora.rank: must be >= 1, got {rank}")
        bad = [t for t in targets if t not in TARGETS]
        if bad:
            raise LoraError(f"lora.targets: unknown {bad}; valid: {list(TARGETS)}")
        n = model.arch.num_hidden_layers
        if layers is not None and any(not 0 <= i < n for i in layers):
            raise LoraError(f"lora.layers: indices must be in [0, {n}), got {layers}")
        object.__setattr__(self, "model", model)  # not a submodule
        self.rank, self.alpha, self.targets = rank, float(alpha), list(targets)
        self.layers = None if layers is None else sorted(set(layers))
        self.scaling = self.alpha / rank
        self.shared_outer = bool(shared_outer)
        if self.shared_outer and any(getattr(l.mlp, "ep_size", 1) > 1 for l in model.model.layers):
            raise LoraError("lora.experts_shared_outer with expert parallelism (train.ep_size > 1) is not supported: "
                            "the shared factors' gradients would need a reduction over the EP group")
        self.sites = _sites(model, self.targets, self.layers)
        if not self.sites:
            raise LoraError(f"lora: targets {targets} on layers {layers} select no weight of this model")
        ref = getattr(self.sites[0].module, self.sites[0].attrs[0])
        self.A = nn.ParameterDict()
        self.B = nn.ParameterDict()
        for s in self.sites:
            a, b = _ab_shapes(s, rank, self.shared_outer)
            self.A[_pkey(s.key)] = nn.Parameter(torch.zeros(a, device=ref.device, dtype=ref.dtype))
            self.B[_pkey(s.key)] = nn.Parameter(torch.zeros(b, device=ref.device, dtype=ref.dtype))
        for p in model.parameters():
            p.requires_grad_(False)

    # --- init / layout -------------------------------------------------------------------
    def init_weights(self, seed: int) -> "LoraAdapters":
        """PEFT's default: A ~ kaiming-uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)), B = 0.
        Expert A's are this rank's slice of one global draw (EP=1 and EP=n agree)."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for s in self.sites:
                A = self.A[_pkey(s.key)]
                bound = 1.0 / math.sqrt(A.shape[-1])
                if A.dim() == 2 or (self.shared_outer and s.target == "experts.gate_up_proj"):  # dense, or shared
                    A.copy_(torch.empty(A.shape).uniform_(-bound, bound, generator=g))
                else:
                    moe = self.model.model.layers[s.layer].mlp
                    full = torch.empty((moe.num_experts,) + tuple(A.shape[1:])).uniform_(-bound, bound, generator=g)
                    A.copy_(full[moe.ep_rank * moe.num_local:][: moe.num_local])
                self.B[_pkey(s.key)].zero_()
        return self

    # --- applying ---------------------------------------------------------------------------
    def delta_weights(self) -> Iterator[tuple[nn.Module, str, torch.Tensor]]:
        """(module, parameter name, adapted weight) for every adapted weight, differentiable
        in A and B. One addmm / baddbmm per weight, all experts of a layer at once."""
        for s in self.sites:
            yield from self._site_deltas(s)

    @contextlib.contextmanager
    def applied(self):
        """Within the block the model computes with W + s*B@A in place of each adapted W
        (autograd reaches A and B; the base parameters are untouched and restored after).
        Under ``torch.no_grad`` the adapted weights are frozen Parameters, so code that looks
        parameters up by name (``local_hf_tensor``) reads the merged weights."""
        with swapped_parameters(self.delta_weights()):
            yield

    @torch.no_grad()
    def merged_hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) of the model with the adapters merged, in canonical order, without
        touching the model: an adapted weight (a layer's expert stack) is made when its first
        name comes, and dropped when the next layer starts (a few stacks alive at a time)."""
        sites = {(id(s.module), a): s for s in self.sites for a in s.attrs}
        made: dict[tuple[int, str], torch.Tensor] = {}
        layer_of_made = None
        for name, t in iter_local_hf_tensors(self.model):
            parsed = parse_expert_name(name)
            if parsed is not None:
                layer, expert, attr = parsed
                moe = self.model.model.layers[layer].mlp
                module, index = moe.experts, expert - moe.ep_rank * moe.num_local
            else:
                layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
                module, attr, index = self.model.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1], None
            site = sites.get((id(module), attr))
            if site is None:
                yield name, t
                continue
            if layer != layer_of_made:
                made, layer_of_made = {}, layer
            key = (id(module), attr)
            if key not in made:
                made.update({(id(m), a): w for m, a, w in self._site_deltas(site)})
            w = made[key]
            yield name, (w if index is None else w[index])

    def _site_deltas(self, s: _Site, base=None):
        """(module, attr, base + s*B@A) for one site; ``base`` overrides the model's weights."""
        def w(attr):
            return getattr(s.module, attr) if base is None else base[id(s.module), attr]
        A, B = self.A[_pkey(s.key)], self.B[_pkey(s.key)]
        if A.dim() == 2:
            yield s.module, "weight", torch.addmm(w("weight"), B, A, alpha=self.scaling)
            return
        A, B = per_expert(A, B)
        if s.transposed:  # W [E, in, out] + s (B A)^T
            yield s.module, s.attrs[0], torch.baddbmm(w(s.attrs[0]), A.transpose(1, 2), B.transpose(1, 2),
                                                      alpha=self.scaling)
            return
        parts = (B[:, : s.split], B[:, s.split:]) if s.split is not None else (B,)
        for attr, Bp in zip(s.attrs, parts):
            yield s.module, attr, torch.baddbmm(w(attr), Bp, A, alpha=self.scaling)

    def attach(self):
        """Serves the adapters in the model's forward, unmerged: y = x@W^T + s*(x@A^T)@B^T.
        Dense targets get a forward hook on their ``nn.Linear``; expert targets an
        ``ExpertLora`` on the layer's ``Experts`` (two grouped GEMMs of rank r per projection
        over the expert-sorted rows, all experts at once). The hooks read A and B themselves, so
        writing new values into them (a weight sync) changes what the model computes, and
        autograd reaches them. Returns a function that detaches everything again."""
        handles, experts, dense = [], {}, []
        for s in self.sites:
            A, B = self.A[_pkey(s.key)], self.B[_pkey(s.key)]
            if A.dim() == 2:
                handles.append(s.module.register_forward_hook(_linear_hook(A, B, self.scaling)))
                s.module.lora_delta = (A, B, self.scaling)  # for code that reads the weight (linear_weight)
                dense.append(s.module)
                continue
            if id(s.module) not in experts:
                experts[id(s.module)] = (s.module, ExpertLora(self.scaling))
            lora = experts[id(s.module)][1]
            if s.target == "experts.gate_up_proj":
                lora.gate_up = (A, B)
            else:
                lora.down = (A, B)
        for module, lora in experts.values():
            module.lora = lora

        def detach():
            for h in handles:
                h.remove()
            for module in dense:
                del module.lora_delta
            for module, _ in experts.values():
                del module.lora  # back to the class default (None)
        return detach

    @contextlib.contextmanager
    def in_forward(self):
        """Within the block the model computes with the adapters unmerged (``attach``)."""
        detach = self.attach()
        try:
            yield
        finally:
            detach()

    # --- wire names ---------------------------------------------------------------------------
    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of every adapter tensor, native layout: ``<site>.lora_A`` /
        ``<site>.lora_B`` (experts: this rank's [E_local, ...] stack)."""
        for s in self.sites:
            yield s.key + ".lora_A", self.A[_pkey(s.key)]
            yield s.key + ".lora_B", self.B[_pkey(s.key)]

    def load_hf_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, t in self.hf_tensors():
                if name not in tensors:
                    raise LoraError(f"adapter tensors lack {name!r}")
                t.copy_(tensors[name])

    # --- PEFT format ----------------------------------------------------------------------
    def peft_config(self) -> dict:
        modules, params = [], []
        for s in self.sites:
            if s.target in DENSE_TARGETS:
                modules.append(s.key)
            elif s.target == ROUTER_TARGET:
                params.append(s.key + ".weight")
            else:
                params.append(s.key)
        return {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank, "lora_alpha": self.alpha,
            "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
            "use_dora": False, "init_lora_weights": True, "inference_mode": True,
            "target_modules": modules, "target_parameters": params or None,
            "base_model_name_or_path": None, "revision": None, "modules_to_save": None,
        }

    def peft_state_dict(self) -> dict[str, torch.Tensor]:
        """PEFT's keys and layouts (EP=1 model). On one module PEFT nests the wrappers of
        several target parameters in list order: the first sits under ``base_layer``."""
        _require_full(self.model)
        out = {}
        for sites in _group_by_module(self.sites):
            mod = _module_of(sites[0])
            for depth, s in enumerate(sites):
                prefix = "base_model.model." + mod + ".base_layer" * (len(sites) - 1 - depth)
                A, B = self.A[_pkey(s.key)].detach(), self.B[_pkey(s.key)].detach()
                if A.dim() == 3:  # PEFT: A [E*r, in] expert-major; B [out, r*E] with expert fastest
                    A, B = per_expert(A, B)  # PEFT has no shared factor: one copy per expert
                    E, r, inp = A.shape
                    A = A.reshape(E * r, inp)
                    B = B.permute(1, 2, 0).reshape(B.shape[1], r * E)
                out[prefix + ".lora_A.weight"] = A.contiguous().clone()
                out[prefix + ".lora_B.weight"] = B.contiguous().clone()
        return out

    def per_expert_state_dict(self, shared_3d: bool = False) -> tuple[dict[str, torch.Tensor], list[str]]:
        """PEFT keys of per-expert modules (``experts.{e}.{gate,up,down}_proj``; transformers
        4.x's layout, and what SGLang's LoRA loader reads for routed experts): gate and up
        each get the shared A. Returns (state dict, target_modules).

        ``shared_3d`` (shared outer factors only): SGLang's shared-outer form instead, one 3-D
        tensor per expert factor and no expert index in the key (``experts.gate_up_proj.lora_A``
        [1, r, H], ``.lora_B`` [E, 2I, r]; ``experts.down_proj.lora_A`` [E, r, I], ``.lora_B``
        [1, H, r]), which an SGLang server started with ``--experts-shared-outer-loras`` loads."""
        _require_full(self.model)
        if shared_3d and not self.shared_outer:
            raise LoraError("SGLang's shared-outer adapter form needs lora.experts_shared_outer=true")
        if any(s.transposed for s in self.sites):
            raise LoraError("the per-expert adapter layout has no modules for this model's experts (gpt-oss stores "
                            "them as one [E, in, out] parameter): save it in PEFT's fused layout (target_parameters), "
                            "or drop the experts.* targets")
        out, modules = {}, set()
        for s in self.sites:
            A, B = self.A[_pkey(s.key)].detach(), self.B[_pkey(s.key)].detach()
            if s.target == ROUTER_TARGET:
                raise LoraError("the per-expert (SGLang) adapter layout has no router target; drop 'router' "
                                "from lora.targets to serve through SGLang")
            if A.dim() == 2:
                out[f"base_model.model.{s.key}.lora_A.weight"] = A.contiguous().clone()
                out[f"base_model.model.{s.key}.lora_B.weight"] = B.contiguous().clone()
                modules.add(s.target)
                continue
            if shared_3d:  # the site's own name: ...mlp.experts.{gate_up,down}_proj
                modules.update(("gate_proj", "up_proj") if s.split is not None else ("down_proj",))
                out[f"base_model.model.{s.key}.lora_A.weight"] = A.contiguous().clone()
                out[f"base_model.model.{s.key}.lora_B.weight"] = B.contiguous().clone()
                continue
            mod = _module_of(s)
            A, B = per_expert(A, B)
            parts = (("gate_proj", B[:, : s.split]), ("up_proj", B[:, s.split:])) if s.split is not None \
                else (("down_proj", B),)
            for proj, Bp in parts:
                modules.add(proj)
                for e in range(A.shape[0]):
                    out[f"base_model.model.{mod}.{e}.{proj}.lora_A.weight"] = A[e].contiguous().clone()
                    out[f"base_model.model.{mod}.{e}.{proj}.lora_B.weight"] = Bp[e].contiguous().clone()
        return out, sorted(modules)

    def load_per_expert_state_dict(self, sd: dict[str, torch.Tensor], where: str = "adapter") -> None:
        """Inverse of ``per_expert_state_dict`` (either form). Gate and up must share A (this
        form's adapter)."""
        if is_shared_outer_file(sd):
            if not self.shared_outer:
                raise LoraError(f"{where}: an adapter in SGLang's shared-outer form (3-D expert tensors); it loads "
                                "with lora.experts_shared_outer=true")
            mine, _ = self.per_expert_state_dict(shared_3d=True)
            missing, extra = sorted(set(mine) - set(sd)), sorted(set(sd) - set(mine))
            if missing or extra:
                raise LoraError(f"{where}: keys do not match this lora config: missing {missing[:3]}, unexpected {extra[:3]}")
            bad = [k for k in mine if tuple(sd[k].shape) != tuple(mine[k].shape)]
            if bad:
                raise LoraError(f"{where}: {bad[0]} has shape {tuple(sd[bad[0]].shape)}, this lora config "
                                f"{tuple(mine[bad[0]].shape)}")
            with torch.no_grad():  # in this form every key is the adapter tensor's own name
                for name, t in self.hf_tensors():
                    t.copy_(sd[f"base_model.model.{name}.weight"])
            return
        mine, _ = self.per_expert_state_dict()
        missing, extra = sorted(set(mine) - set(sd)), sorted(set(sd) - set(mine))
        if missing or extra:
            raise LoraError(f"{where}: keys do not match this lora config: missing {missing[:3]}, unexpected {extra[:3]}")
        with torch.no_grad():
            for s in self.sites:
                A, B = self.A[_pkey(s.key)], self.B[_pkey(s.key)]
                if A.dim() == 2:
                    A.copy_(sd[f"base_model.model.{s.key}.lora_A.weight"])
                    B.copy_(sd[f"base_model.model.{s.key}.lora_B.weight"])
                    continue
                mod, projs = _module_of(s), (("gate_proj", "up_proj") if s.split is not None else ("down_proj",))
                E = max(A.shape[0], B.shape[0])
                a = {p: torch.stack([sd[f"base_model.model.{mod}.{e}.{p}.lora_A.weight"] for e in range(E)]) for p in projs}
                if len(projs) == 2 and not torch.equal(a["gate_proj"], a["up_proj"]):
                    raise LoraError(f"{where}: {mod}: gate_proj and up_proj adapters have different A; moe-rl's "
                                    "experts.gate_up_proj target shares one A (PEFT's fused form)")
                A.copy_(_unshare(a[projs[0]], A, where, f"{mod} lora_A"))
                B.copy_(_unshare(torch.cat([torch.stack([sd[f"base_model.model.{mod}.{e}.{p}.lora_B.weight"]
                                                         for e in range(E)]) for p in projs], dim=1),
                                 B, where, f"{mod} lora_B"))

    def load_peft_state_dict(self, sd: dict[str, torch.Tensor], where: str = "adapter") -> None:
        _require_full(self.model)
        mine = self.peft_state_dict()
        missing = sorted(set(mine) - set(sd))
        extra = sorted(set(sd) - set(mine))
        if missing or extra:
            raise LoraError(f"{where}: keys do not match this lora config: missing {missing[:3]}, unexpected {extra[:3]}")
        # invert the layout by position: peft_state_dict lists sites in the same order
        keys = iter(mine)
        by_key = {}
        for mod_sites in _group_by_module(self.sites):
            for s in mod_sites:
                by_key[s.key] = (next(keys), next(keys))
        with torch.no_grad():
            for s in self.sites:
                ka, kb = by_key[s.key]
                A, B = self.A[_pkey(s.key)], self.B[_pkey(s.key)]
                a, b = sd[ka], sd[kb]
                if A.dim() == 3:
                    E, r, inp = max(A.shape[0], B.shape[0]), A.shape[1], A.shape[2]
                    if a.numel() != E * r * inp or b.numel() != b.shape[0] * r * E:
                        raise LoraError(f"{where}: {ka} / {kb} shapes {tuple(sd[ka].shape)} / {tuple(sd[kb].shape)} "
                                        f"do not fit rank {self.rank} on {E} experts")
                    a = _unshare(a.reshape(E, r, inp), A, where, ka)
                    b = _unshare(b.reshape(b.shape[0], r, E).permute(2, 0, 1), B, where, kb)
                if tuple(a.shape) != tuple(A.shape) or tuple(b.shape) != tuple(B.shape):
                    raise LoraError(f"{where}: {ka} / {kb} shapes {tuple(sd[ka].shape)} / {tuple(sd[kb].shape)} "
                                    f"do not fit rank {self.rank}")
                A.copy_(a)
                B.copy_(b)


def is_shared_outer_file(sd: dict[str, torch.Tensor]) -> bool:
    """Keys of SGLang's 3-D shared-outer form: expert adapters without an expert index."""
    return any(k.endswith((".experts.gate_up_proj.lora_A.weight", ".experts.down_proj.lora_A.weight")) for k in sd)


def _group_by_module(sites: list[_Site]) -> list[list[_Site]]:
    groups: dict[str, list[_Site]] = {}
    for s in sites:
        groups.setdefault(_module_of(s), []).append(s)
    return list(groups.values())


def _module_of(s: _Site) -> str:
    """The HF module PEFT wraps: experts' two targets share ``mlp.experts``."""
    return s.key.rsplit(".", 1)[0] if s.target in EXPERT_TARGETS else s.key


def _pkey(key: str) -> str:
    return key.replace(".", "__")


def _linear_hook(A: torch.Tensor, B: torch.Tensor, scaling: float):
    def hook(module, args, out):  # the module's own ops (moe_rl.model.ops): exact ones under true_on_policy
        linear = module.ops.linear
        return out + scaling * linear(linear(args[0], A), B)
    return hook


class ExpertLora:
    """A layer's expert adapters in the experts' forward (``Experts.lora``). A plain object,
    not a module: the model's parameters and state dict stay HF's."""

    def __init__(self, scaling: float):
        self.scaling = scaling
        self.gate_up: tuple[torch.Tensor, torch.Tensor] | None = None  # A [E or 1, r, H], B [E, 2I, r]
        self.down: tuple[torch.Tensor, torch.Tensor] | None = None  # A [E, r, I], B [E or 1, H, r]

    def _rows(self, ab, x, offs, ops=TORCH):
        A, B = ab  # a factor with leading dim 1 is shared by the experts: one plain matmul over all rows
        h = ops.linear(x, A[0]) if A.shape[0] == 1 else ops.grouped_mm(x, A, offs)
        if A.shape[0] == 1 or B.shape[0] == 1:
            # a plain matmul spans the padded buffer's tail (rows in no group), where a grouped GEMM
            # leaves its output and its input gradient undefined: the rank-r rows are zeroed there,
            # so with permute's zero input rows and unpermute's zero gradient rows nothing from the
            # tail reaches A's or B's gradient
            h = torch.where(in_groups(h.shape[0], offs), h, 0.0)
        return self.scaling * (ops.linear(h, B[0]) if B.shape[0] == 1 else ops.grouped_mm(h, B, offs))

    def add_gate_up(self, gate: torch.Tensor, up: torch.Tensor, x: torch.Tensor,
                    offs: torch.Tensor, ops=TORCH) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate, up) plus the adapter's rows: B's first I rows adapt gate, its last I up.
        ``ops``: the experts' (moe_rl.model.ops)."""
        if self.gate_up is None:
            return gate, up
        d_gate, d_up = self._rows(self.gate_up, x, offs, ops).chunk(2, dim=-1)
        return gate + d_gate, up + d_up

    def add_fused_gate_up(self, gate_up: torch.Tensor, x: torch.Tensor, offs: torch.Tensor,
                          ops=TORCH) -> torch.Tensor:
        """gate_up plus the adapter's rows in gate_up's own column order (experts whose gate and
        up are one tensor, e.g. gpt-oss's interleaved [E, H, 2I])."""
        return gate_up if self.gate_up is None else gate_up + self._rows(self.gate_up, x, offs, ops)

    def add_down(self, out: torch.Tensor, h: torch.Tensor, offs: torch.Tensor, ops=TORCH) -> torch.Tensor:
        return out if self.down is None else out + self._rows(self.down, h, offs, ops)


def _require_full(model: MoEForCausalLM) -> None:
    if any(getattr(l.mlp, "ep_size", 1) > 1 for l in model.model.layers):
        raise LoraError("PEFT files hold every expert's adapter; gather the EP shards first (EP > 1)")


def save_peft(adapters: LoraAdapters, path: str | Path, base_model: str | None = None,
              layout: str = "fused") -> Path:
    """Writes adapter_config.json + adapter_model.safetensors atomically (temp dir + rename).
    ``layout``: "fused" (PEFT ``target_parameters`` on transformers 5's 3-D experts),
    "per_expert" (one module per expert: SGLang's loader, transformers 4.x) or "shared_outer"
    (SGLang's 3-D form of shared outer factors)."""
    cfg = adapters.peft_config()
    cfg["base_model_name_or_path"] = base_model
    if layout == "fused":
        sd = adapters.peft_state_dict()
    elif layout in ("per_expert", "shared_outer"):
        sd, modules = adapters.per_expert_state_dict(shared_3d=layout == "shared_outer")
        cfg.update(target_modules=modules, target_parameters=None)
        if adapters.layers is not None:
            cfg["layers_to_transform"] = adapters.layers
    else:
        raise ValueError(f"layout must be 'fused', 'per_expert' or 'shared_outer', got {layout!r}")
    with atomic_dir(path) as tmp:
        (tmp / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
        save_file(sd, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    return Path(path)


def read_peft(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    path = Path(path)
    cfg_file, st_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    for f in (cfg_file, st_file):
        if not f.exists():
            raise FileNotFoundError(f"{f}: missing (not a PEFT adapter directory)")
    cfg = json.loads(cfg_file.read_text())
    with safe_open(str(st_file), framework="pt") as sf:
        sd = {k: sf.get_tensor(k) for k in sf.keys()}
    return cfg, sd


def load_peft(adapters: LoraAdapters, path: str | Path) -> LoraAdapters:
    """Loads a PEFT adapter written by ``save_peft`` in either layout (or by PEFT for the same
    targets)."""
    cfg, sd = read_peft(path)
    if int(cfg.get("r", -1)) != adapters.rank or float(cfg.get("lora_alpha", -1)) != adapters.alpha:
        raise LoraError(f"{path}/adapter_config.json: r={cfg.get('r')}, lora_alpha={cfg.get('lora_alpha')}; "
                        f"the lora config has rank={adapters.rank}, alpha={adapters.alpha}")
    where = str(Path(path) / "adapter_model.safetensors")
    if any(".experts.0." in k for k in sd) or is_shared_outer_file(sd):
        adapters.load_per_expert_state_dict(sd, where)  # the per-expert or SGLang's shared-outer form
    else:
        adapters.load_peft_state_dict(sd, where)
    return adapters


def build_lora(model: MoEForCausalLM, cfg) -> LoraAdapters:
    """Adapters for ``cfg`` (the ``lora:`` config section), seeded."""
    return LoraAdapters(model, cfg.rank, cfg.alpha, cfg.targets, cfg.layers, cfg.dropout,
                        cfg.experts_shared_outer).init_weights(cfg.seed)


@contextlib.contextmanager
def swapped_parameters(weights: Iterator[tuple[nn.Module, str, torch.Tensor]]):
    """Puts each (module, parameter name, tensor) in place of that parameter for the block and
    restores the originals after. Under ``torch.no_grad`` the tensors go in as frozen Parameters,
    so code that looks parameters up by name reads them."""
    swapped = []
    grad = torch.is_grad_enabled()
    try:
        for module, attr, w in list(weights):
            swapped.append((module, attr, module._parameters[attr]))
            module._parameters[attr] = w if grad else nn.Parameter(w, requires_grad=False)
        yield
    finally:
        for module, attr, orig in reversed(swapped):
            module._parameters[attr] = orig


class AdapterSource:
    """The adapter tensors as a weight-sync source (``moe_rl.sync.source`` interface): an
    adapter-only sync sends these, by name, through the same bucketed broadcast."""

    def __init__(self, adapters: LoraAdapters):
        model = adapters.model
        if any(getattr(l.mlp, "ep_size", 1) > 1 for l in model.model.layers):
            raise LoraError("lora.sync=adapter needs train.ep_size=1 (expert adapters are not gathered over EP yet)")
        self.adapters, self.arch = adapters, model.arch
        self.tensors = dict(adapters.hf_tensors())
        self.device = next(iter(self.tensors.values())).device

    def specs(self, wire_dtype: torch.dtype | None = None):
        return [(n, tuple(t.shape), wire_dtype or t.dtype) for n, t in self.tensors.items()]

    def begin(self) -> None:
        pass

    def tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name].detach()

    def cache_key(self):
        return tuple(t.data_ptr() for t in self.tensors.values())


class AdapterServing:
    """Engine side of adapter-only sync: the engine's model serves ``adapters`` in its forward
    (``LoraAdapters.attach``, unmerged), so an update only writes the adapter tensors; the
    base weights are never touched."""

    def __init__(self, model: MoEForCausalLM, rank: int, alpha: float, targets: list[str],
                 layers: list[int] | None = None, shared_outer: bool = False):
        with torch.no_grad():
            self.adapters = LoraAdapters(model, rank, alpha, targets, layers, shared_outer=shared_outer)
        for p in self.adapters.parameters():
            p.requires_grad_(False)
        self.detach = self.adapters.attach()

    def named_tensors(self) -> dict[str, torch.Tensor]:
        return {n: t.data for n, t in self.adapters.hf_tensors()}

    def load_peft(self, path) -> None:
        """All or nothing: a file that fails half-way leaves the adapter that was served."""
        old = {n: t.clone() for n, t in self.named_tensors().items()}
        try:
            load_peft(self.adapters, path)
        except Exception:
            with torch.no_grad():
                for n, t in self.named_tensors().items():
                    t.copy_(old[n])
            raise

    def unload(self) -> None:
        """Back to the base model (B = 0 makes every adapter's rows zero)."""
        with torch.no_grad():
            for p in self.adapters.parameters():
                p.zero_()
