"""The megatron backend on a GPU against the native backend (one GPU, a 1-rank NCCL world).

No shims here (compare test_forward_cpu.py): megatron-core as it runs in training, alltoall
token dispatcher, TE layer specs when transformer_engine imports. docs/megatron.md gives the
command. Checks:
* logits and log-probs equal the native backend's (fp32 tight; bf16 within bf16 tolerance);
* with routing replay, the experts megatron's routers select equal the recorded ones for every
  token and MoE layer, in the forward and in the recomputed forward of the backward pass;
* full RL steps on a fixed batch (replayed routing, two micro-batches) decrease the loss;
* a Qwen3-Next-style hybrid model: log-probs and gradients equal the native backend's.
"""
import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")]
pytest.importorskip("megatron.core")

from moe_rl.model import iter_local_hf_tensors

from .common import GPU_ARCH, build, make_mb, native_hidden, native_record, pg_step, random_routes, replayed_batch, router_calls, routing_mask

LENGTHS = (37, 64, 27)
VOCAB = GPU_ARCH["vocab_size"]


@pytest.fixture(scope="module")
def world():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import torch.distributed as dist

    from tests.distributed import free_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    yield
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    dist.destroy_process_group()


def logits_of(hidden, weight):
    return hidden.float() @ weight.float().t()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_equal_native(world, dtype):
    meg, native = build(GPU_ARCH, "cuda", dtype)
    mb = make_mb(VOCAB, LENGTHS)
    mb.replay = native_record(native, mb)  # identical experts on both sides: bf16 near-ties cannot flip a choice
    with torch.no_grad():
        ref = logits_of(native_hidden(native, mb), native.model.lm_head.weight)
        got = logits_of(meg.hidden_states(mb), meg.model.output_layer.weight)
        lp_ref, _ = native.logprobs(mb, 1.0)
        lp_got, _ = meg.logprobs(mb, 1.0)
    scale = ref.abs().max()
    diff = (got - ref).abs()
    if dtype == "float32":
        torch.testing.assert_close(got, ref, atol=float(2e-4 * scale), rtol=1e-3)
        torch.testing.assert_close(lp_got, lp_ref, atol=1e-3, rtol=1e-4)
    else:
        assert diff.max() <= 0.05 * scale and diff.mean() <= 0.01 * scale, (float(diff.max()), float(diff.mean()), float(scale))
        torch.testing.assert_close(lp_got, lp_ref, atol=0.1, rtol=0.02)
    assert (lp_got[mb.labels.cuda() == -100] == 0).all()


def test_router_choice_matches_native_without_replay(world):
    """fp32, no replay: megatron's softmax top-k router picks the native router's experts."""
    meg, native = build(GPU_ARCH, "cuda", "float32")
    mb = make_mb(VOCAB, LENGTHS)
    rec_native = native_record(native, mb)
    rec_meg = []
    with torch.no_grad():
        meg.hidden_states(mb, record=rec_meg)
    agree = [(a.sort(1).values == b.cpu().sort(1).values).all(1).float().mean().item() for a, b in zip(rec_native, rec_meg)]
    assert min(agree) >= 0.99, agree


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
@pytest.mark.parametrize("source", ["native", "random"])
def test_replay_selects_recorded_experts(world, recompute, source):
    meg, native = build(GPU_ARCH, "cuda", "bfloat16", megatron_recompute=recompute)
    mb = make_mb(VOCAB, LENGTHS)
    E, k = GPU_ARCH["num_experts"], GPU_ARCH["num_experts_per_tok"]
    if source == "native":
        mb.replay = native_record(native, mb)
    else:  # experts the router would not choose: replay must still be followed exactly
        mb.replay = random_routes(mb.num_tokens, E, k, len(meg.arch.moe_layers))
    with router_calls(meg) as calls:
        lp, _ = meg.logprobs(mb, 1.0)
        (-lp.sum()).backward()
    assert len(calls) == (2 if recompute else 1) * len(meg.arch.moe_layers)
    for i, routing_map in calls:
        assert torch.equal(routing_map, routing_mask(mb.replay[i], E)), f"MoE layer {i}: routed experts differ from the record"
    for layer in meg.model.decoder.layers:
        if hasattr(layer.mlp, "router"):
            assert layer.mlp.router.weight.grad.abs().sum() > 0  # R3: the router still learns
    meg.optimizer_step()
    assert meg.replay.pending_backward() == 0


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
def test_rl_step_loss_decreases(world, recompute):
    """Policy-gradient surrogate on a fixed batch of two micro-batches with replayed routing."""
    meg, native = build(GPU_ARCH, "cuda", "float32", megatron_recompute=recompute)
    mbs, adv, n_tokens = replayed_batch(native, VOCAB, LENGTHS)
    losses = [pg_step(meg, mbs, adv, n_tokens) for _ in range(5)]
    first_native = pg_step(native, mbs, adv, n_tokens)
    assert abs(losses[0] - first_native) <= 1e-3 * max(1.0, abs(first_native)), (losses[0], first_native)
    assert losses[-1] < losses[0] - 1e-3, losses


def test_hf_tensors_after_training_load_into_native(world):
    """What the weight-sync sender sends: the trained megatron weights under HF names."""
    meg, native = build(GPU_ARCH, "cuda", "float32")
    mb = make_mb(VOCAB, LENGTHS)
    mb.replay = native_record(native, mb)
    lp, _ = meg.logprobs(mb, 1.0)
    (-lp.mean()).backward()
    meg.optimizer_step()
    sent = {n: t.clone() for n, t in meg.hf_tensors()}
    with torch.no_grad():
        for name, t in iter_local_hf_tensors(native.model):
            t.copy_(sent[name])
        ref = native_hidden(native, mb)
        got = meg.hidden_states(mb)
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-3)


def test_lora_logprobs_and_adapter_grads_equal_native(world):
    """LoRA on the GPU spec (TE linears and TEGroupedMLP experts when TE imports): the same
    log-probs and adapter gradients as the native LoRA (fp32)."""
    from .test_lora_cpu import build_lora

    meg, native = build_lora(arch=GPU_ARCH, device="cuda")
    mb = make_mb(VOCAB, LENGTHS)
    with native.lora.applied():
        mb.replay = native_record(native, mb)
    lp, _ = meg.logprobs(mb, 1.0)
    ref, _ = native.logprobs(mb, 1.0)
    torch.testing.assert_close(lp, ref, atol=1e-4, rtol=1e-4)
    (-lp.sum()).backward()
    (-ref.sum()).backward()
    nat = dict(native.lora.named_parameters())
    for n, p in meg.lora.named_parameters():
        cos = torch.nn.functional.cosine_similarity(p.grad.flatten().float(), nat[n].grad.flatten().float(), dim=0)
        assert cos >= 0.999, (n, float(cos))


HYBRID_ARCH = dict(model_type="qwen3_next", vocab_size=512, hidden_size=128, num_hidden_layers=4,
                   layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=8,
                   num_key_value_heads=2, head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8,
                   linear_key_head_dim=32, linear_value_head_dim=32, num_experts=16, num_experts_per_tok=4,
                   moe_intermediate_size=64, shared_expert_intermediate_size=64, rope_theta=10_000.0,
                   max_position_embeddings=1024)


def test_hybrid_logprobs_and_grads_equal_native(world):
    """Qwen3-Next-style model (megatron-core >= 0.19; with Transformer Engine megatron's
    GatedDeltaNet on flash-linear-attention's kernels, without it on moe-rl's Triton scan), fp32,
    packed micro-batch over several DeltaNet chunks, replayed routing: log-probs and gradients
    (mapped to HF names) against the native backend's."""
    from moe_rl.train.megatron.convert import megatron_to_hf
    from moe_rl.train.megatron.model import te_available

    from .common import native_grads_by_hf_name

    if te_available():
        pytest.importorskip("fla", reason="the TE spec's GatedDeltaNet runs flash-linear-attention's kernels")
    meg, native = build(HYBRID_ARCH, "cuda", "float32", std=0.05)
    mb = make_mb(HYBRID_ARCH["vocab_size"], (150, 37, 64))
    mb.replay = native_record(native, mb)
    lp, _ = meg.logprobs(mb, 1.0)
    lp_ref, _ = native.logprobs(mb, 1.0)
    torch.testing.assert_close(lp, lp_ref, atol=2e-3, rtol=1e-3)
    adv = torch.linspace(-1, 1, mb.num_tokens, device="cuda")
    (adv * lp).sum().backward()
    (adv * lp_ref).sum().backward()
    tensors = meg._tensors()
    grads = {n: t.grad if t.grad is not None else torch.zeros_like(t) for n, t in tensors.items()}
    zero = dict(megatron_to_hf({n: torch.zeros_like(t) for n, t in tensors.items()}, meg.arch, meg.layout))
    got = {n: g - zero[n] for n, g in megatron_to_hf(grads, meg.arch, meg.layout)}
    for name, g in native_grads_by_hf_name(native).items():
        err = float((got[name].float() - g.float()).norm() / g.float().norm().clamp_min(1e-12))
        assert err < 2e-2, (name, err)


def test_the_cpu_shims_leave_triton_the_real_device():
    """The megatron CPU shims (test_forward_cpu.py's; the whole suite runs them on a GPU machine
    too) make ``torch.cuda.current_device`` say "cpu" while on. Triton's CUDA driver keeps the
    function it finds when first used, and flash-linear-attention's import (megatron-core's
    GatedDeltaNet, where fla is installed) is such a first use: it is bound before the patch, so
    a Triton launch after the shims still runs (a fresh interpreter: nothing bound it earlier)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import subprocess
    import sys

    code = """
import torch, triton
from moe_rl.kernels.grouped_gemm import grouped_gemm, grouped_gemm_reference
from moe_rl.train.megatron.model import cpu_forward_shims
with cpu_forward_shims():
    triton.runtime.driver.active.get_current_device()  # a first use under the shims, as fla's import
x, w = torch.randn(64, 32, device="cuda"), torch.randn(4, 48, 32, device="cuda")
offs = torch.tensor([10, 30, 30, 64], dtype=torch.int32, device="cuda")
torch.testing.assert_close(grouped_gemm(x, w, offs, impl="triton"), grouped_gemm_reference(x, w, offs), rtol=1e-4, atol=1e-4)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
