"""true_on_policy: at staleness 0 the trainer's log-probs of the sampled tokens are the embedded
engine's bit for bit, over a real training step (R3 replay, then a weight sync and a second
batch), so the step reads mismatch_k3 == 0 and a ratio of exactly 1.0, for each family and
trainer path; and without the key the same comparison differs (the metric stays live)."""
import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_distributed
from tests.train.on_policy import (DSV3, GLM, LORA, QWEN, behaviour, config, engine_for, rollout, sync, trainer,
                                   trainer_logprobs)

CASES = {
    "softmax": QWEN,  # qwen3_moe: softmax router, a dense layer between MoE ones
    "sigmoid_shared": GLM,  # glm4_moe: biased sigmoid router, group-limited top-k, shared experts
    "mla": DSV3,  # deepseek_v3: latent attention (absorbed in the engine and, under the key, the trainer)
    "lora_adapter": [*QWEN, *LORA],  # adapters trained, only they synced (the base frozen)
    "fused_loss": [*QWEN, "train.fused_loss=true"],  # the fused LM-head loss's config
    "fused_logprobs": [*QWEN, "train.fused_loss=false", "train.minibatches=2"],  # log-probs, then the loss
    "bf16": [*QWEN, "model.dtype=bfloat16", "engine.dtype=bfloat16"],  # both sides in bfloat16 (fp32 accumulation)
}


def _two_steps(cfg, tmp_path):
    """Two training steps on the engine's batches, a weight sync between: per step (metrics,
    the trainer's log-probs before the step, the engine's)."""
    engine = engine_for(cfg)
    t = trainer(cfg, tmp_path / "routing")
    try:
        out = []
        for step in range(2):
            batch = rollout(engine, t, seed=step)
            mine = trainer_logprobs(t, batch)
            metrics = t.train_step(batch)
            out.append((metrics, mine, behaviour(batch)))
            sync(t, engine)
        return out
    finally:
        engine.stop()


@pytest.mark.parametrize("case", list(CASES))
def test_trainer_equals_engine(case, tmp_path):
    steps = _two_steps(config(*CASES[case]), tmp_path)
    for metrics, mine, engine in steps:
        assert torch.equal(mine, engine)
        assert metrics["mismatch_k3"] == 0.0 and metrics["mismatch_max_ratio"] == 1.0
        assert metrics["routing_match"] == 1.0
    assert not torch.equal(steps[0][2], steps[1][2][: steps[0][2].numel()])  # the sync changed the policy


@pytest.mark.parametrize("case", ["softmax", "mla", "bf16"])
def test_without_the_key_the_comparison_differs(case, tmp_path):
    bound = 1e-3 if case == "bf16" else 1e-6  # the small mismatch of torch's ops, still measured
    for metrics, mine, engine in _two_steps(config(*CASES[case], exact=False), tmp_path):
        assert not torch.equal(mine, engine)
        assert 0.0 < metrics["mismatch_k3"] < bound


def test_exact_minibatches_skip_the_proximal_forward(tmp_path, monkeypatch):
    """Minibatches after the first take the engine's log-probs as the proximal ones (no
    forward); the same step without the shortcut (its proximal forward taken) trains to the
    same weights, bit for bit."""
    cfg = config(*QWEN, "train.minibatches=3", "algo.ratio_anchor=proximal")
    engine = engine_for(cfg)
    try:
        a, b = trainer(cfg, tmp_path / "a"), trainer(cfg, tmp_path / "b")
        batch = rollout(engine, a)
        rollout(engine, b)  # b's replay log (the same batch: a seeded, batch-invariant engine)
    finally:
        engine.stop()
    calls = []
    monkeypatch.setattr(type(a), "_proximal", lambda self, prep: calls.append(1) or [])
    skipped = a.train_step(batch)
    assert calls == [] and skipped["proximal_forwards_skipped"] == 2
    monkeypatch.undo()
    b.exact_rollouts = False  # the proximal forward taken, as without the shortcut
    taken = b.train_step(batch)
    assert taken["proximal_forwards_skipped"] == 0
    for (name, p), q in zip(a.backend.model.named_parameters(), b.backend.model.parameters()):
        assert torch.equal(p, q), name
    assert taken["mismatch_k3"] == skipped["mismatch_k3"] == 0.0


def _ep_worker(rank, world, tmp, exact):
    from moe_rl.dist import build_groups
    from moe_rl.model import local_hf_tensor

    cfg = config(*QWEN, "engine.kind=sglang", "engine.urls=[http://unused]", "pools.trainer=2", "pools.rollout=0",
                 "train.ep_size=2", exact=exact)
    cfg_engine = config(*QWEN, exact=exact)  # every rank its own engine (EP=1), the same seeded batch
    t = trainer(cfg, f"{tmp}/routing{rank}", groups=build_groups(cfg))
    t.exact_rollouts = exact  # the trainer's shortcut reads engine.kind; these engines are embedded
    engine = engine_for(cfg_engine)
    try:
        for step in range(2 if exact else 1):  # without the key one step shows the mismatch
            batch = rollout(engine, t, seed=step)
            mine = trainer_logprobs(t, batch)
            metrics = t.train_step(batch)
            same = torch.equal(mine, behaviour(batch, rank, world))
            if exact:
                assert same and metrics["mismatch_k3"] == 0.0 and metrics["mismatch_max_ratio"] == 1.0
            else:
                assert not same and metrics["mismatch_k3"] > 0.0
            # the weights back to this rank's engine: its own experts, the other rank's gathered
            local = {n: w.detach().clone() for n, w in t.backend.hf_tensors()}
            every = [None] * world
            dist.all_gather_object(every, local)
            with torch.no_grad(), engine.model_lock:
                for part in every:
                    for name, w in part.items():
                        local_hf_tensor(engine.model, name).copy_(w)
            t.version += 1
    finally:
        engine.stop()


@pytest.mark.slow  # two gloo ranks, each with an engine: 20-30 s on 2 idle cores
@pytest.mark.parametrize("exact", [True, False])
def test_expert_parallel_trainer_equals_engine(tmp_path, exact):
    """EP=2: each trainer rank computes half the experts, all-to-all moves rows only, the combine
    sums the slots in slot order on the token's own rank: the EP=1 engine's bits."""
    run_distributed(_ep_worker, 2, str(tmp_path), exact, timeout=240)


@pytest.mark.parametrize("overrides, words", [
    (["train.backend=megatron"], "train.backend=native"),
    (["engine.dtype=bfloat16"], "engine.dtype=bfloat16 and model.dtype=float32 differ"),
    (["model.dtype=float16", "engine.dtype=float16"], "float32 or bfloat16"),
    (["train.compile=true"], "train.compile"),
    ([*LORA[:-2], "lora.sync=merged"], "lora.sync=adapter"),
])
def test_the_key_refuses_what_has_no_exact_path(overrides, words):
    from moe_rl.config import ConfigError

    with pytest.raises((ConfigError, ValueError), match="true_on_policy") as err:
        config(*QWEN, *overrides)
    assert words in str(err.value)
    config(*QWEN, *overrides, exact=False)  # valid without the key
