"""The hybrid Gated DeltaNet families against transformers: Qwen3-Next (``qwen3_next``, fused
per-key-head projections) and Qwen3.5-MoE (``qwen3_5_moe_text``, split projections; and the
multimodal ``qwen3_5_moe`` checkpoint's text tower). Gated DeltaNet layers (chunked rule over
sequences longer than a chunk), gated full attention with Gemma q/k norms and partial rotary,
Gemma (1 + w) decoder norms, the sigmoid-gated shared expert; HF round trips; packed batches;
routing replay; compiled blocks."""
import json
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moe_rl.model import MoEArch, MoEForCausalLM, load_hf, save_hf  # noqa: E402

BASE = dict(vocab_size=97, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=12, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=8,
            num_experts_per_tok=3, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                   "partial_rotary_factor": 0.25})
FAMILIES = {
    "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM),
    "qwen3_5_moe_text": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM),
}


def randomize(ref):
    """HF zero-inits norms and routers: random values (A_log and dt_bias in their ranges) make
    every part matter."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if n.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.0, 2.0, generator=g))
            elif n.endswith("dt_bias"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=g))
            else:
                p.copy_(torch.empty(p.shape).normal_(0, 0.15, generator=g))
    return ref


def hf_model(tmp_path, family, dtype=torch.float32, **over):
    cfg_cls, cls = FAMILIES[family]
    cfg = cfg_cls(**{**BASE, **over})
    cfg._experts_implementation = "eager"  # HF's per-expert loop (its grouped_mm refuses float64)
    ref = randomize(cls(cfg).eval())
    ref.save_pretrained(tmp_path / family)
    return ref.to(dtype), tmp_path / family


def ids(B, T, seed=1):
    return torch.randint(0, 97, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers(tmp_path, family):
    """fp32 within 1e-4 on 150-token sequences (three chunks of the rule)."""
    ref, path = hf_model(tmp_path, family)
    model = load_hf(path)
    arch = model.arch
    assert arch.model_type == family and arch.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert arch.moe_layers == [0, 1, 2, 3] and arch.rotary_dim == 4
    x = ids(2, 150)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x).logits, atol=1e-4, rtol=0)


def test_logits_match_transformers_other_shapes(tmp_path):
    """One value head per key head, no top-k renormalisation, alternating layer kinds, untied
    embeddings tied. (No fp64 comparison: transformers computes the rule in fp32 whatever the
    model's dtype; tests/kernels/test_gated_delta.py checks it in fp64.)"""
    ref, path = hf_model(tmp_path, "qwen3_next", linear_num_value_heads=2, norm_topk_prob=False,
                         layer_types=["full_attention", "linear_attention"] * 2, tie_word_embeddings=True)
    model = load_hf(path)
    assert model.arch.tie_word_embeddings and not model.arch.norm_topk_prob
    x = ids(2, 70, seed=2)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x).logits, atol=1e-4, rtol=0)


def test_packed_batch_equals_each_sequence_alone(tmp_path):
    """Packed sequences (cu_seqlens) never see each other's DeltaNet state or conv inputs:
    each one's logits equal those of its own forward. (transformers' torch fallback ignores
    cu_seqlens, so this is where the chunked rule's packing is pinned.)"""
    _, path = hf_model(tmp_path, "qwen3_next")
    model = load_hf(path)
    lens = [70, 3, 129, 64]
    seqs = [ids(1, n, seed=10 + i)[0] for i, n in enumerate(lens)]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    with torch.no_grad():
        packed = model(torch.cat(seqs)[None], cu_seqlens=cu)[0]
        for s, a, b in zip(seqs, cu[:-1].tolist(), cu[1:].tolist()):
            torch.testing.assert_close(packed[a:b], model(s[None])[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_save_is_loadable_by_transformers(tmp_path, family):
    ref, path = hf_model(tmp_path, family)
    model = load_hf(path)
    out = save_hf(model, tmp_path / "saved")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == family and cfg["architectures"] == [FAMILIES[family][1].__name__]
    again = FAMILIES[family][1].from_pretrained(out).eval()
    x = ids(2, 80)
    with torch.no_grad():
        torch.testing.assert_close(again(x).logits, ref(x).logits, atol=1e-5, rtol=0)
    assert MoEArch.from_hf_dir(out) == model.arch


def test_random_init_round_trips_through_transformers(tmp_path):
    arch = MoEArch(model_type="qwen3_5_moe_text", vocab_size=50, hidden_size=32, num_hidden_layers=2, head_dim=8,
                   layer_types=["linear_attention", "full_attention"], shared_expert_intermediate_size=16)
    model = MoEForCausalLM(arch).init_weights(4, std=0.1)
    ref = transformers.Qwen3_5MoeForCausalLM.from_pretrained(save_hf(model, tmp_path / "m")).eval()
    x = torch.randint(0, 50, (2, 70))
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x).logits, atol=1e-5, rtol=0)
    assert MoEArch.from_hf_dir(tmp_path / "m") == arch


def test_multimodal_checkpoint_loads_its_text_tower(tmp_path, caplog):
    """A qwen3_5_moe (VLM) checkpoint as released: text weights under model.language_model.,
    experts stacked ([E, 2I, H] gate_up, [E, H, I] down), a vision tower and an MTP layer. The
    text model loads; the vision and MTP tensors are skipped and the log says so."""
    from safetensors.torch import load_file, save_file

    text = {**BASE, "layer_types": ["linear_attention", "full_attention"] * 2}
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
                  num_position_embeddings=16)
    cfg = transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision)
    cfg.text_config._experts_implementation = "eager"
    ref = randomize(transformers.Qwen3_5MoeForConditionalGeneration(cfg).eval())
    ref.save_pretrained(tmp_path / "vlm")
    state = load_file(tmp_path / "vlm" / "model.safetensors")
    for layer in range(4):  # the released layout: one stacked tensor per projection and layer
        p = f"model.language_model.layers.{layer}.mlp.experts."
        gate_up = [torch.cat([state.pop(f"{p}{e}.gate_proj.weight"), state.pop(f"{p}{e}.up_proj.weight")]) for e in range(8)]
        state[p + "gate_up_proj"] = torch.stack(gate_up)
        state[p + "down_proj"] = torch.stack([state.pop(f"{p}{e}.down_proj.weight") for e in range(8)])
    state["mtp.fc.weight"] = torch.zeros(32, 64)
    assert any(k.startswith("model.visual.") for k in state)
    save_file(state, tmp_path / "vlm" / "model.safetensors")
    with caplog.at_level(logging.INFO, logger="moe_rl.model.hf_io"):
        model = load_hf(tmp_path / "vlm")
    assert model.arch.model_type == "qwen3_5_moe_text"
    assert "the vision tower (not loaded" in caplog.text and "multi-token-prediction" in caplog.text
    x = ids(2, 70)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(input_ids=x).logits, atol=1e-4, rtol=0)


def test_family_fields_are_checked():
    with pytest.raises(ValueError, match="mlp_only_layers=\\[1\\] is not supported by model_type='qwen3_next'"):
        MoEArch(model_type="qwen3_next", mlp_only_layers=[1])
    with pytest.raises(ValueError, match="norm_topk_prob=False is not supported by model_type='qwen3_5_moe_text'"):
        MoEArch(model_type="qwen3_5_moe_text", norm_topk_prob=False)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size=8 is not supported by model_type='qwen3_moe'"):
        MoEArch(shared_expert_intermediate_size=8)
    with pytest.raises(ValueError, match="layer_types must list 2 entries"):
        MoEArch(model_type="qwen3_next", layer_types=["full_attention"])
    with pytest.raises(ValueError, match="layer_types must list"):
        MoEArch(model_type="qwen3_next", layer_types=["linear_attention", "sliding_attention"])
    with pytest.raises(ValueError, match="multiple of linear_num_key_heads"):
        MoEArch(model_type="qwen3_next", linear_num_key_heads=3, linear_num_value_heads=4)
    arch = MoEArch(model_type="qwen3_next", num_hidden_layers=8)
    assert arch.layer_types.count("full_attention") == 2 and arch.partial_rotary_factor == 0.25
    assert MoEArch.from_hf_dict({**arch.to_hf_dict(), "layer_types": None, "full_attention_interval": 2}).layer_types \
        == ["linear_attention", "full_attention"] * 4


# --- routing replay, gradients, compiled blocks ------------------------------------------------
ARCH = MoEArch(model_type="qwen3_next", vocab_size=40, hidden_size=32, num_hidden_layers=2, head_dim=8,
               layer_types=["linear_attention", "full_attention"], num_experts=8, num_experts_per_tok=2,
               moe_intermediate_size=16, shared_expert_intermediate_size=16, linear_key_head_dim=8,
               linear_value_head_dim=8)


def test_every_layer_routes_and_replay_reproduces_the_logits():
    """R3: every layer is MoE (one record per layer, the shared expert not in it); replaying the
    record gives the same logits, and the router and the shared expert's gate get gradients."""
    model = MoEForCausalLM(ARCH).init_weights(3, std=0.2)
    x = torch.randint(0, 40, (2, 70), generator=torch.Generator().manual_seed(0))
    rec = []
    with torch.no_grad():
        ref = model(x, record=rec)
    assert len(rec) == 2 and all(r.shape == (140, 2) for r in rec)
    out = model(x, replay=rec)
    assert torch.equal(out, ref)
    out.logsumexp(-1).sum().backward()
    for layer in model.model.layers:
        assert layer.mlp.gate.weight.grad.abs().sum() > 0 and layer.mlp.shared_expert_gate.weight.grad.abs().sum() > 0
    dn = model.model.layers[0].linear_attn
    for p in (dn.A_log, dn.dt_bias, dn.conv1d.weight, dn.in_proj_qkvz.weight, dn.in_proj_ba.weight, dn.norm.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0


@pytest.mark.slow(longest=True)  # long: scheduled first (tests/conftest.py); runs in CI
def test_compiled_blocks_equal_eager_without_breaks_or_recompiles():
    """A DeltaNet block and a gated-attention block compile with fullgraph (a graph break would
    raise; the chunk scan is an opaque op, so the chunk count never recompiles): logits and
    gradients as eager (aot_eager), one graph per kind of block and batch over packed batches of
    different lengths and chunk counts."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    eager = MoEForCausalLM(ARCH).init_weights(5, std=0.2)
    comp = MoEForCausalLM(ARCH).init_weights(5, std=0.2)
    counter = CompileCounterWithBackend("aot_eager")
    comp.compile_blocks(backend=counter)
    g = torch.Generator().manual_seed(1)
    for lens in ([5, 70, 9], [40, 41, 1]):  # block-mask / padded attention; 2 and 1 DeltaNet chunks
        x = torch.randint(0, 40, (1, sum(lens)), generator=g)
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
        outs = []
        for m in (eager, comp):
            m.zero_grad()
            y = m(x, cu_seqlens=cu, max_seqlen=max(lens))
            (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
            outs.append((y.detach(), [p.grad.clone() for p in m.parameters()]))
        torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-5, rtol=1e-5)
        for a, b in zip(outs[1][1], outs[0][1]):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from moe_rl.model.transformer import DecoderLayer

    # one graph per block kind (DeltaNet, gated attention x (padded, block-mask)), none per batch
    assert len(_debug_get_cache_entry_list(DecoderLayer.forward.__code__)) == 3 and counter.frame_count >= 3
    torch._dynamo.reset()


# --- LoRA: attention, DeltaNet projections, experts ---------------------------------------------
LORA_ARCH = {
    "qwen3_next": ARCH.model_copy(update={"vocab_size": 97}),
    "qwen3_5_moe_text": MoEArch(**{**ARCH.model_dump(), "model_type": "qwen3_5_moe_text", "vocab_size": 97,
                                   "mlp_only_layers": [], "decoder_sparse_step": 1}),
}
LORA_TARGETS = {
    "qwen3_next": ["q_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_ba", "out_proj", "router",
                   "experts.gate_up_proj", "experts.down_proj"],
    "qwen3_5_moe_text": ["q_proj", "k_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
                         "experts.gate_up_proj", "experts.down_proj"],
}


@pytest.mark.parametrize("family", list(LORA_TARGETS))
def test_lora_on_attention_deltanet_and_experts(family, tmp_path):
    """Both LoRA forms (merged, unmerged) equal a hand merge; every adapter gets a gradient; and
    PEFT's LoRA on transformers' model loads the adapter and gives the merged logits."""
    peft = pytest.importorskip("peft", minversion="0.19")
    from moe_rl.model.lora import save_peft

    from tests.model.test_lora import make, merged_by_hand

    model, ad = make(LORA_TARGETS[family], None, arch=LORA_ARCH[family])
    assert {s.target for s in ad.sites} == set(LORA_TARGETS[family])
    x = torch.randint(0, 97, (2, 70), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = merged_by_hand(model, ad)(x)
        base = model(x)
    with torch.no_grad(), ad.applied():
        torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=0)
    with ad.in_forward():
        got = model(x)
        got.square().mean().backward()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert (got - base).abs().max() > 1e-3
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in ad.parameters())
    save_hf(model, tmp_path / "base")
    save_peft(ad, tmp_path / "adapter", base_model=str(tmp_path / "base"))
    hf = FAMILIES[family][1].from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    pm = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(pm(input_ids=x).logits, expected, atol=1e-4, rtol=0)
    assert sorted(peft.get_peft_model_state_dict(pm)) == sorted(ad.peft_state_dict())


def test_state_bytes_per_request_at_qwen3_next_80b_shape():
    """Qwen3-Next-80B-A3B's shape (transformers' Qwen3NextConfig defaults): 36 DeltaNet layers of
    48, each keeping per request a bf16 conv window [8192, 3] and an fp32 state [32, 128, 128]
    (73.7 MiB), whatever the context; the 12 attention layers' K/V grow 24 KiB per token. The
    planned bytes are what allocate makes."""
    from moe_rl.model.attention import KVSpec, RecurrentSpec, state_specs

    arch = MoEArch.from_hf_dict(transformers.Qwen3NextConfig().to_dict())
    specs = state_specs(arch)
    rec = [s for s in specs if isinstance(s, RecurrentSpec)]
    kv = [s for s in specs if isinstance(s, KVSpec)]
    assert len(rec) == 36 and len(kv) == 12
    assert sum(s.bytes_per_slot(32768, 2) for s in rec) == 36 * (8192 * 3 * 2 + 32 * 128 * 128 * 4) == 77_266_944
    assert sum(s.bytes_per_token(2) for s in kv) == 12 * 2 * 2 * 256 * 2 == 24 * 1024
    small = state_specs(ARCH)[0].allocate(3, 100, torch.bfloat16, "cpu")
    nbytes = small.conv.numel() * small.conv.element_size() + small.ssm.numel() * small.ssm.element_size()
    assert small.ssm.dtype == torch.float32 and nbytes == 3 * state_specs(ARCH)[0].bytes_per_slot(100, 2)
