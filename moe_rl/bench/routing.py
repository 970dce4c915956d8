"""``moe-rl bench routing``: train/infer mismatch with routing replay on and off.

An embedded engine in bf16 generates samples (through SGLang's HTTP API, with routed experts);
the fp32 trainer backend recomputes the log-probs of the same tokens twice, replaying the
engine's routing (R3) and letting its own router choose. Reported for each: the k3 KL between
engine and trainer log-probs, the largest probability ratio, and the fraction of (token, MoE
layer) pairs whose expert sets agree.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time

import numpy as np
import torch

from moe_rl.algo import mismatch_metrics
from moe_rl.config import load_config
from moe_rl.engine.client import EngineClient
from moe_rl.engine.server import build_engine, start_server
from moe_rl.replay import RoutingSpec, record_from_responses
from moe_rl.train.backend import MicroBatch, NativeBackend
from moe_rl.replay.match import routing_match


def generate(cfg, prompts: list[list[int]], max_new: int, temperature: float) -> list[dict]:
    """Runs an embedded engine over HTTP in a background loop and returns the responses."""
    loop = asyncio.new_event_loop()
    engine = build_engine(cfg)
    runner, url = loop.run_until_complete(start_server(engine, "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def go():
        async with EngineClient(url) as client:
            return await asyncio.gather(*(
                client.generate(p, {"max_new_tokens": max_new, "temperature": temperature, "sampling_seed": i},
                                return_logprob=True, return_routed_experts=True)
                for i, p in enumerate(prompts)))

    try:
        return asyncio.run(go())
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        engine.stop()


def measure(cfg, n_samples: int, prompt_len: int, max_new: int, seed: int) -> dict:
    arch = cfg.model.arch()
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, arch.vocab_size, size=prompt_len).tolist() for _ in range(n_samples)]
    temperature = cfg.rollout.temperature
    t0 = time.perf_counter()
    responses = generate(cfg, prompts, max_new, temperature)
    gen_s = time.perf_counter() - t0
    spec = RoutingSpec(arch.num_hidden_layers, arch.num_experts_per_tok, arch.num_experts,
                       tuple(arch.mlp_only_layers), arch.decoder_sparse_step, arch.first_k_dense_replace)
    trainer = NativeBackend(cfg)  # fp32: model.dtype of the config
    rows = {}
    for replay in (True, False):
        logp_t, logp_e, matched, total = [], [], 0, 0
        for p, r in zip(prompts, responses):
            out = r["output_ids"]
            if not out:
                continue
            seq = p + out
            rec = torch.from_numpy(record_from_responses([r["meta_info"]], spec, num_tokens=len(seq))).long()
            engine_routing = [rec[:, j, :] for j in range(rec.shape[1])]
            # the last token has no record (its logits score nothing): repeat the row before it
            pad = [torch.cat([e, e[-1:]]) for e in engine_routing]
            labels = torch.full((len(seq),), -100, dtype=torch.long)
            labels[len(p) - 1 : len(seq) - 1] = torch.tensor(out)
            mb = MicroBatch(torch.tensor([seq]), torch.tensor([0, len(seq)]), labels, pad if replay else None)
            used = []
            with torch.no_grad():
                lp, _ = trainer.logprobs(mb, temperature, record=used)
            logp_t.append(lp[len(p) - 1 : len(seq) - 1].cpu())  # compared with the engine's on the host
            logp_e.append(torch.tensor([t[0] for t in r["meta_info"]["output_token_logprobs"]]))
            has = torch.zeros(len(seq), dtype=torch.bool)
            has[: len(seq) - 1] = True
            a, b = routing_match(used, [e.to(trainer.device) for e in pad], has.to(trainer.device))
            matched, total = matched + int(a), total + int(b)
        t, e = torch.cat(logp_t), torch.cat(logp_e)
        mm = mismatch_metrics(t, e, torch.ones_like(t))
        rows["replay" if replay else "no_replay"] = {
            "k3_kl": float(mm["mismatch_k3"]), "max_ratio": float(mm["mismatch_max_ratio"]),
            "routing_match": matched / max(total, 1), "tokens": int(mm["num_tokens"]),
        }
    shape = {k: getattr(arch, k) for k in ("hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_tok")}
    return {"rows": rows, "generate_s": gen_s, "engine_dtype": cfg.engine.dtype, "trainer_dtype": cfg.model.dtype,
            "model": shape}


# Routing shaped like a real MoE (top-8 of 64 experts, as Qwen3-30B-A3B's top-8 of 128), where
# about as many routings flip between bf16 and fp32 as the R3 paper reports (~7-10%); the tiny
# default model (top-2 of 8, hidden 64) flips under 1% and its experts barely differ.
PRESETS = {
    "moe64": ["model.hidden_size=256", "model.intermediate_size=512", "model.num_hidden_layers=4",
              "model.num_experts=64", "model.num_experts_per_tok=8", "model.moe_intermediate_size=128"],
    "config": [],
}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="moe-rl bench routing", description=__doc__)
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="moe64",
                    help="model shape: moe64 (default) or the config's own model")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("overrides", nargs="*", help="config overrides key.sub=value")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    cfg = load_config(a.config, ["engine.dtype=bfloat16", "model.dtype=float32", *PRESETS[a.preset], *a.overrides])
    res = measure(cfg, a.samples, a.prompt_len, a.max_new_tokens, a.seed)
    rr, nr = res["rows"]["replay"], res["rows"]["no_replay"]
    res["summary"] = {
        "kl_replay": rr["k3_kl"], "kl_no_replay": nr["k3_kl"],
        "max_ratio_replay": rr["max_ratio"], "max_ratio_no_replay": nr["max_ratio"],
        "routing_match_replay": rr["routing_match"], "routing_match_no_replay": nr["routing_match"],
        "kl_ratio": rr["k3_kl"] / nr["k3_kl"] if nr["k3_kl"] > 0 else None,
        "device": "cpu",
    }
    if a.json:
        print(json.dumps(res))
    else:
        print(f"engine {cfg.engine.dtype} vs trainer {cfg.model.dtype}, {rr['tokens']} response tokens")
        print(f"{'':12s} {'k3 KL':>12s} {'max ratio':>10s} {'routing match':>14s}")
        for k in ("replay", "no_replay"):
            r = res["rows"][k]
            print(f"{k:12s} {r['k3_kl']:12.3e} {r['max_ratio']:10.4f} {r['routing_match']:14.4%}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
