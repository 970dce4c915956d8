"""LoRA serving on a `moe-rl serve` subprocess: an adapter-only weight sync through the
bucketed path, then SGLang's /load_lora_adapter, lora_path on /generate, /unload_lora_adapter.
The engine's log-probs and routing are checked against the native model with the adapter
merged by hand (independent of the engine's merge)."""
from __future__ import annotations

import aiohttp
import pytest
import torch

from moe_rl.engine import EngineClient, EngineHTTPError
from moe_rl.engine.server import build_model
from moe_rl.model import iter_local_hf_tensors, local_hf_tensor
from moe_rl.model.lora import AdapterSource, LoraAdapters, save_peft
from moe_rl.sync.sender import WeightSender

from .helpers import CFG, ServerProc, check_against_native, run

TARGETS = ["q_proj", "v_proj", "router", "experts.gate_up_proj", "experts.down_proj"]
LORA = ["lora.enabled=true", "lora.sync=adapter", "lora.rank=4", "lora.alpha=8",
        "lora.targets=[q_proj,v_proj,router,experts.gate_up_proj,experts.down_proj]"]


def adapters(seed):
    model = build_model(CFG)  # the engine's initial weights (same config and seed)
    ad = LoraAdapters(model, 4, 8.0, TARGETS).init_weights(seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for b in ad.B.values():
            b.copy_(torch.randn(b.shape, generator=g) * 0.2)
    return model, ad


def merged_model(ad):
    with torch.no_grad(), ad.applied():
        merged = {n: t.clone() for n, t in iter_local_hf_tensors(ad.model)}
    m = build_model(CFG)
    with torch.no_grad():
        for n, t in merged.items():
            local_hf_tensor(m, n).copy_(t)
    return m


def test_adapter_sync_and_sglang_lora_endpoints(tmp_path):
    s = ServerProc(LORA)
    model, ad = adapters(1)
    _, other = adapters(2)
    save_peft(other, tmp_path / "other")
    prompt = [3, 1, 4, 1, 5]
    greedy = {"temperature": 0.0, "max_new_tokens": 8}

    async def main():
        async with EngineClient(s.url, timeout_s=60) as c:
            sender = WeightSender(AdapterSource(ad), engines=[c.engine(s.url)], bucket_mb=0.01, timeout_s=30)
            try:
                base = await c.generate(prompt, greedy, return_routed_experts=True)
                stats = await sender.sync_async("1")
                synced = await c.generate(prompt, greedy, return_routed_experts=True)
            finally:
                sender.close()
            async with aiohttp.ClientSession() as http:
                r = await http.post(s.url + "/load_lora_adapter", json={"lora_name": "other", "lora_path": str(tmp_path / "other")})
                loaded = (r.status, await r.json())
                named = await c.generate(prompt, greedy, return_routed_experts=True, lora_path="other")
                with pytest.raises(EngineHTTPError, match="not loaded"):
                    await c.generate(prompt, greedy, lora_path="missing")
                r = await http.post(s.url + "/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "none")})
                bad = (r.status, await r.json())
                r = await http.post(s.url + "/unload_lora_adapter", json={"lora_name": "other"})
                unloaded = r.status
                after = await c.generate(prompt, greedy, return_routed_experts=True)
        return base, stats, synced, loaded, named, bad, unloaded, after

    try:
        base, stats, synced, loaded, named, bad, unloaded, after = run(main())
    finally:
        s.stop()
    adapter_bytes = sum(t.numel() * t.element_size() for _, t in ad.hf_tensors())
    assert stats.bytes == adapter_bytes  # only the adapters went over the wire
    assert adapter_bytes < 0.5 * sum(p.numel() * 4 for p in model.parameters())
    check_against_native(model, prompt, base, 0.0)
    check_against_native(merged_model(ad), prompt, synced, 0.0)
    assert synced["meta_info"]["weight_version"] == "1"
    assert loaded[0] == 200 and loaded[1]["success"], loaded
    check_against_native(merged_model(other), prompt, named, 0.0)
    assert bad[0] == 400 and "adapter_config.json" in bad[1]["error_message"]
    assert unloaded == 200
    check_against_native(model, prompt, after, 0.0)
