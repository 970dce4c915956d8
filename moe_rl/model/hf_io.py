"""HuggingFace checkpoint I/O and the HF <-> native parameter-name map (every family).

Qwen3-MoE and GLM name experts one tensor each:
``model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight`` (transformers v5 checkpoints may
instead hold stacked ``experts.gate_up_proj`` / ``experts.down_proj``; both load). Natively each
layer's local experts are stacked. gpt-oss names a layer's experts as four stacked tensors
(``experts.gate_up_proj`` [E, H, 2I], ``gate_up_proj_bias``, ``down_proj``, ``down_proj_bias``),
which are the native parameters themselves; under expert parallelism a rank holds rows
[ep_rank * E_local, (ep_rank + 1) * E_local) of each (``stacked_expert_rows``). Its released
checkpoints store ``gate_up_proj`` / ``down_proj`` in MXFP4 (``*_blocks`` + ``*_scales``,
``quantization_config.quant_method: mxfp4``): they load dequantized (``dequantize_mxfp4``), and
what is saved is plain bf16/fp32.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .arch import MoEArch
from .attention import mixer_class
from .transformer import EXPERTS, GATES, MoEForCausalLM

log = logging.getLogger(__name__)

_EXPERT_RE = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED_RE = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.")
# gpt-oss's MXFP4 experts on disk: <stacked name>_blocks / _scales
_MXFP4_RE = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.(?:gate_up_proj|down_proj))_(blocks|scales)$")
# a VLM checkpoint (Qwen3.5's qwen3_5_moe) keeps its text model under model.language_model. and
# its vision tower under model.visual.; multi-token-prediction weights sit under mtp.
TEXT_PREFIX = "model.language_model."
SKIPPED_PREFIXES = {"model.visual.": "the vision tower", "mtp.": "the multi-token-prediction layers"}
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
# kept in fp32 whatever the model's dtype (HF's _keep_in_fp32_modules_strict; SGLang's parameter
# is fp32): a rounded expert-score correction bias chooses other experts
FP32_SUFFIXES = (".e_score_correction_bias",)


def hf_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype tensor ``name`` has (on the wire, in a checkpoint) when the model is ``dtype``."""
    return torch.promote_types(dtype, torch.float32) if name.endswith(FP32_SUFFIXES) else dtype


def expert_name(layer: int, expert: int, proj: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"


def parse_expert_name(name: str) -> tuple[int, int, str] | None:
    """(layer, global expert, proj) for an HF per-expert name, else None."""
    m = _EXPERT_RE.match(name)
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None


def hf_param_specs(arch: MoEArch) -> list[tuple[str, tuple[int, ...]]]:
    """Every HF tensor name with its full (un-sharded) shape, in a fixed canonical order."""
    H = arch.hidden_size
    specs: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (arch.vocab_size, H))]

    def mlp(prefix: str, inter: int) -> list[tuple[str, tuple[int, ...]]]:
        return [(prefix + "gate_proj.weight", (inter, H)), (prefix + "up_proj.weight", (inter, H)),
                (prefix + "down_proj.weight", (H, inter))]

    for i in range(arch.num_hidden_layers):
        p = f"model.layers.{i}."
        specs.append((p + "input_layernorm.weight", (H,)))
        mixer = mixer_class(arch, i)
        specs += [(f"{p}{mixer.hf_name}.{name}", shape) for name, shape in mixer.hf_specs(arch, i)]
        specs.append((p + "post_attention_layernorm.weight", (H,)))
        if arch.is_moe_layer(i):
            gate = GATES[arch.router]
            specs += [(f"{p}mlp.{gate.hf_name}.{name}", shape) for name, shape in gate.hf_specs(arch)]
            specs += [(f"{p}mlp.experts.{name}", shape) for name, shape in EXPERTS[arch.family.experts].hf_specs(arch)]
            if arch.n_shared_experts:
                specs += mlp(p + "mlp.shared_experts.", arch.moe_intermediate_size * arch.n_shared_experts)
            if arch.shared_expert_intermediate_size:  # Qwen3-Next / Qwen3.5: one gated shared expert
                specs += mlp(p + "mlp.shared_expert.", arch.shared_expert_intermediate_size)
                specs.append((p + "mlp.shared_expert_gate.weight", (1, H)))
        else:
            specs += mlp(p + "mlp.", arch.intermediate_size)
    specs.append(("model.norm.weight", (H,)))
    if not arch.tie_word_embeddings:
        specs.append(("lm_head.weight", (arch.vocab_size, H)))
    return specs


def stacked_expert_rows(name: str, arch: MoEArch) -> int | None:
    """For an HF tensor that stacks a layer's experts along dim 0 (gpt-oss's ``experts.*``),
    the number of experts (its rows, which EP ranks hold in equal consecutive blocks); else None."""
    if ".mlp.experts." not in name or parse_expert_name(name) is not None or EXPERTS[arch.family.experts].per_expert_hf:
        return None
    return arch.num_experts


def expert_owner(name: str, arch: MoEArch, ep_size: int) -> int | None:
    """EP rank that holds an HF expert tensor, or None for a tensor every rank holds (a stacked
    expert tensor, ``stacked_expert_rows``, is held in parts by every rank: None too)."""
    parsed = parse_expert_name(name)
    if parsed is None:
        return None
    return parsed[1] // (arch.num_experts // ep_size)


def local_hf_tensor(model: MoEForCausalLM, name: str) -> torch.Tensor | None:
    """A view of this rank's tensor for an HF name; None if another EP rank holds it (of a
    stacked expert tensor, this rank's rows)."""
    parsed = parse_expert_name(name)
    if parsed is None:
        if name == "lm_head.weight" and model.arch.tie_word_embeddings:
            return model.lm_head.weight
        if name.endswith(FP32_SUFFIXES):
            return model.get_buffer(name)
        return model.get_parameter(name)
    layer, expert, proj = parsed
    moe = model.model.layers[layer].mlp
    lo = moe.ep_rank * moe.num_local
    if not lo <= expert < lo + moe.num_local:
        return None
    return getattr(moe.experts, proj)[expert - lo]


def iter_local_hf_tensors(model: MoEForCausalLM) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, view) for every tensor this rank holds, in canonical order."""
    for name, _ in hf_param_specs(model.arch):
        t = local_hf_tensor(model, name)
        if t is not None:
            yield name, t


def _stacked_expert_names(model: MoEForCausalLM, pname: str) -> list[str]:
    """HF names of the experts a stacked parameter (``...mlp.experts.<proj>``) holds, in order."""
    layer, proj = int(pname.split(".")[2]), pname.rsplit(".", 1)[1]
    moe = model.model.layers[layer].mlp
    lo = moe.ep_rank * moe.num_local
    return [expert_name(layer, lo + e, proj) for e in range(moe.num_local)]


def _per_expert_stack(model: MoEForCausalLM, pname: str) -> bool:
    """A stacked expert parameter whose experts HF names one tensor each (Qwen3-MoE, GLM)."""
    return ".experts." in pname and getattr(model.get_submodule(pname.rsplit(".", 1)[0]), "per_expert_hf", False)


def hf_named_tensors(model: MoEForCausalLM) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's parameters and the buffers that are HF tensors (the correction bias)."""
    yield from model.named_parameters()
    yield from ((n, b) for n, b in model.named_buffers() if n.endswith(FP32_SUFFIXES))


def _binding_anchors(model: MoEForCausalLM) -> list[str]:
    """Per parameter, the HF names that pin where its views lie (first and last expert)."""
    names = []
    for pname, _ in hf_named_tensors(model):
        if _per_expert_stack(model, pname):
            experts = _stacked_expert_names(model, pname)
            names += [experts[0], experts[-1]]
        else:
            names.append(pname)
    return names


def bind_hf_views(model: MoEForCausalLM, views: dict[str, torch.Tensor],
                  dense: bool = False) -> dict[str, torch.Tensor] | None:
    """Re-points every parameter of ``model`` at the memory of ``views`` (HF name -> tensor,
    e.g. views into weight-sync buckets), so those buffers become the model's storage without a
    copy. A stacked expert parameter becomes a strided view over its experts' HF tensors, which
    needs them in one buffer at a uniform stride (one layer's experts in one bucket, in HF
    order). All or nothing: returns None, changing nothing, if any parameter cannot be bound;
    else the new (HF name -> live tensor) map, which is ``views`` itself. ``dense``: every
    parameter must stay non-overlapping and dense, so a stack binds only over experts that lie
    back to back (fused AdamW takes no other layout; HF order interleaves gate, up and down).

    The binding of a given set of buffers is remembered (a few sets: weight sync alternates
    two), so binding thousands of small experts again costs one look-up per parameter."""
    cache = model.__dict__.setdefault("_hf_bind_cache", {})
    anchors = model.__dict__.get("_hf_bind_anchors")
    if anchors is None:
        anchors = model.__dict__["_hf_bind_anchors"] = _binding_anchors(model)
    if all(n in views for n in anchors):
        key = (dense, *(views[n].data_ptr() for n in anchors))
        plan = cache.get(key)
        if plan is not None:
            for p, new in plan:
                p.data = new
            return views
    else:
        return None
    plan = []
    for pname, p in hf_named_tensors(model):
        if _per_expert_stack(model, pname):
            vs = [views.get(n) for n in _stacked_expert_names(model, pname)]
            if any(v is None or v.dtype != p.dtype or tuple(v.shape) != tuple(p.shape[1:]) or not v.is_contiguous()
                   for v in vs):
                return None
            storage = vs[0].untyped_storage().data_ptr()
            step = vs[1].storage_offset() - vs[0].storage_offset() if len(vs) > 1 else vs[0].numel()
            if any(v.untyped_storage().data_ptr() != storage or v.storage_offset() != vs[0].storage_offset() + e * step
                   for e, v in enumerate(vs)) or step < vs[0].numel() or (dense and step != vs[0].numel()):
                return None
            new = vs[0].as_strided(tuple(p.shape), (step,) + tuple(vs[0].stride()), vs[0].storage_offset())
        else:
            new = views.get(pname)
            if new is None or new.dtype != p.dtype or tuple(new.shape) != tuple(p.shape):
                return None
        plan.append((p, new))
    for p, new in plan:
        p.data = new
    if len(cache) >= 4:
        cache.clear()
    cache[key] = plan
    # each given view now is the live tensor of its name (an expert's is row e of its stack)
    return views


# --- reading ----------------------------------------------------------------------------
def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no model.safetensors, index or *.safetensors files")
    return files


def load_hf_weights(model: MoEForCausalLM, path: str | Path) -> MoEForCausalLM:
    """Loads an HF safetensors checkpoint into ``model`` (this rank's experts only). MXFP4
    experts (``*_blocks`` + ``*_scales``, gpt-oss's format) are dequantized into the model's
    dtype, as are block-FP8 weights (``weight_scale_inv`` beside them, DeepSeek-V3's format);
    layers past ``num_hidden_layers`` (a multi-token-prediction block) are skipped, with a warning."""
    path = Path(path)
    specs = {n for n, _ in hf_param_specs(model.arch)}
    missing = set(specs)
    mxfp4: dict[str, dict[str, tuple[torch.Tensor, Path]]] = {}  # name -> {"blocks"/"scales": (rows, file)}
    files = _checkpoint_files(path)
    scales = _fp8_scales(files)
    block = _fp8_block(path) if scales else None
    skipped: set[int] = set()
    skipped_parts: dict[str, int] = {}
    with torch.no_grad():
        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                for stored in sf.keys():
                    why = next((w for p, w in SKIPPED_PREFIXES.items() if stored.startswith(p)), None)
                    if why is not None:  # not modelled: the text model is what moe-rl trains
                        skipped_parts[why] = skipped_parts.get(why, 0) + 1
                        continue
                    key = "model." + stored[len(TEXT_PREFIX):] if stored.startswith(TEXT_PREFIX) else stored
                    in_layer = _LAYER_RE.match(key)
                    if in_layer and int(in_layer.group(1)) >= model.arch.num_hidden_layers:
                        skipped.add(int(in_layer.group(1)))  # a multi-token-prediction layer: not modelled
                        continue
                    if key.endswith(FP8_SCALE_SUFFIX):
                        continue  # read with its weight
                    if key not in specs and 0 in sf.get_slice(stored).get_shape():
                        continue  # HF's GLM with n_shared_experts=0 saves a zero-width shared MLP
                    quant = _MXFP4_RE.match(key)
                    if quant and quant.group(1) in specs:
                        name, part = quant.group(1), quant.group(2)
                        mxfp4.setdefault(name, {})[part] = (_local_rows(model, name, sf.get_slice(key)), f)
                        if len(mxfp4[name]) == 2:
                            _assign(model, name, dequantize_mxfp4(**{k: t for k, (t, _) in mxfp4[name].items()},
                                                                 name=name, where=f), missing, f, local=True)
                        continue
                    if key in specs and stacked_expert_rows(key, model.arch) is not None:
                        rows = sf.get_slice(key)
                        if rows.get_shape()[0] != model.arch.num_experts:
                            raise ValueError(f"{f}: {key} has shape {tuple(rows.get_shape())}, the model expects "
                                             f"{model.arch.num_experts} experts in dim 0")
                        _assign(model, key, _local_rows(model, key, rows), missing, f, local=True)
                        continue
                    stacked = _STACKED_RE.match(key)
                    if stacked and key not in specs:  # transformers v5 layout: [E, 2I, H] / [E, H, I]
                        layer, kind = int(stacked.group(1)), stacked.group(2)
                        full = sf.get_tensor(stored)
                        for e in range(full.shape[0]):
                            parts = full[e].chunk(2, dim=0) if kind == "gate_up_proj" else (full[e],)
                            projs = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
                            for proj, t in zip(projs, parts):
                                _assign(model, expert_name(layer, e, proj), t, missing, f)
                        continue
                    if key == "lm_head.weight" and model.arch.tie_word_embeddings:
                        continue
                    if parse_expert_name(key) and local_hf_tensor(model, key) is None:
                        missing.discard(key)  # another EP rank's expert
                        continue
                    tensor = sf.get_tensor(stored)
                    if tensor.dtype in FP8_DTYPES:
                        tensor = _dequantize_fp8(stored, tensor, scales, block, f)
                    _assign(model, key, tensor, missing, f)
    half = {n: parts for n, parts in mxfp4.items() if len(parts) == 1}
    if half:
        name, parts = next(iter(half.items()))
        (have, (_, f)), = parts.items()
        lacks = "scales" if have == "blocks" else "blocks"
        raise KeyError(f"{f}: {name}_{have} has no {name}_{lacks} in {path} (an MXFP4 tensor needs both)")
    if skipped:
        log.warning("%s: skipped the multi-token-prediction layer %s (layers past num_hidden_layers=%d are not "
                    "modelled; moe-rl trains and serves without MTP)", path, ", ".join(map(str, sorted(skipped))),
                    model.arch.num_hidden_layers)
    for why, n in skipped_parts.items():
        log.warning("%s: skipped %d tensors of %s (not loaded: moe-rl trains the text model)", path, n, why)
    if missing:
        raise KeyError(f"{path}: checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    return model


# --- block-FP8 checkpoints (DeepSeek-V3's weight + weight_scale_inv) ----------------------------
FP8_SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


def _fp8_scales(files: list[Path]) -> dict[str, Path]:
    """name of each FP8 weight's scale -> the file that holds it."""
    out = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            out.update({k: f for k in sf.keys() if k.endswith(FP8_SCALE_SUFFIX)})
    return out


def _fp8_block(path: Path) -> tuple[int, int]:
    quant = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
    size = quant.get("weight_block_size") or [128, 128]
    return int(size[0]), int(size[1])


def _dequantize_fp8(name: str, w: torch.Tensor, scales: dict[str, Path], block, f) -> torch.Tensor:
    """w [rows, cols] in FP8 times its per-block scale (``weight_scale_inv`` [ceil(rows / b0),
    ceil(cols / b1)], the factor that turns the stored value back into the weight)."""
    sname = name + FP8_SCALE_SUFFIX
    if sname not in scales:
        raise ValueError(f"{f}: {name} is {w.dtype} without a {sname}; only block-FP8 checkpoints with "
                         "weight_scale_inv are dequantized on load")
    with safe_open(str(scales[sname]), framework="pt") as sf:
        scale = sf.get_tensor(sname).float()
    rows, cols = w.shape
    b0, b1 = block
    if tuple(scale.shape) != (-(-rows // b0), -(-cols // b1)):
        raise ValueError(f"{f}: {sname} has shape {tuple(scale.shape)}, expected blocks of {b0}x{b1} over "
                         f"{name} {tuple(w.shape)}")
    full = scale.repeat_interleave(b0, 0)[:rows].repeat_interleave(b1, 1)[:, :cols]
    return w.float() * full


def _local_rows(model: MoEForCausalLM, name: str, rows) -> torch.Tensor:
    """This EP rank's experts of a stacked expert tensor (a safetensors slice: only they are read)."""
    moe = model.model.layers[int(name.split(".")[2])].mlp
    lo = moe.ep_rank * moe.num_local
    return rows[lo : lo + moe.num_local]


def _assign(model, name, tensor, missing, f, local=False):
    """Copies a checkpoint tensor into the model; ``local``: already this rank's rows of a
    stacked expert tensor."""
    try:
        dst = local_hf_tensor(model, name)
    except AttributeError:
        raise KeyError(f"{f}: unexpected tensor {name!r} for a {model.arch.model_type} model of this config") from None
    if dst is None:
        missing.discard(name)
        return
    if tuple(dst.shape) != tuple(tensor.shape):
        want = tuple(dst.shape)
        if local:  # name the full shapes
            want, got = (model.arch.num_experts,) + want[1:], (model.arch.num_experts,) + tuple(tensor.shape[1:])
        else:
            got = tuple(tensor.shape)
        raise ValueError(f"{f}: {name} has shape {got}, the model expects {want}")
    dst.copy_(tensor)
    missing.discard(name)


# E2M1 (FP4) code -> value: sign bit 3, then 2 exponent bits and 1 mantissa bit
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, *, name: str = "tensor", where="",
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """gpt-oss's MXFP4 experts as released -> HF's [E, in, out] layout.

    ``blocks`` uint8 [E, out, G, 16]: each byte two FP4 (E2M1) codes, the low nibble the even
    column; a group of 32 columns shares one ``scales`` byte (uint8 [E, out, G], E8M0: the
    value 2^(s - 127)). The dequantized [E, out, G * 32] is transposed to [E, G * 32, out]
    (``gate_up_proj`` [E, H, 2I], ``down_proj`` [E, I, H]). One expert at a time, so the
    temporaries stay one expert's size. A tensor that does not fit is an error naming it."""
    at = f"{where}: " if where else ""
    if blocks.dtype != torch.uint8 or blocks.dim() != 4 or blocks.shape[-1] != 16:
        raise ValueError(f"{at}{name}_blocks: expected uint8 [experts, rows, groups, 16] (32 FP4 values per group), "
                         f"got {blocks.dtype} {tuple(blocks.shape)}")
    if scales.dtype != torch.uint8 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(f"{at}{name}_scales: expected uint8 {tuple(blocks.shape[:-1])} (one E8M0 scale per group of "
                         f"{name}_blocks {tuple(blocks.shape)}), got {scales.dtype} {tuple(scales.shape)}")
    E, R, G, _ = blocks.shape
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32, device=blocks.device)
    out = torch.empty(E, G * 32, R, dtype=dtype, device=blocks.device)
    for e in range(E):  # loading, not a hot path: bounds the temporaries
        codes = torch.stack((blocks[e] & 0x0F, blocks[e] >> 4), dim=-1).view(R, G, 32)
        values = torch.ldexp(lut[codes.int()], scales[e].to(torch.int32)[..., None] - 127)
        out[e] = values.view(R, G * 32).t()
    return out
def load_hf(path: str | Path, dtype: torch.dtype | None = None, ep_group=None) -> MoEForCausalLM:
    """Builds a model from an HF directory (config.json + safetensors) of a supported family
    (``model_type``: see ``moe_rl.model.arch.FAMILIES``)."""
    arch = MoEArch.from_hf_dir(path)
    if dtype is None:
        return load_hf_weights(MoEForCausalLM(arch, ep_group=ep_group), path)
    with torch.device("meta"):  # allocated in ``dtype`` at once: no float32 copy of a large model
        model = MoEForCausalLM(arch, ep_group=ep_group).to(dtype)
    return load_hf_weights(model.to_empty(device="cpu"), path)


# --- writing ----------------------------------------------------------------------------
@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yields a temp directory beside ``path`` to fill; renames it into place when the block
    ends (replacing an old ``path``), removes it when the block raises: a reader never sees a
    half-written checkpoint or adapter."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        yield tmp
        if path.exists():
            old = path.with_name(path.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def hf_state_dict(model: MoEForCausalLM) -> dict[str, torch.Tensor]:
    """Full HF state dict of an EP=1 model (contiguous copies, safe to serialise)."""
    if model.model.layers and any(getattr(l.mlp, "ep_size", 1) > 1 for l in model.model.layers):
        raise ValueError("hf_state_dict needs the whole model; gather expert shards first (EP > 1)")
    return {n: t.detach().contiguous().clone() for n, t in iter_local_hf_tensors(model)}


def save_hf(state: dict[str, torch.Tensor] | MoEForCausalLM, path: str | Path, arch: MoEArch | None = None) -> Path:
    """Writes config.json + model.safetensors atomically (a temp directory renamed into place).

    ``state`` is an EP=1 model or a full HF state dict (then ``arch`` is required)."""
    if isinstance(state, MoEForCausalLM):
        arch = arch or state.arch
        state = hf_state_dict(state)
    if arch is None:
        raise ValueError("save_hf: arch is required when saving a state dict")
    dtypes = {t.dtype for n, t in state.items() if not n.endswith(FP32_SUFFIXES)}
    cfg = arch.to_hf_dict()
    cfg["dtype"] = str(next(iter(dtypes))).replace("torch.", "") if len(dtypes) == 1 else "float32"
    with atomic_dir(path) as tmp:
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return Path(path)
