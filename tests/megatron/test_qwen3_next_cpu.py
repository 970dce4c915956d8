"""megatron-core's layers of the hybrid families on CPU against the native model, their weights
through ``convert.py``.

Layers: the Gated DeltaNet layer of its ``gated_delta_net`` attention variant
(``ssm/gated_delta_net``, in the installed release's layout: one module in 0.16, a package in
0.19) and its self-attention with ``attention_output_gate``, built alone. Checks the
conversion's re-layouts (Qwen3-Next's per-key-head ``in_proj_qkvz`` / ``in_proj_ba`` and
Qwen3.5's split projections into ``in_proj`` = [q, k, v, z, beta, alpha]; the gated ``q_proj``
into ``linear_qkv`` per query group [q heads; gate heads; k; v]; ``out_norm`` = w - 1) against
megatron's arithmetic (its torch path of the rule, ``deterministic_mode``: one sequence; fla's
``l2norm`` replaced by the same formula in torch), and that the HF <-> Megatron round trip is the
identity, under the TE spec's names and the local spec's.

The backend's GPTModel (megatron-core >= 0.19; 0.16's GatedDeltaNet has no packed sequences and
is refused by name): the local spec (``moe_rl/train/megatron/deltanet.py``: megatron's
GatedDeltaNet with moe-rl's conv and chunked rule, megatron's gated SelfAttention, zero-centred
norms) gives the native model's log-probs and every gradient on packed micro-batches under
replayed routing, and trains as the native backend does. The TE spec (flash-linear-attention's
kernels) runs on a GPU only.
"""
import functools
import importlib
import importlib.util

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
pytest.importorskip("megatron.core")

from moe_rl.kernels.gated_delta import l2norm  # noqa: E402
from moe_rl.model import MoEArch, MoEForCausalLM, iter_local_hf_tensors  # noqa: E402
from moe_rl.model.attention import PackedCausal, PaddedCausal  # noqa: E402
from moe_rl.train.megatron.convert import (MegatronLayout, hf_to_megatron, megatron_param_specs,  # noqa: E402
                                           megatron_to_hf)
from moe_rl.train.megatron.deltanet import ZeroCenteredRMSNorm, has_packed_gated_delta_net, megatron_version  # noqa: E402

from .common import (  # noqa: E402
    assert_logprobs_and_grads_equal_native, build, make_mb, native_hidden, native_record, pg_step, replayed_batch)
from .test_forward_cpu import cpu_megatron  # noqa: E402,F401  (the module-scoped 1-rank world with shims)

COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12, num_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
              rope_theta=10000.0, max_position_embeddings=256)
ARCHS = {f: MoEArch(model_type=f, **COMMON) for f in ("qwen3_next", "qwen3_5_moe_text")}
TE = MegatronLayout(te=True, grouped_gemm=True)
PACKED_GDN = has_packed_gated_delta_net()
LENGTHS = (70, 9, 30)  # the first longer than one DeltaNet chunk (64)
needs_packed_gdn = pytest.mark.skipif(not PACKED_GDN, reason=f"megatron-core {megatron_version()}: GatedDeltaNet "
                                      "without packed sequences (refused, test_hybrid_refusals)")


def native(family, seed=0):
    return MoEForCausalLM(ARCHS[family]).init_weights(seed, std=0.2)


def megatron_state(model):
    return hf_to_megatron(dict(iter_local_hf_tensors(model)), model.arch, TE)


def tconfig(arch):
    from moe_rl.train.megatron.model import MegatronOptions, transformer_config

    cfg = transformer_config(arch, MegatronOptions(use_te=True, grouped_gemm=True))
    cfg.deterministic_mode = True  # megatron's torch path of the rule (no fla on CPU)
    return cfg


def load(module, state, prefix):
    own = dict(module.named_parameters())
    with torch.no_grad():
        for name, t in state.items():
            if name.startswith(prefix) and name[len(prefix):] in own:
                own.pop(name[len(prefix):]).copy_(t)
    assert not own, f"megatron parameters not covered by the conversion: {sorted(own)}"


@pytest.mark.parametrize("family", list(ARCHS))
def test_round_trip_and_names(family):
    model = native(family)
    arch = model.arch
    hf = dict(iter_local_hf_tensors(model))
    state = hf_to_megatron(hf, arch, TE)
    assert {n: tuple(t.shape) for n, t in state.items()} == dict(megatron_param_specs(arch, TE))
    back = dict(megatron_to_hf(state, arch, TE))
    assert back.keys() == hf.keys()
    for name, t in hf.items():
        torch.testing.assert_close(back[name], t, atol=1e-7 if name.endswith("linear_attn.norm.weight") else 0, rtol=0,
                                   msg=lambda m: f"{name}: {m}")
    # the local spec: the same tensors, the input norms under the layer's own input_layernorm
    local = hf_to_megatron(hf, arch, MegatronLayout(grouped_gemm=True))
    renamed = {n.replace("self_attention.in_proj.layer_norm_weight", "input_layernorm.weight")
               .replace("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight"): t for n, t in state.items()}
    assert local.keys() == renamed.keys() and all(torch.equal(local[n], t) for n, t in renamed.items())
    assert dict(megatron_to_hf(local, arch, MegatronLayout(grouped_gemm=True))).keys() == hf.keys()


@pytest.mark.parametrize("family", list(ARCHS))
def test_megatron_gated_delta_net_equals_native(cpu_megatron, family, monkeypatch):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from moe_rl.train.megatron.model import init_parallel_state

    init_parallel_state(1, 1, cuda=False)
    gdn_mod = importlib.import_module("megatron.core.ssm.gated_delta_net")
    common = importlib.import_module("megatron.core.ssm.gated_delta_net.common") if hasattr(gdn_mod, "__path__") else gdn_mod
    # fla's l2norm, the same formula in torch (0.16 leaves the name undefined without fla)
    monkeypatch.setattr(common, "l2norm", functools.partial(l2norm, eps=1e-6), raising=False)
    if hasattr(common, "HAVE_FLA"):
        monkeypatch.setattr(common, "HAVE_FLA", True)
    model = native(family)
    layer = gdn_mod.GatedDeltaNet(tconfig(model.arch), gdn_mod.GatedDeltaNetSubmodules(
        in_proj=ColumnParallelLinear, out_norm=ZeroCenteredRMSNorm, out_proj=RowParallelLinear),
        layer_number=1, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    load(layer, megatron_state(model), "decoder.layers.0.self_attention.")
    x = torch.randn(150, model.arch.hidden_size, generator=torch.Generator().manual_seed(1))  # > 2 chunks
    with torch.no_grad():
        want = model.model.layers[0].linear_attn(x, None, None, PaddedCausal(1, 150))
        got, bias = layer(x[:, None], attention_mask=None)
    assert bias is None
    # megatron runs the delta rule in fp32 whatever the input dtype, so two fp32 chunked scans
    # differ by their rounding (up to ~1.2e-5 here, depending on the CPU's kernels)
    torch.testing.assert_close(got[:, 0], want, atol=3e-5, rtol=1e-4)


def test_megatron_gated_attention_equals_native(cpu_megatron):
    """megatron's SelfAttention with attention_output_gate (local linear layers, the backend's
    SDPA core attention, zero-centred q/k norms) against the native GatedAttention on a packed
    row: the converted linear_qkv puts each query group's gate heads where megatron reads them."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType

    from moe_rl.model.attention import packed_positions
    from moe_rl.train.megatron.attention import TorchSDPAttention
    from moe_rl.train.megatron.model import init_parallel_state

    init_parallel_state(1, 1, cuda=False)
    model = native("qwen3_next", seed=3)
    arch = model.arch
    cfg = tconfig(arch)
    attn = SelfAttention(cfg, SelfAttentionSubmodules(
        linear_qkv=ColumnParallelLinear, core_attention=TorchSDPAttention, linear_proj=RowParallelLinear,
        q_layernorm=ZeroCenteredRMSNorm, k_layernorm=ZeroCenteredRMSNorm), layer_number=2,
        attn_mask_type=AttnMaskType.causal)
    load(attn, megatron_state(model), "decoder.layers.1.self_attention.")
    lens = [30, 70, 12]
    T = sum(lens)
    cu = torch.tensor([0, 30, 100, 112])
    x = torch.randn(T, arch.hidden_size, generator=torch.Generator().manual_seed(2))
    rope = RotaryEmbedding(arch.head_dim, rotary_percent=arch.partial_rotary_factor, rotary_base=arch.rope_theta)
    pos = packed_positions(cu, T)
    freqs = rope(int(pos.max()) + 1)[pos]  # [T, 1, 1, rot]: each token at its position in its sequence
    layout = PackedCausal(cu, T)
    with torch.no_grad():
        cos, sin = model.rope.cos_sin(pos, x.dtype)
        want = model.model.layers[1].self_attn(x, cos, sin, layout)
        got, _ = attn(x[:, None], attention_mask=~layout.mask[None, None], rotary_pos_emb=(freqs, freqs))
    torch.testing.assert_close(got[:, 0], want, atol=1e-5, rtol=1e-4)




@needs_packed_gdn
@pytest.mark.parametrize("family", list(ARCHS))
def test_hybrid_gpt_model_logprobs_routing_and_grads_equal_native(cpu_megatron, family):
    """The backend's GPTModel (local spec): its parameters are the converter's names and shapes;
    on a packed micro-batch (three sequences, one over a chunk) megatron's own routing picks the
    native model's experts (the R3 record); under replay, log-probs and every gradient, mapped to
    HF names, equal the native model's."""
    meg, native = build(dict(COMMON, model_type=family), "cpu", std=0.2)
    built = {n: tuple(p.shape) for n, p in meg.model.named_parameters()}
    assert built == dict(megatron_param_specs(meg.arch, meg.layout))
    layer0 = meg.model.decoder.layers[0].self_attention
    assert type(layer0).__mro__[1].__name__ == "GatedDeltaNet" and meg.tconfig.attention_output_gate
    mb = make_mb(COMMON["vocab_size"], LENGTHS)
    rec_meg = []
    with torch.no_grad():
        got = meg.hidden_states(mb, record=rec_meg)
        ref = native_hidden(native, mb)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    rec_native = native_record(native, mb)
    assert len(rec_meg) == len(rec_native) == COMMON["num_hidden_layers"]
    for a, b in zip(rec_meg, rec_native):
        assert torch.equal(a.sort(1).values, b.sort(1).values)
    mb.replay = rec_native
    assert_logprobs_and_grads_equal_native(meg, native, mb)


@needs_packed_gdn
def test_hybrid_rl_steps_equal_native(cpu_megatron):
    """Optimizer steps (activation recompute on, replayed routing) leave both backends with the
    same weights, and the loss goes down."""
    meg, native = build(dict(COMMON, model_type="qwen3_next"), "cpu", std=0.2, megatron_recompute=True)
    mbs, adv, n_tokens = replayed_batch(native, COMMON["vocab_size"], LENGTHS)
    losses = [pg_step(meg, mbs, adv, n_tokens) for _ in range(3)]
    native_losses = [pg_step(native, mbs, adv, n_tokens) for _ in range(3)]
    assert losses[-1] < losses[0] - 1e-3, losses
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(native_losses), atol=1e-4, rtol=1e-4)
    sent = dict(meg.hf_tensors())
    for name, t in iter_local_hf_tensors(native.model):
        torch.testing.assert_close(sent[name], t, atol=1e-4, rtol=1e-3, msg=lambda m: f"{name}: {m}")


@needs_packed_gdn
def test_hybrid_bf16_logprobs_near_native(cpu_megatron):
    """bf16 weights (fp32 inside the DeltaNet rule on both sides): log-probs within bf16
    tolerance of the native model's, and a step runs on the fp32 main params."""
    meg, native = build(dict(COMMON, model_type="qwen3_5_moe_text"), "cpu", "bfloat16", std=0.2)
    mb = make_mb(COMMON["vocab_size"], LENGTHS)
    mb.replay = native_record(native, mb)
    lp, _ = meg.logprobs(mb, 1.0)
    with torch.no_grad():
        lp_ref, _ = native.logprobs(mb, 1.0)
    torch.testing.assert_close(lp, lp_ref, atol=0.1, rtol=0.02)
    (-lp.sum()).backward()
    before = meg.model.decoder.layers[0].self_attention.in_proj.weight.detach().clone()
    meg.optimizer_step()
    assert not torch.equal(meg.model.decoder.layers[0].self_attention.in_proj.weight, before)


def test_hybrid_refusals(cpu_megatron, monkeypatch):
    """What the backend does not build is refused by name: a megatron-core whose GatedDeltaNet
    has no packed sequences, the TE spec without flash-linear-attention, LoRA."""
    import megatron.core

    from moe_rl.config import LoraConfig
    from moe_rl.model.lora import LoraError
    from moe_rl.train.megatron.model import MegatronOptions, build_gpt_model, transformer_config

    arch = ARCHS["qwen3_next"]
    local, te = MegatronOptions(use_te=False, grouped_gemm=True), MegatronOptions(use_te=True, grouped_gemm=True)
    if PACKED_GDN:
        with monkeypatch.context() as mp:
            mp.setattr(megatron.core, "__version__", "0.16.1")
            with pytest.raises(RuntimeError, match=r"megatron-core >= 0\.19.*0\.16\.1 is installed"):
                build_gpt_model(arch, local, transformer_config(arch, local))
        if importlib.util.find_spec("fla") is None:
            with pytest.raises(RuntimeError, match="flash-linear-attention"):
                build_gpt_model(arch, te, transformer_config(arch, te))
        with pytest.raises(LoraError, match="model_type='qwen3_next'.*train.backend=native"):
            build(dict(COMMON, model_type="qwen3_next"), "cpu", lora=LoraConfig(enabled=True, rank=2, alpha=4.0))
    else:
        with pytest.raises(RuntimeError, match=rf"megatron-core {megatron.core.__version__} is installed"):
            build(dict(COMMON, model_type="qwen3_next"), "cpu")
