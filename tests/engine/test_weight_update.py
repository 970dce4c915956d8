"""Weight update through the distributed group: /init_weights_update_group +
/update_weights_from_distributed on a `moe-rl serve` subprocess, with this test as rank 0."""
from __future__ import annotations

import asyncio
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("moe_rl.sync.receiver", reason="moe_rl.sync.receiver is not importable")

from moe_rl.engine import EngineClient, EngineHTTPError, output_logprobs, token_weight_versions  # noqa: E402
from moe_rl.model import iter_local_hf_tensors  # noqa: E402
from moe_rl.sync.group import SyncGroup, free_port  # noqa: E402

from moe_rl.config import load_config  # noqa: E402
from moe_rl.engine.server import build_model  # noqa: E402

from .helpers import CFG, ROOT, ServerProc, start_long, check_against_native, recompute, run  # noqa: E402


async def _push(c, url, group, group_name, tensors, version, n_buckets=2):
    """Sends ``tensors`` [(name, tensor)] as flattened fp32 buckets; returns the engine replies."""
    replies = []
    for b in range(n_buckets):
        part = tensors[b::n_buckets]
        flat = torch.cat([t.detach().reshape(-1).float() for _, t in part])
        post = c.update_weights_from_distributed(
            url, [n for n, _ in part], ["float32"] * len(part), [list(t.shape) for _, t in part],
            group_name=group_name, weight_version=version)
        send = asyncio.to_thread(lambda: group.wait_work(group.broadcast(flat, 0)))
        reply, _ = await asyncio.gather(post, send)
        replies.append(reply)
        if b < n_buckets - 1:
            assert (await c.get_model_info(url))["weight_version"] != version  # not committed yet
    return replies


def test_weight_update_changes_outputs_and_version():
    s = ServerProc()
    old_model = build_model(CFG)
    new_model = build_model(CFG).init_weights(seed=4242)
    tensors = list(iter_local_hf_tensors(new_model))
    prompt = [4, 8, 15, 16, 23, 42]

    async def main():
        async with EngineClient(s.url, timeout_s=60) as c:
            port = free_port()
            reply, group = await asyncio.gather(
                c.init_weights_update_group(s.url, "127.0.0.1", port, rank_offset=1, world_size=2,
                                            group_name="wtest", backend="gloo"),
                asyncio.to_thread(SyncGroup, "127.0.0.1", port, 0, 2, "wtest", "gloo", 60))
            assert reply["success"], reply

            # an in-flight request paused in place spans the update
            tasks = await start_long(c, [prompt], n=150, return_logprob=True)
            await c.pause_generation("in_place")
            replies = await _push(c, s.url, group, "wtest", tensors, "1")
            assert all(r["success"] for r in replies), replies
            assert (await c.get_model_info())["weight_version"] == "1"
            await c.continue_generation()
            spanning = await tasks[0]

            after = await c.generate(prompt, {"temperature": 0.0, "max_new_tokens": 12}, return_routed_experts=True)
            group.close()
            return spanning, after

    try:
        spanning, after = run(main())
    finally:
        s.stop()
    versions = token_weight_versions(spanning["meta_info"])
    k = versions.index("1")
    assert 0 < k and versions == ["0"] * k + ["1"] * (150 - k)
    assert spanning["meta_info"]["weight_versions"] == [
        {"version": "0", "start": 0, "end": k}, {"version": "1", "start": k, "end": 150}]
    assert spanning["meta_info"]["weight_version"] == "1"
    assert after["meta_info"]["weight_version"] == "1"
    check_against_native(new_model, prompt, after, 0.0)  # the engine now runs the new weights
    old_lp, _ = recompute(old_model, prompt, after["output_ids"], 1.0)
    assert np.max(np.abs(np.array(old_lp) - output_logprobs(after["meta_info"]))) > 1e-3


def test_sender_death_keeps_previous_weights():
    s = ServerProc()
    port = free_port()
    dying_sender = (
        "import os, time\n"
        "from moe_rl.sync.group import SyncGroup\n"
        f"g = SyncGroup('127.0.0.1', {port}, 0, 2, 'wfail', 'gloo', 30)\n"
        "time.sleep(0.5)\n"
        "os._exit(0)\n"
    )

    async def main():
        async with EngineClient(s.url, timeout_s=60) as c:
            before = await c.generate([1, 2, 3], {"temperature": 0.0, "max_new_tokens": 8}, return_logprob=True)
            proc = subprocess.Popen([sys.executable, "-c", dying_sender], cwd=ROOT)
            reply = await c.init_weights_update_group(s.url, "127.0.0.1", port, 1, 2, group_name="wfail", backend="gloo")
            assert reply["success"]
            await asyncio.to_thread(proc.wait, 30)
            t = dict(iter_local_hf_tensors(build_model(CFG)))
            name = next(iter(t))
            with pytest.raises(EngineHTTPError) as e:
                await c.update_weights_from_distributed(s.url, [name], ["float32"], [list(t[name].shape)],
                                                        group_name="wfail", weight_version="9")
            assert e.value.status == 400 and e.value.body["success"] is False
            assert "weight_version 0" in e.value.body["message"]
            info = await c.get_model_info()
            assert info["weight_version"] == "0" and info["last_weight_update_error"]
            again = await c.generate([1, 2, 3], {"temperature": 0.0, "max_new_tokens": 8}, return_logprob=True)
            return before, again

    try:
        before, again = run(main())
    finally:
        s.stop()
    assert again["output_ids"] == before["output_ids"]
    assert again["meta_info"]["weight_version"] == "0"
    np.testing.assert_allclose(output_logprobs(again["meta_info"]), output_logprobs(before["meta_info"]), atol=1e-6)


def test_weight_sender_drives_the_server_over_http():
    """moe_rl.sync's WeightSender pushes a whole model in several buckets through
    EngineClient handles; an in-flight request is aborted by the sender's pause (SGLang's default)."""
    from moe_rl.sync.sender import WeightSender

    s = ServerProc()
    new_model = build_model(CFG).init_weights(seed=77)
    prompt = [2, 4, 6, 8]

    async def main():
        async with EngineClient(s.url, timeout_s=60) as c:
            sender = WeightSender(new_model, engines=[c.engine(s.url)], bucket_mb=0.05, timeout_s=30)
            try:
                tasks = await start_long(c, [prompt], n=900)
                stats = await sender.sync_async("3")
                partial = await tasks[0]
                after = await c.generate(prompt, {"temperature": 0.0, "max_new_tokens": 10}, return_routed_experts=True)
                info = await c.get_model_info()
            finally:
                sender.close()
            return stats, partial, after, info

    try:
        stats, partial, after, info = run(main())
    finally:
        s.stop()
    assert stats.buckets > 1
    assert partial["meta_info"]["finish_reason"]["type"] == "abort" and partial["meta_info"]["weight_version"] == "0"
    assert info["weight_version"] == "3" and info["paused"] is None
    assert after["meta_info"]["weight_version"] == "3"
    check_against_native(new_model, prompt, after, 0.0)


def test_update_weights_from_disk(tmp_path):
    """SGLang's /update_weights_from_disk: a request in flight goes on with the new weights
    (its tokens tagged with the new version), later ones run them; a missing checkpoint or one
    of another model is a 400 and the engine keeps its weights."""
    from moe_rl.model import save_hf

    from .helpers import InProcessServer

    new_model = build_model(CFG).init_weights(seed=4242)
    save_hf(new_model, tmp_path / "new")
    other = load_config(str(ROOT / "configs" / "tiny.yaml"), ["model.num_hidden_layers=2"])
    save_hf(build_model(other), tmp_path / "other_arch")
    (tmp_path / "empty").mkdir()
    prompt = [4, 8, 15, 16, 23, 42]
    greedy = {"temperature": 0.0, "max_new_tokens": 12}
    s = InProcessServer()

    async def main():
        async with EngineClient(s.url, timeout_s=60) as c:
            before = await c.generate(prompt, greedy)
            refused = []
            for bad in ("empty", "other_arch", "missing"):
                with pytest.raises(EngineHTTPError) as e:
                    await c.request("POST", "/update_weights_from_disk", payload={"model_path": str(tmp_path / bad),
                                                                                  "weight_version": "9"})
                refused.append(e.value)
            unchanged = await c.generate(prompt, greedy)
            tasks = await start_long(c, [prompt], n=150, return_logprob=True)
            reply = await c.request("POST", "/update_weights_from_disk",
                                    payload={"model_path": str(tmp_path / "new"), "weight_version": "7"})
            spanning = await tasks[0]
            after = await c.generate(prompt, greedy, return_routed_experts=True)
            tasks = await start_long(c, [prompt], n=900)
            await c.request("POST", "/update_weights_from_disk", payload={
                "model_path": str(tmp_path / "new"), "weight_version": "8", "abort_all_requests": True})
            aborted = await tasks[0]
            return before, refused, unchanged, reply, spanning, after, aborted, await c.get_model_info()

    try:
        before, refused, unchanged, reply, spanning, after, aborted, info = run(main())
    finally:
        s.stop()
    for e in refused:
        assert e.status == 400 and e.body["success"] is False and "keeps serving weight_version 0" in e.body["message"]
    assert unchanged["output_ids"] == before["output_ids"]
    assert output_logprobs(unchanged["meta_info"]) == output_logprobs(before["meta_info"])
    assert reply == {"success": True, "message": "Succeeded to update model weights. Weight version updated to 7.",
                     "num_paused_requests": 0}
    versions = token_weight_versions(spanning["meta_info"])
    k = versions.index("7")
    assert 0 < k and versions == ["0"] * k + ["7"] * (150 - k)
    assert after["meta_info"]["weight_version"] == "7"
    check_against_native(new_model, prompt, after, 0.0)
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert aborted["meta_info"]["finish_reason"]["message"] == "Aborted for a weight update"
    assert info["weight_version"] == "8" and info["model_path"] == str(tmp_path / "new")
