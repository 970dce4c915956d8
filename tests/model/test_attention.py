"""The attention package: the decode fold, rope (YaRN, interleaved) against transformers' own
functions, the per-layer kind registry and the decode-state specs."""
import pytest
import torch
import torch.nn.functional as F

from moe_rl.model import MoEArch, MoEForCausalLM
from moe_rl.model.attention import MIXERS, KVSpec, Rope, apply_rope, decode_sdpa, mixer_class, state_specs


@pytest.mark.parametrize("hq,hkv,dv", [(8, 2, 16), (4, 4, 16), (6, 1, 10)])
def test_decode_fold_equals_repeated_kv(hq, hkv, dv):
    """Query heads folded into the query length, against K/V repeated per query head."""
    g = torch.Generator().manual_seed(0)
    B, S, D = 3, 11, 16
    q = torch.randn(B, hq, D, generator=g)
    k, v = torch.randn(B, hkv, S, D, generator=g), torch.randn(B, hkv, S, dv, generator=g)
    mask = torch.arange(S)[None, :] <= torch.tensor([3, 10, 0])[:, None]
    got = decode_sdpa(q, k, v, mask, scale=0.3)
    rep = hq // hkv
    ref = F.scaled_dot_product_attention(q[:, :, None], k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                         attn_mask=mask[:, None, None, :], scale=0.3)[:, :, 0]
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)
    # float64: the same numbers whichever order the kernel sums in
    got64 = decode_sdpa(q.double(), k.double(), v.double(), mask, scale=0.3)
    ref64 = F.scaled_dot_product_attention(q.double()[:, :, None], k.double().repeat_interleave(rep, 1),
                                           v.double().repeat_interleave(rep, 1), attn_mask=mask[:, None, None, :],
                                           scale=0.3)[:, :, 0]
    torch.testing.assert_close(got64, ref64, atol=1e-12, rtol=0)


@pytest.mark.parametrize("hq,hkv,dv,t,s,causal", [(8, 2, 16, 11, 11, True), (6, 1, 10, 5, 12, False),
                                                   (4, 4, 16, 7, 7, False)])
def test_wide_heads_attend_in_row_chunks_as_in_one_call(monkeypatch, hq, hkv, dv, t, s, causal):
    """A head too wide for SDPA's fused GPU kernels goes in chunks of query rows with the query
    heads of a kv group folded into the rows: each row's output is the one call's (K/V repeated
    per query head, the mask as given), causal or with a mask of later rows over a longer prefix."""
    from moe_rl.model.attention import layouts

    g = torch.Generator().manual_seed(1)
    B, D = 2, 16
    q = torch.randn(B, hq, t, D, generator=g)
    k, v = torch.randn(B, hkv, s, D, generator=g), torch.randn(B, hkv, s, dv, generator=g)
    mask = None if causal else layouts.visible(torch.arange(s - t, s)[:, None], torch.arange(s)[None, :])
    rep = hq // hkv
    ref = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                         attn_mask=mask, is_causal=causal, scale=0.3)
    calls = []
    monkeypatch.setattr(layouts, "math_backend_rows", lambda q, n_keys: calls.append(n_keys) or 3)
    got = layouts.sdpa(q, k, v, mask=mask, is_causal=causal, scale=0.3)
    assert calls == [s]
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)


def test_math_backend_rows_bound_the_scores():
    """Folded chunks only on a GPU with a head over 256 (DeepSeek-V3's absorbed 576), sized so
    that the fp32 scores of one call stay under 1 GiB; a segment that fits is one chunk (still
    folded: a few new rows over a long cached prefix would otherwise repeat K/V per head)."""
    from types import SimpleNamespace

    from moe_rl.model.attention.layouts import MATH_SCORES_BYTES, math_backend_rows

    def q(device, shape):
        return SimpleNamespace(device=torch.device(device), shape=shape)

    rows = math_backend_rows(q("cuda", (1, 128, 8192, 576)), 8192)
    assert rows == 256 and 4 * 128 * rows * 8192 <= MATH_SCORES_BYTES < 4 * 128 * (rows + 1) * 8192
    assert math_backend_rows(q("cuda", (1, 128, 8192, 256)), 8192) is None  # flash takes 256
    assert math_backend_rows(q("cpu", (1, 128, 8192, 576)), 8192) is None  # the CPU's kernel is blocked
    assert math_backend_rows(q("cuda", (1, 128, 200, 576)), 200) >= 200  # one chunk
    assert math_backend_rows(q("cuda", (1, 128, 8192, 576)), 10 ** 9) == 1


def _hf_yarn(params: dict, head_dim: int, max_pos: int):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.Qwen3MoeConfig(head_dim=head_dim, hidden_size=64, num_attention_heads=4,
                                      max_position_embeddings=max_pos, rope_parameters=params)
    return ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")


@pytest.mark.parametrize("params", [
    {"factor": 4.0, "original_max_position_embeddings": 64},
    {"factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
     "mscale_all_dim": 1.0},  # DeepSeek-V3's
    {"factor": 8.0, "original_max_position_embeddings": 128, "mscale": 0.707, "mscale_all_dim": 1.0,
     "truncate": False},
])
def test_yarn_equals_transformers(params):
    params = {"rope_type": "yarn", "rope_theta": 10000.0, **params}
    inv_freq, factor = _hf_yarn(params, head_dim=64, max_pos=512)
    rope = Rope.from_hf(params, dim=64, theta=10000.0)
    torch.testing.assert_close(rope.inv_freq("cpu"), inv_freq, atol=0, rtol=1e-6)
    assert rope.scale() == pytest.approx(factor, rel=1e-12)
    cos, _ = rope.cos_sin(torch.arange(5), torch.float32)
    emb = torch.arange(5).float()[:, None] * inv_freq[None, :]
    torch.testing.assert_close(cos, torch.cat([emb, emb], -1).cos() * factor, atol=1e-6, rtol=0)


def test_interleaved_rope_equals_transformers():
    pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    rope = Rope(8, 10000.0, interleaved=True)
    cos, sin = rope.cos_sin(torch.arange(6), torch.float32)
    x = torch.randn(6, 3, 8)
    ref, _ = apply_rotary_pos_emb_interleave(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos[None], sin[None])
    torch.testing.assert_close(rope.apply(x, cos, sin), ref[0].transpose(0, 1), atol=1e-6, rtol=0)
    # partial: the rotated dims first, the rest unchanged
    wide = torch.randn(6, 3, 12)
    out = apply_rope(wide, cos, sin, interleaved=True)
    torch.testing.assert_close(out[..., 8:], wide[..., 8:], atol=0, rtol=0)


def test_rope_scaling_round_trips_and_bad_types_are_named():
    arch = MoEArch.from_hf_dict({"hidden_size": 64, "num_attention_heads": 4, "head_dim": 16,
                                 "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 128}})
    assert arch.rope().rope_type == "yarn" and arch.rope().factor == 4.0
    again = MoEArch.from_hf_dict(arch.to_hf_dict())
    assert again.rope() == arch.rope()
    assert MoEArch().rope() == Rope(16, 1_000_000.0)
    with pytest.raises(ValueError, match="rope_scaling: unsupported rope_type 'llama3'"):
        MoEArch.from_hf_dict({"hidden_size": 64, "num_attention_heads": 4,
                              "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    with pytest.raises(ValueError, match="rope_type yarn needs original_max_position_embeddings"):
        MoEArch(rope_scaling={"rope_type": "yarn", "factor": 4.0})


def test_layer_kinds_pick_the_mixer_and_its_state(monkeypatch):
    arch = MoEArch(num_hidden_layers=3)
    assert arch.layer_kinds() == ["mha"] * 3
    model = MoEForCausalLM(arch)
    assert all(type(layer.mixer) is MIXERS["mha"] and layer.mixer is layer.self_attn for layer in model.model.layers)
    specs = state_specs(arch)
    assert specs == [KVSpec(arch.num_key_value_heads, arch.head_dim, arch.head_dim)] * 3
    assert specs[0].bytes_per_slot(10, 4) == 2 * 2 * 16 * 10 * 4  # K + V x kv heads x head_dim x ctx x fp32

    from moe_rl.model import arch as arch_mod

    fam = arch_mod.FAMILIES["qwen3_moe"]
    monkeypatch.setitem(arch_mod.FAMILIES, "qwen3_moe",
                        type(fam)(**{**fam.__dict__, "attention": lambda a, i: "nope" if i == 1 else "mha"}))
    with pytest.raises(ValueError, match="layer 1: unknown attention kind 'nope'"):
        mixer_class(arch, 1)


def test_values_stored_inside_the_keys():
    """v_in_k: one tensor per layer; the values are a view of the keys' leading features."""
    spec = KVSpec(1, 12, 8, v_in_k=True)
    cache = spec.allocate(3, 5, torch.float32, "cpu")
    assert cache.v.data_ptr() == cache.k.data_ptr() and spec.bytes_per_token(2) == 24
    rows = torch.randn(2, 1, 12)
    cache.write_rows(torch.tensor([0, 2]), torch.tensor([4, 1]), rows, None)
    ks, vs = cache.gather(torch.tensor([2, 0]), 5)
    torch.testing.assert_close(ks[0, :, 1], rows[1], atol=0, rtol=0)
    torch.testing.assert_close(vs[1, :, 4], rows[0, :, :8], atol=0, rtol=0)
    with pytest.raises(ValueError, match="v_dim=13 exceeds k_dim=12"):
        KVSpec(1, 12, 13, v_in_k=True)
