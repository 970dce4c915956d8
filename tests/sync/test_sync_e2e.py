"""End-to-end weight sync over gloo: trainer process(es) -> a receiver process.

Bit-identity is checked with a SHA-256 per tensor. The receiver is a process holding a
WeightReceiver over an EP=1 model, driven over a pipe with SGLang's request fields
(moe_rl.sync.local); the sender is the real WeightSender.
"""
from __future__ import annotations


import pytest

from moe_rl.model import MoEForCausalLM
from moe_rl.sync import WeightSender
from tests.distributed import run_distributed
from tests.sync import helpers as H


@pytest.fixture
def receiver():
    """(trainer pipe, control pipe, process) of a receiver whose model has init seed 0."""
    with H.spawn_receiver(0) as r:
        yield r


def expected_hashes(seed: int) -> dict[str, str]:
    return H.model_hashes(MoEForCausalLM(H.arch()).init_weights(seed))


def test_sync_ep1_then_ep2_identical(receiver):
    """EP=1 sync, then an EP=2 sync of other weights (checksums on): identical each time."""
    tr, ctl, _ = receiver
    want1, want2 = expected_hashes(1), expected_hashes(2)
    assert ctl.call("hashes")["result"] != want1
    run_distributed(H.trainer_sync, 1, tr, 1, "1", False, None, timeout=90)
    assert ctl.call("hashes")["result"] == want1
    assert ctl.call("state")["result"]["version"] == "1"
    run_distributed(H.trainer_sync, 2, tr, 2, "2", True, None, timeout=90)
    got = ctl.call("hashes")["result"]
    assert got.keys() == want2.keys()
    assert [n for n in want2 if got[n] != want2[n]] == []
    assert ctl.call("state")["result"]["version"] == "2"


def test_killed_sender_leaves_old_version(receiver):
    """The sender dies after 3 buckets; the receiver reports it and keeps the old weights;
    a fresh sender then re-creates the group and syncs fine."""
    tr, ctl, _ = receiver
    before = ctl.call("hashes")["result"]
    with pytest.raises(AssertionError, match="exit"):
        run_distributed(H.trainer_sync, 1, tr, 1, "v1", False, 3, timeout=60)
    state = ctl.call("state")["result"]
    assert state["version"] is None
    err = state["last_error"]
    assert "aborted after 3 buckets" in err and "is the sender alive?" in err and "parameters unchanged (still the initial weights)" in err, err
    assert ctl.call("hashes")["result"] == before
    # recovery: the control pipe acts as a new trainer's engine connection
    model = MoEForCausalLM(H.arch()).init_weights(1)
    sender = WeightSender(model, engines=[ctl], bucket_mb=H.BUCKET_MB, timeout_s=30)
    sender.sync("v2")
    sender.close()
    assert ctl.call("hashes")["result"] == expected_hashes(1)
    assert ctl.call("state")["result"]["version"] == "v2"


def test_engine_rejection_reaches_every_trainer_rank(receiver):
    """A trainer whose model does not match the engine's (other expert width): the engine
    rejects the bucket naming the tensor, both EP ranks raise, the engine keeps its weights."""
    tr, ctl, _ = receiver
    before = ctl.call("hashes")["result"]
    with pytest.raises(AssertionError) as ei:
        run_distributed(H.trainer_mismatch, 2, tr, timeout=90)
    msg = str(ei.value)
    assert "shape mismatch for model.layers.0.mlp.experts.0.gate_proj.weight" in msg, msg
    assert ctl.call("hashes")["result"] == before


@pytest.fixture
def rebinding_receiver():
    """A receiver whose commits swap storage (the received buckets become its weights)."""
    with H.spawn_receiver(0, rebind=True) as r:
        yield r


def test_zero_copy_commits_stay_identical_and_atomic(rebinding_receiver):
    """Buckets large enough to hold each layer's experts: the engine commits by re-pointing its
    parameters at the received buckets. Three updates in a row (the buckets of one update take
    the next) end bit-identical, and a sender killed mid-update still leaves the last one."""
    tr, ctl, _ = rebinding_receiver
    for i, seed in enumerate((1, 2, 3), start=1):
        sender = WeightSender(MoEForCausalLM(H.arch()).init_weights(seed), engines=[ctl], bucket_mb=1, timeout_s=30)
        sender.sync(f"z{seed}")
        sender.close()
        assert ctl.call("hashes")["result"] == expected_hashes(seed)
        state = ctl.call("state")["result"]
        assert state["version"] == f"z{seed}" and state["zero_copy_commits"] == i
    with pytest.raises(AssertionError, match="exit"):  # a trainer process dies after 3 buckets
        run_distributed(H.trainer_sync, 1, tr, 9, "dead", False, 3, timeout=60)
    assert ctl.call("hashes")["result"] == expected_hashes(3)
    state = ctl.call("state")["result"]
    assert state["version"] == "z3" and "parameters unchanged (still version z3)" in state["last_error"]


GLM = dict(model_type="glm4_moe", mlp_only_layers=[], first_k_dense_replace=1, n_shared_experts=1, n_group=2,
           attention_bias=True)


def _glm_trainer_model(seed):
    import torch

    model = MoEForCausalLM(H.arch(**GLM)).init_weights(seed)
    with torch.no_grad():
        for i in model.moe_layers:
            model.model.layers[i].mlp.gate.e_score_correction_bias.normal_(
                0, 0.1, generator=torch.Generator().manual_seed(seed + i))
    return model


def test_glm_sync_carries_the_correction_bias_through_bound_buffers():
    """GLM: the sender's parameters and correction-bias buffers live in its bucket buffers, the
    engine commits by re-pointing them at its received buckets; after a bias update (in place, in
    the bound storage) the next sync carries the new bias too."""
    import torch

    with H.spawn_receiver(0, arch_kw=GLM, rebind=True) as (_, ctl, _p):
        model = _glm_trainer_model(1)
        sender = WeightSender(model, engines=[ctl], bucket_mb=1, timeout_s=30, bind_params=True)
        assert sender._bound is not None  # the bias is bound with the parameters
        sender.sync("g1")
        assert ctl.call("hashes")["result"] == H.model_hashes(model)
        model.track_expert_load()
        # fixed tokens: an unseeded batch can give every expert the same load, and no update
        model(torch.randint(0, 48, (4, 16), generator=torch.Generator().manual_seed(3))).sum().backward()
        load = model.model.layers[1].mlp.gate.load
        assert not torch.all(load == load.mean()), load
        before = model.model.layers[1].mlp.gate.e_score_correction_bias.clone()
        model.update_expert_bias(0.5)
        assert not torch.equal(model.model.layers[1].mlp.gate.e_score_correction_bias, before)
        sender.sync("g2")
        sender.close()
        assert ctl.call("hashes")["result"] == H.model_hashes(model)
        state = ctl.call("state")["result"]
        assert state["version"] == "g2" and state["zero_copy_commits"] == 2
