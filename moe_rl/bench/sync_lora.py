"""``moe-rl bench sync --lora RANK``: full vs adapter-only weight sync, in the same run.

Both go through the same ``WeightSender`` (bucketed broadcast over gloo) to a receiver in a
second process. The adapter-only receiver is the embedded engine's: it serves the adapter in its
forward (unmerged), so its commit writes the adapter tensors and nothing else.

``forward_costs`` measures the price of that choice in the same run: one forward of the set at
a decode-sized and a prefill-sized token count, plain vs with the adapter in the forward, and
what a merge (base + s*B@A for every adapted weight) would cost per sync instead.

Parameter set: Qwen3-30B-A3B's widths (hidden 2048, 128 experts of moe_intermediate 768, 32/4
heads of 128, bf16 on the wire) with fewer layers (``--lora-layers``) and a vocabulary shrunk
in proportion (151,936 x layers / 48), so the shares of experts, attention and embeddings in
the bytes are the real model's. The bytes of the whole 48-layer model are also counted from its
tensor shapes (nothing allocated) for the full-model ratio.
"""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import statistics
import time

import torch

from moe_rl.model import MoEArch, MoEForCausalLM, hf_param_specs, iter_local_hf_tensors

QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8, tie_word_embeddings=False)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "experts.gate_up_proj", "experts.down_proj"]


def bench_arch(layers: int) -> MoEArch:
    vocab = max(1024, round(QWEN3_30B_A3B["vocab_size"] * layers / QWEN3_30B_A3B["num_hidden_layers"]))
    return MoEArch(**{**QWEN3_30B_A3B, "num_hidden_layers": layers, "vocab_size": vocab})


def adapter_numel(arch: MoEArch, rank: int, targets=TARGETS, shared_outer: bool = False) -> int:
    """Elements of the adapters on ``arch`` (same shapes as moe_rl.model.lora), by arithmetic.
    ``shared_outer``: gate_up's A [r, H] and down's B [H, r] once per layer, not per expert."""
    H, hd, E, I = arch.hidden_size, arch.head_dim, arch.num_experts, arch.moe_intermediate_size
    q, kv = arch.num_attention_heads * hd, arch.num_key_value_heads * hd
    per_layer_attn = {"q_proj": rank * (H + q), "k_proj": rank * (H + kv), "v_proj": rank * (H + kv),
                      "o_proj": rank * (q + H)}
    per_moe = {"router": rank * (H + E), "experts.gate_up_proj": (1 if shared_outer else E) * rank * H + E * rank * 2 * I,
               "experts.down_proj": E * rank * I + (1 if shared_outer else E) * rank * H}
    n = 0
    for i in range(arch.num_hidden_layers):
        n += sum(v for t, v in per_layer_attn.items() if t in targets)
        if arch.is_moe_layer(i):
            n += sum(v for t, v in per_moe.items() if t in targets)
    return n


def _receiver(conn, layers: int, rank: int, adapter: bool, shared_outer: bool):
    torch.set_num_threads(1)
    from moe_rl.model.lora import AdapterServing
    from moe_rl.sync import WeightReceiver
    from moe_rl.sync.local import serve_receiver

    model = MoEForCausalLM(bench_arch(layers)).to(torch.bfloat16)
    if not adapter:
        serve_receiver(conn, WeightReceiver(dict(iter_local_hf_tensors(model)), timeout_s=300))
        return
    serving = AdapterServing(model, rank, 2.0 * rank, TARGETS, shared_outer=shared_outer)  # the engine's: in its forward
    serve_receiver(conn, WeightReceiver(serving.named_tensors(), timeout_s=300))


def run_lora(rank: int, layers: int, reps: int, bucket_mb: float, shared_outer: bool = False) -> dict:
    from moe_rl.model.lora import AdapterSource, LoraAdapters
    from moe_rl.sync import WeightSender
    from moe_rl.sync.local import LocalEngine

    arch = bench_arch(layers)
    model = MoEForCausalLM(arch).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.01, 0.01)
    ad = LoraAdapters(model, rank, 2.0 * rank, TARGETS, shared_outer=shared_outer).init_weights(0)
    ctx = mp.get_context("spawn")
    out = {"rank": rank, "targets": TARGETS, "layers": layers, "vocab_size": arch.vocab_size,
           "bucket_mb": bucket_mb, "dtype": "bfloat16", "experts_shared_outer": shared_outer}
    senders, procs, engines = {}, [], []
    try:
        for kind, src in (("full", model), ("adapter", AdapterSource(ad))):
            a, b = ctx.Pipe()
            proc = ctx.Process(target=_receiver, args=(b, layers, rank, kind == "adapter", shared_outer), daemon=True)
            proc.start()
            procs.append(proc)
            b.close()
            engines.append(LocalEngine(a, name=f"bench-{kind}", timeout_s=600))
            s = WeightSender(src, engines=[engines[-1]], bucket_mb=bucket_mb,
                             timeout_s=300, group_name=f"bench-lora-{kind}", use_triton=False, bind_params=False)
            asyncio.run(s.push("warmup"))
            senders[kind] = s
        times = {k: [] for k in senders}
        for r in range(reps):  # each round measures both: a paired ratio cancels the shared machine's drift
            for kind, s in senders.items():
                t0 = time.perf_counter()
                st = asyncio.run(s.push(f"{kind}-{r}"))
                times[kind].append(time.perf_counter() - t0)
                out[f"{kind}_bytes"] = st.bytes
        for kind in senders:
            out[f"{kind}_seconds"] = min(times[kind])
            out[f"{kind}_median_seconds"] = statistics.median(times[kind])
        out["bytes_ratio"] = out["adapter_bytes"] / out["full_bytes"]
        out["speedup_paired"] = statistics.median(f / a for f, a in zip(times["full"], times["adapter"]))
        full48 = MoEArch(**QWEN3_30B_A3B)
        full_numel = sum(_numel(s) for _, s in hf_param_specs(full48))
        out["qwen3_30b_a3b_full_bytes_bf16"] = 2 * full_numel
        out["qwen3_30b_a3b_adapter_bytes_bf16"] = 2 * adapter_numel(full48, rank, TARGETS, shared_outer)
        out["qwen3_30b_a3b_bytes_ratio"] = adapter_numel(full48, rank, TARGETS, shared_outer) / full_numel
        out.update(forward_costs(model, ad))
    finally:
        for s in senders.values():
            s.close()
        for e in engines:
            try:
                e.call("stop")
            except Exception:  # noqa: BLE001 - the process may be gone already
                pass
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return out


def forward_costs(model: MoEForCausalLM, ad, tokens=(32, 512), reps: int = 5, train_tokens: int = 512) -> dict:
    """Median seconds of one forward at each token count without / with the unmerged adapter,
    of computing every merged weight once (what a merging engine pays per sync), and of one
    training forward+backward in each form (weight deltas vs in the forward). Each round times
    the forms back to back, so the paired ratios cancel the shared machine's drift."""
    def timed(fn):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def train_step(ids, form):
        ad.zero_grad(set_to_none=True)
        with form():
            model(ids).float().square().mean().backward()

    def merge():
        with ad.applied():
            pass

    g = torch.Generator().manual_seed(0)
    out, rounds = {}, {}
    for _ in range(reps):
        with torch.no_grad():
            for n in tokens:
                ids = torch.randint(0, model.arch.vocab_size, (1, n), generator=g)
                rounds.setdefault(f"forward_{n}_plain", []).append(timed(lambda: model(ids)))
                with ad.in_forward():
                    rounds.setdefault(f"forward_{n}_lora", []).append(timed(lambda: model(ids)))
            rounds.setdefault("merge", []).append(timed(merge))
        ids = torch.randint(0, model.arch.vocab_size, (1, train_tokens), generator=g)
        rounds.setdefault(f"train_{train_tokens}_merged", []).append(timed(lambda: train_step(ids, ad.applied)))
        rounds.setdefault(f"train_{train_tokens}_in_forward", []).append(timed(lambda: train_step(ids, ad.in_forward)))
    for k, v in rounds.items():
        out[f"{k}_seconds"] = statistics.median(v)
    out["train_tokens"] = train_tokens
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def print_lora(r: dict) -> str:
    form = "shared outer expert factors" if r.get("experts_shared_outer") else "per-expert factors"
    lines = [f"LoRA sync, rank {r['rank']} on {', '.join(r['targets'])} ({form}); Qwen3-30B-A3B widths, {r['layers']} layer(s), "
             f"vocab {r['vocab_size']}, {r['dtype']}, {r['bucket_mb']:.0f} MiB buckets (best of rounds, median)"]
    for kind in ("full", "adapter"):
        lines.append(f"  {kind:<8} {r[f'{kind}_bytes'] / 2**20:10.1f} MiB  {r[f'{kind}_seconds']:.4f} s "
                     f"({r[f'{kind}_median_seconds']:.4f})")
    lines.append(f"  adapter/full bytes {100 * r['bytes_ratio']:.2f}%   full/adapter time (paired median) "
                 f"{r['speedup_paired']:.1f}x (end to end: the engine serves the adapter in its forward)")
    for k in sorted(x for x in r if x.startswith("forward_") and x.endswith("_plain_seconds")):
        n = k.split("_")[1]
        lines.append(f"  forward of {n} tokens (median): {r[k]:.4f} s plain, {r[f'forward_{n}_lora_seconds']:.4f} s with the "
                     f"adapter in the forward")
    lines.append(f"  merging every adapted weight once (a merging engine, per sync): {r['merge_seconds']:.4f} s")
    n = r["train_tokens"]
    lines.append(f"  trainer forward+backward of {n} tokens: {r[f'train_{n}_merged_seconds']:.4f} s as weight deltas, "
                 f"{r[f'train_{n}_in_forward_seconds']:.4f} s in the forward")
    lines.append(f"  whole 48-layer Qwen3-30B-A3B (by shapes): {r['qwen3_30b_a3b_full_bytes_bf16'] / 1e9:.1f} GB full, "
                 f"{r['qwen3_30b_a3b_adapter_bytes_bf16'] / 1e6:.0f} MB adapter = "
                 f"{100 * r['qwen3_30b_a3b_bytes_ratio']:.2f}%")
    return "\n".join(lines)
