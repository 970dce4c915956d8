"""The embedded engine with a hybrid Gated DeltaNet model (Qwen3-Next): per-request conv and
recurrent states beside the full-attention layers' KV cache, prefill chunked and decode
recurrent, in continuous batching, the static decode step and its CUDA-graph logic; the state
through an in-place weight update (transformers' own cached decode is the reference), abort
(the slot is freed and its next request reads nothing of it) and retract (re-prefill)."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from moe_rl.engine import decode_routed_experts, output_logprobs
from moe_rl.engine.engine import Engine
from moe_rl.engine.protocol import GenerateRequest
from moe_rl.model import MoEArch, MoEForCausalLM, save_hf
from moe_rl.model.attention import RecurrentState

from .helpers import generate_queued, wait_for
from .test_static_decode import StandInGraphs

ARCH = MoEArch(model_type="qwen3_next", vocab_size=64, hidden_size=64, num_hidden_layers=4, num_experts=8,
               num_experts_per_tok=2, shared_expert_intermediate_size=32, max_position_embeddings=512)
V, L, K = ARCH.vocab_size, ARCH.num_hidden_layers, ARCH.num_experts_per_tok


@pytest.fixture(scope="module")
def model():
    return MoEForCausalLM(ARCH).init_weights(0)


def bodies(n=5):
    """Prompts of 3 to 163 tokens and outputs of 10 to 50: prefills of one to three chunks,
    decodes crossing chunk boundaries, the batch shrinking step by step."""
    return [{"input_ids": [(7 * i + 3 * j + 1) % V for j in range(3 + 40 * i)], "return_logprob": True,
             "return_routed_experts": True,
             "sampling_params": {"temperature": 1.0, "max_new_tokens": 10 + 10 * i, "sampling_seed": i}}
            for i in range(n)]


def native(model, prompt, output):
    """Log-probs of ``output`` and routing rows [seqlen - 1, L, K] from one full forward (the
    chunked rule over the whole sequence)."""
    record = []
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt + output]), record=record)[0].float(), -1)
    P = len(prompt)
    return [lp[P - 1 + j, t].item() for j, t in enumerate(output)], torch.stack(record, 1).numpy()[:-1]


def check(model, outs, reqs, atol=1e-5):
    for body, out in zip(reqs, outs):
        ref_lp, ref_rows = native(model, body["input_ids"], out["output_ids"])
        np.testing.assert_allclose(output_logprobs(out["meta_info"]), ref_lp, atol=atol, rtol=0)
        np.testing.assert_array_equal(decode_routed_experts(out, L, K), ref_rows)


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_decode_equals_the_full_forward(model, static):
    """Recurrent decode (and chunked prefill) against a chunked full forward: log-probs within
    1e-5, the same experts on every layer (every layer is MoE)."""
    engine = Engine(model, max_running_requests=8, max_context=256, static_decode=static)
    outs = generate_queued(engine, bodies())
    check(model, outs, bodies())
    assert engine.stats["decode_static_steps" if static else "steps"] > 20


def test_decode_step_is_captured_on_cpu(model):
    """The static step with recurrent layers reads nothing on the host and replays as captured
    (the CPU stand-in for CUDA graphs)."""
    want = generate_queued(Engine(model, max_running_requests=6, max_context=256, static_decode=True), bodies(4))
    graphs = StandInGraphs()
    engine = Engine(model, max_running_requests=6, max_context=256, cuda_graph=True, graphs=graphs)
    assert engine.static_decoder.host_reads() == []
    got = generate_queued(engine, bodies(4))
    assert graphs.replays > 10 and engine.stats["decode_graph_steps"] == graphs.replays
    for a, b in zip(want, got):
        assert a["output_ids"] == b["output_ids"]
        np.testing.assert_allclose(output_logprobs(b["meta_info"]), output_logprobs(a["meta_info"]), atol=1e-6)


@pytest.mark.gpu
def test_hybrid_decode_graphs_on_a_gpu(model):
    """On a GPU (bf16, sm_90+): prefill through the Triton chunk scan, recurrent decode, the decode
    step captured as CUDA graphs; the replayed graphs give the eager static step's outputs, and
    both follow the fp32 CPU model's full forwards within bf16 rounding."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the capturable (CUTLASS) grouped GEMM needs sm_90+")
    gpu = MoEForCausalLM(ARCH).to("cuda", torch.bfloat16)
    gpu.load_state_dict(model.state_dict())
    eager = Engine(gpu, max_running_requests=6, max_context=256, static_decode=True, cuda_graph=False)
    graphs = Engine(gpu, max_running_requests=6, max_context=256, cuda_graph=True)
    want, got = generate_queued(eager, bodies(4)), generate_queued(graphs, bodies(4))
    assert graphs.stats["decode_graph_steps"] == eager.stats["decode_static_steps"] > 10
    for a, b in zip(want, got):
        assert a["output_ids"] == b["output_ids"]
        np.testing.assert_allclose(output_logprobs(b["meta_info"]), output_logprobs(a["meta_info"]), rtol=0, atol=1e-5)
    for body, out in zip(bodies(4), got):  # bf16 against the fp32 CPU model: close, not equal
        ref_lp, _ = native(model, body["input_ids"], out["output_ids"])
        np.testing.assert_allclose(output_logprobs(out["meta_info"]), ref_lp, atol=0.15, rtol=0)


def _start(engine, body):
    done, out = threading.Event(), {}
    req = GenerateRequest.parse(body, vocab_size=V, max_context=engine.max_context)
    rid = engine.submit(req, lambda r: (out.update(r), done.set()))
    return rid, done, out


def test_state_survives_an_in_place_weight_update(tmp_path):
    """A request paused in place, the weights replaced, continued: the tokens after the update
    read the conv/recurrent states (and K/V) its prefix left under the old weights. Reference:
    transformers' cached decode, the prefix through the old model, the rest through the new one
    with the same cache. A re-prefill under the new weights would give other log-probs."""
    transformers = pytest.importorskip("transformers")
    old, new = MoEForCausalLM(ARCH).init_weights(0, std=0.05), MoEForCausalLM(ARCH).init_weights(1, std=0.05)
    engine = Engine(MoEForCausalLM(ARCH).init_weights(0, std=0.05), max_running_requests=2, max_context=256).start()
    body = {"input_ids": [(5 * j + 2) % V for j in range(70)], "return_logprob": True,
            "sampling_params": {"temperature": 1.0, "max_new_tokens": 16, "sampling_seed": 3}}
    try:
        _, done, out = _start(engine, body)
        assert wait_for(lambda: engine.running and len(engine.running[0].output_ids) >= 4, 60)
        engine.pause("in_place")
        engine.commit_weights(lambda: engine.model.load_state_dict(new.state_dict()), "1")
        engine.resume()
        assert done.wait(60)
    finally:
        engine.stop()
    versions = out["meta_info"]["output_token_weight_versions"]
    j = versions.index("1")
    assert 4 <= j < 16 and set(versions[:j]) == {"0"} and set(versions[j:]) == {"1"}
    hf = [transformers.Qwen3NextForCausalLM.from_pretrained(save_hf(m, tmp_path / n)).eval()
          for m, n in ((old, "old"), (new, "new"))]
    prompt, output = body["input_ids"], out["output_ids"]
    with torch.no_grad():  # old weights forward the prompt and output[:j - 1]; new ones the rest
        step = hf[0](torch.tensor([prompt + output[: j - 1]]), use_cache=True)
        logits, cache = [step.logits[0, len(prompt) - 1 :]], step.cache
        for t in output[j - 1 : -1]:
            step = hf[1](torch.tensor([[t]]), cache=cache, use_cache=True)
            logits.append(step.logits[0])
            cache = step.cache
    lp = torch.log_softmax(torch.cat(logits).float(), -1)
    ref = [lp[i, t].item() for i, t in enumerate(output)]
    got = output_logprobs(out["meta_info"])
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
    recomputed, _ = native(new, prompt, output)  # what a retract (re-prefill) would have given
    assert np.abs(np.array(got[j:]) - np.array(recomputed[j:])).max() > 1e-3


def test_abort_frees_the_state_and_the_next_request_reads_none_of_it(model):
    """An aborted request's slot goes back to the free list; filled with NaN there, it serves
    the next request as if new (a forward from position 0 does not read the slot's state)."""
    engine = Engine(model, max_running_requests=1, max_context=256).start()
    try:
        rid, done, out = _start(engine, {**bodies(3)[2], "return_routed_experts": False})
        assert wait_for(lambda: engine.running and len(engine.running[0].output_ids) >= 3, 60)
        slot = engine.running[0].slot
        assert engine.abort(rid) == 1 and done.wait(30)
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert wait_for(lambda: engine.free_slots == [slot], 10)
        with engine.model_lock:
            for st in engine.states:
                for t in ((st.conv, st.ssm) if isinstance(st, RecurrentState) else (st.k, st.v)):
                    t[slot] = float("nan")
        _, done, out = _start(engine, bodies(2)[1])
        assert done.wait(60)
    finally:
        engine.stop()
    check(model, [out], bodies(2)[1:])


def test_retract_re_prefills_from_position_zero(model):
    engine = Engine(model, max_running_requests=4, max_context=256).start()
    try:
        started = [_start(engine, b) for b in bodies(3)]
        assert wait_for(lambda: sum(len(r.output_ids) for r in engine.running) >= 8, 60)
        engine.pause("retract")
        assert engine.free_slots and not engine.running
        engine.resume()
        assert all(done.wait(60) for _, done, _ in started)
    finally:
        engine.stop()
    outs = [out for _, _, out in started]
    assert sum(o["meta_info"]["num_retractions"] for o in outs) >= 1
    check(model, outs, bodies(3))
