"""(a) moe-rl's sender against SGLang's own weight-sync receiving code, over gloo: one server
with two TP ranks (``standin.SGLangStandIn``), several syncs; every tensor each TP rank
received must equal the trainer's, bit for bit."""
from __future__ import annotations

import asyncio

import pytest
import torch

from .conftest import require_sglang  # noqa: E402

require_sglang("sglang.srt.utils.common")

from moe_rl.engine.server import build_model  # noqa: E402
from moe_rl.model import iter_local_hf_tensors  # noqa: E402
from moe_rl.sync import WeightSender  # noqa: E402
from tests.engine.helpers import CFG  # noqa: E402

from .standin import SGLangStandIn  # noqa: E402


@pytest.fixture(scope="module")
def engine():
    e = SGLangStandIn(tp_size=2)
    yield e
    e.close()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_sender_meets_sglang_init_custom_process_group_with_two_tp_ranks(engine):
    model = build_model(CFG).init_weights(seed=3)
    sender = WeightSender(model, engines=[engine], bucket_mb=0.02, timeout_s=60)
    try:
        assert len(sender.plan.buckets) > 2
        for version in (1, 2, 3):
            with torch.no_grad():  # a training step: every tensor changes
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.01)
            stats = asyncio.run(sender.update_engines(version))
            assert stats.buckets == len(sender.plan.buckets)
            want = {n: t.detach().clone() for n, t in iter_local_hf_tensors(model)}
            for tp, got in enumerate(engine.received()):
                assert got.keys() == want.keys(), f"TP rank {tp}: {set(want) ^ set(got)}"
                for n, t in want.items():
                    assert got[n].dtype == t.dtype and got[n].shape == t.shape, n
                    assert torch.equal(_bits(got[n]), _bits(t)), f"TP rank {tp}: {n} differs after sync {version}"
        assert sender.engines[0].num_ranks == 2  # learnt from server_info: the group had 1 + 2 ranks
        init = [b for k, b in engine.requests if k == "init"]
        assert [(b["rank_offset"], b["world_size"]) for b in init] == [(1, 3)]
        kinds = [k for k, _ in engine.requests]
        # every sync: begin, the buckets, end; the flush rides on the last bucket (abort pause)
        assert kinds.count("begin") == kinds.count("end") == 3
        first = kinds.index("begin")
        assert kinds[first + 1] == "update" and kinds[first + len(sender.plan.buckets) + 1] == "end"
        flushes = [b["flush_cache"] for k, b in engine.requests if k == "update"]
        n = len(sender.plan.buckets)
        assert flushes == ([False] * (n - 1) + [True]) * 3
    finally:
        sender.close()


def test_group_is_destroyed_before_it_is_formed_again(engine):
    """The skip-down-engine recovery re-forms the group under the same name: SGLang refuses
    that unless /destroy_weights_update_group came first. (The first sync here also meets the
    group the previous test's sender left on the engine.)"""
    engine.requests.clear()
    model = build_model(CFG).init_weights(seed=5)
    sender = WeightSender(model, engines=[engine], bucket_mb=0.05, timeout_s=60)
    try:
        asyncio.run(sender.update_engines(1))
        sender._close_group()  # as after a failed sync: the next one forms the group again
        asyncio.run(sender.update_engines(2))
        kinds = [k for k, _ in engine.requests]
        assert kinds.count("init") == 2 and kinds.count("destroy") == 2
        assert kinds.index("destroy") < kinds.index("init") and kinds.index("destroy", kinds.index("init")) < len(kinds)
        want = dict(iter_local_hf_tensors(model))
        for got in engine.received():
            assert all(torch.equal(_bits(got[n]), _bits(t)) for n, t in want.items())
    finally:
        sender.close()


def test_verify_is_refused_and_in_place_never_flushes_against_sglang(engine):
    """SGLang drops the ``checksum`` field, so a verified sync against it would check nothing:
    the sender refuses to start one. With in_place (or retract) pauses requests keep running,
    and SGLang fails an update that must flush then: no bucket asks for a flush."""
    from moe_rl.sync.receiver import WeightSyncError

    model = build_model(CFG).init_weights(seed=7)
    sender = WeightSender(model, engines=[engine], bucket_mb=0.05, timeout_s=60, verify=True)
    try:
        with pytest.raises(WeightSyncError, match="sync.verify"):
            asyncio.run(sender.update_engines(1))
    finally:
        sender.close()
    engine.requests.clear()
    sender = WeightSender(model, engines=[engine], bucket_mb=0.05, timeout_s=60, pause_mode="in_place")
    try:
        asyncio.run(sender.update_engines(2))
        flushes = [b["flush_cache"] for k, b in engine.requests if k == "update"]
        assert flushes and not any(flushes)
        want = dict(iter_local_hf_tensors(model))
        for got in engine.received():
            assert all(torch.equal(_bits(got[n]), _bits(t)) for n, t in want.items())
    finally:
        sender.close()
