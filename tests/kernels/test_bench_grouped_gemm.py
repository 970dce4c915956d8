"""`moe-rl bench grouped-gemm` (moe_rl.kernels.bench.grouped_gemm): its accuracy check fails a call
whose group ends are off by a row, and its choice never takes an inaccurate candidate."""
import pytest
import torch

from moe_rl.kernels import grouped_gemm as gg
from moe_rl.kernels.bench import grouped_gemm as bench

pytestmark = pytest.mark.skipif(gg.triton is None or not (gg.TRITON_INTERPRET or torch.cuda.is_available()),
                                reason="needs triton with TRITON_INTERPRET=1 or a GPU")


def test_decode_offs_route_each_token_to_top_k_distinct_experts():
    offs = bench.decode_offs(64, 8, 2, torch.Generator().manual_seed(0), "cpu")
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    assert int(offs[-1]) == 64 and counts.max() <= 32 and (counts >= 0).all()


def test_the_check_passes_the_kernel_and_fails_shifted_group_ends():
    dims = bench.CPU_DIMS
    rows = bench.bench_dtype(torch.float32, dims, [4], bench.CPU_CANDIDATES[:1], torch.device("cpu"), 1,
                             torch.Generator().manual_seed(0))
    assert rows and all(r["accurate"] for r in rows)
    assert bench.check_can_fail(torch.float32, dims, torch.device("cpu"), (16, *bench.CPU_CANDIDATES[0]),
                                torch.Generator().manual_seed(1))


def test_an_inaccurate_candidate_is_never_chosen():
    def row(blocks, us, accurate, gemm):
        return {"dtype": "float32", "rows": 4, "gemm": gemm, "provider": "candidate", "blocks": blocks, "us": us,
                "accurate": accurate, "calls_per_layer": 2 if gemm == "gate_up" else 1}
    fast_wrong, slow_right = [16, 32, 64, 4, 3], [16, 64, 32, 4, 3]
    rows = [row(fast_wrong, 1.0, False, "gate_up"), row(fast_wrong, 1.0, True, "down"),
            row(slow_right, 9.0, True, "gate_up"), row(slow_right, 9.0, True, "down")]
    s = bench.summarise(rows, torch.float32)
    assert s["best"] == slow_right and s["best_us"] == 27.0 and s["candidates_accurate"] == 1
