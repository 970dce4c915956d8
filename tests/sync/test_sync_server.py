"""WeightSender against the embedded engine server (`moe-rl serve` subprocess) over HTTP:
pause -> buckets -> commit -> weight_version -> continue; outputs then match the new weights."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch

pytest.importorskip("moe_rl.engine.server")

from moe_rl.engine import EngineClient  # noqa: E402
from moe_rl.engine.server import build_model  # noqa: E402
from moe_rl.sync import WeightSender, WeightSyncError  # noqa: E402
from tests.engine.helpers import CFG, ServerProc, check_against_native  # noqa: E402


async def _generate(url, prompt):
    async with EngineClient(url, timeout_s=60) as c:
        out = await c.generate(prompt, {"temperature": 0.0, "max_new_tokens": 6}, return_logprob=True,
                               return_routed_experts=True)
        info = await c.get_model_info(url)
    return out, info


def test_sender_updates_served_model():
    s = ServerProc()
    try:
        new = build_model(CFG).init_weights(seed=31)
        sender = WeightSender(new, engines=[s.url], bucket_mb=0.01, verify=True, timeout_s=30)
        assert len(sender.plan.buckets) > 3
        stats = sender.sync(5)
        assert stats.buckets == len(sender.plan.buckets)
        prompt = [3, 1, 4, 1, 5, 9]
        out, info = asyncio.run(_generate(s.url, prompt))
        assert info["weight_version"] == "5"
        assert out["meta_info"]["weight_version"] == "5"
        check_against_native(new, prompt, out, 0.0)  # bit-exact weights: same log-probs and routing

        # a trainer of another shape: the engine rejects it, names the tensor, keeps version 5
        wrong = build_model(CFG.model_copy(update={"model": CFG.model.model_copy(update={"moe_intermediate_size": 16})}))
        bad = WeightSender(wrong, engines=[s.url], bucket_mb=0.01, timeout_s=30)
        with pytest.raises(WeightSyncError, match=r"shape mismatch for model\.layers\.0\.mlp\.experts\.0\.gate_proj"):
            bad.sync(6)
        out, info = asyncio.run(_generate(s.url, prompt))
        assert info["weight_version"] == "5"
        check_against_native(new, prompt, out, 0.0)
        sender.close(), bad.close()
    finally:
        s.stop()


@pytest.mark.slow  # long: scheduled first (tests/conftest.py); runs in CI
def test_sync_leaves_out_a_dead_or_frozen_engine_and_updates_it_once_it_is_back():
    a, b = ServerProc(), ServerProc()
    port_a = int(a.url.rsplit(":", 1)[1])
    model = build_model(CFG).init_weights(seed=31)
    sender = WeightSender(model, engines=[a.url, b.url], bucket_mb=0.01, timeout_s=30)
    strict = None
    prompt = [3, 1, 4, 1, 5, 9]
    quick = WeightSender(model, engines=[a.url, b.url], bucket_mb=0.01, timeout_s=3, group_name="quick")
    try:
        # b freezes (SIGSTOP: its connections are accepted, nothing answers): the sync that finds
        # it waits out its timeout, the next ones only probe /health, and it is back when it answers
        assert quick.sync(11).skipped == []
        os.kill(b.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        assert quick.sync(12).skipped == [b.url]
        first, t0 = time.monotonic() - t0, time.monotonic()
        assert quick.sync(13).skipped == [b.url]
        probed = time.monotonic() - t0
        assert first < 3 + 3 + 5 and probed < 3 + 3, (first, probed)  # timeout + answer margin; health probe
        os.kill(b.proc.pid, signal.SIGCONT)
        assert quick.sync(14).skipped == []
        assert asyncio.run(_generate(b.url, prompt))[1]["weight_version"] == "14"

        assert sender.sync(1).skipped == []
        a.kill()  # crashed: no answer at all
        stats = sender.sync(2)
        assert stats.skipped == [a.url] and stats.buckets == len(sender.plan.buckets)
        out, info = asyncio.run(_generate(b.url, prompt))
        assert info["weight_version"] == "2"
        check_against_native(model, prompt, out, 0.0)
        strict = WeightSender(model, engines=[a.url, b.url], bucket_mb=0.01, timeout_s=30, skip_down_engines=False)
        with pytest.raises(WeightSyncError, match="pause_generation failed on " + a.url):
            strict.sync(2)

        a = ServerProc(port=port_a)  # restarted at the same address, with its initial weights
        with torch.no_grad():  # a training step
            next(model.parameters()).add_(0.01)
        assert sender.sync(3).skipped == []
        for url in (a.url, b.url):  # both in the new group, both on the trainer's weights
            out, info = asyncio.run(_generate(url, prompt))
            assert info["weight_version"] == "3"
            check_against_native(model, prompt, out, 0.0)
    finally:
        os.kill(b.proc.pid, signal.SIGCONT)
        sender.close(), quick.close()
        if strict is not None:
            strict.close()
        a.stop()
        b.stop()
