"""The embedded engine on a GPU: model and KV cache on the device, sampling on the device; its
outputs checked against the native model's recomputation on the CPU (fp32)."""

import numpy as np
import pytest
import torch

from moe_rl.config import load_config
from moe_rl.engine import decode_routed_experts, output_logprobs
from moe_rl.engine.server import build_engine, build_model
from moe_rl.placement import engine_weight_bytes, kv_bytes_per_request

from .helpers import ARCH, CFG, CONFIG, OVERRIDES, K, L, generate, generate_queued, recompute

pytestmark = pytest.mark.gpu


def _generate(engine, n, max_new, temperature=1.0):
    prompts = [[(7 * i + 3 * j + 1) % ARCH.vocab_size for j in range(5 + i % 4)] for i in range(n)]
    outs = generate(engine, [{"input_ids": prompt, "return_logprob": True, "return_routed_experts": True,
                              "sampling_params": {"temperature": temperature, "max_new_tokens": max_new,
                                                  "sampling_seed": 100 + i}} for i, prompt in enumerate(prompts)])
    return list(zip(prompts, outs))


def test_engine_on_cuda_matches_the_native_model_on_cpu():
    cpu_model = build_model(CFG)
    engine = build_engine(CFG, model=build_model(CFG), device="cuda").start()
    try:
        assert engine.device.type == "cuda" and engine.states[0].k.is_cuda
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


def _bodies(n, max_new):
    return [{"input_ids": [(7 * i + 3 * j + 1) % ARCH.vocab_size for j in range(5 + 13 * i)], "return_logprob": True,
             "return_routed_experts": True,
             "sampling_params": {"temperature": 1.0, "max_new_tokens": max_new + 3 * i, "sampling_seed": 100 + i}}
            for i in range(n)]


def test_decode_cuda_graphs_replay_the_eager_static_step():
    """engine.cuda_graph on a GPU: every (batch, context) shape captured at start, the decode
    steps replayed, and the outputs those of the same static step run eagerly."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the capturable (CUTLASS) grouped GEMM needs sm_90+")
    cfg = load_config(CONFIG, OVERRIDES + ["engine.dtype=bfloat16", "engine.max_context=256"])
    eager = build_engine(cfg, device="cuda", cuda_graph=False, static_decode=True)
    graphs = build_engine(cfg, device="cuda")  # engine.cuda_graph unset: on for bf16 on sm_90+
    assert graphs.cuda_graph and not eager.cuda_graph
    # queued before start: both engines run the same batches, so the same padded shapes
    want, got = generate_queued(eager, _bodies(12, 20), 300), generate_queued(graphs, _bodies(12, 20), 300)
    dec = graphs.static_decoder
    assert graphs.stats["decode_graphs"] == len(dec.batch_sizes) * len(dec.context_sizes)
    assert graphs.stats["decode_graph_steps"] == eager.stats["decode_static_steps"] > 20
    for a, b in zip(want, got):
        assert a["output_ids"] == b["output_ids"]
        np.testing.assert_allclose(output_logprobs(b["meta_info"]), output_logprobs(a["meta_info"]), rtol=0, atol=1e-5)
        np.testing.assert_array_equal(decode_routed_experts(b, L, K), decode_routed_experts(a, L, K))


@pytest.mark.slow  # Inductor compiles 2 graphs of the step: scheduled first
def test_a_compiled_decode_step_gives_the_eager_steps_outputs():
    """engine.compile on a GPU (Inductor, fp32 like configs/gpu_1x.yaml, graphs on): compiled
    at start, every decode step replayed from graphs of the compiled step, and the tokens,
    log-probs (fused kernels round differently: 1e-4) and nearly all routing of the eager engine."""
    cfg = load_config(CONFIG, OVERRIDES + ["engine.max_context=256"])
    eager = build_engine(cfg, device="cuda", cuda_graph=True)
    compiled = build_engine(cfg, device="cuda", cuda_graph=True, compile=True)
    want, got = generate_queued(eager, _bodies(12, 20), 300), generate_queued(compiled, _bodies(12, 20), 300)
    assert compiled.static_decoder.compiled and compiled.static_decoder.compile_s > 0
    assert compiled.stats["decode_graph_steps"] == eager.stats["decode_graph_steps"] > 20
    matched = total = 0
    for a, b in zip(want, got):
        assert a["output_ids"] == b["output_ids"]
        np.testing.assert_allclose(output_logprobs(b["meta_info"]), output_logprobs(a["meta_info"]), rtol=0, atol=1e-4)
        ra, rb = decode_routed_experts(a, L, K), decode_routed_experts(b, L, K)
        matched += int((ra == rb).all(axis=-1).sum())
        total += ra.shape[0] * ra.shape[1]
    assert matched / total > 0.99


def test_a_step_reads_the_device_once():
    """With graphs on, the only synchronizing call of a step (prefill or decode) is the one read
    of its sampled tokens, log-probs and routing record (torch's sync debug mode counts them)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the capturable (CUTLASS) grouped GEMM needs sm_90+")
    import warnings

    cfg = load_config(CONFIG, OVERRIDES + ["engine.dtype=bfloat16", "engine.max_context=256"])
    engine = build_engine(cfg, device="cuda").start()  # captures the graphs (those synchronize)
    try:
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                _generate(engine, 8, 24)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        engine.stop()
    syncs = [w for w in seen if "synchronizing CUDA operation" in str(w.message)]
    assert engine.stats["decode_graph_steps"] > 10
    assert len(syncs) == engine.stats["steps"], [f"{w.filename}:{w.lineno}" for w in syncs][:20]


def test_host_reads_are_found_on_a_gpu():
    """The check before capture sees CUDA reads; an engine whose step has one (float64 experts:
    padded_grouped_mm) runs without graphs when engine.cuda_graph is unset, one without (float32:
    the Triton grouped GEMM) with them."""
    from moe_rl.engine.decode import host_reads

    x = torch.ones(4, device="cuda")
    with torch.inference_mode():
        assert host_reads(lambda: x.sum().item()) and host_reads(lambda: x.cpu()) and host_reads(lambda: x.nonzero())
        assert not host_reads(lambda: x * 2)
    cfg = load_config(CONFIG, OVERRIDES + ["engine.max_context=256"])  # engine.dtype float32
    engine = build_engine(cfg, device="cuda")
    assert engine.cuda_graph  # unset: on until start finds out
    with torch.inference_mode():
        reads = engine.static_decoder.host_reads()
    engine.start()
    engine.stop()
    assert engine.cuda_graph == (not reads)
