"""Compiled decoder blocks (``MoEForCausalLM.compile_blocks``, ``train.compile``) against the same
model run eagerly: no graph break (MoE routing, grouped GEMM, routing replay, LoRA adapters on
attention, router, routed and shared experts), one graph per kind of packed batch rather than
per batch, and inductor's code equal to eager within fp32 rounding, values and gradients, for
the families (Qwen3-MoE's softmax router; GLM-4.5's sigmoid group-limited router with shared
experts, partial rotary and q/k/v bias; gpt-oss's sliding window, sinks and clamped experts).

Inductor compiles take ~30-45 s per graph (forward and backward) on two shared cores, so inductor
(the real thing) compiles one graph by default: Qwen3-MoE replaying a record with LoRA adapters
on attention, router and experts. The other cases of the family x replay x LoRA matrix compare
aot_eager (dynamo's graph, AOTAutograd's forward and backward) with eager; with
MOE_RL_COMPILE_ALL_CASES=1 they run under inductor too. Dynamo-only checks (explain, a
counting backend) cover graph breaks and recompiles.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

from moe_rl.model import MoEArch, MoEForCausalLM
from moe_rl.model.lora import LoraAdapters
from moe_rl.model.attention import PackedCausal, packed_positions

COMMON = dict(vocab_size=48, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2, num_hidden_layers=1)
ARCHS = {
    "qwen3_moe": MoEArch(**COMMON),
    "glm4_moe": MoEArch(model_type="glm4_moe", n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.0,
                        attention_bias=True, **COMMON),
    # multi-head latent attention (expanded K/V in training), YaRN, the sigmoid router
    "deepseek_v3": MoEArch(model_type="deepseek_v3", n_shared_experts=1, n_group=2, topk_group=1, q_lora_rank=12,
                           kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                           rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8,
                                         "mscale": 1.0, "mscale_all_dim": 1.0}, **COMMON),
    # gpt-oss: a sliding-window layer with sinks, biases, the biased top-k-softmax router, clamped experts
    "gpt_oss": MoEArch(model_type="gpt_oss", sliding_window=3, attention_bias=True, swiglu_limit=0.5, **COMMON),
}
LORA_TARGETS = {"qwen3_moe": ["q_proj", "o_proj", "router", "experts.gate_up_proj", "experts.down_proj"],
                "glm4_moe": ["v_proj", "router", "experts.gate_up_proj", "experts.down_proj", "shared_experts.up_proj"],
                "deepseek_v3": ["q_b_proj", "kv_b_proj", "router", "experts.down_proj"],
                "gpt_oss": ["q_proj", "router", "experts.gate_up_proj", "experts.down_proj"]}


def make(family: str, lora: bool, seed: int = 0):
    """(model, its adapters or None), every weight (and adapter factor) random."""
    model = MoEForCausalLM(ARCHS[family]).init_weights(seed, std=0.2)
    adapters = None
    if lora:
        adapters = LoraAdapters(model, 4, 8.0, LORA_TARGETS[family]).init_weights(seed)
        with torch.no_grad():
            for b in adapters.B.values():
                b.normal_(0, 0.2, generator=torch.Generator().manual_seed(seed + 1))
        adapters.attach()
    return model, adapters


def batch(lens: list[int], seed: int, replay: bool):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    ids = torch.randint(0, COMMON["vocab_size"], (1, T), generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    rec = None
    if replay:  # distinct experts per token, unlike what the router would choose
        rec = [torch.rand(T, COMMON["num_experts"], generator=g).argsort(1)[:, :COMMON["num_experts_per_tok"]]]
    return ids, cu, rec


def run(model, adapters, ids, cu, rec):
    """Logits, and the gradients of a fixed function of them (LoRA: the adapters'; else every
    parameter's), with the experts used."""
    params = list(adapters.parameters()) if adapters is not None else list(model.parameters())
    for p in params:
        p.grad = None
    used = []
    logits = model(ids, cu_seqlens=cu, replay=rec, record=used)
    w = torch.randn(logits.shape, generator=torch.Generator().manual_seed(7))
    (logits * w).sum().backward()
    return logits.detach(), [p.grad.clone() for p in params], used


@pytest.fixture(scope="module")
def compiled_models():
    """An eager and an inductor-compiled copy of a (family, LoRA) model, made once for the module
    (each compiles at its first call)."""
    torch._dynamo.reset()
    made = {}

    def get(family, lora, backend):
        if (family, lora, backend) not in made:
            comp = make(family, lora)
            comp[0].compile_blocks(backend=backend)
            made[family, lora, backend] = make(family, lora), comp
        return made[family, lora, backend]
    yield get
    torch._dynamo.reset()


ALL_CASES = os.environ.get("MOE_RL_COMPILE_ALL_CASES", "0") not in ("", "0")
CHEAP = "inductor" if ALL_CASES else "aot_eager"


@pytest.mark.parametrize("family, lora, replay, backend", [
    ("qwen3_moe", True, True, "inductor"), ("qwen3_moe", False, False, CHEAP),
    ("glm4_moe", True, False, CHEAP), ("glm4_moe", False, True, CHEAP), ("gpt_oss", False, True, CHEAP)])
def test_compiled_block_equals_eager(compiled_models, family, lora, replay, backend):
    """fp32 logits within 1e-5, every gradient at cosine >= 0.99999 (and within 1e-4), the same
    experts chosen; under replay the record's experts, not the router's."""
    (em, ea), (cm, ca) = compiled_models(family, lora, backend)
    ids, cu, rec = batch([5, 9, 3, 7], 1, replay)
    want, want_g, want_used = run(em, ea, ids, cu, rec)
    got, got_g, got_used = run(cm, ca, ids, cu, rec)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for a, b in zip(got_g, want_g):
        assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) >= 0.99999
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert all(torch.equal(a, b) for a, b in zip(got_used, want_used))
    if replay:
        assert torch.equal(got_used[0], rec[0])


def _block_inputs(model, lens, replay):
    ids, cu, rec = batch(lens, 0, replay)
    T = ids.shape[1]
    h = model.model.embed_tokens(ids[0])
    cos, sin = model.rope.cos_sin(packed_positions(cu, T), h.dtype)
    return h, cos, sin, PackedCausal(cu, T, max(lens)), None if rec is None else rec[0]


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe", "deepseek_v3", "gpt_oss"])
def test_no_graph_break(family):
    """torch._dynamo.explain of a decoder block: one graph, no break, with and without replay,
    LoRA and a sigmoid router that counts its experts' load (train.expert_bias_update_rate);
    on the padded attention path and the block-mask one."""
    for lora in (True,) if family == "gpt_oss" else (False, True):  # gpt-oss: its own parts, with LoRA
        model, _ = make(family, lora)
        if model.arch.router == "sigmoid":
            model.track_expert_load()
        block = model.model.layers[0]
        for replay in (False, True):
            for lens in ([5, 9, 3], [1, 1, 12]):  # padded [S, L_max] / [T, T] mask (padding > 2x)
                inputs = _block_inputs(model, lens, replay)
                assert inputs[3].padded == (lens == [5, 9, 3])
                e = torch._dynamo.explain(block)(*inputs)
                assert e.graph_break_count == 0 and e.graph_count == 1, (lora, replay, lens, e.break_reasons)


def test_variable_lengths_do_not_recompile():
    """Sixteen packed batches of different lengths, sequence counts and longest sequences,
    forward and backward: graphs only for the kinds of batch (padded attention with several
    sequences, one sequence, the block mask), none per batch."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")  # dynamo's graphs, run as captured
    model, _ = make("qwen3_moe", False)
    model.compile_blocks(backend=counter)
    g = torch.Generator().manual_seed(3)
    kinds = set()
    for i in range(16):
        if i % 5 == 4:
            lens = [int(torch.randint(2, 20, (1,), generator=g))]  # one sequence
        elif i % 7 == 6:
            lens = [1, 1, 1, 30]  # padding would exceed 2x: the mask
        else:
            lens = torch.randint(2, 14, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        ids, cu, rec = batch(lens, i, replay=i % 2 == 0)
        attn = PackedCausal(cu, ids.shape[1], max(lens))
        kinds.add((attn.padded, len(lens) == 1, rec is not None))
        model(ids, cu_seqlens=cu, replay=rec).square().mean().backward()
    assert len(kinds) == 6  # (padded, several sequences), (padded, one), (mask, several) x replay or not
    assert counter.frame_count <= len(kinds), counter.frame_count
    torch._dynamo.reset()


def test_expert_parallel_blocks_are_refused():
    model, _ = make("qwen3_moe", False)
    model.model.layers[0].mlp.ep_size = 2
    with pytest.raises(ValueError, match="expert parallelism"):
        model.compile_blocks()


def test_cuda_graph_blocks_ask_inductor_for_graphs_and_keep_a_copy_of_the_record(monkeypatch):
    """compile_blocks(cuda_graphs=True) (train.cuda_graphs): every block compiled with Inductor's
    CUDA graphs, a skip of them an error where torch can say so (no silent eager run), and the
    routing record copied out of the graphs' outputs, which their next replay overwrites. (A CPU
    graph is never a CUDA graph: the replay itself is a GPU test, the train bench's
    native_graphs row.)"""
    import torch._inductor.config as inductor_config

    seen = []
    real_compile = torch.compile

    def compile_spy(fn, **kwargs):
        seen.append(kwargs)
        return real_compile(fn, backend="eager", fullgraph=kwargs["fullgraph"], dynamic=kwargs["dynamic"])

    monkeypatch.setattr(torch, "compile", compile_spy)
    torch._dynamo.reset()
    model, _ = make("qwen3_moe", False)
    model.compile_blocks(cuda_graphs=True)
    assert len(seen) == len(model.model.layers)
    for kwargs in seen:
        assert kwargs["options"]["triton.cudagraphs"] is True and kwargs["fullgraph"] and kwargs["dynamic"]
        assert kwargs["options"].get("triton.cudagraph_or_error") is (
            True if hasattr(inductor_config.triton, "cudagraph_or_error") else None)
    ids, cu, _ = batch([5, 9, 3], 0, replay=False)
    record: list[torch.Tensor] = []
    model.hidden_states(ids, cu_seqlens=cu, record=record)
    out_ids = []
    real_layer_forward = type(model.model.layers[0]).forward

    def forward_keeping_its_ids(self, *args):  # the block's own output, as a graph would return it
        out = real_layer_forward(self, *args)
        out_ids.append(out[1])
        return out

    monkeypatch.setattr(type(model.model.layers[0]), "forward", forward_keeping_its_ids)
    torch._dynamo.reset()
    record2: list[torch.Tensor] = []
    model.hidden_states(ids, cu_seqlens=cu, record=record2)
    assert all(torch.equal(a, b) for a, b in zip(record, record2))
    assert all(r.data_ptr() != o.data_ptr() for r, o in zip(record2, out_ids))  # copies, not the outputs
    torch._dynamo.reset()
