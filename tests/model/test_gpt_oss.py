"""The gpt-oss family (attention sinks, sliding-window layers, yarn rope, biases everywhere, the
biased top-k-softmax router, clamped SwiGLU experts with gate/up interleaved, fp32-scaled norms,
MXFP4 checkpoints) against HF transformers' GptOssForCausalLM, and routing replay with its router."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from moe_rl.model import MoEArch, MoEForCausalLM, dequantize_mxfp4, load_hf, save_hf  # noqa: E402
from moe_rl.model.attention import PackedCausal, visible  # noqa: E402

YARN = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 32, "rope_theta": 150000.0}
BASE = dict(vocab_size=97, hidden_size=32, intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=12, num_local_experts=6, num_experts_per_tok=2, sliding_window=4,
            max_position_embeddings=256, rope_parameters=YARN)
CASES = {
    "window_4": {},
    # a limit the activations cross: both clamps act (checked below), another alpha
    "clamped": dict(swiglu_limit=0.15, swiglu_alpha=1.1, sliding_window=2),
    "no_attention_bias_one_kv_head": dict(attention_bias=False, num_key_value_heads=1,
                                          layer_types=["full_attention", "sliding_attention", "sliding_attention"]),
}


def hf_gpt_oss(tmp_path, dtype=torch.float32, **over):
    cfg = transformers.GptOssConfig(**{**BASE, **over})
    cfg._attn_implementation = "eager"  # HF's gpt-oss has no SDPA path (sinks)
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    ref = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in ref.named_parameters():  # HF zero-inits the biases: random ones, and sinks that matter
            p.normal_(0, 1.0 if n.endswith("sinks") else 0.15)
    ref.save_pretrained(tmp_path / "hf")
    return ref.to(dtype), tmp_path / "hf"


def ids_of(B=3, T=11, vocab=97, seed=1):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case):
    ref, path = hf_gpt_oss(tmp_path, **CASES[case])
    model = load_hf(path)
    arch = model.arch
    assert arch.model_type == "gpt_oss" and arch.router == "topk_softmax" and arch.rope().rope_type == "yarn"
    assert arch.layer_kinds() == ["swa" if t == "sliding_attention" else "mha" for t in ref.config.layer_types]
    ids = ids_of()  # 11 tokens: longer than every window
    with torch.no_grad():
        got = model(ids)
        torch.testing.assert_close(got, ref(ids).logits, atol=1e-4, rtol=0)
    if case == "clamped":  # the clamps act: gate above the limit, up beyond it on both sides
        seen = []
        ex = model.model.layers[1].mlp.experts
        h = ex.register_forward_hook(lambda m, a, o: seen.append(a))
        with torch.no_grad():
            model(ids)
        h.remove()
        x, offs = seen[0]
        gu = x @ ex.gate_up_proj[0] + ex.gate_up_proj_bias[0]
        assert (gu[:, 0::2] > 0.15).any() and (gu[:, 1::2] > 0.15).any() and (gu[:, 1::2] < -0.15).any()


def test_sinks_window_and_biases_each_change_the_logits(tmp_path):
    """The match above is not a coincidence of parts that do nothing: zeroing the sinks, widening
    the window or zeroing the expert and router biases each moves the logits away from HF's."""
    ref, path = hf_gpt_oss(tmp_path)
    ids = ids_of()
    with torch.no_grad():
        want = ref(ids).logits
        for change in ("sinks", "window", "expert_bias", "router_bias"):
            model = load_hf(path)
            for layer in model.model.layers:
                if change == "sinks":
                    layer.self_attn.sinks.zero_()
                elif change == "window" and layer.self_attn.window is not None:
                    layer.self_attn.window = 100
                elif change == "expert_bias":
                    layer.mlp.experts.down_proj_bias.zero_()
                elif change == "router_bias":
                    layer.mlp.router.bias.zero_()
            assert (model(ids) - want).abs().max() > 1e-3, change


def test_window_is_counted_as_transformers_counts_it():
    """``visible`` (every layout's mask) equals transformers' sliding-window causal mask: a query
    sees ``sliding_window`` keys, its own included (128 for gpt-oss), which SGLang expresses as
    a window-left of sliding_window - 1 (``get_attention_sliding_window_size``)."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    for W in (1, 3, 128):
        T = 300
        hf = sliding_window_causal_mask_function(W)
        i = torch.arange(T)
        want = hf(torch.tensor(0), torch.tensor(0), i[:, None], i[None, :])
        got = visible(i[:, None], i[None, :], W)
        assert torch.equal(got, want)
        assert got.sum(1).tolist() == [min(q + 1, W) for q in range(T)]
        left = W - 1  # flash-attention's window_size[0]: keys q - left .. q
        assert torch.equal(got, (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - left))


def test_sglang_window_left_is_one_less():
    from tests.sglang.conftest import sglang_methods

    fn = sglang_methods("srt/models/gpt_oss.py", None, ("get_attention_sliding_window_size",))
    assert fn["get_attention_sliding_window_size"](MoEArch(model_type="gpt_oss", sliding_window=128)) == 127


def test_packed_and_padded_layouts_agree_with_sinks_and_windows(tmp_path):
    """Several sequences packed in one row (positions restart, the window stays inside each
    sequence) give each sequence's own logits; the block-mask path too."""
    _, path = hf_gpt_oss(tmp_path)
    model = load_hf(path)
    seqs = [ids_of(1, n, seed=n)[0] for n in (7, 2, 9)]
    with torch.no_grad():
        alone = [model(s[None])[0] for s in seqs]
        cu = torch.tensor([0, 7, 9, 18])
        packed = model(torch.cat(seqs)[None], cu_seqlens=cu)[0]
        torch.testing.assert_close(packed, torch.cat(alone), atol=1e-5, rtol=0)
        uneven = [ids_of(1, n, seed=n)[0] for n in (15, 1, 1, 1)]
        cu = torch.tensor([0, 15, 16, 17, 18])
        assert not PackedCausal(cu, 18).padded  # the [total, total] block-mask path
        packed = model(torch.cat(uneven)[None], cu_seqlens=cu)[0]
        torch.testing.assert_close(packed, torch.cat([model(s[None])[0] for s in uneven]), atol=1e-5, rtol=0)


def test_router_matches_hf_router(tmp_path):
    ref, path = hf_gpt_oss(tmp_path)
    model = load_hf(path)
    x = torch.randn(400, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, w_ref, ids_ref = ref.model.layers[1].mlp.router(x)
        ids, w = model.model.layers[1].mlp.route(x, None)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=0)


def test_save_is_loadable_by_transformers_and_config_round_trips(tmp_path):
    ref, path = hf_gpt_oss(tmp_path)
    model = load_hf(path)
    out = save_hf(model, tmp_path / "saved")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "gpt_oss" and cfg["architectures"] == ["GptOssForCausalLM"]
    assert cfg["intermediate_size"] == 16 and cfg["sliding_window"] == 4 and "moe_intermediate_size" not in cfg
    again = transformers.GptOssForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    again.config._experts_implementation = "eager"
    ids = ids_of(2, 9)
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, ref(ids).logits, atol=1e-5, rtol=0)
    assert MoEArch.from_hf_dir(out) == model.arch
    # a seeded random model round-trips too
    arch = MoEArch(model_type="gpt_oss", vocab_size=50, hidden_size=32, num_hidden_layers=2, head_dim=8,
                   moe_intermediate_size=16, sliding_window=3, attention_bias=True)
    rnd = MoEForCausalLM(arch).init_weights(4, std=0.1)
    hf = transformers.GptOssForCausalLM.from_pretrained(save_hf(rnd, tmp_path / "rnd"), dtype=torch.float32).eval()
    hf.config._experts_implementation = "eager"
    with torch.no_grad():
        torch.testing.assert_close(rnd(ids_of(2, 7, 50)), hf(ids_of(2, 7, 50)).logits, atol=1e-5, rtol=0)


# --- MXFP4 checkpoints -----------------------------------------------------------------------
MX = dict(vocab_size=50, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=3)


def mxfp4_checkpoint(tmp_path):
    """An HF gpt-oss checkpoint whose experts are MXFP4 as released: ``*_blocks`` uint8 [E, out,
    in / 32, 16] and ``*_scales`` uint8 [E, out, in / 32], quantization_config mxfp4."""
    cfg = transformers.GptOssConfig(**MX)
    torch.manual_seed(0)
    base = transformers.GptOssForCausalLM(cfg)
    with torch.no_grad():
        for p in base.parameters():
            p.normal_(0, 0.1)
    base.save_pretrained(tmp_path / "base")
    sd = load_file(tmp_path / "base" / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    E, H, I = 4, 64, 32
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts."
        del sd[p + "gate_up_proj"], sd[p + "down_proj"]
        for proj, (rows, cols) in (("gate_up_proj", (2 * I, H)), ("down_proj", (H, I))):
            sd[p + proj + "_blocks"] = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
            sd[p + proj + "_scales"] = torch.randint(119, 124, (E, rows, cols // 32), generator=g, dtype=torch.uint8)
    out = tmp_path / "mxfp4"
    out.mkdir()
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    c = json.loads((tmp_path / "base" / "config.json").read_text())
    c["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(c))
    return out, sd


def test_mxfp4_checkpoint_loads_to_the_dequantized_models_logits(tmp_path):
    """transformers' own MXFP4 loader (dequantize) is the reference: the same expert weights
    bit for bit, the same logits; what moe-rl saves back is plain fp32 that transformers loads."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path, sd = mxfp4_checkpoint(tmp_path)
    ref = transformers.GptOssForCausalLM.from_pretrained(
        path, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32).eval()
    ref.config._experts_implementation = "eager"
    ref.config._attn_implementation = "eager"
    model = load_hf(path)
    for layer in range(2):
        for proj in ("gate_up_proj", "down_proj"):
            p = f"model.layers.{layer}.mlp.experts.{proj}"
            want = convert_moe_packed_tensors(sd[p + "_blocks"], sd[p + "_scales"], dtype=torch.float32)
            assert torch.equal(model.get_parameter(p), want)
            assert torch.equal(dequantize_mxfp4(sd[p + "_blocks"], sd[p + "_scales"]), want)
    ids = ids_of(2, 9, 50)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-5, rtol=0)
    saved = save_hf(model, tmp_path / "plain")
    keys = set(load_file(saved / "model.safetensors"))
    assert "model.layers.0.mlp.experts.gate_up_proj" in keys and not any(k.endswith(("_blocks", "_scales")) for k in keys)
    with torch.no_grad():
        torch.testing.assert_close(load_hf(saved)(ids), model(ids), atol=0, rtol=0)


@pytest.mark.parametrize("bad", ["truncated", "wrong_dtype", "missing"])
def test_bad_mxfp4_scales_are_named(tmp_path, bad):
    path, sd = mxfp4_checkpoint(tmp_path)
    name = "model.layers.1.mlp.experts.down_proj_scales"
    if bad == "truncated":
        sd[name] = sd[name][:, :40].contiguous()
    elif bad == "wrong_dtype":
        sd[name] = sd[name].float()
    else:
        del sd[name]
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises((ValueError, KeyError), match=name if bad != "missing" else
                       "down_proj_blocks has no model.layers.1.mlp.experts.down_proj_scales"):
        load_hf(path)


# --- routing replay (R3) with the biased top-k-softmax router --------------------------------------
ARCH = MoEArch(model_type="gpt_oss", vocab_size=40, hidden_size=32, num_hidden_layers=3, head_dim=8,
               num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, sliding_window=3, attention_bias=True)


def gpt_oss_model(seed=7):
    model = MoEForCausalLM(ARCH).init_weights(seed, std=0.2)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.router.bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(seed))
    return model


def test_record_replay_reproduces_logits():
    model = gpt_oss_model()
    ids = ids_of(2, 6, 40)
    rec = []
    with torch.no_grad():
        ref = model(ids, record=rec)
        assert len(rec) == 3 and all(r.shape == (12, 3) for r in rec)
        assert torch.equal(model(ids, replay=rec), ref)  # routing match 1.0, the same logits
        rec2 = []
        model(ids, record=rec2)
        assert all(torch.equal(a, b) for a, b in zip(rec, rec2))


def test_replayed_weights_are_the_softmax_of_the_current_biased_logits():
    """Replay weights = softmax over the replayed experts' logits x W^T + b, from the router's
    current weights (Megatron's pre_softmax=False with the router bias); the bias is in them."""
    model = gpt_oss_model()
    moe = model.model.layers[1].mlp
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(1))
    given = torch.randperm(8, generator=torch.Generator().manual_seed(2))[:3].repeat(6, 1)
    with torch.no_grad():
        chosen, w = moe.route(x, given)
        logits = x @ moe.router.weight.T + moe.router.bias  # plain torch
        want = torch.softmax(logits.gather(1, given), -1)
        torch.testing.assert_close(w, want, atol=1e-6, rtol=0)
        moe.router.bias.add_(torch.linspace(-1, 1, 8))
        assert not torch.allclose(moe.route(x, given)[1], w)  # the bias moves the replayed weights
    assert torch.equal(chosen, given)


def test_router_weight_and_bias_get_gradients_under_replay():
    model = gpt_oss_model()
    rec = []
    ids = ids_of(2, 6, 40)
    with torch.no_grad():
        model(ids, record=rec)
    model(ids, replay=rec).logsumexp(-1).sum().backward()
    router = model.model.layers[1].mlp.router
    assert router.weight.grad.abs().sum() > 0 and router.bias.grad.abs().sum() > 0
    attn = model.model.layers[0].self_attn
    assert attn.sinks.grad.abs().sum() > 0 and attn.o_proj.bias.grad.abs().sum() > 0
    assert model.model.layers[0].mlp.experts.gate_up_proj_bias.grad.abs().sum() > 0


def test_family_fields_are_checked():
    with pytest.raises(ValueError, match="sliding_window is a field of another family; model_type='qwen3_moe'"):
        MoEArch(sliding_window=4)
    with pytest.raises(ValueError, match="n_shared_experts=1 is not supported by model_type='gpt_oss'"):
        MoEArch(model_type="gpt_oss", n_shared_experts=1)
    with pytest.raises(ValueError, match=r"layer_types must list 3 entries \(num_hidden_layers\)"):
        MoEArch(model_type="gpt_oss", num_hidden_layers=3, layer_types=["full_attention"] * 2)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        MoEArch(model_type="gpt_oss", num_hidden_layers=2)
    a = MoEArch(model_type="gpt_oss", num_hidden_layers=4, sliding_window=128)
    assert a.layer_types == ["sliding_attention", "full_attention"] * 2  # HF's default: even layers slide
    assert (a.swiglu_alpha, a.swiglu_limit, a.use_qk_norm) == (1.702, 7.0, False)
    # a Qwen3-MoE config.json's sliding_window (off there) is not read
    q = MoEArch.from_hf_dict({**MoEArch().to_hf_dict(), "sliding_window": 4096})
    assert q.sliding_window is None


# --- LoRA: attention and the [E, in, out] experts, PEFT's layout -------------------------------------
LORA_TARGETS = ["q_proj", "o_proj", "router", "experts.gate_up_proj", "experts.down_proj"]


def lora_model(shared=False):
    from moe_rl.model.lora import LoraAdapters

    model = gpt_oss_model()
    ad = LoraAdapters(model, 4, 8.0, LORA_TARGETS, shared_outer=shared).init_weights(1)
    with torch.no_grad():
        for b in ad.B.values():
            b.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))
    return model, ad


@pytest.mark.parametrize("shared", [False, True])
def test_lora_on_attention_router_and_experts_equals_hand_merge(shared):
    """Merged (``applied``) and unmerged (``in_forward``) adapters equal a merge written here
    expert by expert (W[e] += s (B[e] A[e])^T on the [E, in, out] weights); only the adapters
    get gradients, the biases stay frozen."""
    import copy

    model, ad = lora_model(shared)
    ids = ids_of(2, 8, 40)
    ref = copy.deepcopy(model)
    s = ad.alpha / ad.rank
    with torch.no_grad():
        for key, A in ad.A.items():
            name, B = key.replace("__", "."), ad.B[key]
            if ".experts." in name:
                w = ref.get_parameter(name)
                for e in range(w.shape[0]):
                    w[e] += s * (B[min(e, B.shape[0] - 1)] @ A[min(e, A.shape[0] - 1)]).T
            else:
                ref.get_submodule(name).weight += s * (B @ A)
        want, base = ref(ids), model(ids)
    assert (want - base).abs().max() > 1e-3
    with torch.no_grad(), ad.applied():
        torch.testing.assert_close(model(ids), want, atol=1e-5, rtol=0)
    with ad.in_forward():
        got = model(ids)
        got.square().mean().backward()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert all(p.grad is None and not p.requires_grad for p in model.parameters())
    assert all(p.grad is not None for p in ad.parameters())
    with pytest.raises(Exception, match="per-expert adapter layout has no modules"):
        ad.per_expert_state_dict()


def test_peft_loads_the_adapter_on_transformers_gpt_oss(tmp_path):
    """PEFT's LoRA (q/o_proj modules; the router weight and the experts' 3-D parameters as
    target_parameters) on transformers' GptOssForCausalLM gives moe-rl's merged logits, and PEFT's
    state dict is ours key for key; the adapter loads back."""
    peft = pytest.importorskip("peft", minversion="0.19")
    from moe_rl.model.lora import LoraAdapters, load_peft, save_peft

    model, ad = lora_model()
    save_hf(model, tmp_path / "base")
    save_peft(ad, tmp_path / "adapter", base_model=str(tmp_path / "base"))
    hf = transformers.GptOssForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    hf.config._experts_implementation = "eager"
    pm = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ids = ids_of(2, 8, 40)
    with torch.no_grad(), ad.applied():
        ours = model(ids)
    with torch.no_grad():
        torch.testing.assert_close(pm(input_ids=ids).logits, ours, atol=1e-5, rtol=0)
    assert sorted(peft.get_peft_model_state_dict(pm)) == sorted(ad.peft_state_dict())
    back = LoraAdapters(gpt_oss_model(), 4, 8.0, LORA_TARGETS)
    load_peft(back, tmp_path / "adapter")
    for n, p in ad.named_parameters():
        assert torch.equal(dict(back.named_parameters())[n], p)


@pytest.mark.parametrize("lora", [None, "per_expert", "shared_outer"])
def test_rows_after_the_last_group_reach_nothing(monkeypatch, lora):
    """CUDA's padded expert groups (align 8) leave rows in no group after the last one: with what
    the grouped GEMMs leave undefined there made NaN, the experts' biases (indexed by each row's
    expert) and the expert LoRA keep it out of the logits and every gradient."""
    import contextlib

    from moe_rl.model import grouped as grouped_ops
    from moe_rl.model import ops as ops_mod
    from moe_rl.model import transformer
    from tests.model.test_grouped_experts import _nan_tail

    def run():
        model, ad = lora_model(lora == "shared_outer") if lora else (gpt_oss_model(), None)
        with ad.in_forward() if ad else contextlib.nullcontext():
            out = model(ids_of(2, 7, 40))
            out.square().mean().backward()
        params = ad.parameters() if ad else model.parameters()
        return out.detach(), [p.grad for p in params]

    want, want_grads = run()
    monkeypatch.setattr(transformer, "group_align", lambda x: 8)
    monkeypatch.setattr(transformer, "grouped_mm", _nan_tail(grouped_ops.grouped_mm))
    monkeypatch.setattr(ops_mod, "grouped_mm", _nan_tail(grouped_ops.grouped_mm))  # the LoRA's (model ops)
    got, grads = run()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(grads) == len(want_grads) and all(g is not None for g in want_grads)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
