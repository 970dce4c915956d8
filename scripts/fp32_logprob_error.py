"""How accurate fp32 log-probs are, as figures: how far from the fp64 reference the log-probs and
entropy are for the plain materialised fp32 computation and for each fused provider, on one
device, at the shape of the test that failed on an H100 (1024 x 4096 x 32000, T = 0.7).

    python scripts/fp32_logprob_error.py [--device cuda] [--n 1024 --h 4096 --v 32000]

The test's fp32 bar (tests/kernels/test_fused_logprobs.py, ``check``) is the larger of 1e-5
and twice the materialised computation's error: this prints both sides of that comparison.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_rl.kernels import fused_logprobs  # noqa: E402
from tests.kernels.test_fused_logprobs import make_inputs, reference  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--h", type=int, default=4096)
    ap.add_argument("--v", type=int, default=32000)
    ap.add_argument("--temperature", type=float, default=0.7)
    a = ap.parse_args()
    hidden, weight, labels = make_inputs(a.n, a.h, a.v, torch.float32)
    ref_lp, ref_ent = reference(hidden, weight, labels, a.temperature)  # fp64, on the CPU
    hidden, weight, labels = hidden.to(a.device), weight.to(a.device), labels.to(a.device)

    def err(lp, ent):
        d_lp = (lp.double().cpu() - ref_lp).abs()
        d_ent = (ent.double().cpu() - ref_ent).abs()
        return {"logp_max": float(d_lp.max()), "logp_over_1e-5": int((d_lp > 1e-5).sum()),
                "entropy_max": float(d_ent.max()), "entropy_over_1e-5": int((d_ent > 1e-5).sum())}

    out = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
           "shape": [a.n, a.h, a.v], "temperature": a.temperature,
           "materialised_fp32": err(*reference(hidden, weight, labels, a.temperature, dtype=torch.float32))}
    for impl in (["torch", "triton"] if a.device == "cuda" else ["torch"]):
        with torch.no_grad():
            out[f"fused_{impl}"] = err(*fused_logprobs(hidden, weight, labels, a.temperature,
                                                       return_entropy=True, impl=impl))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
