"""Megatron-core pieces of the megatron backend: parallel state, the GPTModel, RouterReplay.

Everything that touches megatron-core's process-global state lives here:
``init_parallel_state`` (megatron's ``parallel_state``, set up over the trainer pool only) and
:class:`RouterReplayControl` (the one owner of ``RouterReplay``'s class-level instance list
and actions). Written against the API megatron-core 0.16 and 0.19 share.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_rl.model import MoEArch, RoutingError
from moe_rl.model.arch import FAMILIES

from .convert import MegatronLayout, check_arch

log = logging.getLogger(__name__)


def te_available() -> bool:
    """True when Transformer Engine's torch extension imports (megatron's TE specs need it)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or a TE build that does not match this torch/CUDA
        return False
    return True


@dataclass(frozen=True)
class MegatronOptions:
    """The megatron-specific choices, resolved from ``cfg.train`` (see config.TrainConfig)."""

    use_te: bool
    grouped_gemm: bool
    dispatcher: str = "alltoall"
    router_fusion: bool = False
    recompute: bool = False
    replay: bool = True

    @classmethod
    def from_config(cls, cfg) -> "MegatronOptions":
        t = cfg.train
        use_te = te_available() if t.megatron_use_te is None else t.megatron_use_te
        if use_te and not te_available():
            raise RuntimeError("train.megatron_use_te=true but transformer_engine does not import "
                               "(pip install --no-build-isolation 'transformer_engine[pytorch]')")
        # grouped experts unless turned off: TE's TEGroupedMLP with TE, our TorchGroupedMLP without
        grouped = True if t.megatron_grouped_gemm is None else t.megatron_grouped_gemm
        opts = cls(use_te, grouped, t.megatron_dispatcher, t.megatron_router_fusion, t.megatron_recompute,
                   replay=cfg.replay.enabled)
        opts.check()
        return opts

    def check(self) -> None:
        if self.replay and self.router_fusion:
            raise ValueError(
                "train.megatron_router_fusion=true cannot be used with routing replay (replay.enabled=true):"
                " megatron-core's fused top-k router returns before RouterReplay is consulted, so the"
                " recorded experts would be silently ignored. Set train.megatron_router_fusion=false."
            )

    @property
    def experts(self) -> str:
        """The expert module: TEGroupedMLP, TorchGroupedMLP (experts.py) or SequentialMLP."""
        if not self.grouped_gemm:
            return "SequentialMLP"
        return "TEGroupedMLP" if self.use_te else "TorchGroupedMLP"

    def layout(self, tp_size=1, tp_rank=0, ep_size=1, ep_rank=0) -> MegatronLayout:
        return MegatronLayout(te=self.use_te, grouped_gemm=self.grouped_gemm, tp_size=tp_size,
                              tp_rank=tp_rank, ep_size=ep_size, ep_rank=ep_rank)


# --- parallel state -------------------------------------------------------------------------
@contextlib.contextmanager
def _world_is_first(n: int):
    """Makes megatron's ``initialize_model_parallel`` build its groups over ranks [0, n) only.

    It sizes its groups by the world size and creates every group on every rank; in a world
    that also holds engine ranks those never call it. So, for the duration of the call, the
    world size reads ``n`` and groups are created with local synchronisation (only members
    take part), which lets the trainer pool ([0, n) by moe_rl.dist's layout) set it up alone.
    """
    real_size, real_new_group = dist.get_world_size, dist.new_group

    def world_size(group=None):
        return n if group is None else real_size(group)

    def new_group(*args, **kwargs):
        kwargs["use_local_synchronization"] = True
        return real_new_group(*args, **kwargs)

    dist.get_world_size, dist.new_group = world_size, new_group
    try:
        yield
    finally:
        dist.get_world_size, dist.new_group = real_size, real_new_group


def init_parallel_state(tp_size: int, ep_size: int, trainer_ranks: list[int] | None = None, seed: int = 0,
                        cuda: bool = True) -> None:
    """Initialises megatron's parallel_state over the trainer pool (ranks [0, len(trainers)));
    with ``cuda``, also megatron's CUDA RNG tracker (dropout regions, activation recompute)."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        raise RuntimeError("the megatron backend needs torch.distributed initialised (moe_rl.dist.init_distributed)")
    if ps.model_parallel_is_initialized():
        have = (ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size())
        if have != (tp_size, ep_size):
            raise RuntimeError(f"megatron parallel_state already initialised with (tp, ep)={have}, "
                               f"this backend needs {(tp_size, ep_size)}")
        return
    n = len(trainer_ranks) if trainer_ranks is not None else dist.get_world_size()
    if trainer_ranks is not None and list(trainer_ranks) != list(range(n)):
        raise RuntimeError(f"the megatron backend needs the trainer pool to be ranks [0, {n}), got {trainer_ranks}")
    kwargs = dict(tensor_model_parallel_size=tp_size, expert_model_parallel_size=ep_size,
                  expert_tensor_parallel_size=1, create_gloo_process_groups=False)
    if n == dist.get_world_size():
        ps.initialize_model_parallel(**kwargs)
    else:
        log.info("megatron parallel_state: built over the trainer pool, ranks [0, %d) of %d", n, dist.get_world_size())
        with _world_is_first(n):
            ps.initialize_model_parallel(**kwargs)
    if cuda:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_parallel_state() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()


# --- model ----------------------------------------------------------------------------------
def transformer_config(arch: MoEArch, opts: MegatronOptions, *, dtype=torch.float32, tp_size=1, ep_size=1,
                       cpu_init: bool = True):
    """Megatron's TransformerConfig for an ``arch`` of any family.

    Softmax router (Qwen3-MoE): softmax over all experts, the top k and (norm_topk_prob)
    renormalised, which equals megatron's softmax score function with
    ``moe_router_pre_softmax=False`` (top-k of the logits, softmax over those k). Without
    norm_topk_prob it is ``pre_softmax=True`` (softmax over all, top-k, no renormalisation).
    Sigmoid router (GLM): megatron's sigmoid score function with the expert bias (selection
    only), its group-limited top-k, the scaling factor, fp32 router logits (as HF); the
    renormalisation is megatron's always (``check_arch`` refuses what it cannot express). The
    bias is updated by the backend (``train.expert_bias_update_rate``), not by megatron's
    finalize_model_grads, which moe-rl does not call. Shared experts: megatron's SharedExpertMLP
    of n_shared_experts x moe_intermediate_size, no gate. gpt-oss's router (top-k of the biased
    logits, softmax over them) is the softmax score function with ``pre_softmax=False`` and the
    router bias of ``add_bias_linear`` (``_gpt_oss_fields``). No aux loss, no capacity (dropless).
    """
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    check_arch(arch, MegatronLayout(te=opts.use_te, tp_size=tp_size, ep_size=ep_size))
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if opts.recompute else {}
    fields = dict(
        num_layers=arch.num_hidden_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads,
        kv_channels=arch.v_head_dim if arch.is_mla else arch.head_dim,
        ffn_hidden_size=arch.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        # MLA: megatron's local spec builds the latent norms only with qk_layernorm
        qk_layernorm=arch.use_qk_norm or arch.is_mla,
        **(_mla_fields(arch) if arch.is_mla else {}),
        # megatron-core 0.19's MLA picks its norm / linear classes from transformer_impl, not the spec
        **({"transformer_impl": "local"} if arch.is_mla and not opts.use_te else {}),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.attention_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # MoE
        num_moe_experts=arch.num_experts,
        moe_ffn_hidden_size=arch.moe_intermediate_size,
        moe_layer_freq=[1 if arch.is_moe_layer(i) else 0 for i in range(arch.num_hidden_layers)],
        moe_router_topk=arch.num_experts_per_tok,
        **_router_fields(arch),
        **_hybrid_fields(arch),
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_router_fusion=opts.router_fusion,
        # RouterReplay serves replay and recording; only the fused router (which bypasses it) goes without
        moe_enable_routing_replay=not opts.router_fusion,
        moe_grouped_gemm=opts.experts == "TEGroupedMLP",  # TorchGroupedMLP is swapped into the spec
        moe_token_dispatcher_type=opts.dispatcher,
        # parallelism and precision
        tensor_model_parallel_size=tp_size,
        expert_model_parallel_size=ep_size,
        expert_tensor_parallel_size=1,
        sequence_parallel=tp_size > 1,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=cpu_init,
        perform_initialization=False,  # weights always come from an HF state (checkpoint or seeded init)
        **recompute,
    )
    fields.update(_gpt_oss_fields(arch))  # gpt-oss: its biases, sinks, windows and activation replace the above
    config = (MLATransformerConfig if arch.is_mla else TransformerConfig)(**fields)
    if not arch.is_mla:  # latent attention takes its YaRN from MLATransformerConfig's fields (_mla_fields)
        _set_yarn(config, arch)
    return config


def _gpt_oss_fields(arch: MoEArch) -> dict:
    """gpt-oss: biases on every linear (router and experts included), the learned softmax offset
    (HF's sinks), sliding windows by layer, the clamped SwiGLU with the +1 on the linear side.

    The window: megatron's ``window_size=(left, 0)`` lets query i see keys i - left .. i, left + 1
    keys, where HF's ``sliding_window`` counts W keys, the query's own included: left = W - 1
    (Megatron-Bridge's (128, 0) would attend to 129). ``window_attn_skip_freq`` as a list is
    HF's ``layer_types`` itself (1: sliding)."""
    if arch.family.experts != "clamped_swiglu":
        return {}
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    kinds = arch.layer_kinds()
    window = {}
    if "swa" in kinds:
        window = dict(window_size=(arch.sliding_window - 1, 0), window_attn_skip_freq=[int(k == "swa") for k in kinds])
    return dict(add_bias_linear=True, softmax_type="learnable", activation_func=quick_gelu,
                glu_linear_offset=1.0, activation_func_clamp_value=arch.swiglu_limit, bias_activation_fusion=False,
                **window)


def _set_yarn(config, arch: MoEArch) -> None:
    """YaRN's parameters, which GPTModel(position_embedding_type="yarn") and the attention read
    from the config by ``getattr`` (they are not TransformerConfig fields). mscale and
    mscale_all_dim stay None when HF has none: megatron's concentration factor (cos/sin scale)
    is then 0.1 ln(factor) + 1, HF's attention factor; set to 1.0 (as Megatron-Bridge's gpt-oss
    provider does) they would make it 1."""
    rope = arch.rope()
    if rope.rope_type != "yarn":
        return
    for k, v in dict(rotary_scaling_factor=rope.factor, original_max_position_embeddings=rope.original_max_position_embeddings,
                     beta_fast=rope.beta_fast, beta_slow=rope.beta_slow, mscale=rope.mscale,
                     mscale_all_dim=rope.mscale_all_dim, correction_range_round_to_int=rope.truncate).items():
        setattr(config, "yarn_" + k, v)
    config.apply_rope_fusion = False  # TE's fused RoPE refuses a concentration factor


def _mla_fields(arch: MoEArch) -> dict:
    """MLATransformerConfig's fields from HF's. Its defaults are DeepSeek-V3's YaRN (rope_type
    "yarn", factor 40), and its softmax scale takes mscale(rotary_scaling_factor,
    mscale_all_dim)^2 whatever the rope type: every one is set here (check_arch refuses the YaRN
    variants it computes differently)."""
    rope = arch.rope()
    fields = dict(multi_latent_attention=True, q_lora_rank=arch.q_lora_rank, kv_lora_rank=arch.kv_lora_rank,
                  qk_head_dim=arch.qk_nope_head_dim, qk_pos_emb_head_dim=arch.qk_rope_head_dim,
                  v_head_dim=arch.v_head_dim, rotary_base=arch.rope_theta, rotary_percent=1.0)
    if rope.rope_type == "default":
        return dict(fields, rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    both = bool(rope.mscale and rope.mscale_all_dim)  # HF: mscale / mscale_all_dim only with both
    return dict(fields, rope_type="yarn", rotary_scaling_factor=rope.factor,
                original_max_position_embeddings=rope.original_max_position_embeddings, beta_fast=rope.beta_fast,
                beta_slow=rope.beta_slow, mscale=rope.mscale if both else 1.0,
                mscale_all_dim=float(rope.mscale_all_dim or 0.0))


def _router_fields(arch: MoEArch) -> dict:
    if arch.router == "topk_softmax":
        return dict(moe_router_score_function="softmax", moe_router_pre_softmax=False,
                    moe_router_topk_scaling_factor=None)
    if arch.router == "softmax":
        return dict(moe_router_score_function="softmax", moe_router_pre_softmax=not arch.norm_topk_prob,
                    moe_router_topk_scaling_factor=None)
    groups = dict(moe_router_num_groups=arch.n_group, moe_router_group_topk=arch.topk_group) if arch.n_group > 1 else {}
    shared = arch.moe_intermediate_size * arch.n_shared_experts
    return dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_topk_scaling_factor=arch.routed_scaling_factor, moe_router_dtype="fp32",
                moe_shared_expert_intermediate_size=shared or None, moe_shared_expert_overlap=False, **groups)


def _hybrid_fields(arch: MoEArch) -> dict:
    """Qwen3-Next / Qwen3.5-MoE: megatron-core's gated_delta_net attention variant on the
    linear_attention layers (``linear_attention_freq``: 1 = Gated DeltaNet, 0 = softmax
    attention), the output-gated softmax attention, zero-centred (1 + w) norms, the sigmoid-gated
    shared expert (``shared_experts.gate_weight``)."""
    if not FAMILIES[arch.model_type].hybrid:
        return {}
    shared = arch.shared_expert_intermediate_size
    return dict(experimental_attention_variant="gated_delta_net",
                linear_attention_freq=[int(t == "linear_attention") for t in arch.layer_types],
                linear_conv_kernel_dim=arch.linear_conv_kernel_dim, linear_key_head_dim=arch.linear_key_head_dim,
                linear_value_head_dim=arch.linear_value_head_dim, linear_num_key_heads=arch.linear_num_key_heads,
                linear_num_value_heads=arch.linear_num_value_heads, attention_output_gate=True,
                layernorm_zero_centered_gamma=True, moe_shared_expert_intermediate_size=shared or None,
                moe_shared_expert_gate=bool(shared), moe_shared_expert_overlap=False)


_TE_NAMES_OF_MOE_UTILS = (
    "fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute", "fused_permute_with_probs",
    "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs", "fused_topk_with_score_function",
    "fused_unpermute", "te_general_gemm",
)


def _compat_megatron_without_te() -> None:
    """megatron-core 0.16.x binds its TE kernels in moe_utils only when TE imports, yet the
    router's gating reads ``te_general_gemm`` unconditionally (NameError without TE; later
    releases bind them to None). Bind the missing names to None, as those releases do; and tell
    multi-latent attention that TE is absent when its TE classes are mocks."""
    from megatron.core.transformer.moe import moe_utils

    missing = [n for n in _TE_NAMES_OF_MOE_UTILS if not hasattr(moe_utils, n)]
    if missing:
        for n in missing:
            setattr(moe_utils, n, None)
        log.info("megatron-core without Transformer Engine: bound %d missing TE names in moe_utils to None", len(missing))
    # multi-latent attention tests isinstance(linear, TELinear) when its TE import succeeded, which
    # it does without TE too (megatron's TE extension then hands out mocks, not classes)
    from megatron.core.transformer import multi_latent_attention as mla

    if mla.HAVE_TE and not isinstance(mla.TELinear, type):
        mla.HAVE_TE = False


class _CpuStream:
    """A stand-in for ``torch.cuda.Stream`` on CPU, where work is done when it is issued:
    waits, events and synchronisation are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def record_event(self, event=None) -> "_CpuStream":
        return self

    def synchronize(self) -> None:
        pass


def _read_the_device_before_shims() -> None:
    """On a machine with a GPU (the whole suite there) the CPU shims run beside CUDA work, and
    what reads ``torch.cuda.current_device`` once must read the real one, not the shim's "cpu":
    Triton's CUDA driver keeps the function it finds when first used, and flash-linear-attention
    (imported by megatron-core's GatedDeltaNet where installed) asks for the device's capability
    as it is imported. Both happen here, before the patch."""
    if torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
        import triton

        triton.runtime.driver.active  # noqa: B018 (made on first use: now, before the patch)
    if importlib.util.find_spec("fla") is not None:
        try:
            importlib.import_module("megatron.core.ssm.gated_delta_net")
        except ImportError:  # a megatron-core without it
            pass


def cpu_shim_patches() -> list[tuple[object, str, object]]:
    """(object, attribute, value) patches that let megatron-core's forward/backward run on CPU
    (tests, the CPU bench). It moves the RoPE frequencies and the router weight to
    ``torch.cuda.current_device()`` and forks/restores CUDA RNG states (dropout regions,
    recompute): current device -> "cpu", RNG tracker and CUDA RNG state calls -> no-ops (dropout
    is 0), TorchDynamo off (megatron's ``jit_fuser`` helpers would ask the patched
    current_device for an index). Its alltoall token dispatcher copies the split sizes to the
    host on a side stream: streams -> :class:`_CpuStream`, and the host copy of a CPU tensor
    is made as of a CUDA one (a numpy array where asked: the collective takes a sequence)."""
    import torch._dynamo
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import token_dispatcher

    _read_the_device_before_shims()
    tracker = mrandom.get_cuda_rng_tracker()
    to_host = token_dispatcher.maybe_move_tensor_to_cpu
    stream = _CpuStream()

    def move_to_host(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return to_host(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return [(torch.cuda, "current_device", lambda: "cpu"), (torch._dynamo.config, "disable", True),
            (tracker, "fork", lambda *a, **k: contextlib.nullcontext()), (tracker, "get_states", lambda: {}),
            (tracker, "set_states", lambda states: None),
            (mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state()),
            (mrandom, "_set_cuda_rng_state", lambda *a, **k: None),
            (torch.cuda, "Stream", _CpuStream), (torch.cuda, "current_stream", lambda device=None: stream),
            (torch.cuda, "stream", lambda s: contextlib.nullcontext()),
            (token_dispatcher, "maybe_move_tensor_to_cpu", move_to_host)]


@contextlib.contextmanager
def cpu_forward_shims():
    """:func:`cpu_shim_patches` applied for the duration."""
    patches = cpu_shim_patches()
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def build_gpt_model(arch: MoEArch, opts: MegatronOptions, config):
    """GPTModel with the MoE layers of ``arch``: TE spec when ``opts.use_te``, the local spec otherwise."""
    from megatron.core.models.gpt import GPTModel

    _compat_megatron_without_te()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    hybrid = FAMILIES[arch.model_type].hybrid
    if hybrid:  # Qwen3-Next / Qwen3.5-MoE: megatron's Gated DeltaNet layers (deltanet.py)
        from .deltanet import hybrid_block_spec

        spec = hybrid_block_spec(arch, config, opts.use_te)
    else:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=opts.use_te, normalization="RMSNorm")
    if opts.experts == "TorchGroupedMLP":
        use_torch_grouped_experts(spec)
    if not opts.use_te and not hybrid:  # the hybrid local spec names TorchSDPAttention itself
        use_torch_sdpa_attention(spec)
    if arch.is_mla and arch.q_lora_rank is None:
        if importlib.util.find_spec("megatron.core.transformer.mla_qk_norm_config") is not None:
            raise ValueError("multi-head latent attention without q_lora_rank (a plain q_proj: Moonlight, "
                             "DeepSeek-V2-Lite) on megatron-core >= 0.19: its MLA then builds q_proj as a fused "
                             "norm+linear, which HF's model does not have; use megatron-core 0.16 or the native "
                             "backend (train.backend=native)")
        no_q_norm(spec)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=arch.vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=False,
        # "rope" or "yarn" (_set_yarn); latent attention rotates inside its layers (GPTModel's "rope"
        # then builds nothing, its "yarn" would)
        position_embedding_type="rope" if arch.is_mla else arch.rope().rope_type.replace("default", "rope"),
        rotary_percent=arch.partial_rotary_factor,
        rotary_base=int(arch.rope_theta) if float(arch.rope_theta).is_integer() else arch.rope_theta,
        parallel_output=True,
    )
    if arch.is_mla:
        _latent_norms_at_hf_eps(model)
    _norms_in_params_dtype(model, config.params_dtype)
    return model


def _norms_in_params_dtype(model, dtype: torch.dtype) -> None:
    """The local spec's norms are torch's ``RMSNorm``/``LayerNorm`` built without a dtype, so
    fp32 in a bf16 model (megatron's training casts them with its Float16Module, which moe-rl
    does not use); torch's fused norm kernel refuses a weight whose dtype is not the input's and
    decomposes each norm into some 30 ops. Only the norms: the router's expert bias stays fp32."""
    for m in model.modules():
        if isinstance(m, (torch.nn.RMSNorm, torch.nn.LayerNorm)):
            m.to(dtype)


def _latent_norms_at_hf_eps(model) -> None:
    """HF builds MLA's q_a_layernorm / kv_a_layernorm with eps 1e-6 whatever rms_norm_eps is;
    megatron-core builds them with layernorm_epsilon. Set after the build (the local spec's
    norms, or TE's norm-fused linears)."""
    from moe_rl.model.attention.mla import LATENT_NORM_EPS

    for layer in model.decoder.layers:
        att = layer.self_attention
        for norm, fused in (("q_layernorm", "linear_q_up_proj"), ("kv_layernorm", "linear_kv_up_proj")):
            m = getattr(att, norm, None)
            if m is None or not hasattr(m, "eps"):  # IdentityOp: TE fuses the norm into the up projection
                m = getattr(att, fused, None)
            if m is None:
                continue  # no q_lora_rank: no q norm
            if not hasattr(m, "eps"):
                raise RuntimeError(f"megatron MLA: cannot set the eps of {norm} ({type(m).__name__})")
            m.eps = LATENT_NORM_EPS


def _spec_module(spec):
    """The class a layer-spec entry builds. megatron-core 0.16 wraps it in a ``ModuleSpec``
    (``.module``); 0.19 holds builders, ``functools.partial(cls, submodules=...)`` (``.func``),
    or the class itself."""
    if isinstance(spec, functools.partial):
        return spec.func
    return getattr(spec, "module", spec)


def _spec_submodules(spec):
    """The submodules dataclass of a layer-spec entry, as megatron-core 0.19's
    ``spec_utils.get_submodules`` reads it: a partial's ``submodules`` keyword, else
    ``.submodules`` (a 0.16 ``ModuleSpec``)."""
    if isinstance(spec, functools.partial):
        return spec.keywords["submodules"]
    return spec.submodules


def use_torch_grouped_experts(block_spec) -> None:
    """Replaces the expert module (the local spec's SequentialMLP) of every MoE layer spec.

    The class itself goes into ``MoESubmodules.experts``: 0.16 builds it with
    ``build_module(cls, n, config, pg_collection=...)`` and 0.19 calls the builder as
    ``cls(n, config, pg_collection=..., name=...)``; both reach ``TorchGroupedMLP.__init__``."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from .experts import TorchGroupedMLP

    mlps = [_spec_submodules(s).mlp for s in block_spec.layer_specs]
    moe_specs = [m for m in mlps if _spec_module(m) is MoELayer]
    if not moe_specs:
        built = sorted({getattr(_spec_module(m), "__name__", repr(m)) for m in mlps})
        raise RuntimeError(f"megatron layer spec has no MoELayer to give TorchGroupedMLP experts; its MLP entries "
                           f"build {built}")
    for mlp in moe_specs:
        _spec_submodules(mlp).experts = TorchGroupedMLP


def use_torch_sdpa_attention(block_spec) -> None:
    """Replaces the local spec's core attention (DotProductAttention: unfused, whole-row scores)
    with TorchSDPAttention (attention.py: fused SDPA per packed sequence)."""
    from .attention import TorchSDPAttention

    for s in block_spec.layer_specs:
        _spec_submodules(_spec_submodules(s).self_attention).core_attention = TorchSDPAttention


def no_q_norm(block_spec) -> None:
    """Multi-latent attention without q_lora_rank has no query norm: megatron-core 0.19 refuses a
    spec that still names one (0.16 builds none)."""
    from megatron.core.transformer.identity_op import IdentityOp

    for s in block_spec.layer_specs:
        _spec_submodules(_spec_submodules(s).self_attention).q_layernorm = IdentityOp


# --- routing replay ---------------------------------------------------------------------------
def check_replay(replay: list[torch.Tensor], num_layers: int, n_tokens: int, top_k: int, num_experts: int) -> None:
    """The checks megatron's RouterReplay does not do (it gathers whatever it is given): on the
    host for a host record, by an asynchronous device assert for a device-resident one (as the
    native model's router does)."""
    if len(replay) != num_layers:
        raise RoutingError(f"replay record has {len(replay)} layers, the model has {num_layers} MoE layers")
    for i, ids in enumerate(replay):
        where = f"replay record for MoE layer {i}"
        if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise RoutingError(f"{where}: expected an integer tensor, got {getattr(ids, 'dtype', type(ids))}")
        if tuple(ids.shape) != (n_tokens, top_k):
            raise RoutingError(f"{where}: shape {tuple(ids.shape)}, expected [tokens={n_tokens}, top_k={top_k}]")
        if n_tokens and ids.device.type != "cpu":  # the loop's replay is on the device: no host read
            srt = ids.sort(dim=1).values
            ok = (srt[:, 0] >= 0).all() & (srt[:, -1] < num_experts).all() & ~(srt[:, 1:] == srt[:, :-1]).any()
            torch._assert_async(ok, f"{where}: expert id out of range [0, {num_experts}) or duplicated")
        elif n_tokens:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= num_experts:
                raise RoutingError(f"{where}: expert id out of range [0, {num_experts}): min {lo}, max {hi}")
            srt = ids.sort(dim=1).values
            dup = (srt[:, 1:] == srt[:, :-1]).any(dim=1)
            if bool(dup.any()):  # megatron's alltoall dispatcher would mis-size its splits
                row = int(dup.nonzero()[0])
                raise RoutingError(f"{where}: token {row} has a duplicate expert id: {ids[row].tolist()}")


class RouterReplayControl:
    """The one owner of megatron-core's global ``RouterReplay`` state.

    megatron keeps one ``RouterReplay`` per TopKRouter in a class-level list (construction
    order = MoE layer order) and one action per instance. Per micro-batch forward:

    * replay given: ``set_replay_data`` (one ``[local_tokens, top_k]`` tensor per MoE layer),
      action REPLAY_FORWARD; after the forward, when the graph will be recomputed in backward
      (activation recompute, grad enabled), action REPLAY_BACKWARD, whose FIFO
      (``replay_backward_list``) gives each recomputed forward its micro-batch's ids: backward
      passes must then run in the order of their forwards. Otherwise the FIFO entry just added
      is dropped again, so that no-grad forwards never desynchronise it;
    * no replay, ``record`` wanted: action RECORD, ids read back with ``get_recorded_data``;
    * neither: no action (the router chooses).

    After every forward the action is REPLAY_BACKWARD while any recompute is pending, none
    otherwise. With recompute on, all micro-batches of a step should replay (or none).

    ``end_step`` clears ids, FIFOs and actions (called by ``optimizer_step``).
    """

    def __init__(self, num_moe_layers: int, top_k: int, num_experts: int, recompute: bool):
        from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

        self._rr, self._action = RouterReplay, RouterReplayAction
        self.num_layers, self.top_k, self.num_experts, self.recompute = num_moe_layers, top_k, num_experts, recompute
        self.instances = list(RouterReplay.global_router_replay_instances)
        if len(self.instances) != num_moe_layers:
            raise RuntimeError(
                f"megatron built {len(self.instances)} RouterReplay instances for {num_moe_layers} MoE layers"
                " (was another megatron model built in this process without RouterReplayControl.reset()?)"
            )

    @staticmethod
    def reset() -> None:
        """Forgets instances of earlier models; call right before building a GPTModel."""
        from megatron.core.transformer.moe.router_replay import RouterReplay

        RouterReplay.clear_global_router_replay_instances()

    def _set_action(self, action) -> None:
        for inst in self.instances:
            if action is None:
                inst.clear_router_replay_action()
            else:
                inst.set_router_replay_action(action)

    @contextlib.contextmanager
    def forward(self, replay: list[torch.Tensor] | None, n_tokens: int, device, record: list | None = None):
        """Context for one micro-batch forward; fills ``record`` (if given) after it."""
        if replay is not None:
            check_replay(replay, self.num_layers, n_tokens, self.top_k, self.num_experts)
            data = [r.to(device=device, dtype=torch.long, non_blocking=True) for r in replay]  # no stream sync
            for inst, ids in zip(self.instances, data):
                inst.set_target_indices(ids)
            self._set_action(self._action.REPLAY_FORWARD)
        else:
            self._set_action(self._action.RECORD if record is not None else None)
        keep = replay is not None and self.recompute and torch.is_grad_enabled()
        try:
            yield
            if record is not None:
                if replay is not None:
                    record.extend(d.detach() for d in data)
                else:
                    got = [inst.get_recorded_indices() for inst in self.instances]
                    if any(g is None for g in got):
                        raise RuntimeError("RouterReplay recorded nothing: was the fused router path used?")
                    record.extend(g.detach() for g in got)
        except BaseException:
            keep = False
            raise
        finally:
            if replay is not None and not keep:
                for inst in self.instances:
                    inst.replay_backward_list.pop()
            # recomputed forwards of earlier micro-batches (run by their backward) replay from the FIFO
            self._set_action(self._action.REPLAY_BACKWARD if self.pending_backward() else None)

    def pending_backward(self) -> int:
        return len(self.instances[0].replay_backward_list) if self.instances else 0

    def end_step(self) -> None:
        self._rr.clear_global_indices()
        self._rr.clear_global_router_replay_action()
