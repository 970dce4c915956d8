"""The GLM-4.5 family (sigmoid router with correction bias, groups, shared experts, first-k
dense, partial rotary, qk-norm, attention bias) against HF transformers' Glm4MoeForCausalLM."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moe_rl.model import MoEArch, MoEForCausalLM, load_hf, save_hf  # noqa: E402

BASE = dict(
    vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=12, n_routed_experts=8, num_experts_per_tok=3,
    n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
    first_k_dense_replace=1, partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True, rope_theta=10000.0,
)
CASES = {
    "all": {},
    "no_shared_no_groups": dict(n_shared_experts=0, n_group=1, topk_group=1, first_k_dense_replace=0),
    "unnormalised_full_rotary": dict(norm_topk_prob=False, partial_rotary_factor=1.0, routed_scaling_factor=1.0),
    "plain_attention_two_dense": dict(use_qk_norm=False, attention_bias=False, first_k_dense_replace=2,
                                      n_shared_experts=2, n_group=2, topk_group=1, num_hidden_layers=4),
}


def hf_glm(tmp_path, dtype=torch.float32, **over):
    cfg = transformers.Glm4MoeConfig(**{**BASE, **over})
    cfg._experts_implementation = "eager"  # HF's per-expert loop (its grouped_mm refuses float64)
    torch.manual_seed(0)
    ref = transformers.Glm4MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.15)  # HF zero-inits router and bias: random values make routing non-trivial
        for n, b in ref.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    ref.save_pretrained(tmp_path / "hf")
    return ref.to(dtype), tmp_path / "hf"


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case):
    ref, path = hf_glm(tmp_path, **CASES[case])
    model = load_hf(path)
    arch = model.arch
    assert arch.model_type == "glm4_moe" and arch.router == "sigmoid"
    assert model.moe_layers == list(range(ref.config.first_k_dense_replace, ref.config.num_hidden_layers))
    ids = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-4, rtol=0)


def test_logits_match_transformers_fp64(tmp_path):
    ref, path = hf_glm(tmp_path, torch.float64)
    model = load_hf(path, dtype=torch.float64)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-10, rtol=0)


def test_router_matches_hf_router(tmp_path):
    """Ids and weights of the group-limited, biased selection equal HF's Glm4MoeTopkRouter on
    many tokens; the groups and the bias both change the choice (the test can fail)."""
    ref, path = hf_glm(tmp_path)
    model = load_hf(path)
    x = torch.randn(512, 32, generator=torch.Generator().manual_seed(3))
    hf_gate, gate = ref.model.layers[1].mlp.gate, model.model.layers[1].mlp
    with torch.no_grad():
        _, w_ref, ids_ref = hf_gate(x)
        ids, w = gate.route(x, None)
        order_ref, order = ids_ref.argsort(1), ids.argsort(1)
        assert torch.equal(ids.gather(1, order), ids_ref.gather(1, order_ref))
        torch.testing.assert_close(w.gather(1, order), w_ref.gather(1, order_ref), atol=1e-6, rtol=0)
        scores = gate.gate(x).sigmoid()
        assert not torch.equal(ids.sort(1).values, scores.topk(3).indices.sort(1).values)  # routing is non-trivial
        gate.gate.n_group = 1
        assert not torch.equal(gate.route(x, None)[0].sort(1).values, ids.sort(1).values)  # groups matter


def test_save_is_loadable_by_transformers(tmp_path):
    ref, path = hf_glm(tmp_path)
    model = load_hf(path)
    out = save_hf(model, tmp_path / "saved")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "glm4_moe" and cfg["architectures"] == ["Glm4MoeForCausalLM"]
    again = transformers.Glm4MoeForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, ref(ids).logits, atol=1e-5, rtol=0)


def test_random_init_round_trips_through_transformers(tmp_path):
    arch = MoEArch(model_type="glm4_moe", vocab_size=50, hidden_size=32, num_hidden_layers=3, head_dim=8,
                   n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, attention_bias=True,
                   routed_scaling_factor=1.5)
    model = MoEForCausalLM(arch).init_weights(4, std=0.1)
    with torch.no_grad():
        for layer in model.moe_layers:
            model.model.layers[layer].mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    ref = transformers.Glm4MoeForCausalLM.from_pretrained(save_hf(model, tmp_path / "m")).eval()
    ids = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-5, rtol=0)
    assert MoEArch.from_hf_dir(tmp_path / "m") == arch


def test_correction_bias_stays_fp32_in_a_bf16_model():
    arch = MoEArch(model_type="glm4_moe", num_hidden_layers=1)
    model = MoEForCausalLM(arch).init_weights(0)
    gate = model.model.layers[0].mlp.gate
    with torch.no_grad():
        gate.e_score_correction_bias.copy_(torch.arange(8) * 1e-3 + 1.0)  # not representable in bf16
    want = gate.e_score_correction_bias.clone()
    model.to(torch.bfloat16)
    assert gate.e_score_correction_bias.dtype == torch.float32 and torch.equal(gate.e_score_correction_bias, want)
    assert gate.weight.dtype == torch.bfloat16
    x = torch.randn(4, arch.hidden_size, dtype=torch.bfloat16)
    assert gate(x).dtype == torch.float32  # logits in fp32, as HF and SGLang compute them
    model.double()
    assert gate.e_score_correction_bias.dtype == torch.float64  # never lowered, raised with the model


def test_mtp_layer_is_skipped_and_unknown_family_named(tmp_path):
    from safetensors.torch import load_file, save_file

    _, path = hf_glm(tmp_path)
    state = load_file(path / "model.safetensors")
    state["model.layers.3.eh_proj.weight"] = torch.zeros(32, 64)  # GLM's nextn (MTP) layer
    save_file(state, path / "model.safetensors")
    load_hf(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "no_such_moe"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config.json: unsupported model_type 'no_such_moe'"):
        load_hf(path)


def test_family_fields_are_checked():
    with pytest.raises(ValueError, match="n_shared_experts=1 is not supported by model_type='qwen3_moe'"):
        MoEArch(n_shared_experts=1)
    with pytest.raises(ValueError, match="mlp_only_layers"):
        MoEArch(model_type="glm4_moe", mlp_only_layers=[0])
    with pytest.raises(ValueError, match="multiple of n_group"):
        MoEArch(model_type="glm4_moe", n_group=3)
    assert MoEArch(model_type="glm4_moe").partial_rotary_factor == 0.5  # HF's default
    assert MoEArch().use_qk_norm is True and MoEArch().rotary_dim == 16


# --- routing replay (R3) with the sigmoid router -------------------------------------------------
GLM = MoEArch(model_type="glm4_moe", vocab_size=40, hidden_size=32, num_hidden_layers=3, head_dim=8,
              num_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1,
              first_k_dense_replace=1, routed_scaling_factor=2.5, moe_intermediate_size=16)


def glm_model(seed=7):
    model = MoEForCausalLM(GLM).init_weights(seed, std=0.2)
    with torch.no_grad():
        for i in model.moe_layers:
            model.model.layers[i].mlp.gate.e_score_correction_bias.normal_(0, 0.3, generator=torch.Generator().manual_seed(i))
    return model


def tokens(B=2, T=6):
    return torch.randint(0, 40, (B, T), generator=torch.Generator().manual_seed(0))


def test_glm_record_replay_reproduces_logits_and_skips_dense_layers():
    model = glm_model()
    rec = []
    with torch.no_grad():
        ref = model(tokens(), record=rec)
        assert len(rec) == len(model.moe_layers) == 2 and all(r.shape == (12, 3) for r in rec)
        assert torch.equal(model(tokens(), replay=rec), ref)
        # the bias only selects: under replay moving it changes nothing, without replay it does
        for i in model.moe_layers:
            model.model.layers[i].mlp.gate.e_score_correction_bias.add_(torch.linspace(-1, 1, 8))
        assert torch.equal(model(tokens(), replay=rec), ref)
        assert not torch.equal(model(tokens()), ref)


def test_glm_replayed_weights_are_unbiased_scores_renormalised_and_scaled():
    model = glm_model()
    moe = model.model.layers[1].mlp
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(1))
    given = torch.randperm(8, generator=torch.Generator().manual_seed(2))[:3].repeat(6, 1)
    with torch.no_grad():
        chosen, w = moe.route(x, given)
        scores = torch.sigmoid(x @ moe.gate.weight.T)  # plain torch: HF's / Megatron's formula
        s = scores.gather(1, given)
        want = s / s.sum(-1, keepdim=True) * 2.5
    assert torch.equal(chosen, given)
    torch.testing.assert_close(w, want, atol=1e-6, rtol=0)


def test_glm_router_gets_gradients_under_replay_and_the_bias_none():
    model = glm_model()
    rec = []
    with torch.no_grad():
        model(tokens(), record=rec)
    model(tokens(), replay=rec).logsumexp(-1).sum().backward()
    gate = model.model.layers[1].mlp.gate
    assert gate.weight.grad is not None and gate.weight.grad.abs().sum() > 0
    assert "e_score_correction_bias" not in dict(model.named_parameters())
    assert model.model.layers[1].mlp.shared_experts.down_proj.weight.grad.abs().sum() > 0


def test_expert_bias_update_follows_deepseek_v3_rule():
    """bias += rate * sign(mean_load - load), with the load of forwards that build a graph
    (replayed routings count), restarting after each update; nothing counts under no_grad."""
    model = glm_model()
    model.track_expert_load()
    T = 12
    g = torch.Generator().manual_seed(5)
    replay = [torch.rand(T, 8, generator=g).argsort(1)[:, :3] for _ in model.moe_layers]
    # expert 0 of the first MoE layer gets every token
    replay[0] = torch.cat([torch.zeros(T, 1, dtype=torch.long), 1 + torch.rand(T, 7, generator=g).argsort(1)[:, :2]], 1)
    before = [model.model.layers[i].mlp.gate.e_score_correction_bias.clone() for i in model.moe_layers]
    with torch.no_grad():
        model(tokens(), replay=replay)  # a proximal forward: not counted
    model(tokens(), replay=replay).sum().backward()
    model.update_expert_bias(0.01)
    for i, r, b in zip(model.moe_layers, replay, before):
        load = torch.bincount(r.reshape(-1), minlength=8).double()
        want = b + 0.01 * torch.sign(load.mean() - load).float()
        gate = model.model.layers[i].mlp.gate
        torch.testing.assert_close(gate.e_score_correction_bias, want, atol=0, rtol=0)
        assert gate.e_score_correction_bias[0] < b[0] if i == model.moe_layers[0] else True
        assert gate.load.sum() == 0
    model.update_expert_bias(0.01)  # no tokens since: loads are equal, sign 0, nothing moves
    for i, b in zip(model.moe_layers, before):
        assert not torch.equal(model.model.layers[i].mlp.gate.e_score_correction_bias, b)
