"""HF <-> Megatron conversion (pure torch: runs without megatron-core)."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from moe_rl.model import MoEArch, hf_param_specs, parse_expert_name
from moe_rl.train.megatron.convert import (
    MegatronLayout,
    expert_names,
    fuse_qkv,
    hf_to_megatron,
    megatron_expert_owner,
    megatron_param_specs,
    megatron_to_hf,
    split_qkv,
)

HF_KW = dict(
    vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2,
    mlp_only_layers=[1], decoder_sparse_step=1, norm_topk_prob=True, rope_theta=10000.0,
)


@pytest.fixture(scope="module")
def tiny():
    """A tiny Qwen3-MoE made by transformers (one dense layer), its HF state and arch."""
    cfg = transformers.Qwen3MoeConfig(**HF_KW)
    torch.manual_seed(0)
    ref = transformers.Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.15)
    arch = MoEArch.from_hf_dict(cfg.to_dict())
    state = _per_expert_hf_state(ref, arch)
    assert set(state) == {n for n, _ in hf_param_specs(arch)}
    return arch, state


@pytest.fixture(scope="module")
def glm():
    """A tiny GLM-4.5 made by transformers: q/k/v bias, correction bias, shared experts, groups,
    the first layer dense, no q/k norm."""
    cfg = transformers.Glm4MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, n_routed_experts=6, num_experts_per_tok=2,
        n_shared_experts=2, n_group=2, topk_group=1, first_k_dense_replace=1, attention_bias=True, use_qk_norm=False)
    torch.manual_seed(0)
    ref = transformers.Glm4MoeForCausalLM(cfg)
    with torch.no_grad():
        for t in ref.state_dict().values():
            t.normal_(0, 0.15)
    arch = MoEArch.from_hf_dict(cfg.to_dict())
    state = _per_expert_hf_state(ref, arch)
    assert set(state) == {n for n, _ in hf_param_specs(arch)}
    assert any(n.endswith("e_score_correction_bias") for n in state) and any(".shared_experts." in n for n in state)
    return arch, state


def _per_expert_hf_state(ref, arch):
    """HF names with one tensor per expert (transformers v5 stores experts stacked)."""
    out = {}
    for name, t in ref.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            layer = name.split(".")[2]
            for e in range(t.shape[0]):
                g, u = t[e].chunk(2, dim=0)
                out[f"model.layers.{layer}.mlp.experts.{e}.gate_proj.weight"] = g.clone()
                out[f"model.layers.{layer}.mlp.experts.{e}.up_proj.weight"] = u.clone()
        elif name.endswith("mlp.experts.down_proj"):
            layer = name.split(".")[2]
            for e in range(t.shape[0]):
                out[f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t.clone()
    return out


LAYOUTS = [dict(), dict(te=True), dict(te=True, grouped_gemm=True), dict(grouped_gemm=True)]  # last: TorchGroupedMLP


@pytest.mark.parametrize("family", ["tiny", "glm"])
@pytest.mark.parametrize("kind", LAYOUTS, ids=["local", "te", "te-grouped", "torch-grouped"])
@pytest.mark.parametrize("ep", [1, 2])
def test_round_trip_bit_identical(request, family, kind, ep):
    arch, hf = request.getfixturevalue(family)
    seen = {}
    for r in range(ep):
        layout = MegatronLayout(**kind, ep_size=ep, ep_rank=r)
        meg = hf_to_megatron(hf, arch, layout)
        assert {n: tuple(t.shape) for n, t in meg.items()} == dict(megatron_param_specs(arch, layout))
        yielded = []
        for name, t in megatron_to_hf(meg, arch, layout):
            if name in seen:  # a dense tensor, which every EP rank yields
                assert torch.equal(seen[name], t)
            seen[name] = t
            yielded.append(name)
        # this rank's tensors (dense + its own experts), in canonical HF order
        assert yielded == [n for n, _ in hf_param_specs(arch) if megatron_expert_owner(n, arch, ep) in (None, r)]
    assert set(seen) == {n for n, _ in hf_param_specs(arch)}
    for name, t in seen.items():
        assert t.dtype == hf[name].dtype and torch.equal(t, hf[name]), name


@pytest.mark.parametrize("family", ["tiny", "glm"])
@pytest.mark.parametrize("tp,ep", [(2, 1), (2, 2)])
def test_round_trip_tensor_parallel(request, family, tp, ep):
    """TP shards joined by a gather (concatenation over TP ranks) give the HF tensors back."""
    arch, hf = request.getfixturevalue(family)
    for er in range(ep):
        states = [hf_to_megatron(hf, arch, MegatronLayout(tp_size=tp, tp_rank=r, ep_size=ep, ep_rank=er))
                  for r in range(tp)]
        for r, st in enumerate(states):
            layout = MegatronLayout(tp_size=tp, tp_rank=r, ep_size=ep, ep_rank=er)
            assert {n: tuple(t.shape) for n, t in st.items()} == dict(megatron_param_specs(arch, layout))
        gather = lambda name, local, dim: torch.cat([s[name] for s in states], dim=dim)  # noqa: E731
        for r, st in enumerate(states):
            layout = MegatronLayout(tp_size=tp, tp_rank=r, ep_size=ep, ep_rank=er)
            for name, t in megatron_to_hf(st, arch, layout, gather=gather):
                assert torch.equal(t, hf[name]), name


def test_qkv_layout_is_grouped_by_query_group():
    """Megatron's fused QKV: per query group g, [its q heads; k_g; v_g] (attention.py's split)."""
    arch = MoEArch(hidden_size=4, num_attention_heads=4, num_key_value_heads=2, head_dim=2)
    H, hd = 4, 2
    head = lambda tag, h: torch.full((hd, H), float(tag * 10 + h))  # noqa: E731
    q = torch.cat([head(1, h) for h in range(4)])
    k = torch.cat([head(2, h) for h in range(2)])
    v = torch.cat([head(3, h) for h in range(2)])
    qkv = fuse_qkv(q, k, v, arch)
    rows = qkv[::hd, 0].tolist()  # one value per head block
    assert rows == [10, 11, 20, 30, 12, 13, 21, 31]
    for a, b in zip(split_qkv(qkv, arch), (q, k, v)):
        assert torch.equal(a, b)


def test_expert_names_and_owner(tiny):
    arch, _ = tiny
    assert expert_names(MegatronLayout(), 0, 3) == (
        "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight",
        "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight",
    )
    assert expert_names(MegatronLayout(te=True, grouped_gemm=True), 2, 1) == (
        "decoder.layers.2.mlp.experts.linear_fc1.weight1",
        "decoder.layers.2.mlp.experts.linear_fc2.weight1",
    )
    assert megatron_expert_owner("model.layers.0.mlp.experts.4.up_proj.weight", arch, 2) == 1
    assert megatron_expert_owner("model.layers.0.mlp.gate.weight", arch, 2) is None
    assert parse_expert_name("model.layers.0.mlp.experts.4.up_proj.weight") == (0, 4, "up_proj")


def test_refuses_unshardable():
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by ep_size=4"):
        megatron_param_specs(MoEArch(num_experts=6), MegatronLayout(ep_size=4))
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        megatron_param_specs(MoEArch(tie_word_embeddings=True), MegatronLayout())
    with pytest.raises(ValueError, match="gather"):
        list(megatron_to_hf({}, MoEArch(), MegatronLayout(tp_size=2)))
    with pytest.raises(ValueError, match="norm_topk_prob=False with a sigmoid router"):
        megatron_param_specs(MoEArch(model_type="glm4_moe", norm_topk_prob=False), MegatronLayout())
    with pytest.raises(ValueError, match="scores a group by its top"):
        megatron_param_specs(MoEArch(model_type="glm4_moe", num_experts_per_tok=3, n_group=2, topk_group=1),
                             MegatronLayout())


def test_glm_names(glm):
    arch, _ = glm
    names = dict(megatron_param_specs(arch, MegatronLayout()))
    assert names["decoder.layers.1.mlp.router.expert_bias"] == (6,)
    assert names["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"] == (64, 32)  # [gate; up] of 2 x 16
    assert names["decoder.layers.0.self_attention.linear_qkv.bias"] == (64,)  # (4 q + 2 k + 2 v heads) x 8
    assert not any("layernorm.weight" in n and "_attention.q" in n for n in names)  # use_qk_norm=False


@pytest.fixture(scope="module")
def gpt_oss():
    """A tiny gpt-oss made by transformers: sinks, biases everywhere, stacked [E, H, 2I] experts
    with gate/up interleaved (HF's names are the stacks)."""
    cfg = transformers.GptOssConfig(
        vocab_size=96, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=3)
    torch.manual_seed(0)
    ref = transformers.GptOssForCausalLM(cfg)
    with torch.no_grad():
        for t in ref.state_dict().values():
            t.normal_(0, 0.15)
    arch = MoEArch.from_hf_dict(cfg.to_dict())
    state = {n: t.clone() for n, t in ref.state_dict().items()}
    assert set(state) == {n for n, _ in hf_param_specs(arch)}
    return arch, state


@pytest.mark.parametrize("kind", LAYOUTS, ids=["local", "te", "te-grouped", "torch-grouped"])
@pytest.mark.parametrize("tp,ep", [(1, 1), (1, 2), (2, 2)])
def test_gpt_oss_round_trip(gpt_oss, kind, tp, ep):
    """HF -> Megatron -> HF, bit for bit: each EP rank yields its rows of the stacked experts
    (their concatenation is HF's stack), TP shards of the fused QKV and the sinks are joined; fc1
    is the de-interleaved [gate; up] of HF's columns."""
    arch, hf = gpt_oss
    rows: dict[str, list] = {}
    for er in range(ep):
        states = [hf_to_megatron(hf, arch, MegatronLayout(**kind, tp_size=tp, tp_rank=r, ep_size=ep, ep_rank=er))
                  for r in range(tp)]
        gather = lambda name, local, dim: torch.cat([s[name] for s in states], dim=dim)  # noqa: E731
        layout = MegatronLayout(**kind, tp_size=tp, ep_size=ep, ep_rank=er)
        assert {n: tuple(t.shape) for n, t in states[0].items()} == dict(megatron_param_specs(arch, layout))
        for name, t in megatron_to_hf(states[0], arch, layout, gather=gather if tp > 1 else None):
            rows.setdefault(name, []).append(t)
    for name, parts in rows.items():
        got = torch.cat(parts) if ".mlp.experts." in name else parts[0]
        assert torch.equal(got, hf[name]), name
    fc1 = hf_to_megatron(hf, arch, MegatronLayout())[expert_names(MegatronLayout(), 0, 1)[0]]
    W = hf["model.layers.0.mlp.experts.gate_up_proj"][1]  # [H, 2I], gate in the even columns
    assert torch.equal(fc1, torch.cat([W[:, 0::2].T, W[:, 1::2].T]))


def test_gpt_oss_refusals():
    with pytest.raises(ValueError, match="gpt_oss with attention_bias=False"):
        megatron_param_specs(MoEArch(model_type="gpt_oss", sliding_window=4), MegatronLayout())
    with pytest.raises(ValueError, match="swiglu_alpha=1.5"):
        megatron_param_specs(MoEArch(model_type="gpt_oss", sliding_window=4, attention_bias=True, swiglu_alpha=1.5),
                             MegatronLayout())
