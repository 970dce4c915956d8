"""The native model against HF transformers' Qwen3MoeForCausalLM (independent reference)."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moe_rl.model import MoEArch, MoEForCausalLM, load_hf, save_hf


def tiny_hf(tmp_path, **over):
    kw = dict(
        vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=6, num_experts_per_tok=2, mlp_only_layers=[2], decoder_sparse_step=1,
        norm_topk_prob=True, rope_theta=10000.0,
    )
    kw.update(over)
    cfg = transformers.Qwen3MoeConfig(**kw)
    torch.manual_seed(0)
    ref = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.15)  # HF zero-inits the router; random weights make routing non-trivial
    ref.save_pretrained(tmp_path / "hf")
    return ref, tmp_path / "hf"


@pytest.mark.parametrize("over", [{}, {"norm_topk_prob": False, "decoder_sparse_step": 2, "mlp_only_layers": []},
                                  {"max_position_embeddings": 64, "rope_parameters": {  # YaRN
                                      "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 16}}])
def test_logits_match_transformers(tmp_path, over):
    ref, path = tiny_hf(tmp_path, **over)
    model = load_hf(path)
    ids = torch.randint(0, 97, (3, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits
        got = model(ids)
    assert got.shape == (3, 11, 97)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert model.moe_layers == MoEArch.from_hf_dir(path).moe_layers


def test_save_is_loadable_by_transformers(tmp_path):
    ref, path = tiny_hf(tmp_path)
    model = load_hf(path)
    out = save_hf(model, tmp_path / "saved")
    again = transformers.Qwen3MoeForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, ref(ids).logits, atol=1e-5, rtol=0)
    assert not list(tmp_path.glob(".saved.*")), "temporary directory left behind"


def test_sharded_index_checkpoint(tmp_path):
    ref, path = tiny_hf(tmp_path)
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    model = load_hf(tmp_path / "sharded")
    ids = torch.randint(0, 97, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-4, rtol=0)


def test_packed_sequences_equal_separate(tmp_path):
    model = MoEForCausalLM(MoEArch(vocab_size=50, num_hidden_layers=2)).init_weights(3)
    a, b = torch.randint(0, 50, (1, 7)), torch.randint(0, 50, (1, 4))
    packed = torch.cat([a, b], dim=1)
    with torch.no_grad():
        out = model(packed, cu_seqlens=torch.tensor([0, 7, 11]))
        torch.testing.assert_close(out[:, :7], model(a), atol=1e-5, rtol=0)
        torch.testing.assert_close(out[:, 7:], model(b), atol=1e-5, rtol=0)


def test_missing_tensor_and_bad_shape_are_named(tmp_path):
    ref, path = tiny_hf(tmp_path)
    from safetensors.torch import load_file, save_file

    state = load_file(path / "model.safetensors")
    state.pop("model.layers.0.mlp.experts.3.up_proj.weight")
    save_file(state, path / "model.safetensors")
    with pytest.raises(KeyError, match="lacks 1 tensors"):
        load_hf(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["hidden_size"] = 16
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"\.weight has shape \(\d+, 32\), the model expects \(\d+, 16\)"):
        load_hf(path)
