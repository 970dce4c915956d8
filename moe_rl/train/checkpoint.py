"""Checkpoints: HF weights (loadable by transformers) + trainer state for an exact resume.

``hf/`` is a complete model directory (DESIGN.md contract 6): config.json and
model.safetensors, plus the tokenizer files and chat template of model.tokenizer_path (else
model.path, else the task's data.task_args.tokenizer_path) and generation_config.json (from
model.path, else the tokenizer's directory); config.json keeps model.path's token ids
(bos/eos/pad). transformers, ``moe-rl serve DIR`` and SGLang load it as it is.

Layout: ``<output_dir>/checkpoints/step_<N>/{hf/, adapter/ (LoRA, PEFT format), trainer_rank<r>.pt, rollout.pt}`` and a
``latest`` file naming the newest complete one, written last (atomically), so a crash while
saving leaves the previous checkpoint in charge. A write that fails (a full disk) removes the
partial checkpoint and raises CheckpointWriteError, which names the intact one.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from moe_rl import faults
from moe_rl.rundir import latest_step
from moe_rl.model import hf_param_specs, save_hf

log = logging.getLogger(__name__)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja", "chat_template.json")
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def model_file_sources(cfg) -> tuple[Path | None, Path | None]:
    """(model.path, the tokenizer's directory) a checkpoint's hf/ takes its other files from."""
    model = Path(cfg.model.path) if cfg.model.path else None
    tok = cfg.model.tokenizer_path or cfg.model.path or cfg.data.task_args.get("tokenizer_path")
    return model, Path(tok) if tok else None


def copy_model_files(dst: Path, model_path: Path | None, tokenizer_path: Path | None) -> list[str]:
    """Completes the HF directory ``dst`` (config.json and weights already there): tokenizer
    files and chat template from ``tokenizer_path``, generation_config.json from
    ``model_path`` else ``tokenizer_path``, the token ids of ``model_path``'s config.json.
    Returns the names of the files copied."""
    copied = []
    if tokenizer_path is not None:
        for name in TOKENIZER_FILES:
            if (tokenizer_path / name).is_file():
                shutil.copyfile(tokenizer_path / name, dst / name)
                copied.append(name)
    for src in (model_path, tokenizer_path):
        if src is not None and (src / "generation_config.json").is_file():
            shutil.copyfile(src / "generation_config.json", dst / "generation_config.json")
            copied.append("generation_config.json")
            break
    if model_path is not None and (model_path / "config.json").is_file():
        ids = {k: v for k, v in json.loads((model_path / "config.json").read_text()).items() if k in _TOKEN_IDS}
        if ids:
            cfg = json.loads((dst / "config.json").read_text())
            (dst / "config.json").write_text(json.dumps({**cfg, **ids}, indent=2))
    return copied


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; the previous one is intact."""


def _atomic_save(write, path: Path) -> None:
    """``write(tmp)`` then rename ``tmp`` to ``path``; a failed write leaves no temp file."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        faults.point("checkpoint.write")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _atomic_torch_save(obj, path: Path) -> None:
    _atomic_save(lambda tmp: torch.save(obj, tmp), path)


def gather_hf_state(backend, groups) -> dict[str, torch.Tensor] | None:
    """The full HF state dict on trainer rank 0 (None elsewhere). Experts held by other EP
    ranks are broadcast from their owner inside EP block 0, one tensor at a time."""
    ep_group = groups.ep if groups is not None and backend.ep_size > 1 else None
    local = dict(backend.hf_tensors())
    if ep_group is None:
        return {n: t.detach().cpu().clone() for n, t in local.items()}
    if groups.dp_rank != 0:
        return None
    ep_rank = dist.get_rank(ep_group)
    out = {}
    for name, shape in hf_param_specs(backend.arch):
        if name in local and backend.owner_ep_rank(name) in (None, ep_rank):
            t = local[name].detach().contiguous()
        else:
            t = torch.empty(shape, dtype=next(iter(local.values())).dtype)
        owner = backend.owner_ep_rank(name)
        if owner is not None:
            dist.broadcast(t, group=ep_group, group_src=owner)
        if ep_rank == 0:
            out[name] = t.cpu().clone()
    return out if ep_rank == 0 else None


def save_checkpoint(run_dir: Path, step: int, backend, groups, trainer_state: dict, rollout_state: dict | None,
                    keep: int) -> Path:
    """Collective over the trainer pool. ``rollout_state`` is given on trainer rank 0.
    CheckpointWriteError (naming the cause and the intact checkpoint) if a write fails."""
    root = Path(run_dir) / "checkpoints"
    ckpt = root / f"step_{step}"
    rank = groups.rank if groups is not None else 0
    state = gather_hf_state(backend, groups)
    try:
        if rank == 0:
            if ckpt.exists() and ckpt.name != latest_step(run_dir):
                shutil.rmtree(ckpt)  # a partial one, left by a run that crashed while writing it
            ckpt.mkdir(parents=True, exist_ok=True)
            save_hf(state, ckpt / "hf", arch=backend.arch)  # with LoRA: the merged model
            copy_model_files(ckpt / "hf", *model_file_sources(backend.cfg))  # tokenizer, template, generation config
            faults.point("checkpoint.write")
            if getattr(backend, "lora", None) is not None:
                if backend.ep_size == 1:
                    from moe_rl.model.lora import save_peft

                    save_peft(backend.lora, ckpt / "adapter", base_model=backend.cfg.model.path)
                else:
                    log.warning("checkpoint %s: the PEFT adapter file needs EP=1; the adapters are in the trainer "
                                "state only", ckpt)
            _atomic_torch_save(rollout_state, ckpt / "rollout.pt")
        _barrier(groups)
        _atomic_torch_save({"backend": backend.state_dict(), **trainer_state}, ckpt / f"trainer_rank{rank}.pt")
        _barrier(groups)
        if rank == 0:
            _atomic_save(lambda tmp: tmp.write_text(ckpt.name), root / "latest")
    except OSError as e:
        previous = latest_step(run_dir)
        if rank == 0 and previous != ckpt.name:
            shutil.rmtree(ckpt, ignore_errors=True)
        where = (f"{root / previous} is intact (`latest` names it) and resume=true continues from it" if previous
                 else "there is no earlier checkpoint")
        raise CheckpointWriteError(f"checkpoint {ckpt} could not be written: {e}; {where}") from e
    if rank == 0:
        steps = sorted((p for p in root.glob("step_*") if p != ckpt and _step_of(p) is not None), key=_step_of)
        newer = [p for p in steps if _step_of(p) > step]  # partial ones of a run that crashed after this step
        older = [p for p in steps if _step_of(p) < step]
        for p in newer + older[: max(0, len(older) - (keep - 1))]:
            shutil.rmtree(p, ignore_errors=True)
        log.info("checkpoint saved: %s", ckpt)
    return ckpt


def _step_of(path: Path) -> int | None:
    m = re.fullmatch(r"step_(\d+)", path.name)
    return int(m.group(1)) if m else None


def latest_checkpoint(run_dir: Path) -> Path | None:
    name = latest_step(run_dir)
    if name is None:
        return None
    ckpt = Path(run_dir) / "checkpoints" / name
    if not ckpt.exists():
        raise FileNotFoundError(f"{ckpt.parent / 'latest'} names {name}, which is missing")
    return ckpt


def load_checkpoint(ckpt: Path, backend, rank: int) -> tuple[dict, dict | None]:
    """Restores the backend; returns (trainer_state, rollout_state or None off rank 0)."""
    path = ckpt / f"trainer_rank{rank}.pt"
    if not path.exists():
        raise FileNotFoundError(f"{path}: missing (was the checkpoint written with a different pools.trainer?)")
    state = torch.load(path, weights_only=False)
    backend.load_state_dict(state.pop("backend"))
    rollout = torch.load(ckpt / "rollout.pt", weights_only=False) if rank == 0 else None
    return state, rollout


def _barrier(groups) -> None:
    """The trainer ranks wait for rank 0's writes: on the wait group (moe_rl.dist), as a large
    model's files may take longer than a collective's timeout."""
    if groups is not None and len(groups.layout.trainer_ranks) > 1:
        dist.barrier(group=groups.trainer_wait or groups.trainer)
