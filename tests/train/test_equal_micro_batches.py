"""Micro-batches padded to equal lengths over an EP group (train/loop.py ``shard_micro_batches``,
``make_micro_batches(pad_to=...)``), what megatron's allgather dispatcher needs: the padding is
one filler sequence after the real ones, and everything the loss, the metrics and the replayed
routing read about the real rows is the unpadded micro-batch's. The distributed check (two gloo
ranks through megatron's dispatcher) is tests/megatron/test_gptmodel_cpu.py's EP=2 test."""
import numpy as np
import pytest
import torch

from moe_rl.model.arch import MoEArch
from moe_rl.replay import ReplayLog
from moe_rl.train.loop import make_micro_batches, shard_micro_batches, stale_rows

ARCH = MoEArch(vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2)


def _samples(log_dir, spec):
    """(prompt length, response length, has a routing record) per sample; records in a ReplayLog."""
    g = torch.Generator().manual_seed(0)
    L, k, E = len(ARCH.moe_layers), ARCH.num_experts_per_tok, ARCH.num_experts
    writer = ReplayLog(log_dir, L, k, E)
    out = []
    for i, (p, r, rec) in enumerate(spec):
        if rec:
            ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range((p + r - 1) * L)]).reshape(p + r - 1, L, k)
            writer.append(f"s{i}", ids, [1])
        out.append(dict(uid=f"s{i}", prompt_ids=torch.randint(1, 32, (p,), generator=g).tolist(),
                        response_ids=torch.randint(1, 32, (r,), generator=g).tolist(), behaviour_logprobs=[-0.5] * r,
                        advantage=float(i), has_routing=rec))
    writer.flush()
    return out, ReplayLog(log_dir, mode="r")


def test_padding_leaves_the_real_rows_as_they_were(tmp_path):
    samples, reader = _samples(tmp_path / "routing", [(3, 4, True), (2, 5, False), (4, 2, True)])
    plain, padded = make_micro_batches(samples, 3, 2, ARCH, reader), make_micro_batches(samples, 3, 2, ARCH, reader, [25, 6])
    (a, dummy), (b, pdummy) = plain, padded
    T = a.mb.num_tokens
    assert (T, b.mb.num_tokens, pdummy.mb.num_tokens) == (20, 25, 6)
    # the filler is marked (MicroBatch.padding): the expert load leaves it out (tests/megatron/test_glm_cpu.py)
    assert (a.mb.padding, b.mb.padding, dummy.mb.padding, pdummy.mb.padding) == (0, 5, dummy.mb.num_tokens, 6)
    assert torch.equal(b.mb.input_ids[:, :T], a.mb.input_ids) and not b.mb.input_ids[:, T:].any()
    assert b.mb.cu_seqlens.tolist() == a.mb.cu_seqlens.tolist() + [25]  # its own sequence: attended by none
    assert (b.mb.labels[T:] == -100).all() and torch.equal(b.mb.labels[:T], a.mb.labels)
    for f in ("resp_pos", "behav", "adv", "mask", "seq_ids"):
        assert torch.equal(getattr(b, f), getattr(a, f)), f
    assert torch.equal(b.routing[:, :T], a.routing) and b.routing.shape[1] == 25
    assert torch.equal(b.has_rec[:T], a.has_rec) and not b.has_rec[T:].any()  # no engine routing is matched there
    fresh = [True, False, True]
    assert stale_rows(fresh, b.mb.cu_seqlens)[T:].all()  # routed by the trainer under a mixed minibatch
    assert pdummy.chunk == [] and pdummy.mb.cu_seqlens.tolist() == [0, 6] and (pdummy.mb.labels == -100).all()
    with pytest.raises(ValueError, match="micro-batch 0 holds 20 tokens, more than pad_to=19"):
        make_micro_batches(samples, 3, 2, ARCH, reader, [19, 6])


def test_shards_pad_to_the_longest_of_the_group(tmp_path):
    spec = [(3, 4, True), (2, 1, True), (5, 6, True), (2, 2, True), (1, 3, True), (4, 4, True), (2, 7, True)]
    samples, reader = _samples(tmp_path / "routing", spec)
    world, mbs = 4, 1  # ranks 0-1 and 2-3 are EP groups; 7 samples: rank 3 ends with a dummy
    plain = [[mc.mb.num_tokens for mc in make_micro_batches(samples[r::world], mbs, 2, ARCH, reader)] for r in range(world)]
    assert plain == [[7, 4], [3, 8], [11, 9], [4, 2]]
    for group in ([0, 1], [2, 3]):
        want = np.max([plain[r] for r in group], axis=0).tolist()
        for r in group:
            got = shard_micro_batches(samples, r, world, mbs, ARCH, reader, group)
            assert [mc.mb.num_tokens for mc in got] == want
    # no group (the native backend, or megatron's alltoall dispatcher): as packed
    assert [mc.mb.num_tokens for mc in shard_micro_batches(samples, 1, world, mbs, ARCH, reader)] == plain[1]


def test_a_token_bucket_rounds_every_micro_batch_up(tmp_path):
    """train.token_bucket (train.cuda_graphs: each distinct length is a recording): every packed
    row a multiple of the bucket, over the EP group's equal lengths too; the real rows unchanged."""
    spec = [(3, 4, True), (2, 1, True), (5, 6, True), (2, 2, True), (1, 3, True), (4, 4, True), (2, 7, True)]
    samples, reader = _samples(tmp_path / "routing", spec)
    world, mbs = 4, 1
    plain = [[mc.mb.num_tokens for mc in make_micro_batches(samples[r::world], mbs, 2, ARCH, reader)] for r in range(world)]
    got = shard_micro_batches(samples, 1, world, mbs, ARCH, reader, bucket=8)
    assert [mc.mb.num_tokens for mc in got] == [8, 8] and plain[1] == [3, 8]
    assert [mc.mb.padding for mc in got] == [5, 0]
    equal = shard_micro_batches(samples, 2, world, mbs, ARCH, reader, [2, 3], bucket=8)
    assert [mc.mb.num_tokens for mc in equal] == [16, 16]  # the group's longest (11, 9), rounded up
    a = make_micro_batches(samples[1::world], mbs, 2, ARCH, reader)[0]
    assert torch.equal(got[0].mb.labels[:3], a.mb.labels) and (got[0].mb.labels[3:] == -100).all()


def test_cuda_graphs_pad_to_1024_unless_told_and_need_the_compiled_blocks_on_a_gpu():
    from moe_rl.config import ExperimentConfig

    base = dict(engine=dict(kind="sglang", urls=["http://127.0.0.1:1"]), pools=dict(trainer=1, rollout=0))
    cfg = ExperimentConfig.model_validate(dict(base, train=dict(device="cuda", cuda_graphs=True)))
    assert cfg.train.micro_batch_bucket == 1024
    cfg = ExperimentConfig.model_validate(dict(base, train=dict(device="cuda", cuda_graphs=True, token_bucket=256)))
    assert cfg.train.micro_batch_bucket == 256
    assert ExperimentConfig.model_validate(base).train.micro_batch_bucket == 0
    for train, why in ((dict(device="cpu"), "train.device=cpu"), (dict(device="cuda", compile=False), "train.compile=false"),
                       (dict(device="cuda", backend="megatron"), "train.backend=megatron")):
        with pytest.raises(ValueError, match=f"train.cuda_graphs=true replays .* and {why} here"):
            ExperimentConfig.model_validate(dict(base, train=dict(train, cuda_graphs=True)))


@pytest.mark.parametrize("fused", ["auto", "false"])
def test_a_dummy_runs_the_forwards_of_a_real_micro_batch(fused):
    """A rank left with a dummy micro-batch runs the model forwards a real one runs, in the same
    order (the frozen policy's for the KL term included): under expert parallelism each forward
    is a sequence of collectives that the other ranks of the EP group run at the same time."""
    from moe_rl.config import load_config
    from moe_rl.dist import Groups, Layout
    from moe_rl.model.transformer import MoEForCausalLM
    from moe_rl.train.loop import Trainer
    from tests.train.test_minibatches import TINY, _batch

    cfg = load_config(None, [*TINY, "algo.kl_coef=0.1", f"train.fused_loss={fused}"])
    trainer = Trainer(cfg, Groups(layout=Layout(1, [0], [], 1), rank=0, role="trainer"))
    assert trainer.ref is not None and trainer.fused_loss is (fused == "auto")
    calls = []
    for name, backend in (("policy", trainer.backend), ("frozen", trainer.ref)):
        forward = backend.hidden_states
        backend.hidden_states = lambda mb, record=None, f=forward, n=name: calls.append(n) or f(mb, record)
    init = MoEForCausalLM(cfg.model.arch()).init_weights(cfg.model.init_seed, std=cfg.model.init_std)
    prep = trainer._prepare(_batch(init, cfg.rollout.temperature, n=2))
    dummy = dict(prep, micro=make_micro_batches([], cfg.train.micro_batch_size, 1, trainer.arch, None))
    order = []
    for p in (prep, dummy):
        calls.clear()
        trainer._accumulate(p, None, torch.zeros(11, dtype=torch.float64), torch.zeros(1, dtype=torch.float64))
        order.append(list(calls))
    assert order[0] == (["frozen", "policy"] if fused == "auto" else ["policy", "frozen"])
    assert order[1] == order[0]


def test_a_token_bucket_leaves_the_trainers_steps_as_they_were():
    """The real Trainer.train_step, two steps of two minibatches of single-sample micro-batches,
    with train.token_bucket=32 and without: the same metrics and the same weights."""
    import tempfile

    from moe_rl.config import load_config
    from tests.train.test_device_discipline import TINY, _assert_same_steps, _batch, _rotated_steps, _trainer

    step = [*TINY, "train.minibatches=2", "train.micro_batch_size=1"]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        batch = _batch(load_config(None, step), tmp)
        for bucket in (0, 32):
            trainer = _trainer(load_config(None, [*step, f"train.token_bucket={bucket}"]), None, tmp)
            results[bucket] = _rotated_steps(trainer, batch)
    _assert_same_steps(results[32], results[0], metric_abs=1e-7)


def test_cuda_graphs_keep_every_gradient_in_a_buffer_of_its_own():
    """train.cuda_graphs: a .grad first made inside a graphed backward would be overwritten by the
    graph's next replay (gradient accumulation over micro-batches), so every trainable parameter
    has its gradient buffer before the first backward, and a step zeroes it instead of freeing
    it. (Built here on the CPU: the config is validated for CUDA, then placed on the CPU.)"""
    from moe_rl.config import load_config
    from moe_rl.train.backend import NativeBackend

    for graphs in (True, False):
        cfg = load_config(None, [*TINY_CFG, "train.device=cuda", "train.compile=true", f"train.cuda_graphs={graphs}"])
        object.__setattr__(cfg.train, "device", "cpu")
        b = NativeBackend(cfg)
        params = b.dense_params + b.expert_params
        assert b.stable_grads is graphs
        assert all((p.grad is not None and not p.grad.any()) if graphs else p.grad is None for p in params)
        before = [p.grad for p in params]
        for p in params:
            p.grad.add_(1.0) if graphs else None
        b.optimizer_step()
        assert all((p.grad is g and not g.any()) if graphs else p.grad is None for p, g in zip(params, before))


TINY_CFG = ["model.vocab_size=32", "model.hidden_size=16", "model.intermediate_size=32", "model.moe_intermediate_size=8",
            "model.num_hidden_layers=2", "model.num_attention_heads=2", "model.num_key_value_heads=1", "model.head_dim=8",
            "model.num_experts=4", "model.num_experts_per_tok=2"]
