"""scripts/gpu_summary.py (the summary of `bash scripts/gpu_round.sh all`) on the outputs of a
real CPU dry run of the round, canned in gpu_round_cpu/ (`GPU_ROUND_DEVICE=cpu bash
scripts/gpu_round.sh all`: the train bench on preset small with megatron-core, the log-prob bench
at 256x256x8192, the engine bench and `moe-rl train configs/tiny.yaml` on CPU, `pytest -m gpu`
skipping everything). Each headline figure must be the stage output's own value (recomputed here
from the raw rows); a stage that failed, was skipped or left no or broken output must give null and
keep its exit code; pytest counts come from a JUnit report of a real pytest run."""
import json
import shutil
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CANNED = Path(__file__).parent / "gpu_round_cpu"
SCRIPT = ROOT / "scripts" / "gpu_summary.py"


def summarize(work: Path, out: Path, *args) -> tuple[int, dict]:
    r = subprocess.run([sys.executable, str(SCRIPT), str(work), "--out", str(out), "--device", "cpu", *args],
                       capture_output=True, text=True, timeout=60)
    assert (out / "gpu_summary.json").exists(), r.stderr
    return r.returncode, json.loads((out / "gpu_summary.json").read_text())


def set_stage(work: Path, name: str, **fields):
    lines = [json.loads(line) for line in (work / "stages.jsonl").read_text().splitlines()]
    for rec in lines:
        if rec["stage"] == name:
            rec.update(fields)
    (work / "stages.jsonl").write_text("".join(json.dumps(rec) + "\n" for rec in lines))


@pytest.fixture
def work(tmp_path):
    return Path(shutil.copytree(CANNED, tmp_path / "work"))


def test_every_figure_is_the_stage_outputs_own(work, tmp_path):
    rc, s = summarize(work, tmp_path / "out")
    assert rc == 0 and s["missing"] == {}
    assert set(s["stage_rc"]) == {"install", "train_medium", "train_large", "logprobs", "engine", "engine_compiled",
                                  "engine_bf16",
                                  "pytest_gpu", "gpu_1x", "train_fused", "train_large_megatron", "on_policy",
                                  "gated_delta", "gated_delta_fla", "grouped_gemm"}
    assert set(s["stage_rc"].values()) == {0}
    assert s["commit"] and s["device"] == json.loads((work / "install.json").read_text())["device"]

    # the large preset's native row is train_large's (in `all`); its megatron, recompute and eager
    # rows the by-name stage train_large_megatron's
    assert json.loads((work / "train_large.json").read_text())["backends"] == ["native"]
    assert s["train_large_native_mfu"] == json.loads((work / "train_large.json").read_text())["native"]["mfu"] > 0
    for preset, stage in (("medium", "train_medium"), ("large", "train_large_megatron")):
        t = json.loads((work / f"{stage}.json").read_text())
        assert t["backends"][:2] == ["megatron", "megatron_recompute"]  # before the compiled native row
        if preset == "medium":
            assert s[f"train_{preset}_native_mfu"] == t["native"]["mfu"] > 0
        assert s[f"megatron_vs_native_{preset}"] == pytest.approx(
            t["megatron"]["tokens_per_s"] / t["native"]["tokens_per_s"])
        if preset == "medium":
            assert s["megatron_vs_native_eager_medium"] == pytest.approx(
                t["megatron"]["tokens_per_s"] / t["native_eager"]["tokens_per_s"])
        assert s[f"recompute_step_ratio_{preset}"] == pytest.approx(
            t["megatron_recompute"]["step_s"] / t["megatron"]["step_s"])
        # train.compile: the bench's own rows (eager on a CPU: auto is off there)
        assert s[f"train_{preset}_native_compiled"] is False
        assert s[f"train_{preset}_native_eager_mfu"] == t["native_eager"]["mfu"] > 0
        assert s[f"train_{preset}_compile_speedup"] == pytest.approx(
            t["native_eager"]["step_s"] / t["native"]["step_s"])
        assert s[f"train_{preset}_compile_s"] is None  # not compiled
    # train.fused_loss: the by-name stage train_fused (the medium preset's native and native_fused rows)
    t = json.loads((work / "train_fused.json").read_text())
    assert t["native_fused"]["loss_path"] == "fused"
    assert s["train_fused_native_fused_mfu"] == t["native_fused"]["mfu"] > 0
    assert s["train_fused_fused_loss_speedup"] == pytest.approx(t["native"]["step_s"] / t["native_fused"]["step_s"])

    rows = json.loads((work / "logprobs.json").read_text())["rows"]
    ms = {(r["provider"], r["pass"]): r["ms"] for r in rows if r["shape"] == s["logprobs_shape"] and "ms" in r}
    assert s["logprobs_fwd_vs_gemm"] == pytest.approx(ms["fused", "fwd"] / ms["gemm", "fwd"], abs=1e-4)
    assert s["logprobs_fwd_bwd_vs_gemm"] == pytest.approx(ms["fused", "fwd_bwd"] / ms["gemm", "fwd_bwd"], abs=1e-4)
    assert s["logprobs_ms"]["eager"] == {"fwd": ms["eager", "fwd"], "fwd_bwd": ms["eager", "fwd_bwd"]}
    # no Liger on CPU and the dry run skips torch.compile: null, not a number
    assert s["logprobs_ms"]["liger"] is None and s["logprobs_ms"]["compile"] is None
    assert 0 < s["logprobs_extra_mem_fraction"] and s["logprobs_accuracy_ok"] is True

    eng = json.loads((work / "engine.json").read_text())["summary"]
    assert (s["engine_tokens_per_s_1"], s["engine_tokens_per_s_concurrent"], s["engine_concurrency"]) == \
        (eng["tokens_per_s_1"], eng["tokens_per_s_concurrent"], eng["concurrency"])
    comp = json.loads((work / "engine_compiled.json").read_text())["summary"]  # engine.compile: a static step on CPU
    assert comp["compile"] is True and comp["compile_s"] > 0 and s["stages"]["engine_compiled"]["figures"]["compile"]
    assert (s["engine_compiled_tokens_per_s_1"], s["engine_compiled_tokens_per_s_concurrent"],
            s["engine_compiled_compile_s"]) == (comp["tokens_per_s_1"], comp["tokens_per_s_concurrent"], comp["compile_s"])
    assert s["engine_compiled_profile"]["ms_per_token"] == comp["profile"]["ms_per_token"] > 0
    bf16 = json.loads((work / "engine_bf16.json").read_text())
    assert bf16["params"]["dtype"] == "bfloat16" and s["stages"]["engine_bf16"]["figures"]["dtype"] == "bfloat16"
    assert (s["engine_bf16_tokens_per_s_1"], s["engine_bf16_tokens_per_s_concurrent"], s["engine_bf16_cuda_graph"]) == \
        (bf16["summary"]["tokens_per_s_1"], bf16["summary"]["tokens_per_s_concurrent"], False)  # no graphs on a CPU

    # true_on_policy: the bench's own checks and ratios; each variant's tokens/s and step time
    op = json.loads((work / "on_policy.json").read_text())
    assert s["on_policy_passed"] is True and s["on_policy_checks"] == op["summary"]["checks"]
    assert s["on_policy_checks"]["alone_equals_batched"] and not s["on_policy_checks"]["off_alone_equals_batched"]
    assert s["on_policy_engine_time_on_vs_off"] == op["summary"]["engine_time_on_vs_off"] > 0
    assert s["on_policy_train_step_on_vs_off"] == pytest.approx(
        op["variants"]["on"]["train_step_cpu_s"] / op["variants"]["off"]["train_step_cpu_s"], abs=1e-3)
    assert s["on_policy_engine_tokens_per_s"] == {v: r["engine_tokens_per_s"] for v, r in op["variants"].items()}
    # the Gated DeltaNet scan: no Triton (no CUDA, no interpreter) and no fla on this CPU: null ratios,
    # the reasons kept; the accuracy check ran on the torch form
    gd = json.loads((work / "gated_delta.json").read_text())
    assert s["gated_delta_triton_vs_torch"] == {"fwd": None, "fwd_bwd": None}
    assert s["gated_delta_accuracy_ok"] is True and s["gated_delta_accuracy_check_can_fail"] is True
    assert "needs CUDA" in s["stages"]["gated_delta"]["figures"]["errors"]["triton_fwd"]
    assert s["stages"]["gated_delta"]["figures"]["ms"] == gd["summary"]["ms"] and "torch_fwd" in gd["summary"]["ms"]
    assert s["gated_delta_fla_triton_vs_fla"] == {"fwd": None, "fwd_bwd": None}
    assert s["gated_delta_fla"].startswith("not available")

    # the grouped GEMM's decode tiles (Triton's interpreter on a CPU: accuracy, a choice, the check)
    gmm = json.loads((work / "grouped_gemm.json").read_text())["summary"]["float32"]
    assert s["grouped_gemm_best"] == {"float32": gmm["best"]} and gmm["accuracy_check_can_fail"]
    assert s["grouped_gemm_best_vs_large_tiles"]["float32"] == pytest.approx(gmm["best_us"] / gmm["large_tiles_us"],
                                                                            abs=1e-3)
    assert s["grouped_gemm_tiles_file"] is None and s["engine_grouped_gemm_tiles"] is None  # no GPU here

    m = [json.loads(line) for line in (work / "gpu_1x" / "metrics.jsonl").read_text().splitlines()]
    assert s["gpu_1x_steps_done"] == m[-1]["step"] == len(m)
    assert s["gpu_1x_reward_first10"] == pytest.approx(sum(r["reward_mean"] for r in m[:10]) / 10)
    assert s["gpu_1x_reward_last10"] == pytest.approx(sum(r["reward_mean"] for r in m[-10:]) / 10)
    assert s["gpu_1x_s_per_step"] == pytest.approx((m[-1]["wall_s"] - m[0]["wall_s"]) / (len(m) - 1))
    assert s["gpu_1x_compiled_s_per_step"] is None  # the by-name stage did not run

    assert (s["pytest_gpu_passed"], s["pytest_gpu_failed"]) == (0, 0) and s["pytest_gpu_skipped"] > 0

    # the archive: every stage output and log, the summary itself, nothing left out
    with tarfile.open(tmp_path / "out" / "gpu_round.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"gpu_round/gpu_summary.json", "gpu_round/train_medium.json", "gpu_round/gpu_1x/metrics.jsonl",
            "gpu_round/pytest_gpu.json.xml"} <= names and s["archive_left_out"] == []


def test_failed_skipped_and_missing_stages_give_null_and_keep_their_exit_code(work, tmp_path):
    (work / "train_large.json").unlink()                 # killed by its cap before writing
    set_stage(work, "train_large", rc=124)
    (work / "engine.json").write_text("")                # failed before printing its JSON
    set_stage(work, "engine", rc=2)
    (work / "logprobs.json").write_text('{"rows": [')    # cut off mid-write
    set_stage(work, "logprobs", rc=137)
    (work / "pytest_gpu.json.xml").unlink()
    set_stage(work, "pytest_gpu", rc=None, seconds=0, skipped="round budget spent")
    set_stage(work, "gpu_1x", rc=124)                    # its time cap: its normal end, figures kept
    rc, s = summarize(work, tmp_path / "out")

    assert rc == 1
    assert s["stage_rc"] == {"install": 0, "train_medium": 0, "train_large": 124, "logprobs": 137, "engine": 2,
                             "engine_compiled": 0, "engine_bf16": 0, "pytest_gpu": None, "gpu_1x": 124, "train_fused": 0,
                             "train_large_megatron": 0, "on_policy": 0, "gated_delta": 0, "gated_delta_fla": 0,
                             "grouped_gemm": 0}
    assert s["stages"]["pytest_gpu"]["status"] == "skipped" and s["stages"]["engine"]["status"] == "failed"
    # the large preset's other rows come from their own stage, which ran
    assert s["megatron_vs_native_large"] is not None and s["recompute_step_ratio_large"] is not None
    for key in ("train_large_native_mfu", "train_large_compile_s",
                "logprobs_fwd_vs_gemm", "logprobs_fwd_bwd_vs_gemm", "logprobs_extra_mem_fraction",
                "engine_tokens_per_s_1", "engine_tokens_per_s_concurrent", "pytest_gpu_passed", "pytest_gpu_failed"):
        assert s[key] is None, key
    assert s["logprobs_ms"]["fused"] is None
    assert s["missing"]["train_large"].startswith("no output") and s["missing"]["engine"].startswith("empty output")
    assert s["missing"]["logprobs"].startswith("unreadable")
    assert s["train_medium_native_mfu"] is not None and s["gpu_1x_steps_done"] is not None


def test_a_backend_that_failed_inside_the_train_bench_gives_null(work, tmp_path):
    t = json.loads((work / "train_medium.json").read_text())
    for k in ("megatron", "speedup", "recompute_step_ratio", "recompute_cpu_ratio"):
        t.pop(k)
    t["megatron"] = {"error": "AttributeError: 'functools.partial' object has no attribute 'module'"}
    (work / "train_medium.json").write_text(json.dumps(t))
    set_stage(work, "train_medium", rc=1)
    rc, s = summarize(work, tmp_path / "out")
    assert rc == 1 and s["megatron_vs_native_medium"] is None and s["recompute_step_ratio_medium"] is None
    assert s["train_medium_native_mfu"] == t["native"]["mfu"]
    assert "functools.partial" in s["stages"]["train_medium"]["figures"]["megatron"]["error"]


def test_pytest_counts_come_from_a_real_junit_report(work, tmp_path):
    tests = tmp_path / "t" / "test_four.py"
    tests.parent.mkdir()
    tests.write_text("import pytest\n"
                     "def test_a(): pass\n"
                     "def test_b(): pass\n"
                     "def test_c(): assert 1 == 2\n"
                     "@pytest.mark.skip(reason='x')\ndef test_d(): pass\n"
                     "@pytest.fixture\ndef broken(): raise RuntimeError('setup')\n"
                     "def test_e(broken): pass\n")
    # started with SIGINT ignored, as a background job of a non-interactive shell is: the round's
    # wrapper still stops on it
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "pytest_interruptible.py"), "-q", "-p",
                        "no:cacheprovider", str(tests), f"--junitxml={work / 'pytest_gpu.json.xml'}"],
                       cwd=tests.parent, capture_output=True, text=True, timeout=120,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert r.returncode == 1, r.stdout
    set_stage(work, "pytest_gpu", rc=1)
    _, s = summarize(work, tmp_path / "out")
    assert (s["pytest_gpu_passed"], s["pytest_gpu_failed"], s["pytest_gpu_skipped"]) == (2, 2, 1)
    assert sorted(t.split("::")[-1] for t in s["pytest_gpu_failed_tests"]) == ["test_c", "test_e"]


def test_archive_stays_under_its_limit_by_leaving_out_the_largest_files(work, tmp_path):
    import os

    (work / "profiles" / "logprobs").mkdir(parents=True, exist_ok=True)
    (work / "profiles" / "logprobs" / "fwd_trace.json").write_bytes(os.urandom(300_000))  # incompressible
    (work / "gpu_1x" / "checkpoints" / "step_30").mkdir(parents=True)
    (work / "gpu_1x" / "checkpoints" / "step_30" / "config.json").write_text("{}")
    _, s = summarize(work, tmp_path / "out", "--max-archive-mb", "0.25")
    assert s["archive_left_out"] == ["profiles/logprobs/fwd_trace.json"]
    assert s["archive_bytes"] == (tmp_path / "out" / "gpu_round.tar.gz").stat().st_size <= 0.25 * 2**20
    with tarfile.open(tmp_path / "out" / "gpu_round.tar.gz") as tar:
        assert not [n for n in tar.getnames() if "checkpoint" in n]


def round_(tmp_path, *stages, **env):
    import os

    work, out = tmp_path / "round", tmp_path / "out"
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_round.sh"), *stages], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ, GPU_ROUND_DEVICE="cpu", GPU_ROUND_WORK=str(work),
                                             OUT=str(out), **{"PYTHON": sys.executable, **env}))
    return r, json.loads((out / "gpu_summary.json").read_text())


def test_the_round_script_runs_a_stage_and_records_it(tmp_path):
    """scripts/gpu_round.sh itself, one cheap stage on CPU: its JSON reaches the summary."""
    r, s = round_(tmp_path, "engine")
    assert r.returncode == 0, r.stdout + r.stderr
    assert s["stage_rc"] == {"engine": 0} and s["engine_tokens_per_s_1"] > 0 and s["engine_concurrency"] == 8
    assert (tmp_path / "out" / "gpu_round.tar.gz").exists()


def test_the_round_runs_a_stage_whose_own_cap_is_under_a_minute(tmp_path):
    """Only a stage the budget cut to under a minute is skipped: gated_delta's 25 s cap (at GPU
    scale) is its own, so it runs (to its end or to its cap on a busy CPU), not skipped."""
    r, s = round_(tmp_path, "gated_delta", GPU_ROUND_SCALE="1")
    stage = s["stages"]["gated_delta"]
    assert stage["cap_s"] == 25 and stage["rc"] in (0, 124), r.stdout + r.stderr
    assert stage["status"] in ("ok", "time cap")


def test_the_round_skips_a_stage_its_budget_cannot_fit(tmp_path):
    r, s = round_(tmp_path, "engine", GPU_ROUND_BUDGET_S="30")
    assert r.returncode == 1
    assert s["stage_rc"] == {"engine": None} and s["stages"]["engine"]["status"] == "skipped"
    assert s["engine_tokens_per_s_1"] is None


def test_a_pytest_run_stopped_by_its_cap_still_gives_the_tests_that_ended(work, tmp_path):
    """gpu_round.sh sends pytest a SIGINT before the stage's cap: pytest stops and still writes
    its JUnit report, so the summary counts the tests that ended instead of giving null."""
    tests = tmp_path / "t" / "test_cut.py"
    tests.parent.mkdir()
    tests.write_text("import os, signal\n"
                     "def test_a(): pass\n"
                     "def test_b(): pass\n"
                     "def test_c(): os.kill(os.getpid(), signal.SIGINT)\n"  # the cap's SIGINT, mid-run
                     "def test_d(): pass\n")
    # started with SIGINT ignored, as a background job of a non-interactive shell is: the round's
    # wrapper still stops on it
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "pytest_interruptible.py"), "-q", "-p",
                        "no:cacheprovider", str(tests), f"--junitxml={work / 'pytest_gpu.json.xml'}"],
                       cwd=tests.parent, capture_output=True, text=True, timeout=120,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert r.returncode == 2 and "KeyboardInterrupt" in r.stdout, r.stdout  # interrupted
    set_stage(work, "pytest_gpu", rc=124)
    _, s = summarize(work, tmp_path / "out")
    assert (s["pytest_gpu_passed"], s["pytest_gpu_failed"]) == (2, 0)
    assert s["stages"]["pytest_gpu"]["status"] == "time cap"


def test_the_caps_of_all_leave_gpu_1x_its_minute():
    """`all`'s stages between install and gpu_1x fit the round's budget with a minute left for gpu_1x, so the
    main job runs even when every other stage runs to its cap."""
    import re

    text = (ROOT / "scripts" / "gpu_round.sh").read_text()
    stages = re.search(r"^ALL_STAGES=\(([^)]*)\)", text, re.M).group(1).split()
    caps = {m.group(1): int(m.group(2)) for m in re.finditer(r"^  st (\w+)\s+(\d+)\s", text, re.M)}
    budget = int(re.search(r"GPU_ROUND_BUDGET_S:-\$\(\((\d+) \* SCALE", text).group(1))
    reserve, min_stage = (int(re.search(rf"^{k}=(\d+)", text, re.M).group(1)) for k in ("RESERVE", "MIN_STAGE"))
    assert stages[0] == "install" and stages[-1] == "gpu_1x" and set(stages) <= set(caps)
    before = sum(caps[s] for s in stages[1:-1])          # the budget starts after the install
    assert before + min_stage <= budget - reserve, (before, budget, reserve)


def test_a_failed_install_ends_the_round(tmp_path):
    """Without the install nothing imports (moe_rl.kernels lives where the editable install maps
    it): the stages after a failed install are skipped, not run to their errors."""
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/bash\ncase "$*" in *"-m pip"*|*"import moe_rl._C"*) exit 1;; esac\nexec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    r, s = round_(tmp_path, "install", "engine", PYTHON=str(fake))
    assert r.returncode == 1 and "engine: skipped, the install failed" in r.stdout, r.stdout + r.stderr
    assert s["stage_rc"] == {"install": 1, "engine": None} and s["stages"]["engine"]["status"] == "skipped"


def test_the_commit_fetch_recorded_wins_over_an_older_git_where_the_tree_matches_it(tmp_path, monkeypatch):
    """A device copy of the tree may carry a .git older than its files: .whl/COMMIT, written by
    `gpu_round.sh fetch` with every tracked file's hash, names the round's commit while the files
    match those hashes; once a file differs, git's answer (with its local changes) is given."""
    import hashlib
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_summary_mod", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.delenv("GPU_ROUND_COMMIT", raising=False)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    (tmp_path / "a.py").write_text("old\n")
    subprocess.run(git + ["init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(git + ["add", "a.py"], cwd=tmp_path, check=True)
    subprocess.run(git + ["commit", "-qm", "old"], cwd=tmp_path, check=True)
    (tmp_path / "a.py").write_text("new\n")  # the files of a later commit, over the old .git
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "COMMIT").write_text("feedc0ffee12\n")
    (tmp_path / ".whl" / "tree.sha256").write_text(hashlib.sha256(b"new\n").hexdigest() + "  a.py\n")
    info = mod.commit_info(tmp_path)
    assert info["commit"] == "feedc0ffee12" and info["tree_matches_commit"], info
    (tmp_path / "a.py").write_text("edited on the device\n")
    info = mod.commit_info(tmp_path)
    assert info["commit_source"] == "git" and info["commit"].endswith("+local-changes"), info
