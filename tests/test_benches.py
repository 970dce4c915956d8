"""Every `moe-rl bench NAME --json` runs (at small sizes) and prints the summary keys its issue
asks for. Figures are not checked here: they belong to docs/benchmarks.md, not to unit tests."""
import json
import os
import subprocess
import sys

import pytest

CASES = {
    "replay": (["--tokens", "512", "--reps", "1", "--records", "4"],
               ["bytes_per_token", "int32_bytes_per_token", "encode_gbps", "decode_gbps", "numpy_encode_gbps",
                "numpy_decode_gbps"]),
    "engine": (["--max-new-tokens", "4", "--concurrency", "4", "--sequential-requests", "2", "--repeats", "1",
                "--ttft-samples", "2"],
               ["tokens_per_s_1", "tokens_per_s_concurrent", "ttft_ms", "concurrency", "kv_slots", "device",
                "static_decode", "cuda_graph", "decode_static_steps", "decode_graph_steps", "variants"]),
    "sync": (["--reps", "1", "--buckets", "1", "--scale", "0.1", "--http"],
             ["per_tensor_gbps", "flat_gbps", "bucketed_gbps", "best_bucket_mb", "peak_extra_mib", "device",
              "http_gbps", "http_vs_flat"]),
    "routing": (["--samples", "4", "--max-new-tokens", "4", "--preset", "config"],
                ["kl_replay", "kl_no_replay", "routing_match_replay", "routing_match_no_replay"]),
    "exact": (["--shapes", "tiny", "--rounds", "1"],
              ["tiny", "accuracy_ok", "invariant", "torch_variant_cases", "checks_can_fail"]),
    "gated-delta": (["--device", "cpu", "--reps", "1", "--shapes", "2,64,2,16,16"],  # (auto: cuda on a GPU)
                    ["triton_vs_torch", "triton_vs_fla", "accuracy_ok", "accuracy_check_can_fail", "fla", "ms"]),
    "grouped-gemm": (["--device", "cpu", "--reps", "1", "--dtypes", "fp32", "--rows", "4"],  # the interpreter
                     ["float32"]),
    "on-policy": (["--rounds", "1"], ["engine_time_on_vs_off", "train_step_on_vs_off", "skip_saving", "exact",
                                      "off_mismatch_live", "machine", "checks", "passed", "clock", "device"]),
    "async": (["--steps", "3"],
              ["samples_per_s_async", "samples_per_s_sync", "busy_trainer_async", "busy_rollout_async",
               "final_reward_async", "final_reward_sync", "final_eval_reward_async", "final_eval_reward_sync",
               "final_reward_by_version_async", "final_reward_by_version_sync"]),
}


@pytest.mark.slow  # long: scheduled first (tests/conftest.py); runs in CI
@pytest.mark.parametrize("name", sorted(CASES))
def test_bench_prints_its_summary(name):
    args, keys = CASES[name]
    # grouped-gemm on a CPU runs its Triton kernel in the interpreter (as `make test` sets it)
    env = dict(os.environ, TRITON_INTERPRET="1") if name == "grouped-gemm" else None
    r = subprocess.run([sys.executable, "-m", "moe_rl.cli", "bench", name, "--json", *args],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert set(keys) <= set(out["summary"]), set(keys) - set(out["summary"])
    if name == "engine":  # each decode mode that runs on a CPU, measured with the summary's keys
        variants = out["summary"]["variants"]
        assert set(variants) == {"dynamic", "static"}
        assert variants["static"]["decode_static_steps"] > 0 and variants["dynamic"]["decode_static_steps"] == 0
        assert {"tokens_per_s_1", "tokens_per_s_concurrent", "ttft_ms"} <= set(variants["static"])
    if name == "grouped-gemm":  # a tile choice among accurate candidates, the check able to fail
        s = out["summary"]["float32"]
        assert s["best"] and s["candidates_accurate"] >= 1 and s["accuracy_check_can_fail"]
    if name == "on-policy":  # every exact check passed (exit 0); without the key the same comparisons differ
        checks = out["summary"]["checks"]
        assert checks["alone_equals_batched"] and checks["decode_equals_prefill"] and checks["checks_can_fail"]
        assert not checks["off_alone_equals_batched"] and not checks["off_decode_equals_prefill"]


def test_bench_engine_out_keeps_what_a_stopped_run_measured(tmp_path, monkeypatch, capsys):
    """`moe-rl bench engine --out FILE` rewrites its report as figures come: a run stopped (as a
    time cap stops it) before its second variant keeps the configured engine's figures and says
    what was under way; a finished run's file is what it prints."""
    from moe_rl.bench import engine as bench_engine

    out = tmp_path / "engine.json"
    args = [*CASES["engine"][0], "--out", str(out)]
    seen = []

    def stopped():
        seen.append(json.loads(out.read_text())["summary"])
        raise SystemExit(124)

    monkeypatch.setattr(bench_engine, "_free_device_memory", stopped)
    with pytest.raises(SystemExit):
        bench_engine.main([*args, "--variants", "static"])
    s = json.loads(out.read_text())["summary"]
    assert s == seen[0] and s["stopped"] == "during the static variant"
    assert s["tokens_per_s_1"] > 0 and s["tokens_per_s_concurrent"] > 0 and s["ttft_ms"] > 0 and s["start_s"] >= 0
    assert list(s["variants"]) == ["dynamic"]
    monkeypatch.undo()
    capsys.readouterr()
    assert bench_engine.main([*args, "--variants", "none", "--json", "--profile", str(tmp_path / "prof")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    assert "stopped" not in printed["summary"] and printed["summary"]["variants"].keys() == {"dynamic"}
    # --profile: one more request between /start_profile and /stop_profile
    prof = printed["summary"]["profile"]
    assert prof["ms_per_token"] > 0 and prof["steps"] >= prof["tokens"] > 0 and prof["cpu"][0]["self_ms"] > 0
    assert sorted(p.name.split("-TP-0")[1] for p in (tmp_path / "prof").iterdir()) == [".ops.txt", ".trace.json.gz"]


def test_bench_on_policy_out_keeps_the_rounds_of_a_stopped_run(tmp_path, monkeypatch):
    """`moe-rl bench on-policy --out FILE` saves its report after each measured round: a run
    stopped (as a time cap stops it) before the exactness checks keeps the rounds' figures and
    the checks they decide (trainer = engine, the default's live mismatch), passed unknown."""
    from moe_rl.bench import on_policy

    out = tmp_path / "on_policy.json"
    seen = []

    def stopped(*a, **k):
        seen.append(json.loads(out.read_text()))
        raise SystemExit(124)

    monkeypatch.setattr(on_policy, "exactness", stopped)
    with pytest.raises(SystemExit):
        on_policy.main(["--rounds", "2", "--out", str(out)])
    r = json.loads(out.read_text())
    s = r["summary"]
    assert r == seen[0] and s["stopped"] == "after round 2 of 2, before the exactness checks"
    assert s["checks"] == {"trainer_equals_engine": True, "off_mismatch_live": True} and s["passed"] is None
    assert s["engine_time_on_vs_off"] > 0 and set(r["variants"]) == {"off", "on", "on_forward"}


def test_bench_sync_round_trip_check_can_fail():
    """`moe-rl bench sync --gpu` reports bit_identical from this check (CPU, Triton interpreter):
    true for the right plans, false for an unpack plan whose offsets are off by one tensor."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton bucket copy runs on CPU under TRITON_INTERPRET=1")
    import torch

    from moe_rl.bench.sync import round_trip_identical
    from moe_rl.kernels.bucket_pack import BucketCopy, contiguous_offsets

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=g).to(torch.bfloat16) for n in (64, 8, 4096, 24)]
    offsets = contiguous_offsets(tensors)
    outs = [torch.empty_like(t) for t in tensors]
    pack_plan = BucketCopy(tensors, offsets, torch.bfloat16)
    assert round_trip_identical(pack_plan, BucketCopy(outs, offsets, torch.bfloat16), tensors, outs)
    wrong = [offsets[1]] + offsets[1:]  # tensor 0 read from / written to tensor 1's place
    assert not round_trip_identical(pack_plan, BucketCopy(outs, wrong, torch.bfloat16), tensors, outs)
    assert not round_trip_identical(BucketCopy(tensors, wrong, torch.bfloat16),
                                    BucketCopy(outs, offsets, torch.bfloat16), tensors, outs)

@pytest.mark.slow(longest=True)  # two `moe-rl train` worlds
def test_async_bench_multi_turn_variant_runs():
    r = subprocess.run([sys.executable, "-m", "moe_rl.cli", "bench", "async", "--json", "--multi-turn", "--steps", "2",
                        "--env-latency-max", "0.1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["summary"]["workload"] == "multi-turn" and out["summary"]["speedup"] > 0
    assert all(run["steps"] == 2 and run["samples"] == 2 * 8 * 8 for run in out["runs"].values())


def test_bench_on_policy_device_cuda_without_a_gpu_says_so():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    r = subprocess.run([sys.executable, "-m", "moe_rl.cli", "bench", "on-policy", "--device", "cuda", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--device cuda but no CUDA device is visible" in r.stderr, r.stderr[-2000:]
