"""megatron-core's own layers of the hybrid families on CPU against the native mixers, their
weights through ``convert.py``: the Gated DeltaNet layer of its ``gated_delta_net`` attention
variant (``ssm/gated_delta_net``, in the installed release's layout: one module in 0.16, a
package in 0.19) and its self-attention with ``attention_output_gate``. Checks the conversion's
re-layouts (Qwen3-Next's per-key-head ``in_proj_qkvz`` / ``in_proj_ba`` and Qwen3.5's split
projections into ``in_proj`` = [q, k, v, z, beta, alpha]; the gated ``q_proj`` into
``linear_qkv`` per query group [q heads; gate heads; k; v]; ``out_norm`` = w - 1) against
megatron's arithmetic, and that the HF <-> Megatron round trip is the identity.

On a GPU the hybrid GPTModel needs Transformer Engine (megatron-core builds these layers in its
TE spec only) and flash-linear-attention (its chunked rule and conv with ``cu_seqlens``, for
packed micro-batches: megatron-core >= 0.19; 0.16's layer has no packed sequences). On CPU
neither is there, so here: megatron's torch path of the rule (``deterministic_mode``; one
sequence), fla's ``l2norm`` replaced by the same formula in torch, megatron's local linear
layers, and for TE's zero-centred RMSNorm a stand-in (``ZeroCenteredRMSNorm``: x_hat * (1 + w)).
"""
import functools
import importlib

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
pytest.importorskip("megatron.core")

from moe_rl.kernels.gated_delta import l2norm  # noqa: E402
from moe_rl.model import MoEArch, MoEForCausalLM, iter_local_hf_tensors  # noqa: E402
from moe_rl.model.attention import PackedCausal, PaddedCausal  # noqa: E402
from moe_rl.train.megatron.convert import (MegatronLayout, hf_to_megatron, megatron_param_specs,  # noqa: E402
                                           megatron_to_hf)

from .test_forward_cpu import cpu_megatron  # noqa: E402,F401  (the module-scoped 1-rank world with shims)

COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12, num_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
              rope_theta=10000.0, max_position_embeddings=256)
ARCHS = {f: MoEArch(model_type=f, **COMMON) for f in ("qwen3_next", "qwen3_5_moe_text")}
TE = MegatronLayout(te=True, grouped_gemm=True)


class ZeroCenteredRMSNorm(torch.nn.Module):
    """Stand-in for TE's RMSNorm with zero_centered_gamma (megatron's norms of this family)."""

    def __init__(self, config, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x):
        return torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * (1 + self.weight.float())


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
    with pytest.raises(ValueError, match="needs Transformer Engine"):
        megatron_param_specs(arch, MegatronLayout())


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
    torch.testing.assert_close(got[:, 0], want, atol=1e-5, rtol=1e-4)


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


@pytest.mark.parametrize("family", list(ARCHS))
def test_backend_refuses_the_hybrid_gpt_model(family):
    """The hybrid GPTModel is not built: the backend says so and names the native backend."""
    from moe_rl.train.megatron.model import MegatronOptions, build_gpt_model

    with pytest.raises(RuntimeError, match=rf"model_type='{family}'.*train.backend=native"):
        build_gpt_model(ARCHS[family], MegatronOptions(use_te=True, grouped_gemm=True), tconfig(ARCHS[family]))
