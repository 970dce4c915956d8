"""The embedded engine on a GPU: model and KV cache on the device, sampling on the device; its
outputs checked against the native model's recomputation on the CPU (fp32)."""
import threading

import numpy as np
import pytest
import torch

from moe_rl.engine import decode_routed_experts, output_logprobs
from moe_rl.engine.protocol import GenerateRequest
from moe_rl.engine.server import build_engine, build_model
from moe_rl.placement import engine_weight_bytes, kv_bytes_per_request

from .helpers import ARCH, CFG, K, L, recompute

pytestmark = pytest.mark.gpu


def _generate(engine, n, max_new, temperature=1.0):
    done, outs = threading.Semaphore(0), {}
    for i in range(n):
        prompt = [(7 * i + 3 * j + 1) % ARCH.vocab_size for j in range(5 + i % 4)]
        req = GenerateRequest.parse({"input_ids": prompt, "return_logprob": True, "return_routed_experts": True,
                                     "sampling_params": {"temperature": temperature, "max_new_tokens": max_new,
                                                         "sampling_seed": 100 + i}},
                                    vocab_size=ARCH.vocab_size, max_context=engine.max_context)

        def deliver(r, i=i, prompt=prompt):
            outs[i] = (prompt, r)
            done.release()

        engine.submit(req, deliver)
    for _ in range(n):
        assert done.acquire(timeout=120)
    return [outs[i] for i in range(n)]


def test_engine_on_cuda_matches_the_native_model_on_cpu():
    cpu_model = build_model(CFG)
    engine = build_engine(CFG, model=build_model(CFG), device="cuda").start()
    try:
        assert engine.device.type == "cuda" and engine.k_cache[0].is_cuda
        # the KV cache is sized from placement.mem_fraction_static (at most max_running_requests)
        free = CFG.placement.mem_fraction_static * torch.cuda.get_device_properties(0).total_memory
        fit = (free - engine_weight_bytes(CFG)) // kv_bytes_per_request(ARCH, engine.max_context, 4)
        assert engine.max_running == min(CFG.engine.max_running_requests, fit)
        outs = _generate(engine, 12, 24)  # more requests than fit at once when fit < 12
    finally:
        engine.stop()
    matched = total = 0
    for prompt, out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        ref_lp, ref_rows = recompute(cpu_model, prompt, out["output_ids"], 1.0)
        np.testing.assert_allclose(output_logprobs(out["meta_info"]), ref_lp, atol=2e-4, rtol=0)
        rows = decode_routed_experts(out, L, K)
        matched += int((rows == ref_rows).all(axis=-1).sum())
        total += rows.shape[0] * rows.shape[1]
    assert matched / total > 0.99  # top-k near-ties may flip between devices; nearly all rows agree
