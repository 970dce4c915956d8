"""bf16 or fp32 engine, as figures: the trainer/engine agreement that the R3 metrics
report when the embedded engine runs in bf16 (or fp32) and the trainer in fp32.

    python scripts/engine_dtype_mismatch.py [--config configs/gpu_1x.yaml] [--device cuda]
        [--requests 16] [--new-tokens 32] [key=value ...]

The engine samples ``--requests`` completions (temperature 1, 16-token prompts) with its
log-probs and routing record; the fp32 model recomputes the log-probs of those tokens through
the engine's experts (R3 replay), as the trainer does. Printed per engine dtype, one JSON line:
``mismatch_k3`` and the ratio extremes (``moe_rl.algo.mismatch_metrics``), the mean |log-prob
difference|, and ``routing_match`` (``moe_rl.replay.match``: how often the trainer's own router
picks the engine's experts). On a GPU a bf16 engine also replays its decode CUDA graphs.
"""
import argparse
import json
import sys
import threading
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_rl.algo import mismatch_metrics  # noqa: E402
from moe_rl.config import load_config  # noqa: E402
from moe_rl.engine import decode_routed_experts, output_logprobs  # noqa: E402
from moe_rl.engine.protocol import GenerateRequest  # noqa: E402
from moe_rl.engine.server import build_engine, build_model  # noqa: E402
from moe_rl.replay.match import routing_match  # noqa: E402


def sample(cfg, device, n, new_tokens):
    engine = build_engine(cfg, device=device)
    vocab = engine.arch.vocab_size
    prompts = [[(17 * i + 5 * j + 1) % vocab for j in range(16)] for i in range(n)]
    outs, done = {}, threading.Semaphore(0)
    for i, p in enumerate(prompts):
        req = GenerateRequest.parse({"input_ids": p, "return_logprob": True, "return_routed_experts": True,
                                     "sampling_params": {"temperature": 1.0, "max_new_tokens": new_tokens,
                                                         "sampling_seed": i}},
                                    vocab_size=vocab, max_context=engine.max_context)
        engine.submit(req, lambda r, i=i: (outs.__setitem__(i, r), done.release()))
    engine.start()
    for _ in range(n):
        done.acquire()
    engine.stop()
    return prompts, [outs[i] for i in range(n)], engine.cuda_graph


def compare(trainer, prompts, outs):
    arch = trainer.arch
    L, K, dev = arch.num_hidden_layers, arch.num_experts_per_tok, next(trainer.parameters()).device
    p_all, b_all, used, eng = [], [], [], []
    for prompt, out in zip(prompts, outs):
        ids = out["output_ids"]
        seq = torch.tensor([prompt + ids], device=dev)
        rows = decode_routed_experts(out, L, K)  # [seqlen - 1, L, K]: the last token was not forwarded
        rows = np.concatenate([rows, rows[-1:]])
        replay = [torch.from_numpy(rows[:, layer].astype(np.int64)).to(dev) for layer in trainer.moe_layers]
        own: list[torch.Tensor] = []
        with torch.no_grad():
            lp = torch.log_softmax(trainer(seq, replay=replay)[0].float(), dim=-1)
            trainer(seq, record=own)
        P = len(prompt)
        p_all.append(lp[P - 1 : P - 1 + len(ids)].gather(1, torch.tensor(ids, device=dev)[:, None]).squeeze(1).cpu())
        b_all.append(torch.tensor(output_logprobs(out["meta_info"])))
        used.append([o[:-1].cpu() for o in own])
        eng.append([torch.from_numpy(rows[:-1, layer].astype(np.int64)) for layer in trainer.moe_layers])
    p, b = torch.cat(p_all).double(), torch.cat(b_all).double()
    out = {k: v.item() for k, v in mismatch_metrics(p, b, torch.ones_like(p)).items()}
    match, total = routing_match([torch.cat(x) for x in zip(*used)], [torch.cat(x) for x in zip(*eng)],
                                 torch.ones(sum(len(u[0]) for u in used), dtype=torch.bool))
    out.update(mean_abs_logp_diff=float((p - b).abs().mean()), routing_match=float(match) / float(total))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--config", default="configs/gpu_1x.yaml")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    a = ap.parse_args()
    # the trainer's device (model.dtype, fp32) and the engine's are the --device here
    base = [*a.overrides, f"train.device={a.device}", "placement.gpus=null", f"engine.max_running_requests={a.requests}"]
    trainer = build_model(load_config(a.config, base + ["engine.dtype=float32"])).float().to(a.device).eval()
    for dtype in a.dtypes.split(","):
        cfg = load_config(a.config, base + [f"engine.dtype={dtype}"])
        prompts, outs, graphs = sample(cfg, a.device, a.requests, a.new_tokens)
        print(json.dumps({"engine_dtype": dtype, "device": a.device, "cuda_graph": graphs,
                          **compare(trainer, prompts, outs)}), flush=True)


if __name__ == "__main__":
    main()
