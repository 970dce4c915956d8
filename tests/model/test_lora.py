"""LoRA adapters (moe_rl.model.lora) against independent references: a per-expert merge
written out in plain torch here, and the real ``peft`` package on HF transformers' model."""
import copy
import json

import pytest
import torch

from moe_rl.model import MoEArch, MoEForCausalLM, save_hf
from moe_rl.model.lora import LoraAdapters, LoraError, load_peft, save_peft

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "router", "experts.gate_up_proj", "experts.down_proj"]
ARCH = MoEArch(vocab_size=97, hidden_size=32, moe_intermediate_size=16, intermediate_size=48, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2,
               mlp_only_layers=[1], rope_theta=10000.0)


# GLM: sigmoid router with correction bias, shared experts, a dense first layer
GLM = MoEArch(model_type="glm4_moe", vocab_size=97, hidden_size=32, moe_intermediate_size=16, intermediate_size=48,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6,
              num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
              routed_scaling_factor=1.5, attention_bias=True, rope_theta=10000.0)
GLM_ALL = ALL + ["shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj"]


def make(targets=ALL, layers=None, rank=4, alpha=8.0, seed=0, shared=False, arch=ARCH):
    model = MoEForCausalLM(arch).init_weights(seed, std=0.1)
    if arch.router == "sigmoid":
        with torch.no_grad():
            for i in model.moe_layers:
                model.model.layers[i].mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    ad = LoraAdapters(model, rank, alpha, targets, layers, shared_outer=shared).init_weights(seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():  # B = 0 at init; random B makes every adapter count
        for b in ad.B.values():
            b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return model, ad


def merged_by_hand(model, ad):
    """A second, independent merge: one expert at a time, gate/up split by hand (a factor
    shared by the experts, leading dim 1, is used for every expert)."""
    m = copy.deepcopy(model)
    s = ad.alpha / ad.rank
    with torch.no_grad():
        for name, A in ad.A.items():
            key = name.replace("__", ".")
            B = ad.B[name]
            if key.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
                ex = m.get_submodule(key.rsplit(".", 1)[0])
                I = ex.gate_proj.shape[1]
                for e in range(model.arch.num_experts):
                    d = s * (B[e if B.shape[0] > 1 else 0] @ A[e if A.shape[0] > 1 else 0])
                    if key.endswith("gate_up_proj"):
                        ex.gate_proj[e] += d[:I]
                        ex.up_proj[e] += d[I:]
                    else:
                        ex.down_proj[e] += d
            else:
                m.get_submodule(key).weight += s * (B @ A)
    return m


@pytest.mark.parametrize("targets,layers,shared", [(ALL, None, False), (["experts.down_proj", "router"], [2], False),
                                                   (["q_proj", "experts.gate_up_proj"], [0, 1], False),
                                                   (ALL, None, True)])
def test_applied_equals_hand_merge_and_grads_reach_adapters_only(targets, layers, shared):
    model, ad = make(targets, layers, shared=shared)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    ref = merged_by_hand(model, ad)
    with torch.no_grad():
        expected = ref(ids)
        base = model(ids)
    with ad.applied():
        got = model(ids)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
    assert (got - base).abs().max() > 1e-3  # the adapters changed the model
    got.square().mean().backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in ad.parameters())
    # the base parameters are back in place after the block
    assert all(isinstance(p, torch.nn.Parameter) for p in model.parameters())
    with torch.no_grad():
        torch.testing.assert_close(model(ids), base, atol=0, rtol=0)


@pytest.mark.parametrize("targets,layers,shared", [(ALL, None, False), (["experts.down_proj", "router"], [2], False),
                                                   (["q_proj", "experts.gate_up_proj"], [0, 1], False),
                                                   (ALL, None, True)])
def test_in_forward_equals_hand_merge_and_merged_form_gradients(targets, layers, shared):
    """The unmerged form (hooks + grouped GEMMs of rank r) computes the hand-merged model, and its
    adapter gradients are the weight-delta form's."""
    model, ad = make(targets, layers, shared=shared)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = merged_by_hand(model, ad)(ids)
        base = model(ids)
    with ad.applied():
        ad.zero_grad()
        model(ids).square().mean().backward()
    grads_merged = {n: p.grad.clone() for n, p in ad.named_parameters()}
    ad.zero_grad()
    with ad.in_forward():
        got = model(ids)
        got.square().mean().backward()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert (got - base).abs().max() > 1e-3
    for n, p in ad.named_parameters():
        torch.testing.assert_close(p.grad, grads_merged[n], atol=1e-5, rtol=1e-4)
    assert all(p.grad is None for p in model.parameters())
    with torch.no_grad():  # detached after the block
        torch.testing.assert_close(model(ids), base, atol=0, rtol=0)


def test_merged_hf_tensors_leave_the_model_alone():
    from moe_rl.model import iter_local_hf_tensors

    model, ad = make(layers=[0, 2])
    expected = dict(iter_local_hf_tensors(merged_by_hand(model, ad)))
    before = {n: t.clone() for n, t in iter_local_hf_tensors(model)}
    got = ad.merged_hf_tensors()
    first = next(got)  # a consumer that stops early leaves nothing swapped
    assert first[0] == next(iter(expected))
    got = dict(ad.merged_hf_tensors())
    assert list(got) == list(expected)
    for n in expected:
        torch.testing.assert_close(got[n], expected[n], atol=1e-6, rtol=0)
    for n, t in iter_local_hf_tensors(model):
        assert torch.equal(t, before[n]) and isinstance(model.lm_head.weight, torch.nn.Parameter)


def test_router_adapter_routes_and_replays():
    """The record is of the adapted router; replaying it reproduces the adapted forward."""
    model, ad = make(["router"])
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(4))
    rec_base, rec_lora = [], []
    with torch.no_grad():
        model(ids, record=rec_base)
        with ad.applied():
            out = model(ids, record=rec_lora)
            replayed = model(ids, replay=rec_lora)
        ref = merged_by_hand(model, ad)
        rec_ref = []
        ref(ids, record=rec_ref)
    assert any((a != b).any() for a, b in zip(rec_base, rec_lora)), "router adapter changed no routing"
    for a, b in zip(rec_lora, rec_ref):
        assert torch.equal(a, b)
    torch.testing.assert_close(replayed, out, atol=0, rtol=0)


def test_shared_outer_shapes_and_gradient():
    """Shared outer factors: one gate_up A and one down B per layer; the shared factor's gradient
    is the sum of what a per-expert copy of it would get, expert by expert."""
    model, ad = make(["experts.gate_up_proj", "experts.down_proj"], shared=True)
    E, r, H, I = ARCH.num_experts, 4, ARCH.hidden_size, ARCH.moe_intermediate_size
    A_gu, B_gu = ad.A["model__layers__0__mlp__experts__gate_up_proj"], ad.B["model__layers__0__mlp__experts__gate_up_proj"]
    A_dn, B_dn = ad.A["model__layers__0__mlp__experts__down_proj"], ad.B["model__layers__0__mlp__experts__down_proj"]
    assert A_gu.shape == (1, r, H) and B_gu.shape == (E, 2 * I, r)
    assert A_dn.shape == (E, r, I) and B_dn.shape == (1, H, r)
    # the same function held per expert (copies of the shared factors), trained by the same loss
    _, per = make(["experts.gate_up_proj", "experts.down_proj"])
    with torch.no_grad():
        for n in ad.A:
            per.A[n].copy_(ad.A[n].expand_as(per.A[n]))
            per.B[n].copy_(ad.B[n].expand_as(per.B[n]))
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    with ad.in_forward():
        out = model(ids)
        out.square().mean().backward()
    with per.in_forward():
        out_per = per.model(ids)
        out_per.square().mean().backward()
    torch.testing.assert_close(out, out_per, atol=1e-6, rtol=0)
    for n in ad.A:
        ga, gp = ad.A[n].grad, per.A[n].grad
        torch.testing.assert_close(ga, gp.sum(0, keepdim=True) if ga.shape[0] == 1 else gp, atol=1e-6, rtol=1e-5)
        gb, gq = ad.B[n].grad, per.B[n].grad
        torch.testing.assert_close(gb, gq.sum(0, keepdim=True) if gb.shape[0] == 1 else gq, atol=1e-6, rtol=1e-5)


def test_shared_outer_with_expert_parallelism_is_refused_by_name():
    from moe_rl.config import load_config

    for kv in (["train.ep_size=2", "pools.trainer=2"], ["train.ep_size=2", "pools.trainer=2", "train.backend=megatron"]):
        with pytest.raises(ValueError, match="lora.experts_shared_outer needs train.ep_size=1"):
            load_config("configs/tiny.yaml", ["lora.enabled=true", "lora.experts_shared_outer=true", *kv])
        load_config("configs/tiny.yaml", ["lora.enabled=true", *kv])  # per-expert factors with EP are accepted


def test_bad_settings_are_named():
    model = MoEForCausalLM(ARCH)
    with pytest.raises(LoraError, match="lora.dropout"):
        LoraAdapters(model, 4, 8, ALL, dropout=0.1)
    with pytest.raises(LoraError, match="lora.targets"):
        LoraAdapters(model, 4, 8, ["gate_proj"])
    with pytest.raises(LoraError, match="lora.layers"):
        LoraAdapters(model, 4, 8, ALL, layers=[7])
    with pytest.raises(LoraError, match="select no weight"):
        LoraAdapters(model, 4, 8, ["router"], layers=[1])  # layer 1 is dense


@pytest.mark.parametrize("shared", [False, True])
def test_peft_roundtrip(tmp_path, shared):
    model, ad = make(shared=shared)
    save_peft(ad, tmp_path / "a")
    _, ad2 = make(seed=5, shared=shared)
    ad2.model.load_state_dict(model.state_dict())
    load_peft(ad2, tmp_path / "a")
    for (n, a), (_, b) in zip(ad.named_parameters(), ad2.named_parameters()):
        assert torch.equal(a, b), n
    _, other = make(rank=2)
    with pytest.raises(LoraError, match="r=4"):
        load_peft(other, tmp_path / "a")
    if not shared:  # per-expert factors that differ cannot become one shared factor
        _, sh = make(seed=5, shared=True)
        with pytest.raises(LoraError, match="differs between experts"):
            load_peft(sh, tmp_path / "a")


@pytest.mark.parametrize("shared", [False, True])
def test_per_expert_layout_is_the_same_adapter(tmp_path, shared):
    """The SGLang/transformers-4 layout: rebuilding every weight from its per-expert keys
    by hand gives the merged model."""
    from safetensors.torch import load_file

    model, ad = make(["o_proj", "experts.gate_up_proj", "experts.down_proj"], layers=[0, 2], shared=shared)
    save_peft(ad, tmp_path / "pe", layout="per_expert")
    sd = load_file(tmp_path / "pe" / "adapter_model.safetensors")
    cfg = json.loads((tmp_path / "pe" / "adapter_config.json").read_text())
    assert cfg["target_modules"] == ["down_proj", "gate_proj", "o_proj", "up_proj"] and cfg["layers_to_transform"] == [0, 2]
    m = copy.deepcopy(model)
    s = ad.alpha / ad.rank
    with torch.no_grad():
        for k in sd:
            if not k.endswith("lora_A.weight"):
                continue
            mod = k[len("base_model.model."):-len(".lora_A.weight")]
            d = s * sd[k.replace("lora_A", "lora_B")] @ sd[k]
            parts = mod.split(".")
            if parts[-3] == "experts":
                getattr(m.get_submodule(".".join(parts[:-2])), parts[-1])[int(parts[-2])] += d
            else:
                m.get_submodule(mod).weight += d
    ids = torch.randint(0, 97, (2, 9))
    with torch.no_grad(), ad.applied():
        torch.testing.assert_close(m(ids), model(ids), atol=1e-6, rtol=0)
    _, back = make(["o_proj", "experts.gate_up_proj", "experts.down_proj"], layers=[0, 2], seed=9, shared=shared)
    load_peft(back, tmp_path / "pe")
    for (n, x), (_, y) in zip(ad.named_parameters(), back.named_parameters()):
        assert torch.equal(x, y), n
    _, with_router = make(["router"])
    with pytest.raises(LoraError, match="router"):
        save_peft(with_router, tmp_path / "r", layout="per_expert")


def test_bench_adapter_size_arithmetic_matches_the_adapters():
    from moe_rl.bench.sync_lora import adapter_numel

    for targets in (ALL, ["experts.down_proj", "k_proj"], ["experts.gate_up_proj"]):
        for shared in (False, True):
            _, ad = make(targets, shared=shared)
            assert adapter_numel(ARCH, 4, targets, shared) == sum(p.numel() for p in ad.parameters())


# PEFT adapts transformers 5's fused 3-D experts ([E, out, in]) with target_parameters from
# peft 0.19 (0.17 added target_parameters for [E, in, out] experts only); transformers < 5 has
# per-expert modules instead.
peft = pytest.importorskip("peft", minversion="0.19")
transformers = pytest.importorskip("transformers", minversion="5.0")


def _peft_on_hf_base(tmp_path, model, ad, hf_class):
    """Saves our model as an HF checkpoint and our adapter in PEFT's format, loads both with
    transformers' ``hf_class`` and ``peft.PeftModel``: (the PEFT model, our merged logits,
    PEFT's logits, our base logits) on one batch."""
    save_hf(model, tmp_path / "base")
    save_peft(ad, tmp_path / "adapter", base_model=str(tmp_path / "base"))
    hf = hf_class.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    pm = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ids = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(6))
    with torch.no_grad(), ad.applied():
        ours = model(ids)
    with torch.no_grad():
        theirs = pm(input_ids=ids).logits
        base = model(ids)
    return pm, ours, theirs, base


@pytest.mark.parametrize("targets,layers,shared", [(ALL, None, False), (["experts.down_proj", "router", "v_proj"], [2], False),
                                                   (ALL, None, True)])
def test_peft_loads_adapter_on_hf_base(tmp_path, targets, layers, shared):
    """PEFT's LoRA (target_modules + target_parameters on the fused 3-D experts) on
    transformers' Qwen3MoeForCausalLM gives moe-rl's merged logits (fp32, 1e-5); shared outer
    factors are written once per expert."""
    model, ad = make(targets, layers, shared=shared)
    pm, ours, theirs, _ = _peft_on_hf_base(tmp_path, model, ad, transformers.Qwen3MoeForCausalLM)
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    # and PEFT's own state dict is ours key for key
    sd = peft.get_peft_model_state_dict(pm)
    assert sorted(sd) == sorted(ad.peft_state_dict())
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["peft_type"] == "LORA"



@pytest.mark.parametrize("layers", [None, [2]])
def test_glm_adapters_on_shared_experts_equal_hand_merge(layers):
    """GLM: adapters on attention (with q/k/v bias), the sigmoid router, routed and shared
    experts; both forms equal the hand merge, and gradients reach the shared-expert adapters."""
    model, ad = make(GLM_ALL, layers, arch=GLM)
    assert {s.target for s in ad.sites} == set(GLM_ALL)
    assert all(s.layer >= 1 for s in ad.sites if s.target not in ("q_proj", "k_proj", "v_proj", "o_proj"))
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = merged_by_hand(model, ad)(ids)
        base = model(ids)
    with ad.applied():
        torch.testing.assert_close(model(ids), expected, atol=1e-6, rtol=0)
    with ad.in_forward():
        got = model(ids)
        got.square().mean().backward()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert (got - base).abs().max() > 1e-3
    shared = [n for n in ad.B if "shared_experts" in n]
    assert shared and all(ad.B[n].grad.abs().sum() > 0 for n in shared)
    assert all(p.grad is None for p in model.parameters())


def test_glm_peft_loads_adapter_on_hf_base(tmp_path, monkeypatch):
    """PEFT's LoRA on transformers' Glm4MoeForCausalLM (shared experts as target_modules, the
    router and fused experts as target_parameters) gives moe-rl's merged logits, key for key.

    PEFT 0.19 on transformers 5 rewrites every target module named ``*.gate_proj`` / ``up_proj`` /
    ``down_proj`` of a model with a converted MoE layout (GLM, Qwen-MoE) into the fused expert
    parameters, for adapters trained on transformers 4's per-expert modules; that rewrite
    would mistake the shared experts' own nn.Linear modules for experts, so it is turned off here
    (docs/lora.md)."""
    from peft.utils import transformers_weight_conversion

    monkeypatch.setattr(transformers_weight_conversion, "_convert_peft_config_moe", lambda cfg, model: None)
    model, ad = make(GLM_ALL, None, arch=GLM)
    pm, ours, theirs, base = _peft_on_hf_base(tmp_path, model, ad, transformers.Glm4MoeForCausalLM)
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    assert (ours - base).abs().max() > 1e-3
    assert sorted(peft.get_peft_model_state_dict(pm)) == sorted(ad.peft_state_dict())
    back = make(GLM_ALL, None, arch=GLM, seed=5)[1]
    load_peft(back, tmp_path / "adapter")
    for n, p in ad.named_parameters():
        assert torch.equal(dict(back.named_parameters())[n], p)


# DeepSeek-V3: multi-head latent attention's projections, the sigmoid router, routed and shared experts
DSV3 = MoEArch(model_type="deepseek_v3", vocab_size=97, hidden_size=32, moe_intermediate_size=16, intermediate_size=48,
               num_hidden_layers=3, num_attention_heads=4, num_experts=6, num_experts_per_tok=2, n_group=2,
               topk_group=1, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=1.5, q_lora_rank=12,
               kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, rope_theta=10000.0)
MLA_ALL = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "router", "experts.gate_up_proj",
           "experts.down_proj", "shared_experts.gate_proj", "shared_experts.up_proj", "shared_experts.down_proj"]


def test_mla_adapters_equal_hand_merge_in_training_and_in_the_engine():
    """Adapters on the latent-attention projections: the trainer's form (hooks, expanded K/V) and
    the engine's (absorbed attention, which reads kv_b_proj's weight plus the adapter's delta)
    both compute the hand-merged model; an MHA target on an MLA model is refused by name."""
    from moe_rl.engine.engine import Engine
    from moe_rl.model.lora import AdapterServing

    from tests.engine.helpers import generate_queued

    model, ad = make(MLA_ALL, None, arch=DSV3)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    merged = merged_by_hand(model, ad)
    with torch.no_grad():
        expected = merged(ids)
        base = model(ids)
    with ad.in_forward():
        got = model(ids)
        got.square().mean().backward()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert (got - base).abs().max() > 1e-3
    assert all(ad.B[n].grad.abs().sum() > 0 for n in ad.B if "kv_b_proj" in n)
    # the engine serving the adapter unmerged: log-probs of the merged model's forward
    serving = AdapterServing(model, 4, 8.0, MLA_ALL)
    with torch.no_grad():
        for n, t in serving.named_tensors().items():
            t.copy_(dict(ad.hf_tensors())[n])
    body = {"input_ids": [3, 9, 27, 81, 50], "return_logprob": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 8}}
    out = generate_queued(Engine(model, max_running_requests=2, max_context=64), [body])[0]
    with torch.no_grad():
        lp = torch.log_softmax(merged(torch.tensor([body["input_ids"] + out["output_ids"]]))[0], -1)
    want = [lp[4 + j, t].item() for j, t in enumerate(out["output_ids"])]
    got_lp = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
    torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(want), atol=1e-5, rtol=0)
    with pytest.raises(LoraError, match="\\['k_proj'\\] is not a projection of this model's attention") as e:
        LoraAdapters(MoEForCausalLM(DSV3), 4, 8.0, ["q_a_proj", "k_proj"])
    # the projections named are this model's: with q_lora_rank set, q_a_proj and q_b_proj, no q_proj
    assert "['kv_a_proj_with_mqa', 'kv_b_proj', 'o_proj', 'q_a_proj', 'q_b_proj'])" in str(e.value)


def test_mla_peft_loads_adapter_on_hf_base(tmp_path, monkeypatch):
    """PEFT's LoRA on transformers' DeepseekV3ForCausalLM gives moe-rl's merged logits, key for key."""
    from peft.utils import transformers_weight_conversion

    monkeypatch.setattr(transformers_weight_conversion, "_convert_peft_config_moe", lambda cfg, model: None)
    model, ad = make(MLA_ALL, None, arch=DSV3)
    pm, ours, theirs, base = _peft_on_hf_base(tmp_path, model, ad, transformers.DeepseekV3ForCausalLM)
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    assert (ours - base).abs().max() > 1e-3
    assert sorted(peft.get_peft_model_state_dict(pm)) == sorted(ad.peft_state_dict())
