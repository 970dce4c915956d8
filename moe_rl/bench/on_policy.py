"""``moe-rl bench on-policy [--json]``: what ``true_on_policy`` costs and what it saves.

One process holds an embedded engine and a trainer (one rank, R3 replay on) and runs real
steps as ``moe-rl train`` does, without the processes: the engine samples a batch
(``rollout.prompts_per_step`` x ``rollout.group_size`` requests submitted together, continuous
batching), the trainer trains on it at staleness 0, the weights go back to the engine. Each
round runs every variant once, in turn, so that a drift of the machine's speed hits them alike:

* ``off``: torch's kernels (the default);
* ``on``: ``true_on_policy=true``: the exact kernels on both sides; with
  ``train.minibatches`` > 1 (``--minibatches``) the minibatches after the first take the
  engine's log-probs as their proximal ones, so no proximal forward is taken;
* ``on_forward``: as ``on`` with the proximal forwards taken all the same: ``on`` against it
  is what skipping them saves.

Reported per variant (``variants``): the median over ``--rounds`` rounds (after one warm-up round) of the
engine's output tokens per second over a rollout and of the trainer's step time, each by the
wall clock and by the process's CPU time (with ``--threads 1`` the engine thread computes the
rollout and the calling thread the step, one at a time: CPU time is the work done, which other
processes on a shared machine barely move), and the steps' largest ``mismatch_k3``. In
``summary`` the ratios by CPU time (``wall_*``: by the wall clock): ``engine_time_on_vs_off``
(the off engine's tokens/s over the on one's: > 1 = slower with the key), ``train_step_*_vs_off``,
``skip_saving`` (1 - on / on_forward step time). The check (exit 1 when it fails): ``on`` reads mismatch_k3 == 0 and
ratio 1.0 at every step, ``off`` reads mismatch_k3 > 0 at some step.

The harness (``make_trainer``, ``rollout``, ``sync``) is also what tests/train compares the
trainer's log-probs with the engine's through.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from .replay import _cpu_name

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def make_trainer(cfg, replay_dir, groups=None):
    """A trainer of ``cfg`` without engines (no ``setup``), reading the routing that ``rollout``
    appends to ``replay_dir``; one rank unless ``groups`` says otherwise."""
    from ..dist import Groups, Layout
    from ..replay import ReplayLog
    from ..train.loop import Trainer

    if groups is None:
        layout = Layout(world_size=1, trainer_ranks=[0], rollout_ranks=[], ep_size=1)
        groups = Groups(layout=layout, rank=0, role="trainer")
    t = Trainer(cfg, groups)
    arch = t.arch
    t.writer = ReplayLog(replay_dir, len(arch.moe_layers), arch.num_experts_per_tok, arch.num_experts)
    t.reader = ReplayLog(replay_dir, mode="r")
    return t


def rollout(engine, t, seed: int = 0) -> list[dict]:
    """``rollout.prompts_per_step`` x ``group_size`` seeded samples from ``engine`` (a started
    embedded engine) as the loop's batch dicts, tagged with the trainer's version (the weights
    the engine serves), their routing appended to the trainer's replay log; advantages from a
    fixed draw. Prompts of 3 to 13 tokens."""
    from ..engine.protocol import GenerateRequest
    from ..replay import RoutingSpec, record_from_responses

    cfg, arch = t.cfg, t.arch
    g = torch.Generator().manual_seed(seed)
    bodies = []
    for i in range(cfg.rollout.prompts_per_step):
        prompt = torch.randint(0, arch.vocab_size, (3 + 5 * i % 11,), generator=g).tolist()
        for _ in range(cfg.rollout.group_size):
            bodies.append({"input_ids": prompt, "return_logprob": True, "return_routed_experts": True,
                           "sampling_params": {"temperature": cfg.rollout.temperature,
                                               "max_new_tokens": cfg.rollout.max_new_tokens, "ignore_eos": True,
                                               "sampling_seed": 1000 * seed + len(bodies)}})
    reqs = [GenerateRequest.parse(b, vocab_size=arch.vocab_size, max_context=engine.max_context) for b in bodies]

    async def run():
        return await asyncio.gather(*(engine.generate(r) for r in reqs))

    outs = asyncio.run(run())
    spec = RoutingSpec(arch.num_hidden_layers, arch.num_experts_per_tok, arch.num_experts,
                       tuple(arch.mlp_only_layers), arch.decoder_sparse_step, arch.first_k_dense_replace)
    adv = torch.randn(len(bodies), generator=g).tolist()
    batch = []
    for k, (body, out) in enumerate(zip(bodies, outs)):
        uid = f"s{seed}-{k}"
        resp = out["output_ids"]
        rec = record_from_responses([out["meta_info"]], spec, num_tokens=len(body["input_ids"]) + len(resp))
        t.writer.append(uid, rec, [t.version])
        batch.append(dict(uid=uid, group_id=k // cfg.rollout.group_size, prompt_ids=body["input_ids"],
                          response_ids=resp, versions=[t.version] * len(resp), advantage=adv[k], has_routing=True,
                          behaviour_logprobs=[lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]],
                          loss_mask=None))
    t.writer.flush()
    return batch


def sync(t, engine) -> None:
    """The trainer's weights into the engine, as a weight update commits them: the adapter
    tensors alone under lora.sync=adapter, else every HF tensor; the trainer's version + 1."""
    from ..model import local_hf_tensor

    with torch.no_grad(), engine.model_lock:
        if t.cfg.lora.enabled:
            src = t.backend.hf_source()
            dst = engine.adapter.named_tensors()
            for name in src.tensors:
                dst[name].copy_(src.tensor(name))
        else:
            for name, tensor in t.backend.hf_tensors():
                local_hf_tensor(engine.model, name).copy_(tensor)
    t.version += 1


VARIANTS = {"off": (False, True), "on": (True, True), "on_forward": (True, False)}  # (key, skip allowed)


class _Run:
    """One variant's engine and trainer, kept across rounds (the weights train on)."""

    def __init__(self, cfg, tmp: Path, skip: bool):
        from ..engine.server import build_engine

        self.engine = build_engine(cfg).start()
        self.t = make_trainer(cfg, tmp / "routing")
        self.t.exact_rollouts = self.t.exact_rollouts and skip
        self.seed = 0

    def step(self) -> dict:
        t0, c0 = time.perf_counter(), time.process_time()
        batch = rollout(self.engine, self.t, seed=self.seed)
        t1, c1 = time.perf_counter(), time.process_time()
        metrics = self.t.train_step(batch)
        t2, c2 = time.perf_counter(), time.process_time()
        sync(self.t, self.engine)
        self.seed += 1
        tokens = sum(len(s["response_ids"]) for s in batch)
        return {"tokens_per_s": tokens / (t1 - t0), "step_s": t2 - t1,
                "tokens_per_cpu_s": tokens / (c1 - c0), "step_cpu_s": c2 - c1,
                "mismatch_k3": metrics["mismatch_k3"], "max_ratio": metrics["mismatch_max_ratio"],
                "skipped": metrics.get("proximal_forwards_skipped", 0)}


def measure(config: str, overrides: list[str], rounds: int, minibatches: int) -> dict:
    from ..config import load_config

    out = {}
    with tempfile.TemporaryDirectory(prefix="moe-rl-bench-on-policy-") as tmp:
        runs = {}
        for name, (key, skip) in VARIANTS.items():
            cfg = load_config(config, [*overrides, f"train.minibatches={minibatches}", "algo.ratio_anchor=proximal",
                                       f"true_on_policy={str(key).lower()}", f"output_dir={tmp}/{name}"])
            runs[name] = _Run(cfg, Path(tmp) / name, skip)
        try:
            rows = {name: [] for name in runs}
            for r in range(rounds + 1):
                for name, run in runs.items():
                    row = run.step()
                    if r:  # round 0 warms up
                        rows[name].append(row)
        finally:
            for run in runs.values():
                run.engine.stop()
    for name, rs in rows.items():
        out[name] = {
            "engine_tokens_per_s": round(statistics.median(x["tokens_per_s"] for x in rs), 1),
            "train_step_s": round(statistics.median(x["step_s"] for x in rs), 4),
            "engine_tokens_per_cpu_s": round(statistics.median(x["tokens_per_cpu_s"] for x in rs), 1),
            "train_step_cpu_s": round(statistics.median(x["step_cpu_s"] for x in rs), 4),
            "mismatch_k3_max": max(x["mismatch_k3"] for x in rs),
            "max_ratio_max": max(x["max_ratio"] for x in rs),
            "proximal_forwards_skipped_per_step": statistics.median(x["skipped"] for x in rs),
        }
    on, off, fwd = out["on"], out["off"], out["on_forward"]
    summary = {
        "engine_time_on_vs_off": round(off["engine_tokens_per_cpu_s"] / on["engine_tokens_per_cpu_s"], 3),
        "train_step_on_vs_off": round(on["train_step_cpu_s"] / off["train_step_cpu_s"], 3),
        "train_step_on_forward_vs_off": round(fwd["train_step_cpu_s"] / off["train_step_cpu_s"], 3),
        "skip_saving": round(1 - on["train_step_cpu_s"] / fwd["train_step_cpu_s"], 3),
        "wall_engine_time_on_vs_off": round(off["engine_tokens_per_s"] / on["engine_tokens_per_s"], 3),
        "wall_train_step_on_vs_off": round(on["train_step_s"] / off["train_step_s"], 3),
        "exact": all(x["mismatch_k3"] == 0.0 and x["max_ratio"] == 1.0 for x in rows["on"] + rows["on_forward"]),
        "off_mismatch_live": any(x["mismatch_k3"] > 0.0 for x in rows["off"]),
    }
    return {"variants": out, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="moe-rl bench on-policy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="key.sub=value config overrides (every variant)")
    ap.add_argument("--config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds (one step of every variant each)")
    ap.add_argument("--minibatches", type=int, default=2, help="train.minibatches (> 1: proximal forwards)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the trainer and the engine")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    overrides = [f"engine.threads={a.threads}", f"train.threads={a.threads}", *a.overrides]
    out = measure(a.config, overrides, a.rounds, a.minibatches)
    s = out["summary"]
    s["machine"] = {"cpu": _cpu_name(), "cores": os.cpu_count(),
                      "loadavg_1m": round(os.getloadavg()[0], 2), "threads": a.threads, "rounds": a.rounds,
                      "overrides": a.overrides, "minibatches": a.minibatches}
    if a.json:
        print(json.dumps(out))
    else:
        print(f"{'':11s} {'engine tok/s':>12s} {'tok/cpu-s':>10s} {'step s':>8s} {'step cpu-s':>10s} "
              f"{'mismatch_k3 max':>16s} {'skipped/step':>12s}")
        for name in VARIANTS:
            r = out["variants"][name]
            print(f"{name:11s} {r['engine_tokens_per_s']:12.1f} {r['engine_tokens_per_cpu_s']:10.1f} "
                  f"{r['train_step_s']:8.4f} {r['train_step_cpu_s']:10.4f} {r['mismatch_k3_max']:16.3g} "
                  f"{r['proximal_forwards_skipped_per_step']:12g}")
        print(" ".join(f"{k}={s[k]}" for k in ("engine_time_on_vs_off", "train_step_on_vs_off",
                                                "train_step_on_forward_vs_off", "skip_saving")))
        print(f"check: exact={s['exact']} off_mismatch_live={s['off_mismatch_live']} "
              f"(load {s['machine']['loadavg_1m']} on {s['machine']['cores']} cores)")
    ok = s["exact"] and s["off_mismatch_live"]
    if not ok:
        print("check FAILED: the exact variants must read mismatch_k3 0 and ratio 1, the default a mismatch",
              file=sys.stderr)
    return 0 if ok else 1
