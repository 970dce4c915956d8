"""The DeepSeek-V3 family (multi-head latent attention; Kimi-K2, Moonlight, GLM-4.7-Flash) against
HF transformers' DeepseekV3ForCausalLM and Glm4MoeLiteForCausalLM, and its HF checkpoints."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from moe_rl.model import MoEArch, MoEForCausalLM, load_hf, save_hf  # noqa: E402

BASE = dict(
    vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1,
    n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
    q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=10, qk_rope_head_dim=6, v_head_dim=8, rope_interleave=True,
    rms_norm_eps=1e-5, max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
CASES = {
    "q_lora_interleaved": {},
    "plain_q_proj_neox_rope": dict(q_lora_rank=None, rope_interleave=False),
    "yarn_mscale": dict(rope_parameters=YARN),
    "yarn_bias_two_dense": dict(rope_parameters={**YARN, "mscale": 0.707}, attention_bias=True, num_hidden_layers=4,
                                first_k_dense_replace=2, n_group=1, topk_group=1, n_shared_experts=2),
}


def _randomise(ref):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.15)  # HF zero-inits router and bias: random values make routing non-trivial
        for n, b in ref.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    return ref


def hf_deepseek(tmp_path, dtype=torch.float32, **over):
    cfg = transformers.DeepseekV3Config(**{**BASE, **over})
    cfg._experts_implementation = "eager"  # HF's per-expert loop (its grouped_mm refuses float64)
    ref = _randomise(transformers.DeepseekV3ForCausalLM(cfg).eval())
    ref.save_pretrained(tmp_path / "hf")
    return ref.to(dtype), tmp_path / "hf"


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case):
    ref, path = hf_deepseek(tmp_path, **CASES[case])
    model = load_hf(path)
    arch = model.arch
    assert arch.model_type == "deepseek_v3" and arch.is_mla and arch.head_dim == BASE["qk_rope_head_dim"]
    assert model.moe_layers == list(range(ref.config.first_k_dense_replace, ref.config.num_hidden_layers))
    ids = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-4, rtol=0)
        # packed sequences attend within their own sequence, as separate forwards do
        cu = torch.tensor([0, 11, 22, 33])
        packed = model(ids.reshape(1, -1), cu_seqlens=cu).view(3, 11, -1)
        torch.testing.assert_close(packed, ref(ids).logits, atol=1e-4, rtol=0)


def test_logits_match_transformers_fp64(tmp_path):
    ref, path = hf_deepseek(tmp_path, torch.float64, rope_parameters=YARN)
    model = load_hf(path, dtype=torch.float64)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-10, rtol=0)


def test_latent_norm_eps_is_hf_default_not_rms_norm_eps(tmp_path):
    """q_a_layernorm / kv_a_layernorm use 1e-6 whatever rms_norm_eps is; with a large rms_norm_eps
    the difference shows in the logits."""
    ref, path = hf_deepseek(tmp_path, rms_norm_eps=0.5)
    model = load_hf(path)
    layer = model.model.layers[0].mixer
    assert layer.kv_a_layernorm.eps == 1e-6 and layer.q_a_layernorm.eps == 1e-6
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-4, rtol=0)


def test_glm4_moe_lite_matches_transformers(tmp_path):
    """GLM-4.7-Flash: MLA under GLM's names (mlp_layer_types for the dense layers)."""
    over = {k: v for k, v in BASE.items() if k not in ("first_k_dense_replace",)}
    cfg = transformers.Glm4MoeLiteConfig(**{**over, "mlp_layer_types": ["dense", "sparse", "sparse"]})
    cfg._experts_implementation = "eager"
    ref = _randomise(transformers.Glm4MoeLiteForCausalLM(cfg).eval())
    ref.save_pretrained(tmp_path / "hf")
    model = load_hf(tmp_path / "hf")
    assert model.arch.model_type == "glm4_moe_lite" and model.moe_layers == [1, 2]
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-4, rtol=0)
    again = transformers.Glm4MoeLiteForCausalLM.from_pretrained(save_hf(model, tmp_path / "saved")).eval()
    assert again.config.mlp_layer_types == ["dense", "sparse", "sparse"]
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, ref(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", ["q_lora_interleaved", "yarn_bias_two_dense", "plain_q_proj_neox_rope"])
def test_save_is_loadable_by_transformers(tmp_path, case):
    ref, path = hf_deepseek(tmp_path, **CASES[case])
    model = load_hf(path)
    out = save_hf(model, tmp_path / "saved")
    again = transformers.DeepseekV3ForCausalLM.from_pretrained(out).eval()
    assert again.config.rope_interleave == ref.config.rope_interleave
    assert again.config.rope_parameters["rope_type"] == ref.config.rope_parameters["rope_type"]
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, ref(ids).logits, atol=1e-5, rtol=0)
    assert MoEArch.from_hf_dir(out) == model.arch


def test_mtp_layer_is_skipped_and_said(tmp_path, caplog):
    """DeepSeek-V3 stores its multi-token-prediction block as layer num_hidden_layers; it is not
    modelled: the load skips it and says so."""
    ref, path = hf_deepseek(tmp_path)
    state = load_file(path / "model.safetensors")
    n = ref.config.num_hidden_layers
    state[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(32, 64)
    state[f"model.layers.{n}.self_attn.kv_b_proj.weight"] = torch.zeros(72, 16)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    with caplog.at_level("WARNING"):
        model = load_hf(path)
    assert "multi-token-prediction" in caplog.text and f"layer {n}" in caplog.text
    ids = torch.randint(0, 97, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-4, rtol=0)


def test_kimi_k2_config_is_deepseek_v3(tmp_path):
    ref, path = hf_deepseek(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "model_type": "kimi_k2"}))
    model = load_hf(path)
    assert model.arch.model_type == "deepseek_v3"
    ids = torch.randint(0, 97, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-4, rtol=0)


def test_fp8_block_checkpoint_is_dequantized(tmp_path):
    """A block-FP8 checkpoint (weight float8_e4m3fn + weight_scale_inv per 128x128 block, as
    DeepSeek-V3 ships) loads as weight * scale, block by block."""
    ref, path = hf_deepseek(tmp_path, hidden_size=160, intermediate_size=200)  # blocks of 128 and a ragged edge
    state = load_file(path / "model.safetensors")
    name = "model.layers.0.mlp.gate_proj.weight"  # [200, 160]: 2 x 2 blocks, the last ones partial
    w = state[name]
    scale = torch.tensor([[0.5, 2.0], [0.25, 4.0]])
    state[name] = (w / scale.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :160]).to(torch.float8_e4m3fn)
    state[name + "_scale_inv"] = scale
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant}))
    model = load_hf(path)
    want = state[name].float() * scale.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :160]
    torch.testing.assert_close(model.model.layers[0].mlp.gate_proj.weight, want, atol=0, rtol=0)
    assert not torch.equal(want, w)  # the fp8 rounding is real: the test sees the dequantized values


def test_mla_fields_are_checked():
    with pytest.raises(ValueError, match="needs \\['kv_lora_rank'"):
        MoEArch(model_type="deepseek_v3")
    with pytest.raises(ValueError, match="only DeepSeek-V3's sigmoid / noaux_tc router"):
        MoEArch.from_hf_dict({**BASE, "model_type": "deepseek_v3", "topk_method": "greedy"})
    with pytest.raises(ValueError, match="quant_method='awq'"):
        MoEArch.from_hf_dict({**BASE, "model_type": "deepseek_v3", "quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ValueError, match="mlp_layer_types"):
        MoEArch.from_hf_dict({**BASE, "model_type": "glm4_moe_lite", "mlp_layer_types": ["sparse", "dense", "sparse"]})
    a = MoEArch(model_type="deepseek_v3", q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
                v_head_dim=4, num_key_value_heads=1)
    assert a.num_key_value_heads == a.num_attention_heads and a.head_dim == 4 and a.rope().interleaved
    model = MoEForCausalLM(a)
    assert hasattr(model.model.layers[0].mixer, "q_proj") and not hasattr(model.model.layers[0].mixer, "q_a_proj")


def test_replay_reproduces_the_record_and_recomputes_the_gates():
    """R3 on the family: replaying a record gives the recorded forward exactly; replaying other
    experts changes the output, with gate weights from the current sigmoid scores."""
    arch = MoEArch(model_type="deepseek_v3", vocab_size=40, hidden_size=32, num_hidden_layers=3, num_experts=8,
                   num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                   moe_intermediate_size=16, q_lora_rank=12, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                   v_head_dim=6)
    model = MoEForCausalLM(arch).init_weights(3, std=0.2)
    ids = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(0))
    rec = []
    with torch.no_grad():
        out = model(ids, record=rec)
        assert len(rec) == 2 and torch.equal(model(ids, replay=rec), out)
        other = [(r + 1) % 8 for r in rec]
        assert not torch.allclose(model(ids, replay=other), out)
