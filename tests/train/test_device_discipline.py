"""Device discipline without a GPU: one step of the real training loop, the embedded engine and
the weight sync's pack/stage/commit, with every model on ``fakedev`` (tests/fake_device.py, which
says why that second device and not meta, a default-device guard or a tagging dispatch mode).
An op that mixes a fakedev tensor with a CPU tensor raises there as it would on a GPU, so these
tests catch what broke the main job on its first GPU run:

* train/loop.py built behav, adv, seq_ids and mask on the host while logp was on the device
  (policy_loss: ``log_w = prox - behav``);
* replay/match.py compared the trainer's routing (device) with the engine's (host).

Checked both ways. Against train/loop.py and replay/match.py as they were at ed91456,
test_one_train_step_on_a_second_device fails in policy_loss (``log_w = prox - behav``: "Expected
all tensors to be on the same device, but found at least two devices, fakedev:0 and cpu! (in
aten.sub.Tensor ...)"), the GPU's first crash; with the GPU run's throwaway patch on top (those
four tensors moved to logp's device) it fails in replay/match.py routing_match (aten.eq.Tensor),
the GPU's second. In the fixed loop, reverting each fix alone (``_accumulate`` handing
policy_loss the host ``mc.behav, mc.adv, mc.mask, mc.seq_ids`` instead of the device copy's;
routing_match given the host ``mc.engine_routing``) fails the same two ways. Each scenario
also runs on the CPU and the two must agree, so the fake device cannot pass by computing
something else.

The scenarios run in one fresh process (``fresh_process``): installing fakedev is process-global.
The host syncs of the step are recorded (``recording``) and held at the target: one per
step, the loop's read of the step's metrics at its end (``Trainer.train_step``); nothing inside a
micro-batch's forward and backward reads the device (was 80 with the fused loss, 83 on the
general path, at 1190b7b: the padded grouped GEMM, policy_loss and mismatch_metrics, PackedCausal,
the label check and backward of the log-prob op's torch path, the grad-norm clip).
"""
from __future__ import annotations

import tempfile

import numpy as np
import pytest
import torch

from tests import fake_device as fd

# a gpt-oss model on the same tiny shape: a sliding layer (a ring state in the engine), sinks, biases
GPT_OSS = ["model.model_type=gpt_oss", "model.mlp_only_layers=[]", "model.sliding_window=3", "model.attention_bias=true"]
# the other families on it, each with its own attention kind and decode state: DeepSeek-V3's MLA
# (the compressed latent cache, interleaved rope), grouped sigmoid routing with a bias
# and a shared expert (GLM-4.5 too, with partial rope and attention biases), Qwen3-Next's gated
# DeltaNet layers (recurrent and conv states) beside a gated full-attention layer
FAMILIES = {
    "deepseek-v3-mla": ["model.model_type=deepseek_v3", "model.mlp_only_layers=[]", "model.first_k_dense_replace=1",
                        "model.q_lora_rank=16", "model.kv_lora_rank=16", "model.qk_nope_head_dim=8",
                        "model.qk_rope_head_dim=4", "model.v_head_dim=8", "model.rope_interleave=true",
                        "model.n_group=2", "model.topk_group=1", "model.n_shared_experts=1"],
    "glm-4.5": ["model.model_type=glm4_moe", "model.mlp_only_layers=[]", "model.first_k_dense_replace=1",
                "model.n_group=2", "model.topk_group=1", "model.n_shared_experts=1", "model.partial_rotary_factor=0.5",
                "model.attention_bias=true"],
    "qwen3-next": ["model.model_type=qwen3_next", "model.mlp_only_layers=[]",
                   "model.layer_types=[linear_attention,linear_attention,full_attention]",
                   "model.shared_expert_intermediate_size=16", "model.partial_rotary_factor=0.25",
                   "model.linear_num_key_heads=2", "model.linear_num_value_heads=4", "model.linear_key_head_dim=8",
                   "model.linear_value_head_dim=8", "model.linear_conv_kernel_dim=4"],
}
TINY = ["model.vocab_size=32", "model.hidden_size=32", "model.intermediate_size=64", "model.moe_intermediate_size=16",
        "model.num_hidden_layers=3", "model.mlp_only_layers=[1]", "model.num_attention_heads=4",
        "model.num_key_value_heads=2", "model.head_dim=8", "model.num_experts=4", "model.num_experts_per_tok=2",
        "model.max_position_embeddings=64", "rollout.prompts_per_step=3", "rollout.group_size=2",
        "train.micro_batch_size=2", "train.lr=0.05"]


# --- the harness itself -------------------------------------------------------------------
def _harness_checks():
    dev = fd.DEVICE
    x = torch.arange(6.0).reshape(2, 3)
    d = x.to(dev, non_blocking=True)
    assert d.device == dev and isinstance(d, fd.DeviceTensor)
    out = {}
    with pytest.raises(RuntimeError, match=r"found at least two devices, fakedev:0 and cpu"):
        d + x
    with pytest.raises(RuntimeError, match="two devices"):
        torch.cat([d, x])
    with pytest.raises(TypeError, match="numpy"):
        d.numpy()
    with fd.recording() as rec:
        y = d * torch.tensor(2.0)  # a CPU scalar is allowed, as on CUDA
        z = d[torch.tensor([1, 0])]  # so are CPU indices
        w = torch.zeros(3, device=dev) + torch.ones(3).to(dev)  # blocking copy
        out["item"] = float(y.sum())
        out["list"] = z.tolist()
        out["cpu"] = w.cpu()
        out["masked"] = d[d > 2].cpu()
    k = rec.counts()
    assert (k["item"], k["d2h"], k["h2d_blocking"], k["shape"]) == (1, 3, 1, 1), k
    assert rec.syncs == 6
    assert out["item"] == 30.0 and out["list"] == [[3.0, 4.0, 5.0], [0.0, 1.0, 2.0]]
    assert torch.equal(out["cpu"], torch.ones(3)) and torch.equal(out["masked"], torch.tensor([3.0, 4.0, 5.0]))
    # autograd and an optimizer step, equal to the CPU's
    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2)
    ref = torch.nn.Linear(3, 2)
    ref.load_state_dict(lin.state_dict())
    lin.to(dev)
    for m, inp in ((lin, d), (ref, x)):
        opt = torch.optim.AdamW(m.parameters(), lr=0.1)
        m(inp).pow(2).sum().backward()
        opt.step()
    assert lin.weight.device == dev and lin.weight.grad.device == dev
    torch.testing.assert_close(lin.weight.cpu(), ref.weight.detach())
    t = torch.tensor([1, 2], device=dev)  # torch.tensor(..., device=) copies in blocking
    assert t.device == dev and t.cpu().tolist() == [1, 2]


@pytest.fixture(scope="module")
def fakedev():
    """``run(fn, *args)``: ``fn`` in one fresh process with fakedev installed (for the module)."""
    with fd.fresh_process() as run:
        yield run


def test_the_fake_device_enforces_cudas_rule_and_records_syncs(fakedev):
    fakedev(_harness_checks)


# --- one step of the training loop ----------------------------------------------------------
def _trainer(cfg, device: str | None, replay_dir: str):
    from moe_rl.dist import Groups, Layout
    from moe_rl.replay import ReplayLog
    from moe_rl.train.loop import Trainer

    if device is not None:  # the schema admits cpu|cuda: the backends read this field as is
        object.__setattr__(cfg.train, "device", device)
    layout = Layout(world_size=1, trainer_ranks=[0], rollout_ranks=[], ep_size=1)
    trainer = Trainer(cfg, Groups(layout=layout, rank=0, role="trainer"))
    trainer.reader = ReplayLog(replay_dir, mode="r")  # what Trainer.setup opens
    trainer.version = 1
    # SGD for the comparison: Adam's first step is about lr * sign(g), which turns rounding in a
    # near-zero gradient into a difference of lr (fakedev takes the GPU's fp32 grouped-GEMM path,
    # padded bmm, where the CPU runs torch._grouped_mm); Adam on fakedev: the harness test
    b = trainer.backend
    b.optimizer = torch.optim.SGD(b.dense_params + b.expert_params, lr=cfg.train.lr)
    return trainer


def _rotated_steps(trainer, batch: list[dict], n: int = 2) -> tuple[list[dict], list[torch.Tensor]]:
    """``n`` training steps, each on ``batch`` rotated by one more sample (so packed otherwise):
    their metrics, and the trained weights after the last."""
    metrics = []
    for r in range(n):
        metrics.append(trainer.train_step(batch[r:] + batch[:r]))
        trainer.version += 1
    b = trainer.backend
    return metrics, [p.detach().clone() for p in b.dense_params + b.expert_params]


def _assert_same_steps(got, want, metric_abs: float) -> None:
    """Two ``_rotated_steps`` results: the same metrics (rel 1e-5, abs ``metric_abs``) and weights."""
    for a, b in zip(got[0], want[0]):
        assert a.keys() == b.keys()
        for k in b:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=metric_abs), k
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _batch(cfg, replay_dir: str) -> list[dict]:
    """Samples as the rollout makes them: behaviour log-probs near the initial model's, routing
    records of the initial model in the replay log (one sample without), two stale samples
    (version 0, trained at version 1: routed by the trainer itself), one multi-turn episode."""
    from moe_rl.model.transformer import MoEForCausalLM
    from moe_rl.replay import ReplayLog

    arch = cfg.model.arch()
    model = MoEForCausalLM(arch).init_weights(cfg.model.init_seed, std=cfg.model.init_std)
    writer = ReplayLog(replay_dir, len(arch.moe_layers), arch.num_experts_per_tok, arch.num_experts)
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(6):
        prompt = torch.randint(0, 32, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g).tolist()
        resp = torch.randint(0, 32, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        ids = torch.tensor(prompt + resp)[None]
        rec = []
        with torch.no_grad():
            logits = model(ids, record=rec)[0] / cfg.rollout.temperature
        lp = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1, len(prompt) + len(resp) - 1), torch.tensor(resp)]
        behav = lp + 0.05 * torch.randn(len(resp), generator=g)
        version = 0 if i in (1, 4) else 1
        uid = f"s{i}"
        if i != 3:
            writer.append(uid, torch.stack(rec, 1)[:-1], [version])
        mask = [1] * 2 + [0] * (len(resp) - 3) + [1] if i == 5 and len(resp) > 3 else None
        out.append(dict(uid=uid, group_id=i // 2, prompt_ids=prompt, response_ids=resp, behaviour_logprobs=behav.tolist(),
                        versions=[version] * len(resp), advantage=float(torch.randn((), generator=g)),
                        has_routing=i != 3, loss_mask=mask))
    writer.flush()
    return out


def _train_step(overrides: list[str]):
    from moe_rl.config import load_config

    cfg = load_config(None, [*TINY, *overrides])
    with tempfile.TemporaryDirectory() as tmp:
        batch = _batch(cfg, tmp)
        results = {}
        for name, device in (("cpu", None), ("fakedev", fd.NAME)):
            trainer = _trainer(cfg.model_copy(deep=True), device, tmp)
            with fd.recording(stacks=True) as rec:
                metrics = trainer.train_step(batch)
            b = trainer.backend
            params = {str(i): p.detach().cpu().clone() for i, p in enumerate(b.dense_params + b.expert_params)}
            results[name] = (metrics, params, next(trainer.backend.model.parameters()).device, rec)
    (m_cpu, p_cpu, d_cpu, _), (m_dev, p_dev, d_dev, rec) = results["cpu"], results["fakedev"]
    assert d_cpu.type == "cpu" and d_dev == fd.DEVICE
    assert m_dev.keys() == m_cpu.keys()
    for k in m_cpu:
        assert m_dev[k] == pytest.approx(m_cpu[k], rel=1e-4, abs=1e-6), k
    for n in p_cpu:
        torch.testing.assert_close(p_dev[n], p_cpu[n], rtol=1e-4, atol=1e-5, msg=n)
    blocking = [e for e in rec.events if e.kind == "h2d_blocking"]
    assert not blocking, "a blocking host-to-device copy in the step:\n" + "".join(blocking[0].stack)
    syncs = [e for e in rec.events if e.kind in fd.SYNC_KINDS]
    assert len(syncs) == rec.syncs == 1, "host syncs in the step:\n" + "\n".join("".join(e.stack[-3:]) for e in syncs)
    assert syncs[0].kind == "d2h" and any("loop.py" in f and "in train_step" in f for f in syncs[0].stack)
    return m_cpu, rec.counts()


@pytest.mark.parametrize("overrides", [
    # R3 with stale samples routed by the trainer itself, two updates (proximal forwards), KL to
    # the initial policy (a second backend) and the entropy bonus: every path of the step
    ["replay.stale=trainer", "train.minibatches=2", "algo.kl_coef=0.1", "algo.entropy_coef=0.01",
     "algo.ratio_anchor=proximal"],
    # the defaults: every sample's engine routing replayed, one update
    [],
    # LoRA adapters (lora.rank turns them on) on the router and the experts too
    ["lora.rank=4", "lora.targets=[q_proj,router,experts.gate_up_proj,experts.down_proj]"],
    # the general loss path (log-probs, then policy_loss) with per-sequence aggregation
    ["train.fused_loss=false", "algo.loss_agg=sequence"],
    # gpt-oss, with LoRA on its [E, in, out] experts
    [*GPT_OSS, "lora.rank=4", "lora.targets=[q_proj,router,experts.gate_up_proj,experts.down_proj]"],
    *FAMILIES.values(),
    # MLA's projections and a shared expert with LoRA adapters
    [*FAMILIES["deepseek-v3-mla"], "lora.rank=4", "lora.targets=[q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj,"
                                                   "experts.gate_up_proj,shared_experts.gate_proj]"],
], ids=["stale-kl-entropy-2updates", "defaults", "lora", "general-loss-path", "gpt-oss-lora", *FAMILIES,
        "deepseek-v3-mla-lora"])
def test_one_train_step_on_a_second_device(fakedev, overrides):
    """The step on fakedev computes what it computes on the CPU, with one host sync: the read of
    its metrics at the end."""
    metrics, counts = fakedev(_train_step, overrides)
    assert metrics["routing_match"] == 1.0  # R3: the engine's routing (the initial model's) replayed
    assert metrics["train_tokens"] > 0 and counts["h2d"] > 0
    if "replay.stale=trainer" in overrides:
        assert "routing_match_stale" in metrics and "entropy" in metrics


# --- replay checks on the device ---------------------------------------------------------------
def _replay_checks():
    from moe_rl.model.transformer import MoEForCausalLM
    from moe_rl.train.megatron.model import check_replay

    dev = fd.DEVICE
    good = torch.tensor([[0, 1], [2, 3], [3, 0]])
    bad = {"out of range": torch.tensor([[0, 1], [2, 4], [3, 0]]), "duplicated": torch.tensor([[0, 1], [2, 2], [3, 0]])}
    mlp = next(layer.mlp for layer in MoEForCausalLM(_arch()).model.layers if layer.is_moe)
    checks = {"native router": lambda ids: mlp._check_replay(ids, 3, dev),
              "megatron check_replay": lambda ids: check_replay([ids], 1, 3, 2, 4)}
    for name, check in checks.items():
        on_dev = good.to(dev, non_blocking=True)
        with fd.recording() as rec:
            check(on_dev)
        assert rec.syncs == 0, (name, rec.counts())  # an asynchronous device assert, no host read
        for what, ids in bad.items():
            with pytest.raises(RuntimeError, match=what):  # on a GPU: a device-side assert
                check(ids.to(dev))


def _arch():
    from moe_rl.config import load_config

    return load_config(None, TINY).model.arch()


def test_replay_records_on_the_device_are_checked_without_a_host_read(fakedev):
    """The loop hands the backends their replay on the device: the native router and megatron's
    check_replay validate it there (out-of-range or duplicated experts) without reading it back."""
    fakedev(_replay_checks)


# --- the embedded engine -----------------------------------------------------------------------
def _generate(engine, prompts, max_new):
    from tests.engine.helpers import generate

    return generate(engine, [{"input_ids": prompt, "return_logprob": True, "return_routed_experts": True,
                              "sampling_params": {"temperature": 1.0 if i % 2 else 0.0, "max_new_tokens": max_new,
                                                  "sampling_seed": 7 + i, **({"top_k": 5} if i == 2 else {})}}
                             for i, prompt in enumerate(prompts)])


def _assert_same_outputs(want, got, arch):
    """Token for token, log-probs to 1e-5 and routed experts exactly."""
    from moe_rl.engine import decode_routed_experts, output_logprobs

    L, K = arch.num_hidden_layers, arch.num_experts_per_tok
    for a, b in zip(want, got, strict=True):
        assert a["output_ids"] == b["output_ids"]
        np.testing.assert_allclose(output_logprobs(b["meta_info"]), output_logprobs(a["meta_info"]), rtol=1e-5, atol=1e-6)
        assert np.array_equal(decode_routed_experts(a, L, K), decode_routed_experts(b, L, K))


def _engine_on_both():
    """The embedded engine on fakedev and on the CPU: the same tokens, log-probs and routing.
    A wrapper-subclass tensor cannot be updated in place through an index under
    torch.inference_mode (PyTorch's indexing sets a version counter, which inference tensors
    lack), so the engine runs under no_grad here, which computes the same values."""
    from moe_rl.config import load_config

    inference_mode, torch.inference_mode = torch.inference_mode, torch.no_grad
    try:
        _engine(load_config(None, TINY))
    finally:
        torch.inference_mode = inference_mode


def _sync_on_device():
    from moe_rl.config import load_config

    _sync(load_config(None, [*TINY, "lora.rank=4", "lora.sync=merged"]))


def _engine(cfg):
    from moe_rl.engine.engine import Engine
    from moe_rl.model.transformer import MoEForCausalLM

    arch = cfg.model.arch()
    prompts = [[(5 * i + 3 * j + 1) % arch.vocab_size for j in range(3 + i)] for i in range(4)]
    outs = {}
    for name, device in (("cpu", "cpu"), ("fakedev", fd.DEVICE)):
        model = MoEForCausalLM(arch).init_weights(0, std=0.3).to(device)
        engine = Engine(model, max_running_requests=3, max_context=64).start()  # fewer slots than requests
        try:
            assert engine.states[0].k.device == torch.device(device)
            outs[name] = _generate(engine, prompts, 6)
        finally:
            engine.stop()
    _assert_same_outputs(outs["cpu"], outs["fakedev"], arch)


def _static_engine_on_both(extra=()):
    inference_mode, torch.inference_mode = torch.inference_mode, torch.no_grad
    try:
        _static_engine(extra)
    finally:
        torch.inference_mode = inference_mode


def _static_engine(extra=()):
    """The engine's static decode step on fakedev gives the dynamic step's tokens,
    log-probs and routing on the CPU. The host syncs of the run: one read per step (d2h), no
    blocking copy, no data-dependent shape, no scalar read (the fp32 experts' grouped GEMM is
    the sync-free op, as on a GPU), so the check before capture finds nothing and an unset
    engine.cuda_graph captures every shape."""
    from moe_rl.config import load_config
    from moe_rl.engine.engine import Engine
    from moe_rl.model.transformer import MoEForCausalLM
    from tests.engine.test_static_decode import StandInGraphs

    arch = load_config(None, [*TINY, *extra]).model.arch()
    prompts = [[(5 * i + 3 * j + 1) % arch.vocab_size for j in range(3 + 7 * i)] for i in range(4)]
    cpu = Engine(MoEForCausalLM(arch).init_weights(0, std=0.3), max_running_requests=3, max_context=64).start()
    try:
        want = _generate(cpu, prompts, 8)
    finally:
        cpu.stop()
    model = MoEForCausalLM(arch).init_weights(0, std=0.3).to(fd.DEVICE)
    engine = Engine(model, max_running_requests=3, max_context=64, static_decode=True).start()
    try:
        with fd.recording(stacks=True) as rec:
            got = _generate(engine, prompts, 8)
    finally:
        engine.stop()
    assert engine.stats["decode_static_steps"] > 10
    _assert_same_outputs(want, got, arch)
    k = rec.counts()
    assert k["d2h"] == engine.stats["steps"] and k["h2d_blocking"] == 0 and k["shape"] == 0 and k["item"] == 0, k
    graphs = StandInGraphs()
    auto = Engine(model, max_running_requests=3, max_context=64, cuda_graph=None, graphs=graphs).start()
    auto.stop()
    assert auto.cuda_graph and auto.static_decoder is not None and graphs.captures > 0


class _Handoff:
    """A weight-sync group of two on one machine: the receiver's broadcast takes the sender's
    bucket (what NCCL/gloo carry between processes; they cannot carry fakedev tensors)."""

    group_name = "g"

    def __init__(self, bucket):
        self.bucket = bucket

    def broadcast(self, buf, src=0):
        buf.copy_(self.bucket)

    def wait_work(self, work):
        pass


def _sync(cfg):
    """The trainer side's gather and pack of every bucket and the engine side's staging,
    checksum and commit, both models on fakedev; the trainer with LoRA adapters, so what is
    sent is the merged weights (lora.sync=merged), made on the device."""
    from moe_rl.model import iter_local_hf_tensors
    from moe_rl.model.transformer import MoEForCausalLM
    from moe_rl.sync.receiver import WeightReceiver
    from moe_rl.sync.sender import WeightSender
    from moe_rl.train.backend import NativeBackend

    object.__setattr__(cfg.train, "device", fd.NAME)
    backend = NativeBackend(cfg)
    with torch.no_grad():  # B starts at zero: make every adapter change its weight
        for p in backend.lora.parameters():
            p.normal_(0, 0.1)
    expected = {n: t.cpu() for n, t in backend.hf_tensors()}
    engine = MoEForCausalLM(cfg.model.arch()).init_weights(2, std=0.3).to(fd.DEVICE)
    sender = WeightSender(backend.hf_source(), bucket_mb=0.01, verify=True)
    receiver = WeightReceiver(dict(iter_local_hf_tensors(engine)))
    try:
        assert len(sender.plan.buckets) > 1
        sender.source.begin()  # as WeightSender.push: its stream of merged tensors starts
        done = False
        for i, b in enumerate(sender.plan.buckets):
            buf, checksum = sender._prepare(i)
            assert buf.device == fd.DEVICE
            receiver.groups["g"] = _Handoff(buf)
            done = receiver.receive_bucket(**b.request_fields(), group_name="g", weight_version="1", checksum=checksum)
        assert done
        receiver.commit()
    finally:
        sender.close()
    got = dict(iter_local_hf_tensors(engine))
    assert got.keys() == expected.keys()
    for n, t in got.items():
        assert t.device == fd.DEVICE
        assert torch.equal(t.cpu(), expected[n]), n


def test_engine_on_a_second_device(fakedev):
    """The embedded engine generates on fakedev exactly what it generates on the CPU (greedy and
    sampled rows, a top-k row, more requests than slots)."""
    fakedev(_engine_on_both)


def test_static_decode_on_a_second_device(fakedev):
    """The static decode step on fakedev: the CPU's outputs, one read per step and no blocking
    copy; graphs stay off where the step reads the host."""
    fakedev(_static_engine_on_both)


def test_gpt_oss_static_decode_on_a_second_device(fakedev):
    """gpt-oss's static decode step on fakedev (ring states of the sliding layer, sinks, biased
    experts): the CPU's outputs, one read per step, nothing that keeps a CUDA graph from capturing."""
    fakedev(_static_engine_on_both, GPT_OSS)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_static_decode_on_a_second_device(fakedev, family):
    """Each family's decode state on fakedev (MLA's latent cache, the DeltaNet layers' recurrent
    and conv states): the CPU's outputs, one read per step, nothing that keeps a CUDA graph from
    capturing."""
    fakedev(_static_engine_on_both, FAMILIES[family])


def test_weight_sync_on_a_second_device(fakedev):
    """The weight sync merges LoRA adapters, packs, stages, checks and commits every bucket with
    the trainer's and the engine's models on fakedev."""
    fakedev(_sync_on_device)


# --- moe-rl bench on-policy's harness ----------------------------------------------------------
def _on_policy_bench_on_both():
    """``moe_rl.bench.on_policy`` with ``train.device=fakedev`` (as ``--device cuda`` sets
    ``train.device=cuda``): its engine, KV cache and trainer on the device, its exactness checks
    (the model's forward of a sequence on the engine's device among them) and two steps
    (rollout, train step, weight sync) run there and agree with the CPU's. The default variant
    only: the exact kernels take CPU or CUDA tensors, not fakedev's."""
    from pathlib import Path

    from moe_rl.bench.on_policy import _Run, exactness
    from moe_rl.config import load_config

    cfg = load_config(None, [*TINY, "algo.ratio_anchor=proximal", "train.minibatches=2", "engine.max_context=64"])
    out = {}
    inference_mode, torch.inference_mode = torch.inference_mode, torch.no_grad  # see _engine_on_both
    try:
        for name, device in (("cpu", "cpu"), ("fakedev", fd.NAME)):
            c = cfg.model_copy(deep=True)
            object.__setattr__(c.train, "device", device)
            with tempfile.TemporaryDirectory() as tmp:
                run = _Run(c, Path(tmp), skip=True)
                try:
                    dev = torch.device(device) if device == "cpu" else fd.DEVICE
                    assert run.engine.device == dev and run.engine.states[0].k.device == dev
                    assert next(run.t.backend.model.parameters()).device == dev
                    checks = exactness(run.engine, run.t)
                    rows = [run.step(), run.step()]  # the second on the weights synced after the first
                finally:
                    run.engine.stop()
            out[name] = (checks, rows)
    finally:
        torch.inference_mode = inference_mode
    (c_cpu, r_cpu), (c_dev, r_dev) = out["cpu"], out["fakedev"]
    assert c_dev["tokens"] == c_cpu["tokens"] > 0
    assert c_dev["alone_batched_same_tokens"] and c_cpu["alone_batched_same_tokens"]
    for c in (c_cpu, c_dev):  # torch's kernels: rounding apart, not more
        assert c["alone_vs_batched_max_abs"] < 1e-4 and c["decode_vs_prefill_max_abs"] < 1e-4
        assert c["decode_vs_forward_max_abs"] < 1e-4
    for rows in (r_cpu, r_dev):  # the engine served the trainer's weights: a rounding mismatch only
        assert all(0 <= r["mismatch_k3"] < 1e-6 and r["tokens_per_s"] > 0 for r in rows)


def test_on_policy_bench_on_a_second_device(fakedev):
    fakedev(_on_policy_bench_on_both)
