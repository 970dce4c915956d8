"""The embedded engine with a gpt-oss model: sliding-window layers keep a ring of the last
``sliding_window`` keys per request, sinks enter prefill and decode, and every generated token's
log-prob and routing equal one full forward of the whole sequence (decode runs well past the
window edge), on the dynamic step, the static one and a captured one (no host reads)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_rl.engine import decode_routed_experts, output_logprobs
from moe_rl.engine.engine import Engine
from moe_rl.model import MoEArch, MoEForCausalLM
from moe_rl.model.attention import KVSpec, RingKVSpec, sdpa, state_specs, visible

from .helpers import ROOT, check_bf16_against_fp32_replayed, decode_graphs_on_a_gpu, generate_queued
from .test_static_decode import StandInGraphs

ARCH = MoEArch(model_type="gpt_oss", vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2,
               sliding_window=5, attention_bias=True, max_position_embeddings=256,
               rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                             "truncate": False})
N = 6


@pytest.fixture(scope="module")
def model():
    model = MoEForCausalLM(ARCH).init_weights(3, std=0.2)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0, 1.0, generator=torch.Generator().manual_seed(1))
    return model


def prompt(i):
    return [(3 * i + j) % 64 for j in range(2 + 3 * i)]


def bodies(n=N):
    return [{"input_ids": prompt(i), "return_logprob": True, "return_routed_experts": True,
             "sampling_params": {"temperature": 1.0, "max_new_tokens": 12, "sampling_seed": i}} for i in range(n)]


def generate(engine, n=N):
    return generate_queued(engine, bodies(n))


def check_against_full_forward(model, outs):
    """Log-probs (1e-5) and routed experts (exactly) of one fresh forward of each sequence."""
    for i, out in enumerate(outs):
        p = prompt(i)
        seq = p + out["output_ids"]
        rec = []
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([seq]), record=rec)[0], -1)
        ref = [lp[len(p) - 1 + j, t].item() for j, t in enumerate(out["output_ids"])]
        np.testing.assert_allclose(output_logprobs(out["meta_info"]), ref, atol=1e-5, rtol=0)
        rows = decode_routed_experts(out, ARCH.num_hidden_layers, ARCH.num_experts_per_tok)
        np.testing.assert_array_equal(rows, torch.stack(rec, 1)[:-1].numpy())
    assert max(len(prompt(i)) + 12 for i in range(len(outs))) > 3 * ARCH.sliding_window  # far past the window edge


def test_sliding_layers_keep_a_window_of_keys(model):
    specs = state_specs(ARCH)
    assert [type(s) for s in specs] == [RingKVSpec, KVSpec, RingKVSpec]
    engine = Engine(model, max_running_requests=4, max_context=64)
    assert [tuple(s.k.shape) for s in engine.states] == [(4, 2, 5, 8), (4, 2, 64, 8), (4, 2, 5, 8)]
    assert specs[0].bytes_per_slot(64, 2) == 5 * 2 * 2 * 8 * 2 and specs[1].bytes_per_slot(64, 2) == 64 * 2 * 2 * 8 * 2


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_decode_equals_a_full_forward_across_the_window_edge(model, static):
    engine = Engine(model, max_running_requests=4, max_context=64, static_decode=static)
    outs = generate(engine)
    check_against_full_forward(model, outs)
    if static:
        assert engine.stats["decode_static_steps"] > 10


def test_captured_decode_reads_nothing_on_the_host(model):
    """The step with ring states captures (no host reads) and every replay issues the
    captured ops; the results still equal full forwards."""
    graphs = StandInGraphs()
    engine = Engine(model, max_running_requests=2, max_context=64, cuda_graph=True, graphs=graphs)
    assert engine.static_decoder.host_reads() == []
    outs = generate(engine, 4)
    assert graphs.replays > 10
    check_against_full_forward(model, outs)


def test_ring_span_equals_the_full_cache_from_any_start():
    """A prefill that starts mid-sequence (the ring's old entries read before they are
    overwritten) attends as the full K/V cache does, sinks included, for spans shorter and
    longer than the window."""
    g = torch.Generator().manual_seed(0)
    W, H, D = 4, 2, 8
    full, ring = KVSpec(H, D, D).allocate(2, 32, torch.float32, "cpu"), RingKVSpec(H, D, D, W).allocate(2, 32, torch.float32, "cpu")
    sinks = torch.randn(4, generator=g)
    start = 0
    for n in (3, 1, 6, 2, 9):
        k, v, q = torch.randn(n, H, D, generator=g), torch.randn(n, H, D, generator=g), torch.randn(1, 4, n, D, generator=g)
        qpos = torch.arange(start, start + n)
        outs = []
        for cache in (full, ring):
            ks, vs, kpos = cache.span(1, start, k, v)
            outs.append(sdpa(q, ks, vs, mask=visible(qpos[:, None], kpos[None, :], W), sinks=sinks))
        torch.testing.assert_close(outs[1], outs[0], atol=1e-6, rtol=0)
        start += n
    ks, _ = ring.gather(torch.tensor([1]), 32)
    pos = ring.key_positions(torch.tensor([start - 1]), W)[0]
    assert sorted(pos.tolist()) == list(range(start - W, start))  # the last W positions, each where it belongs
    torch.testing.assert_close(ks[0, :, pos.argsort()], full.k[1, :, start - W:start], atol=0, rtol=0)


def test_gpt_oss_20b_config_kv_bytes_and_sglang_line(capsys):
    """configs/gpt_oss_20b_1x8.yaml: the released shape (12 sliding layers of window 128, 12 full),
    whose KV cache per token at 8k context is 12 x 128 / 8192 + 12 layers' worth of K/V (8 heads x
    64 x 2 x bf16 = 2 KiB a layer) instead of 24; ``moe-rl serve --dry-run`` prints its SGLang line."""
    from moe_rl.cli import main
    from moe_rl.config import load_config
    from moe_rl.placement import kv_bytes_per_request

    path = str(ROOT / "configs" / "gpt_oss_20b_1x8.yaml")
    arch = load_config(path, ["model.path=null"]).model.arch()
    assert arch.layer_kinds() == ["swa", "mha"] * 12 and arch.sliding_window == 128 and arch.num_experts == 32
    layer = 8 * 64 * 2 * 2
    ring, full = kv_bytes_per_request(arch, 8192, 2), kv_bytes_per_request(
        arch.model_copy(update={"layer_types": ["full_attention"] * 24}), 8192, 2)
    assert (ring, full) == (12 * layer * (128 + 8192), 24 * layer * 8192)
    assert full / ring > 1.96
    # model.path (the MXFP4 release, which serve resolves) is not on this machine; SGLang's
    # --model-path is engine.sglang_model_path either way
    assert main(["serve", path, "model.path=null", "--dry-run"]) == 0
    line = capsys.readouterr().out
    assert "--model-path /models/gpt-oss-20b-bf16" in line and "--tp-size 4 --ep-size 4" in line
    assert "--enable-return-routed-experts" in line


@pytest.mark.gpu
def test_gpt_oss_decode_graphs_on_a_gpu(model):
    """On a GPU (bf16, sm_90+): the gpt-oss engine captures its decode step (ring states, sinks)
    and the replayed graphs give the eager static step's outputs; both follow the fp32 CPU model's
    full forwards within bf16 rounding."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the capturable (CUTLASS) grouped GEMM needs sm_90+")
    outs = decode_graphs_on_a_gpu(model, bodies(), max_running_requests=4, max_context=64)
    check_bf16_against_fp32_replayed(model, bodies(), outs)
