"""lora.sync=adapter against SGLang (moe_rl.sync.adapter_files): the adapter files are read by
SGLang's own code (its LoRAConfig, its weight-name -> layer / target-module / expert mapping and
its gate/up stacking), the endpoint bodies are SGLang's request types, and the whole swap runs
over HTTP against a `moe-rl serve` engine, whose log-probs are checked against the native model
with the adapter merged by hand."""
from __future__ import annotations

import ast
import re

import pytest
import torch

from moe_rl.config import ExperimentConfig
from moe_rl.engine import EngineClient, EngineHTTPError
from moe_rl.engine.server import build_model
from moe_rl.model.lora import LoraAdapters, LoraError, load_peft, read_peft, save_peft
from moe_rl.sync.adapter_files import AdapterFileSync

from ..engine.helpers import CFG, ServerProc, check_against_native, run
from ..engine.test_lora_serving import merged_model
from .conftest import check_request, require_sglang, sglang_source

LoRAConfig = require_sglang("sglang.srt.lora.lora_config").LoRAConfig
get_layer_id = require_sglang("sglang.srt.layers.utils.common").get_layer_id

TARGETS = ["q_proj", "v_proj", "experts.gate_up_proj", "experts.down_proj"]
LORA = ["lora.enabled=true", "lora.sync=adapter", "lora.rank=4", "lora.alpha=8",
        "lora.targets=[q_proj,v_proj,experts.gate_up_proj,experts.down_proj]"]


def sglang_functions(relpath: str, names: list[str], cls: str | None = None) -> dict:
    """SGLang's own functions (or ``cls``'s methods), compiled from the installed source: their
    modules import GPU-only code at the top, the functions themselves need only torch/typing."""
    tree = ast.parse(sglang_source(relpath).read_text())
    body = tree.body
    if cls is not None:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls).body
    found = [n for n in body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert sorted(f.name for f in found) == sorted(names), f"SGLang {relpath} lacks {names}"
    import typing
    ns = {"torch": torch, "re": re, **{k: getattr(typing, k) for k in typing.__all__}}
    exec(compile(ast.Module(body=found, type_ignores=[]), relpath, "exec"), ns)
    return {n: ns[n] for n in names}


def adapters(seed, rank=4):
    ad = LoraAdapters(build_model(CFG), rank, 2.0 * rank, TARGETS).init_weights(seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for b in ad.B.values():
            b.copy_(torch.randn(b.shape, generator=g) * 0.2)
    return ad


def adapter_dir(tmp_path):
    ad = adapters(1)
    return ad, save_peft(ad, tmp_path / "a", layout="per_expert")


def test_sglang_reads_our_adapter_files(tmp_path):
    ad, path = adapter_dir(tmp_path)
    cfg = LoRAConfig(str(path))  # SGLang's reader of adapter_config.json
    assert (cfg.r, cfg.lora_alpha) == (4, 8.0)
    f = sglang_functions("srt/lora/utils.py", ["get_normalized_target_modules", "get_target_module_name"])
    targets = f["get_normalized_target_modules"](cfg.target_modules)
    assert targets == {"qkv_proj", "gate_up_proj", "down_proj"}
    norm = sglang_functions("srt/lora/lora.py", ["normalize_qkv_proj", "normalize_gate_up_proj"], cls="LoRAAdapter")
    _, sd = read_peft(path)
    per_layer: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in sd.items():  # LoRAAdapter._process_weight: by get_layer_id
        per_layer.setdefault(get_layer_id(name), {})[name] = t
    assert sorted(per_layer) == list(range(CFG.model.num_hidden_layers))
    for layer, w in per_layer.items():  # LoRAAdapter._normalize_weights, then the memory pool's lookup
        norm["normalize_qkv_proj"](None, list(w), w)
        norm["normalize_gate_up_proj"](None, list(w), w)
        for name in w:
            assert int(name.split("layers.")[1].split(".")[0]) == layer
            module = f["get_target_module_name"](name, targets)
            m = re.search(r"experts\.(\d+)\.", name)  # mem_pool.py's expert-id match
            assert (m is not None) == (module != "qkv_proj"), name
    # per expert, SGLang's stacked gate_up is our shared-A adapter: A twice, B = [gate; up]
    moe = [i for i, l in enumerate(ad.model.model.layers) if l.is_moe][0]
    w = per_layer[moe]
    key = f"model.layers.{moe}.mlp.experts.gate_up_proj".replace(".", "__")
    A, B = ad.A[key], ad.B[key]
    for e in (0, A.shape[0] - 1):
        pre = f"base_model.model.model.layers.{moe}.mlp.experts.{e}.gate_up_proj"
        torch.testing.assert_close(w[pre + ".lora_A.weight"], torch.cat([A[e], A[e]]), atol=0, rtol=0)
        torch.testing.assert_close(w[pre + ".lora_B.weight"], B[e], atol=0, rtol=0)
    # and its stacked qkv: B rows q, k (zero: no k_proj adapter), v
    qkv = w[f"base_model.model.model.layers.{moe}.self_attn.qkv_proj.lora_B.weight"]
    q_b = ad.B[f"model.layers.{moe}.self_attn.q_proj".replace(".", "__")]
    torch.testing.assert_close(qkv[: q_b.shape[0]], q_b, atol=0, rtol=0)


def test_sglang_reads_our_shared_outer_files(tmp_path):
    """SGLang's shared-outer MoE LoRA form (lora.experts_shared_outer): its code maps every key,
    detects the form, stacks gate/up as its memory pool expects, and the function it computes
    (gate = B[:I] A[:r], up = B[I:] A[r:2r] per expert, down = B_shared A_e) is our adapter."""
    ad = LoraAdapters(build_model(CFG), 4, 8.0, TARGETS, shared_outer=True).init_weights(1)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for b in ad.B.values():
            b.copy_(torch.randn(b.shape, generator=g) * 0.2)
    path = save_peft(ad, tmp_path / "so", layout="shared_outer")
    cfg = LoRAConfig(str(path))
    f = sglang_functions("srt/lora/utils.py", ["get_normalized_target_modules", "get_target_module_name"])
    targets = f["get_normalized_target_modules"](cfg.target_modules)
    assert targets == {"qkv_proj", "gate_up_proj", "down_proj"}
    norm = sglang_functions("srt/lora/lora.py", ["normalize_qkv_proj", "normalize_gate_up_proj"], cls="LoRAAdapter")
    detect = sglang_functions("srt/lora/lora_manager.py", ["_detect_shared_outer_loras"], cls="LoRAManager")
    _, sd = read_peft(path)
    per_layer: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in sd.items():
        per_layer.setdefault(get_layer_id(name), {})[name] = t
    for w in per_layer.values():
        norm["normalize_qkv_proj"](None, list(w), w)
        norm["normalize_gate_up_proj"](None, list(w), w)
        for name, t in w.items():
            module = f["get_target_module_name"](name, targets)
            # mem_pool.py: no expert index, a 3-D tensor under "experts" -> the shared-outer branch
            assert re.search(r"experts\.(\d+)\.", name) is None
            assert ("experts" in name and t.dim() == 3) == (module != "qkv_proj"), name
    from types import SimpleNamespace
    fake = SimpleNamespace(loras={"a": SimpleNamespace(layers=[SimpleNamespace(weights=w) for w in per_layer.values()])})
    assert detect["_detect_shared_outer_loras"](fake) is True
    # the function SGLang's kernels compute from these tensors, merged by hand, expert by expert
    m = build_model(CFG)
    m.load_state_dict(ad.model.state_dict())
    s_ = ad.scaling
    with torch.no_grad():
        for layer, w in per_layer.items():
            pre = f"base_model.model.model.layers.{layer}."
            for x in ("q", "v"):
                name = pre + f"self_attn.{x}_proj"
                if name + ".lora_A.weight" in sd:
                    m.get_submodule(name[len("base_model.model."):]).weight += s_ * sd[name + ".lora_B.weight"] @ sd[name + ".lora_A.weight"]
            if pre + "mlp.experts.gate_up_proj.lora_A.weight" not in w:
                continue
            ex = m.model.layers[layer].mlp.experts
            A2, Bgu = w[pre + "mlp.experts.gate_up_proj.lora_A.weight"], w[pre + "mlp.experts.gate_up_proj.lora_B.weight"]
            Ad, Bd = w[pre + "mlp.experts.down_proj.lora_A.weight"], w[pre + "mlp.experts.down_proj.lora_B.weight"]
            r, I = ad.rank, ex.gate_proj.shape[1]
            assert A2.shape[0] == 1 and A2.shape[1] == 2 * r and Bd.shape[0] == 1  # shared: expert dim 1
            for e in range(ex.gate_proj.shape[0]):
                ex.gate_proj[e] += s_ * Bgu[e][:I] @ A2[0][:r]
                ex.up_proj[e] += s_ * Bgu[e][I:] @ A2[0][r:]
                ex.down_proj[e] += s_ * Bd[0] @ Ad[e]
    ids = torch.randint(0, CFG.model.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), ad.applied():
        torch.testing.assert_close(m(ids), ad.model(ids), atol=1e-6, rtol=0)
    # round trip, and per-expert adapters refuse the form by name
    back = LoraAdapters(build_model(CFG), 4, 8.0, TARGETS, shared_outer=True)
    load_peft(back, path)
    for (n, x), (_, y) in zip(ad.named_parameters(), back.named_parameters()):
        assert torch.equal(x, y), n
    with pytest.raises(LoraError, match="experts_shared_outer"):
        load_peft(LoraAdapters(build_model(CFG), 4, 8.0, TARGETS), path)


def test_endpoint_bodies_are_sglang_requests():
    check_request("LoadLoRAAdapterReqInput", {"lora_name": "moe-rl-v1", "lora_path": "/x"})
    check_request("UnloadLoRAAdapterReqInput", {"lora_name": "moe-rl-v1"})
    check_request("UpdateWeightVersionReqInput", {"new_version": "1", "abort_all_requests": False})
    check_request("GenerateReqInput", {"input_ids": [1], "sampling_params": {}, "return_logprob": True,
                                        "lora_path": "moe-rl-v1"})


@pytest.mark.parametrize("bad,match", [
    (["lora.targets=[router,q_proj]"], "router"),
    (["train.ep_size=2", "pools.trainer=2"], "ep_size"),
    (["rollout.partial_rollout=in_place"], "partial_rollout"),
    (["lora.targets=[k_proj,v_proj]"], "q_proj"),
])
def test_config_refuses_what_sglang_cannot_serve(bad, match):
    base = {"engine": {"kind": "sglang", "urls": ["http://127.0.0.1:1"]}, "pools": {"rollout": 0},
            "lora": {"enabled": True, "sync": "adapter"}}
    ExperimentConfig(**base)  # the default targets pass
    for kv in bad:
        k, v = kv.split("=")
        sec, key = k.split(".")
        base.setdefault(sec, {})[key] = v.strip("[]").split(",") if v.startswith("[") else v
    with pytest.raises(ValueError, match=match):
        ExperimentConfig(**base)


def test_versioned_swap_over_http(tmp_path):
    """Two syncs through the endpoints: each loads a new name, the rollouts name it, the old
    one is unloaded; a failing load leaves the engine on the previous adapter."""
    s = ServerProc(LORA)
    ad = adapters(1)
    ad_keep = {n: t.detach().clone() for n, t in ad.hf_tensors()}
    prompt, greedy = [3, 1, 4, 1, 5], {"temperature": 0.0, "max_new_tokens": 6}
    sync = AdapterFileSync(ad, [s.url], tmp_path / "sync", timeout_s=60)

    async def main():
        out = {}
        async with EngineClient(s.url, timeout_s=60) as c:
            out["v1"] = await sync.sync_async(1)
            c.lora_path = sync.lora_name
            out["gen1"] = await c.generate(prompt, greedy, return_routed_experts=True)
            with torch.no_grad():
                for b in ad.B.values():
                    b.mul_(-1.0)
            await sync.sync_async(2)
            c.lora_path = sync.lora_name
            out["gen2"] = await c.generate(prompt, greedy, return_routed_experts=True)
            out["batch"] = await c.generate_batch([prompt, prompt], [greedy, greedy])
            c.lora_path = "moe-rl-v1"  # the client names its adapter on every request: the old one is gone
            with pytest.raises(EngineHTTPError, match="not loaded"):
                await c.generate_batch([prompt], [greedy])
            c.lora_path = sync.lora_name
            out["dirs"] = sorted(p.name for p in (tmp_path / "sync").iterdir())
            sync.adapters = adapters(3, rank=2)  # the engine refuses it (its lora config has rank 4)
            with pytest.raises(Exception, match="r=2"):
                await sync.sync_async(3)
            out["name_after_fail"] = sync.lora_name
            out["gen_after_fail"] = await c.generate(prompt, greedy)
        return out

    try:
        out = run(main())
    finally:
        s.stop()
    assert out["dirs"] == ["moe-rl-v2"]  # v1 unloaded and deleted
    assert out["gen2"]["meta_info"]["weight_version"] == "2"
    check_against_native(merged_model(ad), prompt, out["gen2"], 0.0)
    assert [r["output_ids"] for r in out["batch"]] == [out["gen2"]["output_ids"]] * 2
    with torch.no_grad():
        for n, t in ad.hf_tensors():
            t.copy_(ad_keep[n])
    check_against_native(merged_model(ad), prompt, out["gen1"], 0.0)
    assert out["name_after_fail"] == "moe-rl-v2"
    assert out["gen_after_fail"]["output_ids"] == out["gen2"]["output_ids"]
