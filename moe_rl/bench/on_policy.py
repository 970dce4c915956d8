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
``skip_saving`` (1 - on / on_forward step time). On a GPU (``--device cuda``: the model, the engine's
KV cache and the trainer on the current GPU, bfloat16 unless ``--dtype`` says otherwise, the exact
kernels' Triton versions) the ratios are by the wall clock (``summary["clock"]``), each step's time
taken after the device has finished it. There ``train.compile`` (auto) compiles the default
variant's decoder blocks in its warm-up round, not the exact variants' (the key turns it off):
``train.compile=false`` compares eager with eager.

The checks (``checks`` per variant, after the timed rounds, on the weights trained so far; every
comparison bit for bit, ``torch.equal``), each reported pass/fail in ``summary["checks"]``:

* ``trainer_equals_engine``: ``on`` and ``on_forward`` read mismatch_k3 == 0 and ratio 1.0 at
  every step (the trainer's log-probs of the sampled tokens are the engine's);
* ``alone_equals_batched``: a request's tokens, output and input log-probs generated alone equal
  those it gets submitted among the rollout's requests (other prompts, lengths and seeds);
* ``decode_equals_prefill``: its decode-step log-probs equal the engine's prefill of the whole
  sequence (``input_token_logprobs``) and the model's full forward on the engine's device;
* ``off_mismatch_live``: ``off`` reads mismatch_k3 > 0 at some step (the metric stays live);
  ``off_*`` give the same comparisons without the key (expected to differ, reported only);
* ``checks_can_fail``: the comparison flags a copy with one bit changed.

Exit 1 unless ``summary["passed"]``: every exact check holds for both exact variants and the
default shows its mismatch. ``--out FILE`` writes the JSON after each measured round too
(``summary.stopped`` says what was still to come, ``passed`` is null until the checks ran),
so a run stopped by a time cap keeps its rounds and the checks they decide.

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

DEVICES = ("cpu", "cuda")

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


def generate(engine, bodies: list[dict], vocab_size: int) -> list[dict]:
    """The engine's responses to ``bodies`` (/generate request bodies), all submitted at once."""
    from ..engine.protocol import GenerateRequest

    reqs = [GenerateRequest.parse(b, vocab_size=vocab_size, max_context=engine.max_context) for b in bodies]

    async def run():
        return await asyncio.gather(*(engine.generate(r) for r in reqs))

    return asyncio.run(run())


def rollout(engine, t, seed: int = 0) -> list[dict]:
    """``rollout.prompts_per_step`` x ``group_size`` seeded samples from ``engine`` (a started
    embedded engine) as the loop's batch dicts, tagged with the trainer's version (the weights
    the engine serves), their routing appended to the trainer's replay log; advantages from a
    fixed draw. Prompts of 3 to 13 tokens."""
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
    outs = generate(engine, bodies, arch.vocab_size)
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
EXACT_VARIANTS = ("on", "on_forward")


def engine_device(cfg) -> str:
    """Where a bench engine runs: the trainer's device (``train.device``; the current GPU on cuda),
    as the engine host places it."""
    return f"cuda:{torch.cuda.current_device()}" if cfg.train.device == "cuda" else cfg.train.device


class _Run:
    """One variant's engine and trainer, kept across rounds (the weights train on), both on
    ``train.device``."""

    def __init__(self, cfg, tmp: Path, skip: bool):
        from ..engine.server import build_engine

        self.engine = build_engine(cfg, device=engine_device(cfg)).start()
        self.t = make_trainer(cfg, tmp / "routing")
        self.t.exact_rollouts = self.t.exact_rollouts and skip
        self.cuda = self.engine.device.type == "cuda"
        self.seed = 0

    def _clock(self) -> tuple[float, float]:
        if self.cuda:  # the bench's clock only: the step's own code adds no sync
            torch.cuda.synchronize(self.engine.device)
        return time.perf_counter(), time.process_time()

    def step(self) -> dict:
        t0, c0 = self._clock()
        batch = rollout(self.engine, self.t, seed=self.seed)
        t1, c1 = self._clock()
        metrics = self.t.train_step(batch)
        t2, c2 = self._clock()
        sync(self.t, self.engine)
        self.seed += 1
        tokens = sum(len(s["response_ids"]) for s in batch)
        return {"tokens_per_s": tokens / (t1 - t0), "step_s": t2 - t1,
                "tokens_per_cpu_s": tokens / (c1 - c0), "step_cpu_s": c2 - c1,
                "mismatch_k3": metrics["mismatch_k3"], "max_ratio": metrics["mismatch_max_ratio"],
                "skipped": metrics.get("proximal_forwards_skipped", 0)}


def _logprobs(out: dict, key: str) -> torch.Tensor:
    return torch.tensor([lp for lp, _, _ in out["meta_info"][key] if lp is not None], dtype=torch.float64)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, float | None]:
    """(bit for bit equal, the largest absolute difference; None when the shapes differ)."""
    if a.shape != b.shape:
        return False, None
    return torch.equal(a, b), (float((a - b).abs().max()) if a.numel() else 0.0)


def _self_test() -> bool:
    """``same_bits`` flags a copy of a log-prob row with one bit of one element changed."""
    a = torch.log_softmax(torch.randn(64, dtype=torch.float64, generator=torch.Generator().manual_seed(0)), -1)
    b = a.clone()
    b.view(torch.int64)[17] ^= 1
    return same_bits(a, a.clone())[0] and not same_bits(a, b)[0]


def exactness(engine, t, seed: int = 0) -> dict:
    """The engine's exactness at its current weights (``t``: the trainer, for the config and the
    rollout's requests): a target request (9-token prompt, temperature 1, its own seed)
    generated alone, then submitted in the middle of a rollout's requests; its decode-step
    log-probs against the engine's prefill of prompt + tokens (one more request, its
    ``input_token_logprobs``) and against the model's full forward on the engine's device."""
    from ..model.ops import tempered

    cfg, arch = t.cfg, t.arch
    g = torch.Generator().manual_seed(10_000 + seed)
    prompt = torch.randint(0, arch.vocab_size, (9,), generator=g).tolist()
    new = cfg.rollout.max_new_tokens

    def body(ids, max_new, **kw):
        return {"input_ids": list(ids), "return_logprob": True, "logprob_start_len": 0, **kw,
                "sampling_params": {"temperature": 1.0, "max_new_tokens": max_new, "ignore_eos": True,
                                    "sampling_seed": 777}}

    target = body(prompt, new)
    alone = generate(engine, [target], arch.vocab_size)[0]
    others = []
    for i in range(cfg.rollout.prompts_per_step * cfg.rollout.group_size):
        others.append({"input_ids": torch.randint(0, arch.vocab_size, (3 + 5 * i % 11,), generator=g).tolist(),
                       "return_logprob": True,
                       "sampling_params": {"temperature": cfg.rollout.temperature, "max_new_tokens": 4 + (3 * i) % new,
                                           "ignore_eos": True, "sampling_seed": 5000 + i}})
    mid = len(others) // 2
    batched = generate(engine, others[:mid] + [target] + others[mid:], arch.vocab_size)[mid]
    tokens = alone["output_ids"]
    decode = _logprobs(alone, "output_token_logprobs")
    eq_tokens = tokens == batched["output_ids"]
    eq_out, diff_out = same_bits(decode, _logprobs(batched, "output_token_logprobs"))
    eq_in, diff_in = same_bits(_logprobs(alone, "input_token_logprobs"), _logprobs(batched, "input_token_logprobs"))

    seq = prompt + tokens
    again = generate(engine, [body(seq, 1)], arch.vocab_size)[0]
    prefill = _logprobs(again, "input_token_logprobs")[len(prompt) - 1:]  # token p's sits at p - 1
    model = engine.model
    ids = torch.tensor([seq]).to(engine.device, non_blocking=True)
    with torch.no_grad(), engine.model_lock:
        logp = model.ops.log_softmax(tempered(model(ids)[0], 1.0))
        at = torch.arange(len(prompt) - 1, len(seq) - 1, device=engine.device)
        forward = logp[at, torch.tensor(tokens).to(engine.device, non_blocking=True)].double().cpu()
    eq_pre, diff_pre = same_bits(decode, prefill)
    eq_fwd, diff_fwd = same_bits(decode, forward)
    return {"alone_equals_batched": bool(eq_tokens and eq_out and eq_in), "alone_batched_same_tokens": eq_tokens,
            "alone_vs_batched_max_abs": max((d for d in (diff_out, diff_in) if d is not None), default=None),
            "decode_equals_prefill": eq_pre, "decode_equals_forward": eq_fwd,
            "decode_vs_prefill_max_abs": diff_pre, "decode_vs_forward_max_abs": diff_fwd,
            "tokens": len(tokens)}


def measure(config: str, overrides: list[str], rounds: int, minibatches: int, save=None) -> dict:
    """Every variant's rounds, then the checks; ``save(report)``, if given, gets the report after
    each measured round (``summary.stopped`` says what was still to come) and at the end."""
    from ..config import load_config

    save = save or (lambda report: None)
    with tempfile.TemporaryDirectory(prefix="moe-rl-bench-on-policy-") as tmp:
        runs = {}
        for name, (key, skip) in VARIANTS.items():
            cfg = load_config(config, [*overrides, f"train.minibatches={minibatches}", "algo.ratio_anchor=proximal",
                                       f"true_on_policy={str(key).lower()}", f"output_dir={tmp}/{name}"])
            runs[name] = _Run(cfg, Path(tmp) / name, skip)
        device = runs["off"].engine.device
        try:
            rows = {name: [] for name in runs}
            for r in range(rounds + 1):
                for name, run in runs.items():
                    row = run.step()
                    if r:  # round 0 warms up
                        rows[name].append(row)
                if r:
                    partial = _report(rows, None, device)
                    partial["summary"]["stopped"] = (f"after round {r} of {rounds}"
                                                     + (", before the exactness checks" if r == rounds else ""))
                    save(partial)
            checks = {name: exactness(run.engine, run.t) for name, run in runs.items()}
        finally:
            for run in runs.values():
                run.engine.stop()
    report = _report(rows, checks, device)
    save(report)
    return report


def _report(rows: dict, checks: dict | None, device) -> dict:
    """The variants' medians and the summary from the rounds so far; ``checks`` None: the
    exactness checks have not run (the summary then holds the checks the rounds decide)."""
    out = {}
    for name, rs in rows.items():
        out[name] = {
            "engine_tokens_per_s": round(statistics.median(x["tokens_per_s"] for x in rs), 1),
            "train_step_s": round(statistics.median(x["step_s"] for x in rs), 4),
            "engine_tokens_per_cpu_s": round(statistics.median(x["tokens_per_cpu_s"] for x in rs), 1),
            "train_step_cpu_s": round(statistics.median(x["step_cpu_s"] for x in rs), 4),
            "mismatch_k3_max": max(x["mismatch_k3"] for x in rs),
            "max_ratio_max": max(x["max_ratio"] for x in rs),
            "proximal_forwards_skipped_per_step": statistics.median(x["skipped"] for x in rs),
            **({"checks": checks[name]} if checks is not None else {}),
        }
    on, off, fwd = out["on"], out["off"], out["on_forward"]
    # a GPU's work does not show in the process's CPU time: the wall clock there
    clock = "wall" if device.type == "cuda" else "cpu"
    tok, step = ("engine_tokens_per_s", "train_step_s") if clock == "wall" else ("engine_tokens_per_cpu_s",
                                                                                  "train_step_cpu_s")
    exact = all(x["mismatch_k3"] == 0.0 and x["max_ratio"] == 1.0 for v in EXACT_VARIANTS for x in rows[v])
    live = any(x["mismatch_k3"] > 0.0 for x in rows["off"])
    summary_checks = {"trainer_equals_engine": exact, "off_mismatch_live": live}
    if checks is not None:
        ex = [checks[v] for v in EXACT_VARIANTS]
        summary_checks = {
            "trainer_equals_engine": exact,
            "alone_equals_batched": all(c["alone_equals_batched"] for c in ex),
            "decode_equals_prefill": all(c["decode_equals_prefill"] and c["decode_equals_forward"] for c in ex),
            "off_mismatch_live": live,
            "off_alone_equals_batched": checks["off"]["alone_equals_batched"],
            "off_decode_equals_prefill": (checks["off"]["decode_equals_prefill"]
                                          and checks["off"]["decode_equals_forward"]),
            "checks_can_fail": _self_test(),
        }
    required = ("trainer_equals_engine", "alone_equals_batched", "decode_equals_prefill", "off_mismatch_live",
                "checks_can_fail")
    summary = {
        "engine_time_on_vs_off": round(off[tok] / on[tok], 3),
        "train_step_on_vs_off": round(on[step] / off[step], 3),
        "train_step_on_forward_vs_off": round(fwd[step] / off[step], 3),
        "skip_saving": round(1 - on[step] / fwd[step], 3),
        "wall_engine_time_on_vs_off": round(off["engine_tokens_per_s"] / on["engine_tokens_per_s"], 3),
        "wall_train_step_on_vs_off": round(on["train_step_s"] / off["train_step_s"], 3),
        "clock": clock,
        "device": str(device),
        "exact": exact,
        "off_mismatch_live": live,
        "checks": summary_checks,
        "passed": all(summary_checks[k] for k in required) if checks is not None else None,
    }
    return {"variants": out, "summary": summary}


def device_overrides(device: str, dtype: str) -> list[str]:
    """The config overrides that put every variant on ``device`` in ``dtype`` (auto: bfloat16 on
    a GPU, the config's on the CPU)."""
    out = [f"train.device={device}"]
    if dtype == "auto" and device == "cuda":
        dtype = "bfloat16"
    if dtype != "auto":
        out += [f"model.dtype={dtype}", f"engine.dtype={dtype}"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="moe-rl bench on-policy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="key.sub=value config overrides (every variant)")
    ap.add_argument("--config", default=str(DEFAULT_CONFIG))
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds (one step of every variant each)")
    ap.add_argument("--minibatches", type=int, default=2, help="train.minibatches (> 1: proximal forwards)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the trainer and the engine")
    ap.add_argument("--device", choices=DEVICES, default="cpu",
                    help="where the engines and trainers run (cuda: the current GPU)")
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                    help="model.dtype and engine.dtype of every variant (auto: bfloat16 on cuda, the config's on cpu)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--out", default=None, help="also write the JSON there, after each measured round (summary."
                    "stopped: what was still to come) and at the end")
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("moe-rl bench on-policy: --device cuda but no CUDA device is visible", file=sys.stderr)
        return 2
    torch.set_num_threads(a.threads)
    overrides = [f"engine.threads={a.threads}", f"train.threads={a.threads}", *device_overrides(a.device, a.dtype),
                 *a.overrides]
    machine = {"cpu": _cpu_name(), "cores": os.cpu_count(), "gpu": torch.cuda.get_device_name() if a.device == "cuda"
               else None, "loadavg_1m": round(os.getloadavg()[0], 2), "threads": a.threads, "rounds": a.rounds,
               "overrides": a.overrides, "minibatches": a.minibatches, "dtype": a.dtype}

    def save(report: dict) -> None:
        report["summary"]["machine"] = machine
        if a.out:
            Path(a.out).write_text(json.dumps(report) + "\n")

    out = measure(a.config, overrides, a.rounds, a.minibatches, save)
    s = out["summary"]
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
        print(f"ratios by {s['clock']} time: " + " ".join(
            f"{k}={s[k]}" for k in ("engine_time_on_vs_off", "train_step_on_vs_off", "train_step_on_forward_vs_off",
                                    "skip_saving")))
        print("checks: " + " ".join(f"{k}={v}" for k, v in s["checks"].items())
              + f" (load {s['machine']['loadavg_1m']} on {s['machine']['cores']} cores)")
    if not s["passed"]:
        failed = [k for k, v in s["checks"].items() if not v and (not k.startswith("off_") or k == "off_mismatch_live")]
        print(f"check FAILED ({failed}): the exact variants must read mismatch_k3 0 and ratio 1 and give the same "
              "bits alone and batched, decode and prefill; the default must show a mismatch", file=sys.stderr)
    return 0 if s["passed"] else 1
