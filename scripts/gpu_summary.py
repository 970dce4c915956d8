"""gpu_summary.json and gpu_round.tar.gz from the outputs of `scripts/gpu_round.sh`'s stages.

    python scripts/gpu_summary.py WORK_DIR --out OUT_DIR [--device cuda|cpu] [--max-archive-mb 16]

Every figure is read from a stage's own output in WORK_DIR (stages.jsonl: each stage's exit
code, seconds and cap; <stage>.json: the bench's JSON; <stage>.json.xml: pytest's JUnit report;
gpu_1x/metrics.jsonl: the training run's rows). A stage that did not run, failed before writing
its output, or wrote something unreadable gives null for its figures (with the reason under
"missing") and keeps its exit code in "stages"; nothing is filled in otherwise. A stage's name
prefix says how it is read (train_, logprobs, engine, gpu_1x, pytest, on_policy, gated_delta,
grouped_gemm), so a with/without variant
added to gpu_round.sh (e.g. engine_no_graph) gets its own entry under "stages" with no change here.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHIVE = "gpu_round.tar.gz"
# files the archive holds (the work folder may also hold a run's checkpoints: never archived)
ARCHIVE_SUFFIXES = (".json", ".jsonl", ".log", ".txt", ".xml", ".csv", ".yaml")


# --- the commit -----------------------------------------------------------------------------
def commit_info(root: Path = ROOT) -> dict:
    """The commit the round ran: GPU_ROUND_COMMIT, else .whl/COMMIT written by `gpu_round.sh
    fetch` where the tracked files still match the hashes it recorded, else git, else .whl/COMMIT
    with what differs. The recorded commit comes before git: a device copy of the tree may bring
    a .git older than its files (one said ebcff73 for a round of dbc0087)."""
    if os.environ.get("GPU_ROUND_COMMIT"):
        return {"commit": os.environ["GPU_ROUND_COMMIT"], "commit_source": "GPU_ROUND_COMMIT"}
    recorded = _recorded_commit(root)
    if recorded and recorded["tree_matches_commit"]:
        return recorded
    try:
        desc = subprocess.run(["git", "describe", "--always", "--abbrev=12", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
        return {"commit": desc + ("+local-changes" if dirty else ""), "commit_source": "git"}
    except (OSError, subprocess.CalledProcessError):
        pass
    return recorded or {"commit": None, "commit_source": "unknown: no .git, no GPU_ROUND_COMMIT, no .whl/COMMIT "
                                                         "(run `bash scripts/gpu_round.sh fetch` and carry .whl)"}


def _recorded_commit(root: Path) -> dict | None:
    """.whl/COMMIT, checked against .whl/tree.sha256; None where fetch left no COMMIT."""
    recorded = root / ".whl" / "COMMIT"
    if not recorded.exists():
        return None
    changed = []
    lines = (root / ".whl" / "tree.sha256").read_text().splitlines() if (root / ".whl" / "tree.sha256").exists() else []
    for line in lines:
        digest, path = line.split(None, 1)
        path = path.lstrip("*")
        f = root / path
        if not f.is_file() or hashlib.sha256(f.read_bytes()).hexdigest() != digest:
            changed.append(path)
    if not lines:
        state = "no .whl/tree.sha256 to check the tree against"
    elif changed:
        state = f"the tree differs from it in {len(changed)} tracked files, e.g. {changed[:3]}"
    else:
        state = f"the tree matches it ({len(lines)} tracked files)"
    return {"commit": recorded.read_text().strip(), "commit_source": f".whl/COMMIT (gpu_round.sh fetch); {state}",
            "tree_matches_commit": bool(lines) and not changed}


# --- readers, one per stage kind --------------------------------------------------------------
def _load_json(path: Path):
    """The JSON object in ``path`` (a bench may print log lines before it: the last line that
    parses is taken)."""
    text = path.read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        for line in reversed(text.splitlines()):
            if line.startswith("{"):
                return json.loads(line)
        raise


def _get(d, *keys):
    for k in keys:
        if not isinstance(d, dict) or d.get(k) is None:
            return None
        d = d[k]
    return d


TRAIN_ROWS = ("native", "native_eager", "native_fused", "native_graphs", "megatron", "megatron_recompute")


def read_train(path: Path) -> dict:
    r = _load_json(path)
    out = {"preset": r.get("preset"), "dtype": r.get("dtype"), "megatron_core": r.get("megatron_core"),
           "megatron_experts": r.get("megatron_experts"), "megatron_vs_native": r.get("speedup"),
           "recompute_step_ratio": r.get("recompute_step_ratio"), "compile_speedup": r.get("compile_speedup"),
           "fused_loss_speedup": r.get("fused_loss_speedup"), "cuda_graphs_speedup": r.get("cuda_graphs_speedup")}
    for b in TRAIN_ROWS:
        row = r.get(b)
        if row is None:
            continue
        if "error" in row:
            out[b] = {"error": row["error"]}
            continue
        out[b] = {k: row.get(k) for k in ("tokens_per_s", "step_s", "cpu_s", "mfu", "model_tflops_per_s",
                                          "peak_mem_gib", "compiled", "loss_path", "first_step_s", "compile_s",
                                          "build_s", "stopped", "issue_s", "host_syncs")
                  if k in row}
    # against the eager native row too: it runs before the compiled one, which a cap may cut
    meg, eager = (out.get(b) or {} for b in ("megatron", "native_eager"))
    if meg.get("tokens_per_s") and eager.get("tokens_per_s"):
        out["megatron_vs_native_eager"] = meg["tokens_per_s"] / eager["tokens_per_s"]
    return out


def read_logprobs(path: Path) -> dict:
    r = _load_json(path)
    s = r.get("summary", {})
    shape = s.get("shape")
    ms, errors = {}, {}
    for row in r.get("rows", []):
        if row.get("shape") != shape:
            continue
        if "error" in row:
            errors.setdefault(row["provider"], {})[row["pass"]] = row["error"]
        else:
            ms.setdefault(row["provider"], {})[row["pass"]] = row["ms"]
    gemm = ms.get("gemm", {})
    vs_gemm = {p: {q: round(v / gemm[q], 4) for q, v in passes.items() if gemm.get(q)}
               for p, passes in ms.items() if p != "gemm"}
    out = {"shape": shape, "fwd_vs_gemm": s.get("fwd_vs_gemm"), "fwd_bwd_vs_gemm": s.get("fwd_bwd_vs_gemm"),
           "extra_mem_fraction": s.get("extra_mem_fraction"), "extra_mem_fraction_fwd": s.get("extra_mem_fraction_fwd"),
           "accuracy_ok": s.get("accuracy_ok"), "ms": ms, "vs_gemm": vs_gemm}
    if errors:
        out["errors"] = errors
    return out


def read_engine(path: Path) -> dict:
    r = _load_json(path)
    s = r["summary"]
    variants = {name: ({"skipped": v["skipped"]} if "skipped" in v else
                       {k: v.get(k) for k in ("tokens_per_s_1", "tokens_per_s_concurrent", "capture_s")})
                for name, v in (s.get("variants") or {}).items()}
    return {"tokens_per_s_1": s.get("tokens_per_s_1"), "tokens_per_s_concurrent": s.get("tokens_per_s_concurrent"),
            "concurrency": s.get("concurrency"), "ttft_ms": s.get("ttft_ms"), "dtype": _get(r, "params", "dtype"),
            "engine_device": s.get("device"), "cuda_graph": s.get("cuda_graph"), "decode_graphs": s.get("decode_graphs"),
            "compile": s.get("compile"), "compile_s": s.get("compile_s"),
            "start_s": s.get("start_s"), "capture_s": s.get("capture_s"), "stopped": s.get("stopped"),
            "grouped_gemm_tiles": s.get("grouped_gemm_tiles"),
            "variants": variants, "profile": _engine_profile(s.get("profile"))}


def _engine_profile(prof: dict | None) -> dict | None:
    """The profiled request of ``bench engine --profile``: ms per token, engine steps, the top
    five ops by device time (CPU time on a CPU) and by CPU time."""
    if not prof:
        return None
    out = {k: prof.get(k) for k in ("ms_per_token", "steps", "tokens")}
    for side in ("device", "cpu"):
        if prof.get(side):
            out[f"top_{side}"] = [(row["op"][:80], round(row["self_ms"], 3), row["calls"]) for row in prof[side][:5]]
    return out


def read_on_policy(path: Path) -> dict:
    """`moe-rl bench on-policy`: its pass/fail checks and the key's cost (ratios by its clock)."""
    r = _load_json(path)
    s = r["summary"]
    variants = r.get("variants") or {}
    return {"passed": s.get("passed"), "checks": s.get("checks"), "stopped": s.get("stopped"),
            "clock": s.get("clock"), "device": s.get("device"),
            "dtype": _get(s, "machine", "dtype"),
            **{k: s.get(k) for k in ("engine_time_on_vs_off", "train_step_on_vs_off", "train_step_on_forward_vs_off",
                                     "skip_saving")},
            "engine_tokens_per_s": {v: row.get("engine_tokens_per_s") for v, row in variants.items()},
            "train_step_s": {v: row.get("train_step_s") for v, row in variants.items()}}


def read_gated_delta(path: Path) -> dict:
    """`moe-rl bench gated-delta`: the Triton scan against torch (and fla), and the accuracy check."""
    r = _load_json(path)
    s = r["summary"]
    out = {k: s.get(k) for k in ("shape", "dtype", "triton_vs_torch", "triton_vs_fla", "ms", "fla", "accuracy_ok",
                                 "accuracy_check_can_fail")}
    errors = {f"{row['provider']}_{row['pass']}": row["error"] for row in r.get("rows", []) if "error" in row}
    if errors:
        out["errors"] = errors
    return out


def read_grouped_gemm(path: Path) -> dict:
    """`moe-rl bench grouped-gemm`: per dtype the fastest decode tiles, their total time against the
    tiles the kernel takes now (``current``) and the training tiles, the check; and the file it
    saved."""
    r = _load_json(path)
    return {"summary": r.get("summary"), "saved": r.get("saved"),
            "errors": sum(1 for row in r.get("rows", []) if "error" in row)}


def read_train_run(run_dir: Path, first_last: int = 10) -> dict:
    """Rewards of the first and last ``first_last`` logged steps, steps done and seconds per step
    (wall time between the first and the last logged step / steps between them, so the start-up
    before step 1 is not counted) of a `moe-rl train` run, from its metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} has no rows")

    def mean(key, part):
        vals = [r[key] for r in part if r.get(key) is not None]
        return sum(vals) / len(vals) if vals else None

    first, last = rows[:first_last], rows[-first_last:]
    n = rows[-1]["step"]
    s_per_step = (rows[-1]["wall_s"] - rows[0]["wall_s"]) / (n - rows[0]["step"]) if n > rows[0]["step"] else None
    return {"steps_done": n, "reward_first10": mean("reward_mean", first), "reward_last10": mean("reward_mean", last),
            "reward_last20": mean("reward_mean", rows[-2 * first_last:]),
            "s_per_step": s_per_step, "first_step_wall_s": rows[0].get("wall_s"),
            "rollout_tokens_per_s": mean("rollout_tokens_per_s", last), "train_tokens_per_s": mean("tokens_per_s", last),
            "sync_s": mean("sync_s", last), "routing_match": mean("routing_match", last)}


def read_pytest(path: Path) -> dict:
    """Counts from pytest's JUnit XML report, with the ids of the tests that failed."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    tests = failures = errors = skipped = 0
    failed = []
    for s in suites:
        tests += int(s.get("tests", 0))
        failures += int(s.get("failures", 0))
        errors += int(s.get("errors", 0))
        skipped += int(s.get("skipped", 0))
        for case in s.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(f"{case.get('classname')}::{case.get('name')}")
    return {"passed": tests - failures - errors - skipped, "failed": failures, "errors": errors, "skipped": skipped,
            "failed_tests": failed}


READERS = [  # stage-name prefix -> (reader, the stage's output)
    ("train_", read_train, lambda w, s: w / f"{s}.json"),
    ("logprobs", read_logprobs, lambda w, s: w / f"{s}.json"),
    ("engine", read_engine, lambda w, s: w / f"{s}.json"),
    ("gpu_1x", read_train_run, lambda w, s: w / s),
    ("pytest", read_pytest, lambda w, s: w / f"{s}.json.xml"),  # pytest_gpu, pytest_suite
    ("on_policy", read_on_policy, lambda w, s: w / f"{s}.json"),
    ("gated_delta", read_gated_delta, lambda w, s: w / f"{s}.json"),  # gated_delta, gated_delta_fla
    ("grouped_gemm", read_grouped_gemm, lambda w, s: w / f"{s}.json"),
    ("install", _load_json, lambda w, s: w / f"{s}.json"),
]


def read_stage(work: Path, name: str):
    """(figures or None, why they are missing or None)."""
    for prefix, reader, output in READERS:
        if name.startswith(prefix):
            path = output(work, name)
            if not path.exists():
                return None, f"no output ({path.name})"
            if path.is_file() and path.stat().st_size == 0:
                return None, f"empty output ({path.name}): the stage wrote nothing there"
            try:
                return reader(path), None
            except Exception as exc:  # a truncated or foreign file: null, never a guess
                return None, f"unreadable {path.name}: {type(exc).__name__}: {exc}"[:300]
    path = work / f"{name}.json"  # a stage without a reader of its own: its JSON as it is
    if path.exists() and path.stat().st_size:
        try:
            return _load_json(path), None
        except Exception as exc:
            return None, f"unreadable {path.name}: {type(exc).__name__}: {exc}"[:300]
    return None, f"no output ({path.name})"


# --- the summary --------------------------------------------------------------------------------
def summarize(work: Path, device: str = "cuda") -> dict:
    stages = {}
    stages_file = work / "stages.jsonl"
    for line in (stages_file.read_text().splitlines() if stages_file.exists() else []):
        if line.strip():
            rec = json.loads(line)
            stages[rec.pop("stage")] = rec
    figures, missing = {}, {}
    for name, rec in stages.items():
        fig, why = read_stage(work, name)
        figures[name] = fig
        if why:
            missing[name] = why
        rec["status"] = ("skipped" if rec.get("rc") is None else "ok" if rec["rc"] == 0
                         else "time cap" if rec["rc"] in (124, 137) else "failed")
        if fig is not None and name != "install":
            rec["figures"] = fig

    env = figures.get("install") or {}
    tm, tl = figures.get("train_medium") or {}, figures.get("train_large") or {}
    # the large preset's megatron, recompute and eager rows: the by-name stage train_large_megatron
    # (train_large in `all` runs the compiled native row only)
    tlm = figures.get("train_large_megatron") or {}

    def large(get):
        value = get(tl)
        return value if value is not None else get(tlm)

    tf = figures.get("train_fused") or {}  # by name only: the medium preset's native vs native_fused
    lp, en, eb = figures.get("logprobs") or {}, figures.get("engine") or {}, figures.get("engine_bf16") or {}
    ec = figures.get("engine_compiled") or {}  # engine.compile: the decode step compiled before the capture
    run, pt = figures.get("gpu_1x") or {}, figures.get("pytest_gpu") or {}
    run_c = figures.get("gpu_1x_compiled") or {}  # by name: the main job as shipped (compiled)
    op, gdn = figures.get("on_policy") or {}, figures.get("gated_delta") or {}
    ag = figures.get("agent_api") or {}  # by name: examples/openai_agent/bench.py --json, as it is
    gdn_fla = figures.get("gated_delta_fla") or {}  # by name: 8k tokens, fla too
    gmm = figures.get("grouped_gemm") or {}
    gmm_dtypes = gmm.get("summary") or {}
    run_g, run_f = figures.get("gpu_1x_gloo") or {}, figures.get("gpu_1x_full") or {}  # by name
    ms = lp.get("ms", {})
    out = {
        **commit_info(),
        "device": env.get("device"),
        "round_device": device,
        "software": {k: env.get(k) for k in ("python", "torch", "cuda", "triton", "megatron_core", "liger_kernel",
                                             "fla_core")},
        "train_medium_native_mfu": _get(tm, "native", "mfu"),
        "train_large_native_mfu": _get(tl, "native", "mfu"),
        # train.compile: the native row as configured (compiled on CUDA) vs eager, and the fused loss
        "train_medium_native_compiled": _get(tm, "native", "compiled"),
        "train_large_native_compiled": _get(tl, "native", "compiled"),
        "train_medium_native_eager_mfu": _get(tm, "native_eager", "mfu"),
        # train.cuda_graphs: the compiled blocks replayed as CUDA graphs (> 1: faster than compiled alone)
        "train_medium_native_graphs_mfu": _get(tm, "native_graphs", "mfu"),
        "train_medium_cuda_graphs_speedup": tm.get("cuda_graphs_speedup"),
        "train_medium_native_graphs_error": _get(tm, "native_graphs", "error"),
        "train_large_native_eager_mfu": large(lambda t: _get(t, "native_eager", "mfu")),
        "train_fused_native_fused_mfu": _get(tf, "native_fused", "mfu"),
        "train_medium_compile_speedup": tm.get("compile_speedup"),
        "train_large_compile_speedup": large(lambda t: t.get("compile_speedup")),
        "train_medium_compile_s": _get(tm, "native", "compile_s"),
        "train_large_compile_s": _get(tl, "native", "compile_s"),
        "train_fused_fused_loss_speedup": tf.get("fused_loss_speedup"),
        "megatron_vs_native_medium": tm.get("megatron_vs_native"),
        "megatron_vs_native_eager_medium": tm.get("megatron_vs_native_eager"),
        "megatron_vs_native_large": large(lambda t: t.get("megatron_vs_native")),
        "recompute_step_ratio_medium": tm.get("recompute_step_ratio"),
        "recompute_step_ratio_large": large(lambda t: t.get("recompute_step_ratio")),
        "logprobs_shape": lp.get("shape"),
        "logprobs_fwd_vs_gemm": lp.get("fwd_vs_gemm"),
        "logprobs_fwd_bwd_vs_gemm": lp.get("fwd_bwd_vs_gemm"),
        "logprobs_extra_mem_fraction": lp.get("extra_mem_fraction"),
        "logprobs_accuracy_ok": lp.get("accuracy_ok"),
        "logprobs_ms": {p: ms.get(p) for p in ("fused", "gemm", "liger", "compile", "eager")} | ms,
        # the decode tiles timed on this GPU: per dtype the fastest [BLOCK_M, BLOCK_N, BLOCK_K, warps,
        # stages] and its time over the training tiles' (< 1: faster); the later stages ran them
        "grouped_gemm_best": {d: v.get("best") for d, v in gmm_dtypes.items()} or None,
        "grouped_gemm_best_vs_large_tiles": {d: v.get("best_vs_large_tiles") for d, v in gmm_dtypes.items()} or None,
        "grouped_gemm_best_vs_current": {d: (round(v["best_us"] / v["current_us"], 4) if v.get("best_us") and
                                             v.get("current_us") else None)
                                         for d, v in gmm_dtypes.items()} or None,
        "grouped_gemm_tiles_file": _get(gmm, "saved", "ship_as"),
        "engine_grouped_gemm_tiles": en.get("grouped_gemm_tiles"),
        "engine_tokens_per_s_1": en.get("tokens_per_s_1"),
        "engine_tokens_per_s_concurrent": en.get("tokens_per_s_concurrent"),
        "engine_concurrency": en.get("concurrency"),
        "engine_cuda_graph": en.get("cuda_graph"),
        "engine_profile": en.get("profile"),
        "engine_compiled_tokens_per_s_1": ec.get("tokens_per_s_1"),
        "engine_compiled_tokens_per_s_concurrent": ec.get("tokens_per_s_concurrent"),
        "engine_compiled_compile_s": ec.get("compile_s"),
        "engine_compiled_profile": ec.get("profile"),
        "engine_bf16_tokens_per_s_1": eb.get("tokens_per_s_1"),
        "engine_bf16_tokens_per_s_concurrent": eb.get("tokens_per_s_concurrent"),
        "engine_bf16_cuda_graph": eb.get("cuda_graph"),
        # true_on_policy (bf16, the exact kernels' Triton versions): pass/fail checks, then the cost
        "on_policy_passed": op.get("passed"),
        "on_policy_checks": op.get("checks"),
        "on_policy_engine_time_on_vs_off": op.get("engine_time_on_vs_off"),
        "on_policy_train_step_on_vs_off": op.get("train_step_on_vs_off"),
        "on_policy_skip_saving": op.get("skip_saving"),
        "on_policy_engine_tokens_per_s": op.get("engine_tokens_per_s"),
        "on_policy_train_step_s": op.get("train_step_s"),
        # the Gated DeltaNet chunk scan: ms ratios per pass (< 1: the Triton scan faster)
        "gated_delta_triton_vs_torch": gdn.get("triton_vs_torch"),
        "gated_delta_accuracy_ok": gdn.get("accuracy_ok"),
        "gated_delta_accuracy_check_can_fail": gdn.get("accuracy_check_can_fail"),
        "gated_delta_fla_triton_vs_torch": gdn_fla.get("triton_vs_torch"),
        "gated_delta_fla_triton_vs_fla": gdn_fla.get("triton_vs_fla"),
        "gated_delta_fla_accuracy_ok": gdn_fla.get("accuracy_ok"),
        "gated_delta_fla": gdn_fla.get("fla"),
        "gpu_1x_steps_done": run.get("steps_done"),
        "gpu_1x_reward_first10": run.get("reward_first10"),
        "gpu_1x_reward_last10": run.get("reward_last10"),
        "gpu_1x_reward_last20": run.get("reward_last20"),
        "gpu_1x_s_per_step": run.get("s_per_step"),  # `all`: train.compile=false
        "gpu_1x_sync_s": run.get("sync_s"),  # the last 10 steps' mean (configs/gpu_1x.yaml: sync.backend=ipc)
        "gpu_1x_gloo_sync_s": run_g.get("sync_s"),  # the same over gloo
        "gpu_1x_gloo_s_per_step": run_g.get("s_per_step"),
        # the whole 200-step run as shipped (the target: the last 20 steps' reward >= 0.8)
        "gpu_1x_full_steps_done": run_f.get("steps_done"),
        "gpu_1x_full_reward_last20": run_f.get("reward_last20"),
        "gpu_1x_full_s_per_step": run_f.get("s_per_step"),
        "gpu_1x_compiled_steps_done": run_c.get("steps_done"),
        "gpu_1x_compiled_s_per_step": run_c.get("s_per_step"),
        # the OpenAI-API agent path's samples/s over the token-level path's, pair by pair (median), per arm
        "agent_api_ratio_median": {k: v.get("ratio_median") for k, v in (ag.get("arms") or {}).items()} or None,
        "agent_api_response_len": {k: v.get("response_len_mean") for k, v in (ag.get("arms") or {}).items()} or None,
        "agent_api_cpus": _get(ag, "machine", "cpus"),
        "agent_api_warmup": ag.get("warmup"),
        "agent_api_prep_steps": ag.get("prep_steps"),
        "agent_api_pairs_done": ag.get("pairs_done"),
        "pytest_gpu_passed": pt.get("passed"),
        "pytest_gpu_failed": (pt["failed"] + pt["errors"]) if pt else None,
        "pytest_gpu_skipped": pt.get("skipped"),
        "pytest_gpu_failed_tests": pt.get("failed_tests"),
        "stage_rc": {name: rec.get("rc") for name, rec in stages.items()},
        "stages": stages,
        "missing": missing,
    }
    return out


def write_archive(work: Path, dest: Path, limit_bytes: int) -> dict:
    """The logs, JSON outputs and profiles of the round as one tar.gz under ``limit_bytes``: when
    everything does not fit, the largest files are left out (named in the result) until it does."""
    files = sorted(p for p in work.rglob("*") if p.is_file() and p.name.endswith(ARCHIVE_SUFFIXES)
                   and "checkpoint" not in p.relative_to(work).as_posix())
    left_out = []
    while True:
        with tarfile.open(dest, "w:gz") as tar:
            for p in files:
                tar.add(p, arcname=f"gpu_round/{p.relative_to(work).as_posix()}")
        size = dest.stat().st_size
        if size <= limit_bytes or not files:
            break
        biggest = max(files, key=lambda p: p.stat().st_size)
        files.remove(biggest)
        left_out.append(biggest.relative_to(work).as_posix())
    return {"archive": dest.name, "archive_bytes": size, "archive_files": len(files), "archive_left_out": left_out}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work", type=Path, help="the round's work folder (gpu_round.sh's GPU_ROUND_WORK)")
    ap.add_argument("--out", type=Path, required=True, help="where gpu_summary.json and the archive go")
    ap.add_argument("--device", default="cuda", help="the round's device (cuda, or cpu for a dry run)")
    ap.add_argument("--max-archive-mb", type=float, default=16.0)
    # exit code: 0 when every stage ended cleanly (gpu_1x stopped by its time cap counts as clean),
    # 1 otherwise; gpu_summary.json and the archive are written either way
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    summary = summarize(args.work, args.device)
    # the summary goes into the archive too, then gets the archive's own figures
    (args.work / "gpu_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    summary.update(write_archive(args.work, args.out / ARCHIVE, int(args.max_archive_mb * 2**20)))
    (args.out / "gpu_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k not in ("stages", "missing")}, indent=1))
    capped_run = lambda k, v: k.startswith("gpu_1x") and v in (124, 137)  # noqa: E731  its normal end
    bad = {k: v for k, v in summary["stage_rc"].items() if v != 0 and not capped_run(k, v)}
    if bad:
        print(f"[gpu_summary] stages that did not end cleanly (rc; null = skipped): {bad}; missing figures: "
              f"{summary['missing']}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
