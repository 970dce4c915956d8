"""`moe-rl serve` never answers success to an update it did not apply: SGLang's per-tensor form
(no load_format) is applied as such; an unknown load_format, a bucket whose dtypes do not match
the model, and an update missing tensors are refused with a clear error, the sender's broadcast
does not hang, and the old weights stay."""
from __future__ import annotations

import asyncio
import time

import torch

from moe_rl.engine import EngineClient, EngineHTTPError
from moe_rl.engine.server import build_model
from moe_rl.model import iter_local_hf_tensors
from moe_rl.sync.group import SyncGroup, free_port
from tests.engine.helpers import CFG, ServerProc, check_against_native, run


async def _post(c, body):
    try:
        return 200, await c.request("POST", "/update_weights_from_distributed", payload=body)
    except EngineHTTPError as e:
        return e.status, e.body


def test_serve_applies_per_tensor_updates_and_refuses_what_it_cannot_apply():
    s = ServerProc()
    old = build_model(CFG)  # what the server starts with (same seed)
    new = build_model(CFG).init_weights(seed=99)
    tensors = list(iter_local_hf_tensors(new))
    prompt = [3, 1, 4, 1, 5]

    async def main():
        async with EngineClient(s.url, timeout_s=60) as c:
            async def group(name):
                port = free_port()
                reply, g = await asyncio.gather(
                    c.init_weights_update_group(s.url, "127.0.0.1", port, rank_offset=1, world_size=2,
                                                group_name=name, backend="gloo"),
                    asyncio.to_thread(SyncGroup, "127.0.0.1", port, 0, 2, name, "gloo", 30))
                assert reply["success"], reply
                return g

            results = {}
            # 1. unknown load_format: refused, and the engine leaves the group so the broadcast
            # fails now instead of after the 30 s timeout
            g = await group("g1")
            t0 = time.monotonic()
            body = {"names": ["x"], "dtypes": ["float32"], "shapes": [[4]], "group_name": "g1", "load_format": "bogus",
                    "weight_version": "9"}
            send = asyncio.to_thread(lambda: g.wait_work(g.broadcast(torch.ones(4), 0)))
            reply, sent = await asyncio.gather(_post(c, body), send, return_exceptions=True)
            results["bogus"] = (reply, sent, time.monotonic() - t0)
            g.close()

            # 2. a bucket of two dtypes whose tensors the model holds in float32: received (no
            # hang), then refused naming the tensor
            g = await group("g2")
            (n0, t0_), (n1, t1_) = tensors[0], tensors[1]
            raw = torch.cat([t0_.detach().float().reshape(-1).view(torch.uint8),
                             t1_.detach().to(torch.bfloat16).reshape(-1).view(torch.uint8)])
            body = {"names": [n0, n1], "dtypes": ["float32", "bfloat16"], "shapes": [list(t0_.shape), list(t1_.shape)],
                    "group_name": "g2", "load_format": "flattened_bucket", "weight_version": "9"}
            send = asyncio.to_thread(lambda: g.wait_work(g.broadcast(raw, 0)))
            results["mixed"] = await asyncio.gather(_post(c, body), send, return_exceptions=True)

            # 3. a partial update inside a session: the end is refused, nothing applied
            await c.request("POST", "/begin_weight_update", payload={})
            half = tensors[: len(tensors) // 2]
            body = {"names": [n for n, _ in half], "dtypes": ["float32"] * len(half),
                    "shapes": [list(t.shape) for _, t in half], "group_name": "g2", "weight_version": "9"}
            send = asyncio.to_thread(lambda: [g.wait_work(w) for w in [g.broadcast(t.detach().float().contiguous().reshape(-1), 0) for _, t in half]])
            results["half"] = await asyncio.gather(_post(c, body), send, return_exceptions=True)
            try:
                await c.request("POST", "/end_weight_update", payload={})
                results["end"] = (200, None)
            except EngineHTTPError as e:
                results["end"] = (e.status, e.body)
            results["version_after_refusals"] = (await c.get_model_info())["weight_version"]
            out_old = await c.generate(prompt, {"temperature": 0.0, "max_new_tokens": 5}, return_routed_experts=True)

            # 4. SGLang's per-tensor form (no load_format): one broadcast per tensor, applied
            await c.request("POST", "/begin_weight_update", payload={})
            body = {"names": [n for n, _ in tensors], "dtypes": ["float32"] * len(tensors),
                    "shapes": [list(t.shape) for _, t in tensors], "group_name": "g2", "weight_version": "10"}
            send = asyncio.to_thread(lambda: [g.wait_work(w) for w in [g.broadcast(t.detach().float().contiguous().reshape(-1), 0) for _, t in tensors]])
            results["per_tensor"] = await asyncio.gather(_post(c, body), send)
            results["end2"] = await c.request("POST", "/end_weight_update", payload={})
            results["version_after"] = (await c.get_model_info())["weight_version"]
            out_new = await c.generate(prompt, {"temperature": 0.0, "max_new_tokens": 5}, return_routed_experts=True)
            g.close()
            return results, out_old, out_new

    try:
        results, out_old, out_new = run(main())
    finally:
        s.stop()
    (code, body), sent, secs = results["bogus"]
    assert code == 400 and "load_format 'bogus' is not supported" in body["message"], body
    assert isinstance(sent, BaseException) and secs < 25, (sent, secs)  # failed at once, not at the timeout
    (code, body), sent = results["mixed"]
    assert code == 400 and "dtype mismatch" in body["message"] and sent is None, (body, sent)
    (code, body), sent = results["half"]
    assert code == 200 and sent is not None  # staged; the session's end tells
    code, body = results["end"]
    assert code == 400 and "incomplete" in body["message"], body
    assert results["version_after_refusals"] == "0"
    check_against_native(old, prompt, out_old, 0.0)  # the old weights, untouched
    (code, body), _ = results["per_tensor"]
    assert code == 200 and results["end2"]["success"] and results["version_after"] == "10", results
    check_against_native(new, prompt, out_new, 0.0)  # the new weights, exactly


def test_eos_ends_a_sequence_unless_ignore_eos(tmp_path):
    """As SGLang: the model's EOS (config.json / generation_config.json) stops a request
    without being listed in stop_token_ids; ignore_eos turns that off."""
    import json

    from moe_rl.engine.protocol import GenerateRequest
    from moe_rl.engine.text import model_eos_ids

    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    eos = model_eos_ids(str(tmp_path))
    assert eos == {7, 9} and model_eos_ids(None) == frozenset()
    limits = dict(vocab_size=64, max_context=256, eos_token_ids=eos)
    r = GenerateRequest.parse({"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [3]}}, **limits)
    assert r.sampling_params.stop_token_ids == {3, 7, 9}
    r = GenerateRequest.parse({"input_ids": [1, 2], "sampling_params": {"ignore_eos": True}}, **limits)
    assert r.sampling_params.stop_token_ids == frozenset()
