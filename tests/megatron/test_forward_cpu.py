"""megatron-core's forward and backward on CPU, against the native model (fp32).

megatron-core runs on CUDA only because of a few device moves and its CUDA RNG tracker: it
moves the RoPE frequencies and the router weight to ``torch.cuda.current_device()`` on first
use, and dropout regions / activation recompute fork and restore CUDA RNG states. The
``cpu_megatron`` fixture shims exactly those for this module (``model.cpu_forward_shims``, also
used by the CPU bench), so everything else -- the GPTModel's attention, MoE routing and
RouterReplay, token dispatch, experts, recompute -- runs unchanged. It also runs megatron's
``torch.compile``d helpers (``jit_fuser``) eagerly: where CUDA is visible, TorchDynamo asks
``torch.cuda.current_device()`` for the device index, gets the shim's "cpu" and fails
(InternalTorchDynamoError). Eager and compiled compute the same; compilation is not what these
tests check.
The same checks on a GPU, without shims and also in bf16, are in test_megatron_gpu.py.
"""

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
pytest.importorskip("megatron.core")

from tests.distributed import free_port

from .common import (
    CPU_ARCH,
    assert_logprobs_and_grads_equal_native,
    build,
    make_mb,
    native_hidden,
    native_record,
    pg_step,
    random_routes,
    replayed_batch,
    router_calls,
    routing_mask,
)

LENGTHS = (11, 20, 9)


@pytest.fixture(scope="module")
def cpu_megatron():
    from megatron.core import parallel_state as ps

    from moe_rl.train.megatron.model import cpu_forward_shims

    with pytest.MonkeyPatch.context() as mp, cpu_forward_shims():
        mp.setenv("MASTER_ADDR", "127.0.0.1")
        mp.setenv("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
        try:
            yield
        finally:
            ps.destroy_model_parallel()
            dist.destroy_process_group()


def test_hidden_and_logprobs_equal_native(cpu_megatron):
    meg, native = build(CPU_ARCH, "cpu")
    mb = make_mb(CPU_ARCH["vocab_size"], LENGTHS)
    rec_native = native_record(native, mb)
    rec_meg = []
    with torch.no_grad():
        got = meg.hidden_states(mb, record=rec_meg)  # no replay: megatron's router chooses
        ref = native_hidden(native, mb)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert len(rec_meg) == len(rec_native) == len(meg.arch.moe_layers)
    for a, b in zip(rec_meg, rec_native):  # same experts, same top-k order
        assert torch.equal(a, b)
    mb.replay = rec_native
    with torch.no_grad():
        lp, ent = meg.logprobs(mb, 0.7, with_entropy=True)
        lp_ref, ent_ref = native.logprobs(mb, 0.7, with_entropy=True)
    torch.testing.assert_close(lp, lp_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ent, ent_ref, atol=1e-4, rtol=1e-4)
    assert (lp[mb.labels == -100] == 0).all()
    assert meg.replay.pending_backward() == 0  # no-grad forwards leave megatron's FIFO empty


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
def test_replay_selects_recorded_experts(cpu_megatron, recompute):
    """Routes the router would not choose are followed exactly, in the forward and in the
    recomputed forward of the backward pass (REPLAY_BACKWARD); the router still gets grads."""
    meg, native = build(CPU_ARCH, "cpu", megatron_recompute=recompute)
    mb = make_mb(CPU_ARCH["vocab_size"], LENGTHS)
    E, k = CPU_ARCH["num_experts"], CPU_ARCH["num_experts_per_tok"]
    mb.replay = random_routes(mb.num_tokens, E, k, len(meg.arch.moe_layers))
    with router_calls(meg) as calls:
        lp, _ = meg.logprobs(mb, 1.0)
        assert meg.replay.pending_backward() == (1 if recompute else 0)
        (-lp.sum()).backward()
    assert len(calls) == (2 if recompute else 1) * len(meg.arch.moe_layers)
    for i, routing_map in calls:
        assert torch.equal(routing_map, routing_mask(mb.replay[i], E)), f"MoE layer {i}"
    # the same gradients as the native model under the same replay (R3 gate weights)
    (-native.logprobs(mb, 1.0)[0].sum()).backward()
    meg_grads = {n: p.grad for n, p in meg.model.named_parameters()}
    for layer, moe_i in zip(meg.arch.moe_layers, range(len(meg.arch.moe_layers))):
        g_meg = meg_grads[f"decoder.layers.{layer}.mlp.router.weight"]
        g_nat = native.model.model.layers[layer].mlp.gate.weight.grad
        assert g_meg.abs().sum() > 0
        torch.testing.assert_close(g_meg, g_nat, atol=1e-4, rtol=1e-3)
    meg.optimizer_step()
    assert meg.replay.pending_backward() == 0


def test_replay_checks_records(cpu_megatron):
    from moe_rl.model import RoutingError

    meg, _ = build(CPU_ARCH, "cpu")
    mb = make_mb(CPU_ARCH["vocab_size"], LENGTHS)
    T, n = mb.num_tokens, len(meg.arch.moe_layers)
    good = random_routes(T, CPU_ARCH["num_experts"], CPU_ARCH["num_experts_per_tok"], n)
    for bad, match in [
        (good[:-1], "MoE layers"),
        ([g[:-1] for g in good], "shape"),
        ([g.clone().fill_(CPU_ARCH["num_experts"]) for g in good], "out of range"),
        ([torch.zeros_like(g) for g in good], "duplicate"),
    ]:
        mb.replay = bad
        with pytest.raises(RoutingError, match=match):
            meg.logprobs(mb, 1.0)
        assert meg.replay.pending_backward() == 0


def test_rl_steps_decrease_loss(cpu_megatron):
    """Full steps on a fixed batch of two micro-batches with replayed routing; the first loss
    equals the native backend's, and the loss goes down."""
    meg, native = build(CPU_ARCH, "cpu", megatron_recompute=True)
    mbs, adv, n_tokens = replayed_batch(native, CPU_ARCH["vocab_size"], LENGTHS)
    losses = [pg_step(meg, mbs, adv, n_tokens) for _ in range(4)]
    first_native = pg_step(native, mbs, adv, n_tokens)
    assert abs(losses[0] - first_native) < 1e-4, (losses[0], first_native)
    assert losses[-1] < losses[0] - 1e-3, losses
    # after the steps both backends hold the same weights (same grads, same AdamW)
    for _ in range(3):
        pg_step(native, mbs, adv, n_tokens)
    sent = dict(meg.hf_tensors())
    from moe_rl.model import iter_local_hf_tensors

    for name, t in iter_local_hf_tensors(native.model):
        torch.testing.assert_close(sent[name], t, atol=1e-4, rtol=1e-3, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
def test_token_loss_equals_logprobs_then_loss(cpu_megatron, recompute):
    """The fused LM-head loss (backend.token_loss, the trainer's train.fused_loss path) gives
    the loss, log-probs, entropies and every parameter gradient of the general path (logprobs,
    then the same per-token loss, then backward), with replayed routing."""
    meg, native = build(CPU_ARCH, "cpu", megatron_recompute=recompute)
    mbs, _, _ = replayed_batch(native, CPU_ARCH["vocab_size"], LENGTHS)
    mb = mbs[0]
    rows = torch.nonzero(mb.labels != -100)[:, 0]
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(len(rows), generator=g), torch.randn(len(rows), generator=g)

    def token_loss(logp, ent, sl):
        return a[sl] * logp + b[sl] * ent * ent

    lp_all, ent_all = meg.logprobs(mb, 0.7, with_entropy=True)
    want = token_loss(lp_all[rows], ent_all[rows], slice(0, len(rows))).sum()
    want.backward()
    grads = {n: p.grad.clone() for n, p in meg.model.named_parameters() if p.grad is not None}
    meg.optimizer.zero_grad(set_to_none=True)
    loss, lp, ent = meg.token_loss(mb, rows, 0.7, token_loss, with_entropy=True)
    loss.backward()
    torch.testing.assert_close(loss, want.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lp, lp_all[rows].detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ent_all[rows].detach(), atol=1e-5, rtol=0)
    got = {n: p.grad for n, p in meg.model.named_parameters() if p.grad is not None}
    assert set(got) == set(grads) and len(got) > 5
    for n in grads:  # fp32, two summation orders: relative L2 error
        err = float((got[n] - grads[n]).norm() / grads[n].norm().clamp_min(1e-30))
        assert err < 1e-5, (n, err)
    assert meg.replay.pending_backward() == 0


def test_from_transformers_checkpoint_matches_transformers(cpu_megatron, tmp_path):
    """model.path: a checkpoint written by transformers' save_pretrained, read lazily tensor by
    tensor; megatron's logits equal transformers' own Qwen3MoeForCausalLM."""
    transformers = pytest.importorskip("transformers")
    from moe_rl.train.megatron import MegatronBackend

    from .common import make_cfg

    hf_cfg = transformers.Qwen3MoeConfig(
        **{k: v for k, v in CPU_ARCH.items() if k != "max_position_embeddings"}, max_position_embeddings=256,
        norm_topk_prob=True, decoder_sparse_step=1,
    )
    torch.manual_seed(0)
    ref = transformers.Qwen3MoeForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.1)
    ref.save_pretrained(tmp_path / "hf")
    cfg = make_cfg(CPU_ARCH, "cpu")
    cfg.model.path = str(tmp_path / "hf")
    meg = MegatronBackend(cfg)
    mb = make_mb(CPU_ARCH["vocab_size"], (17,))
    with torch.no_grad():
        expected = ref(mb.input_ids).logits[0]
        got = meg.hidden_states(mb) @ meg.model.output_layer.weight.t()
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_state_dict_round_trip_and_record_without_replay_config(cpu_megatron):
    meg, native = build(CPU_ARCH, "cpu")
    meg.cfg.replay.enabled = False  # recording still goes through RouterReplay (RECORD)
    mb = make_mb(CPU_ARCH["vocab_size"], LENGTHS)
    rec = []
    lp, _ = meg.logprobs(mb, 1.0, record=rec)
    assert [r.shape for r in rec] == [(mb.num_tokens, CPU_ARCH["num_experts_per_tok"])] * len(meg.arch.moe_layers)
    (-lp.sum()).backward()
    meg.optimizer_step()
    state = meg.state_dict()
    other, _ = build(CPU_ARCH, "cpu", seed=99)
    other.load_state_dict(state)
    for (n1, t1), (n2, t2) in zip(meg.hf_tensors(), other.hf_tensors()):
        assert n1 == n2 and torch.equal(t1, t2), n1
    assert other.optimizer.state_dict()["state"].keys() == meg.optimizer.state_dict()["state"].keys()


def test_weight_sync_from_megatron_equals_the_native_weights(cpu_megatron):
    """The weight-sync sender takes the megatron backend as it takes the native one: it streams
    Megatron -> HF conversion bucket by bucket, and the engine ends bit-identical to the native
    model holding the same weights."""
    from moe_rl.sync import WeightSender
    from moe_rl.sync.local import LocalEngine
    from tests.sync import helpers as H

    meg, native = build(CPU_ARCH, "cpu")
    with H.spawn_receiver(0, CPU_ARCH) as (tr, ctl, _):
        want = H.model_hashes(native.model)
        assert ctl.call("hashes")["result"] != want
        sender = WeightSender(meg.hf_source(), engines=[LocalEngine(tr, timeout_s=60)], bucket_mb=0.005,
                              timeout_s=30, port=free_port())
        stats = sender.sync("3")
        assert stats.buckets == len(sender.plan.buckets) > 4
        sender.close()
        assert ctl.call("hashes")["result"] == want
        assert ctl.call("state")["result"]["version"] == "3"


def test_bf16_model_steps_fp32_main_params(cpu_megatron):
    """bf16 model and grads, fp32 main params (megatron's distributed-optimizer precision): the
    loss goes down and the model holds its main params rounded to bf16 after every step."""
    from moe_rl.train.main_params import MainParamsOptimizer

    meg, native = build(CPU_ARCH, "cpu", "bfloat16")
    assert isinstance(meg.optimizer, MainParamsOptimizer)
    assert sum(p.numel() for p in meg.model.parameters() if p.dtype == torch.bfloat16) > 0.9 * sum(
        p.numel() for p in meg.model.parameters())  # megatron may keep a few (e.g. the router) in fp32
    norms = {n: p.dtype for n, p in meg.model.named_parameters() if "layernorm" in n or n.endswith("final_layernorm.weight")}
    assert norms and set(norms.values()) == {torch.bfloat16}, norms  # torch's fused norm wants the input's dtype
    assert {m.dtype for m in meg.optimizer.main_params} == {torch.float32}
    mbs, adv, n_tokens = replayed_batch(native, CPU_ARCH["vocab_size"], LENGTHS)
    losses = [pg_step(meg, mbs, adv, n_tokens) for _ in range(4)]
    assert losses[-1] < losses[0] - 1e-3, losses
    for p, main in zip(meg.optimizer.model_params, meg.optimizer.main_params):
        assert torch.equal(p.detach(), main.detach().to(p.dtype))


@pytest.mark.parametrize("grouped,align", [(True, 1), (True, 8), (False, 1)],
                         ids=["TorchGroupedMLP", "TorchGroupedMLP-padded", "SequentialMLP"])
def test_experts_forward_and_every_gradient_equal_native(cpu_megatron, monkeypatch, grouped, align):
    """Without TE the experts are our TorchGroupedMLP (torch._grouped_mm) unless turned off; either
    way megatron's log-probs and every parameter's gradient (mapped to HF names by the converter)
    equal the native model's on the same weights and replayed routes (fp32). ``align=8`` runs the
    CUDA layout (groups padded to aligned starts) on CPU."""
    from moe_rl.train.megatron import experts as experts_mod

    monkeypatch.setattr(experts_mod, "group_align", lambda x: align)

    meg, native = build(CPU_ARCH, "cpu", megatron_grouped_gemm=grouped)
    experts = {type(layer.mlp.experts).__name__ for layer in meg.model.decoder.layers if hasattr(layer.mlp, "experts")}
    assert experts == {"TorchGroupedMLP" if grouped else "SequentialMLP"}
    mb = make_mb(CPU_ARCH["vocab_size"], LENGTHS)
    mb.replay = native_record(native, mb)
    assert_logprobs_and_grads_equal_native(meg, native, mb)


def test_local_spec_attention_is_fused_sdpa_and_refuses_other_masks(cpu_megatron):
    """Without TE, core attention is TorchSDPAttention (its output equals the native model's
    above); a mask that is not block-causal over packed sequences is refused, not attended."""
    from moe_rl.model.attention import PackedCausal
    from moe_rl.train.megatron.attention import TorchSDPAttention

    meg, _ = build(CPU_ARCH, "cpu")
    cores = {type(layer.self_attention.core_attention) for layer in meg.model.decoder.layers}
    assert cores == {TorchSDPAttention}
    cu = torch.tensor([0, 3, 7, 10])
    mask = ~PackedCausal(cu, 10).mask[None, None]
    assert torch.equal(TorchSDPAttention.packing(mask).cu_seqlens, cu)
    bad = mask.clone()
    bad[0, 0, 5, 1] = False  # token 5 (second sequence) would see token 1 (first sequence)
    with pytest.raises(ValueError, match="not block-causal"):
        TorchSDPAttention.packing(bad)
    # read once per forward: recompute hands each layer a detached alias of the same mask
    first = TorchSDPAttention.packing(mask)
    assert TorchSDPAttention.packing(mask.detach()) is first and TorchSDPAttention.packing(mask) is first
    assert TorchSDPAttention.packing(mask.clone()) is not first  # other memory: read again
    other = mask.clone()
    TorchSDPAttention.packing(other)
    other[0, 0] = ~PackedCausal(torch.tensor([0, 5, 10]), 10).mask  # written in place: read again
    assert torch.equal(TorchSDPAttention.packing(other.detach()).cu_seqlens, torch.tensor([0, 5, 10]))


def test_the_shims_have_triton_bind_the_real_device_first(monkeypatch):
    """On a GPU machine (the whole suite there) the shims run beside CUDA work. Triton's CUDA
    driver keeps the ``torch.cuda.current_device`` it finds when made (its first use, which
    flash-linear-attention's import is, under the shims where megatron's GatedDeltaNet imports
    it): the shims have it made before they patch. Stand-in: a CUDA driver made here."""
    triton = pytest.importorskip("triton")
    import sys

    from triton.backends.driver import GPUDriver

    from moe_rl.train.megatron.model import cpu_forward_shims

    cuda = type("Cuda", (GPUDriver,), dict.fromkeys(GPUDriver.__abstractmethods__, lambda *a, **k: None))
    made = []
    monkeypatch.setattr(sys.modules["triton.runtime.driver"], "_create_driver", lambda: made.append(cuda()) or made[-1])
    monkeypatch.setattr(triton.runtime.driver, "_default", None)
    monkeypatch.setattr(triton.runtime.driver, "_active", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real = torch.cuda.current_device
    with cpu_forward_shims():
        assert triton.runtime.driver.active is made[-1]  # a first use under the shims
    assert len(made) == 1 and made[0].get_current_device is real
