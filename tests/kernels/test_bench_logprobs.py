"""The logprobs microbenchmark runs at a tiny shape and prints the JSON the issue asks for."""
import json

from moe_rl.cli import main as cli_main


def test_bench_logprobs_json(capsys):
    rc = cli_main(["bench", "logprobs", "--json", "--shapes", "48,32,500;64,32,700",
                   "--reps", "2", "--no-compile", "--device", "cpu"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["rows"]
    assert {(r["provider"], r["pass"]) for r in rows} >= {
        (p, q) for p in ("fused", "eager", "gemm") for q in ("fwd", "fwd_bwd")}
    for r in rows:
        assert "error" not in r, r
        assert r["ms"] > 0 and r["tflops"] > 0 and r["extra_mib"] >= 0
    fused = next(r for r in rows if r["provider"] == "fused" and r["pass"] == "fwd"
                 and r["shape"] == [64, 32, 700])
    assert fused["max_abs_err_logp"] < 1e-5 and fused["max_abs_err_entropy"] < 1e-5
    eager = next(r for r in rows if r["provider"] == "eager" and r["pass"] == "fwd"
                 and r["shape"] == [64, 32, 700])
    # the materialising baseline holds at least the fp32 logits; the memory probe sees them
    assert eager["extra_mib"] >= 64 * 700 * 4 / 2**20
    s = out["summary"]
    assert s["shape"] == [64, 32, 700]  # the largest shape run
    for key in ("fwd_vs_gemm", "fwd_bwd_vs_gemm", "extra_mem_fraction", "device"):
        assert key in s
    assert s["fwd_vs_gemm"] > 0 and s["fwd_bwd_vs_gemm"] > 0 and s["extra_mem_fraction"] >= 0
