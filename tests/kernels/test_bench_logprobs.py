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


def test_bench_accuracy_check_can_fail():
    # The bench's fp64 check passes the fused op and flags a planted error in each output.
    import torch

    from moe_rl.kernels.bench.logprobs import accuracy_report, check_accuracy, fp64_reference
    from moe_rl.kernels.fused_logprobs import fused_logprobs

    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(40, 32, generator=g), torch.randn(300, 32, generator=g) / 6
    labels = torch.randint(0, 300, (40,), generator=g)
    labels[::7] = -100
    assert check_accuracy(hidden, weight, labels, 0.7)["accuracy_ok"]
    g_logp, g_ent = torch.randn(40, generator=g), torch.randn(40, generator=g)
    ref = fp64_reference(hidden, weight, labels, 0.7, g_logp, g_ent, rows_per_chunk=16)
    hg, wg = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logp, ent = fused_logprobs(hg, wg, labels, 0.7, return_entropy=True)
    dh, dw = torch.autograd.grad((g_logp * logp).sum() + (g_ent * ent).sum(), [hg, wg])
    good = (logp.detach(), ent.detach(), dh, dw)
    assert accuracy_report(ref, good, torch.float32)["accuracy_ok"]
    for i in range(4):
        bad = list(good)
        bad[i] = bad[i].clone()
        bad[i].view(-1)[3] += 1e-3 * (1 + bad[i].abs().max())
        assert not accuracy_report(ref, tuple(bad), torch.float32)["accuracy_ok"], i


def test_bench_profile_writes_breakdown(tmp_path, capsys):
    rc = cli_main(["bench", "logprobs", "--json", "--shapes", "48,32,500", "--reps", "1",
                   "--no-compile", "--device", "cpu", "--profile", str(tmp_path)])
    assert rc == 0
    prof = json.loads((tmp_path / "profile.json").read_text())
    assert set(prof["passes"]) == {"fwd", "fwd_bwd"}
    for p in prof["passes"].values():
        assert p["total_ms"] > 0 and p["top"]
    assert (tmp_path / "fwd_bwd_table.txt").read_text().strip()
    assert json.loads(capsys.readouterr().out)["summary"]["accuracy_ok"] is True
