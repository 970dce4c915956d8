"""The embedded rollout engine: continuous batching over the native MoE model with a KV cache.

One background thread runs the model. Each step forwards, in ONE call of
``model.forward_tokens``, the whole prompt of every newly admitted request (prefill) and the
last sampled token of every running request (decode); embeddings, projections, norms, routers
and experts see all of those tokens at once. Attention reads a slot-based KV cache
(``[slots, kv_heads, max_context, head_dim]`` per layer): decode rows of all requests go
through one padded, masked SDPA call; each prefill segment gets its own causal call.

Requests come from any thread (the aiohttp loop) through ``submit``; results go back through
``asyncio`` futures. Torch releases the GIL during the forward, so the event loop stays
responsive while the engine computes.

Pause modes (SGLang's): ``abort`` finishes every in-flight request with an ``abort`` finish
reason and its partial output; ``retract`` frees their KV cache and requeues them (recomputed
by a prefill of prompt + output after ``continue``); ``in_place`` keeps them with their KV
cache. Requests that arrive while paused wait for ``continue``. Weight commits run between
steps under ``model_lock``; every output token is tagged with the version that produced it.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from . import protocol as P
from .protocol import GenerateRequest, RequestError

log = logging.getLogger(__name__)


@dataclass
class _Req:
    req: GenerateRequest
    rid: str
    generator: torch.Generator
    deliver: Callable[[dict], None]  # final response (called from any thread)
    on_update: Callable[[dict], None] | None = None  # streaming snapshots
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    routing: list[np.ndarray] = field(default_factory=list)  # int32 [tokens, layers, k] chunks
    routing_len: int = 0
    # SGLang's input log-probs (filled by the first prefill; a retract's re-prefill keeps them)
    input_logprobs: list | None = None  # [None, lp, ...] for input_ids[start:]
    input_top: list | None = None  # [None, [(lp, id), ...top-k], ...]
    output_top: list = field(default_factory=list)  # per output token: [(lp, id), ...top-k]
    slot: int = -1
    kv_len: int = 0  # tokens whose K/V are in the cache
    abort_msg: str | None = None  # set while the request is inside a step
    done: bool = False
    retractions: int = 0
    created: float = field(default_factory=time.monotonic)

    @property
    def params(self) -> P.SamplingParams:
        return self.req.sampling_params


class _StepAttention:
    """The ``attend`` backend of one engine step (see the module docstring)."""

    def __init__(self, k_cache, v_cache, segments, dec_rows, dec_slots, dec_pos, lmax: int):
        """``dec_*``: the decode rows' token rows, cache slots and positions, already on the
        cache's device; ``lmax``: 1 + their largest position (known on the host: no sync)."""
        self.k_cache, self.v_cache = k_cache, v_cache
        self.prefill = [s for s in segments if not (s[2] == 1 and s[1] > 0)]
        self.dec_rows, self.dec_slots, self.dec_pos, self.lmax = dec_rows, dec_slots, dec_pos, lmax
        if lmax:
            ar = torch.arange(lmax, device=dec_pos.device)
            self.dec_mask = (ar[None, :] <= dec_pos[:, None])[:, None, None, :]  # [B,1,1,L]

    def __call__(self, layer, q, k, v):
        kc, vc = self.k_cache[layer], self.v_cache[layer]
        out = torch.empty_like(q)
        for slot, start, n, off in self.prefill:
            kc[slot, :, start : start + n] = k[off : off + n].transpose(0, 1)
            vc[slot, :, start : start + n] = v[off : off + n].transpose(0, 1)
            qs = q[off : off + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            ks = kc[slot : slot + 1, :, : start + n]
            vs = vc[slot : slot + 1, :, : start + n]
            if start == 0:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            else:
                qpos = torch.arange(start, start + n, device=q.device)
                mask = qpos[:, None] >= torch.arange(start + n, device=q.device)[None, :]
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
            out[off : off + n] = o.squeeze(0).transpose(0, 1)
        if self.dec_rows.numel():
            rows, slots, pos = self.dec_rows, self.dec_slots, self.dec_pos
            kc[slots, :, pos] = k[rows]
            vc[slots, :, pos] = v[rows]
            ks = kc[:, :, : self.lmax].index_select(0, slots)  # [B, Hkv, L, D]
            vs = vc[:, :, : self.lmax].index_select(0, slots)
            o = F.scaled_dot_product_attention(q[rows].unsqueeze(2), ks, vs, attn_mask=self.dec_mask, enable_gqa=True)
            out[rows] = o.squeeze(2)
        return out


def apply_penalties(logits: torch.Tensor, params: list[P.SamplingParams], outputs: list[list[int]]) -> None:
    """SGLang's penaltylib on ``logits`` [R, V] (fp32, one row per request) in place, from each
    request's output tokens so far: ``frequency_penalty`` * count and ``presence_penalty`` once
    per generated token, ``-inf`` on ``min_new_tokens_ids`` while fewer than ``min_new_tokens``
    tokens are out (the additive ones, summed first as SGLang's overlap scheduler does), then
    ``repetition_penalty`` on generated tokens (logit * p when negative, / p otherwise).
    Prompt tokens are not penalized (SGLang feeds its penalizers the output tokens only)."""
    R, V = logits.shape
    dev = logits.device

    def padded(lists):  # ragged id lists -> [R, n] padded with V (a scratch column)
        n = max(map(len, lists), default=0)
        return torch.tensor([x + [V] * (n - len(x)) for x in lists], dtype=torch.long).view(R, n).to(dev)

    def column(values):
        return torch.tensor(values, dtype=torch.float32).to(dev)[:, None]

    out = padded([list(o) for o in outputs])
    counts = torch.zeros(R, V + 1, dtype=torch.float32, device=dev).scatter_add_(
        1, out, torch.ones(out.shape, dtype=torch.float32, device=dev))[:, :V]
    seen = counts > 0
    additive = counts * -column([p.frequency_penalty for p in params])
    additive -= seen * column([p.presence_penalty for p in params])
    masked = [sorted(p.min_new_tokens_ids) if len(o) < p.min_new_tokens else [] for p, o in zip(params, outputs)]
    if any(masked):
        stop = torch.zeros(R, V + 1, dtype=torch.float32, device=dev).scatter_(1, padded(masked), float("-inf"))
        additive += stop[:, :V]
    logits.add_(additive)
    scale = torch.where(seen, column([p.repetition_penalty for p in params]), 1.0)
    logits.copy_(torch.where(logits < 0, logits * scale, logits / scale))


class Engine:
    """Continuous-batching generation over ``model`` (a ``MoEForCausalLM``, EP=1)."""

    def __init__(
        self,
        model,
        *,
        max_running_requests: int = 64,
        max_context: int = 512,
        weight_version: str = "0",
        threads: int | None = None,
        model_path: str | None = None,
    ):
        self.model = model.eval()
        self.arch = model.arch
        self.model_path = model_path
        self.max_running = max_running_requests
        self.max_context = min(max_context, self.arch.max_position_embeddings)
        self.threads = threads
        self.weight_version = str(weight_version)
        self.num_layers = self.arch.num_hidden_layers
        self.top_k = self.arch.num_experts_per_tok
        self.moe_layers = list(model.moe_layers)
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        shape = (self.max_running, self.arch.num_key_value_heads, self.max_context, self.arch.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]

        self.cond = threading.Condition()  # guards all request state below
        self.model_lock = threading.Lock()  # held by a forward and by a weight commit
        self.waiting: collections.deque[_Req] = collections.deque()
        self.running: list[_Req] = []
        self.by_rid: dict[str, _Req] = {}
        self.free_slots = list(range(self.max_running - 1, -1, -1))
        self.paused: str | None = None
        self.in_step = False
        self._stop = False
        self.error: str | None = None  # engine thread crashed
        self.last_update_error: str | None = None
        self.stats = collections.Counter()
        # the tokenizer's decode (set by the server when model.path has one): stop strings
        self.decode: Callable[[list[int]], str] | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle -----------------------------------------------------------------------
    def start(self) -> "Engine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="moe-rl-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # --- requests ------------------------------------------------------------------------
    def submit(self, req: GenerateRequest, deliver: Callable[[dict], None], on_update=None) -> str:
        rid = req.rid if req.rid is not None else uuid.uuid4().hex
        seed = req.sampling_params.sampling_seed
        gen = torch.Generator(device="cpu")
        gen.manual_seed(seed if seed is not None else int.from_bytes(uuid.uuid4().bytes[:7], "little"))
        r = _Req(req=req, rid=rid, generator=gen, deliver=deliver, on_update=on_update)
        with self.cond:
            if self.error is not None:
                raise RuntimeError(f"engine is not running: {self.error}")
            if rid in self.by_rid:
                raise RequestError("rid", f"a request with rid {rid!r} is already in flight")
            self.by_rid[rid] = r
            self.waiting.append(r)
            self.stats["submitted"] += 1
            self.cond.notify_all()
        return rid

    async def generate(self, req: GenerateRequest) -> dict:
        """Submits from an asyncio loop and waits; cancelling the wait aborts the request."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def deliver(result):
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(result))

        rid = self.submit(req, deliver)
        try:
            return await fut
        except asyncio.CancelledError:
            self.abort(rid, "client disconnected")
            raise

    def abort(self, rid: str | None = None, message: str = "Aborted by /abort_request", *, abort_all: bool = False) -> int:
        """Finishes requests with an abort reason and their partial outputs. Returns how many."""
        with self.cond:
            targets = list(self.by_rid.values()) if abort_all else [self.by_rid[rid]] if rid in self.by_rid else []
            for r in targets:
                self._abort_locked(r, message)
            self.cond.notify_all()
            return len(targets)

    def _abort_locked(self, r: _Req, message: str) -> None:
        if r.done:
            return
        if self.in_step and r in self.running:
            r.abort_msg = message  # the engine thread finishes it after the step
        else:
            self._finish_locked(r, P.finish_abort(message))

    # --- pause / continue / weights ------------------------------------------------------
    def pause(self, mode: str = "abort") -> None:
        """Blocks until no step is running; then applies ``mode`` to the in-flight requests."""
        if mode not in P.PAUSE_MODES:
            raise RequestError("mode", f"must be one of {', '.join(P.PAUSE_MODES)}, got {mode!r}")
        with self.cond:
            self.paused = mode
            self.cond.notify_all()
            while self.in_step:
                self.cond.wait()
            if mode == "abort":
                for r in list(self.by_rid.values()):
                    self._finish_locked(r, P.finish_abort("Aborted by pause_generation"))
            elif mode == "retract":
                for r in reversed(self.running):
                    self._release_slot(r)
                    r.kv_len = 0
                    r.retractions += 1
                    self.waiting.appendleft(r)
                self.running.clear()
            self.cond.notify_all()

    def resume(self) -> None:
        with self.cond:
            self.paused = None
            self.cond.notify_all()

    def commit_weights(self, commit: Callable[[], Any], weight_version: str | None) -> None:
        """Runs ``commit`` (copies staged weights into the live parameters) between steps."""
        with self.model_lock:
            commit()
            if weight_version is not None:
                self.weight_version = str(weight_version)
        self.last_update_error = None
        self.stats["weight_updates"] += 1

    def info(self) -> dict:
        with self.cond:
            return {
                "paused": self.paused,
                "running_requests": len(self.running),
                "waiting_requests": len(self.waiting),
                "max_running_requests": self.max_running,
                "max_context": self.max_context,
                "dtype": str(self.dtype).replace("torch.", ""),
                "num_hidden_layers": self.num_layers,
                "moe_layers": self.moe_layers,
                "num_experts": self.arch.num_experts,
                "num_experts_per_tok": self.top_k,
                "vocab_size": self.arch.vocab_size,
                "alive": self.alive,
                "engine_error": self.error,
                "last_weight_update_error": self.last_update_error,
                "stats": dict(self.stats),
            }

    # --- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)
        try:
            with torch.inference_mode():
                while True:
                    with self.cond:
                        while not self._stop and (self.paused or not (self.waiting or self.running)):
                            self.cond.wait()
                        if self._stop:
                            return
                        segments = self._schedule_locked()
                        self.in_step = True
                    try:
                        self._step(segments)
                    except Exception as e:  # fail this step's requests, keep serving
                        log.exception("engine step failed")
                        with self.cond:
                            self.stats["step_errors"] += 1
                            for r, _, _ in segments:
                                self._finish_locked(r, P.finish_abort(f"engine step failed: {type(e).__name__}: {e}", 500))
                    finally:
                        with self.cond:
                            self.in_step = False
                            self.cond.notify_all()
        except BaseException as e:  # never leave callers hanging
            log.exception("engine thread crashed")
            with self.cond:
                self.error = f"{type(e).__name__}: {e}"
                for r in list(self.by_rid.values()):
                    self._finish_locked(r, P.finish_abort(f"engine error: {self.error}", 500))
                self.cond.notify_all()

    def _schedule_locked(self) -> list[tuple[_Req, list[int], int]]:
        while self.waiting and self.free_slots:
            r = self.waiting.popleft()
            r.slot = self.free_slots.pop()
            r.kv_len = 0
            self.running.append(r)
        batch = []
        for r in self.running:
            if r.kv_len == 0:  # prefill: prompt plus any output kept over a retract
                batch.append((r, r.req.input_ids + r.output_ids, 0))
            else:
                batch.append((r, [r.output_ids[-1]], r.kv_len))
        return batch

    def _step(self, batch: list[tuple[_Req, list[int], int]]) -> None:
        segments, ids, pos, off = [], [], [], 0
        for r, toks, start in batch:
            segments.append((r.slot, start, len(toks), off))
            ids.extend(toks)
            pos.extend(range(start, start + len(toks)))
            off += len(toks)
        dec = [s for s in segments if s[2] == 1 and s[1] > 0]
        last = [s[3] + s[2] - 1 for s in segments]
        # input log-probs (SGLang's input_token_logprobs) come from this prefill's hidden states:
        # row p predicts input token p + 1, for p in [start, len - 1)
        in_rows, in_targets, in_spans = [], [], []
        for i, (r, toks, start) in enumerate(batch):
            if start == 0 and r.req.return_logprob and r.input_logprobs is None:
                prompt, s0 = r.req.input_ids, r.req.input_logprob_start
                o = segments[i][3]
                in_spans.append((i, len(in_rows), max(0, len(prompt) - 1 - s0)))
                in_rows.extend(range(o + s0, o + len(prompt) - 1))
                in_targets.extend(prompt[s0 + 1 :])
        n_top = max((r.req.top_logprobs_num for r, _, _ in batch), default=0)
        # every index of the step in one host-to-device copy
        host = torch.tensor(ids + pos + last + [s[3] for s in dec] + [s[0] for s in dec] + [s[1] for s in dec]
                            + in_rows + in_targets, dtype=torch.long)
        idx = host.to(self.device, non_blocking=True).split(
            [off, off, len(last), len(dec), len(dec), len(dec), len(in_rows), len(in_targets)])
        input_ids, positions, last_rows = idx[0], idx[1], idx[2]
        lmax = max(s[1] for s in dec) + 1 if dec else 0
        attend = _StepAttention(self.k_cache, self.v_cache, segments, idx[3], idx[4], idx[5], lmax)
        record: list[torch.Tensor] = []
        with self.model_lock:
            hidden = self.model.forward_tokens(input_ids, positions, attend, record=record)
            # one lm_head call: the last row of every request, then the input-log-prob rows
            logits = self.model.lm_head(hidden.index_select(0, torch.cat([last_rows, idx[6]]))).float()
            version = self.weight_version
        logits, in_logits = logits[: len(last)], logits[len(last) :]
        pen = [i for i, (r, _, _) in enumerate(batch) if r.params.penalized]
        if pen:  # SGLang processes the logits before sampling and before its output log-probs
            rows = torch.tensor(pen, dtype=torch.long).to(self.device)
            sub = logits.index_select(0, rows)
            apply_penalties(sub, [batch[i][0].params for i in pen], [batch[i][0].output_ids for i in pen])
            logits.index_copy_(0, rows, sub)
        temps = torch.tensor([r.params.logprob_temperature for r, _, _ in batch], dtype=torch.float32)
        logp = torch.log_softmax(logits / temps.to(self.device, non_blocking=True)[:, None], dim=-1)
        tokens_dev = self._sample_batch([r for r, _, _ in batch], logits, logp)
        lps_dev = logp.gather(1, tokens_dev[:, None]).squeeze(1)
        # the step's one device-to-host copy: tokens, log-probs and the routing record (token
        # and expert ids are exact in float64)
        want_routing = any(r.req.return_routed_experts for r, _, _ in batch)
        B, n_in = len(batch), len(in_rows)
        parts = [tokens_dev.double(), lps_dev.double()]
        if n_in:  # input log-probs at temperature 1, as SGLang's logits processor
            in_logp = torch.log_softmax(in_logits, dim=-1)
            parts.append(in_logp.gather(1, idx[7][:, None]).squeeze(1).double())
        if n_top:  # top-k of the sampling distribution (output) and of the input rows
            out_top = logp.topk(n_top, dim=-1)
            parts += [out_top.values.reshape(-1).double(), out_top.indices.reshape(-1).double()]
            if n_in:
                in_top = in_logp.topk(n_top, dim=-1)
                parts += [in_top.values.reshape(-1).double(), in_top.indices.reshape(-1).double()]
        n_route = 0
        if want_routing and record:
            parts.append(torch.stack(record, 1).reshape(-1).double())
            n_route = off * len(record) * self.top_k
        flat = torch.cat(parts).cpu()
        sizes = [B, B, n_in]
        sizes += [B * n_top, B * n_top, n_in * n_top, n_in * n_top] if n_top else [0, 0, 0, 0]
        sizes.append(n_route)
        f_tok, f_lp, f_in, f_otv, f_oti, f_itv, f_iti, f_route = flat.split(sizes)
        tokens, lps = f_tok.long().tolist(), f_lp.tolist()
        in_lps = f_in.tolist()
        if n_top:
            out_top_v, out_top_i = f_otv.view(B, n_top).tolist(), f_oti.view(B, n_top).long().tolist()
            in_top_v, in_top_i = f_itv.view(n_in, n_top).tolist(), f_iti.view(n_in, n_top).long().tolist()
        routing = None
        if want_routing:
            routing = np.zeros((off, self.num_layers, self.top_k), dtype=np.int32)  # dense layers: 0
            if record:
                routing[:, self.moe_layers, :] = f_route.view(off, len(record), self.top_k).to(torch.int32).numpy()
        # SGLang's layout: the first input token of the span has no log-prob (None)
        for i, at, n in in_spans:
            r, k = batch[i][0], batch[i][0].req.top_logprobs_num
            s0 = r.req.input_logprob_start
            if s0 >= len(r.req.input_ids):
                r.input_logprobs, r.input_top = [], []
                continue
            r.input_logprobs = [None] + in_lps[at : at + n]
            if k:
                r.input_top = [None] + [list(zip(v[:k], t[:k])) for v, t in zip(in_top_v[at : at + n], in_top_i[at : at + n])]

        with self.cond:
            self.stats["steps"] += 1
            self.stats["forwarded_tokens"] += off
            for i, (r, toks, start) in enumerate(batch):
                n, o = len(toks), segments[i][3]
                if start == 0:  # a (re-)prefill recomputes the routing of every token it forwards
                    r.routing, r.routing_len = [], 0
                if r.req.return_routed_experts:
                    r.routing.append(routing[o : o + n])
                r.routing_len += n
                r.kv_len = start + n
                if r.done:
                    continue
                if r.abort_msg is not None:
                    self._finish_locked(r, P.finish_abort(r.abort_msg))
                    continue
                p = r.params
                if p.max_new_tokens == 0:  # prompt-only request: the last token was not "forwarded"
                    self._trim_routing(r, r.routing_len - 1)
                    self._finish_locked(r, P.finish_length(0))
                    continue
                tok = tokens[i]
                r.output_ids.append(tok)
                r.logprobs.append(lps[i])
                if r.req.top_logprobs_num:
                    k = r.req.top_logprobs_num
                    r.output_top.append(list(zip(out_top_v[i][:k], out_top_i[i][:k])))
                r.versions.append(version)
                self.stats["output_tokens"] += 1
                matched = self._stop_str(r) if p.stop_strs else None
                if matched is not None:  # SGLang checks stop strings before stop tokens
                    self._finish_locked(r, P.finish_stop(matched))
                elif tok in p.stop_token_ids:
                    self._finish_locked(r, P.finish_stop(tok))
                elif len(r.output_ids) >= p.max_new_tokens or len(r.req.input_ids) + len(r.output_ids) >= self.max_context:
                    self._finish_locked(r, P.finish_length(len(r.output_ids)))
                elif r.on_update is not None:
                    r.on_update(self._response(r, None))

    @classmethod
    def _sample_batch(cls, reqs: list[_Req], logits: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
        """One token per row, as a long tensor on the logits' device. Plain temperature
        sampling (no top-k/top-p, the RL case) is done for all such rows at once by inverse CDF
        on the device, with one uniform draw from each request's own (CPU) generator, so a
        request's tokens depend on its seed and not on its batch-mates or the device."""
        device = logits.device
        tokens = torch.zeros(len(reqs), dtype=torch.long, device=device)
        is_plain = [not r.params.greedy and r.params.top_k <= 0 and r.params.top_p >= 1.0 and r.params.min_p <= 0.0
                    for r in reqs]
        plain = [i for i, p in enumerate(is_plain) if p]
        other = [i for i, p in enumerate(is_plain) if not p]
        if plain:
            rows = torch.tensor(plain, dtype=torch.long).to(device, non_blocking=True)
            u = torch.stack([torch.rand((), generator=reqs[i].generator) for i in plain]).to(device, non_blocking=True)
            cdf = logp.index_select(0, rows).exp().cumsum(dim=-1)
            # first index whose cdf exceeds u * total: token i with probability p_i exactly
            picked = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
            tokens[rows] = picked.clamp_(max=logits.shape[1] - 1)
        if other:  # top-k / top-p / min-p / greedy rows: per row, on the host (their generators are CPU ones)
            lg, lp = logits[other].cpu(), logp[other].cpu()
            chosen = [cls._sample(reqs[i].params, lg[j], lp[j], reqs[i].generator) for j, i in enumerate(other)]
            tokens[torch.tensor(other, dtype=torch.long).to(device)] = torch.tensor(chosen, dtype=torch.long).to(device)
        return tokens

    @staticmethod
    def _sample(p: P.SamplingParams, logits: torch.Tensor, logp: torch.Tensor, gen: torch.Generator) -> int:
        if p.greedy:
            return int(torch.argmax(logits))
        probs = logp.exp()
        if p.top_k > 0 and p.top_k < probs.numel():
            kth = torch.topk(probs, p.top_k).values[-1]
            probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
        if p.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_p, 0)
            drop = (cum - sorted_p) > p.top_p * cum[-1]  # keep the smallest prefix reaching top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
        if p.min_p > 0.0:  # SGLang's: keep tokens with at least min_p times the top probability
            probs = torch.where(probs >= probs.max() * p.min_p, probs, torch.zeros_like(probs))
        return int(torch.multinomial(probs, 1, generator=gen))

    def _stop_str(self, r: _Req) -> str | None:
        """The first of the request's stop strings in the decoded tail of its output (SGLang's
        Req.tail_str: the last stop_str_max_len + 1 tokens), or None."""
        p = r.params
        n = min(p.stop_str_max_len + 1, len(r.output_ids))
        tail = self.decode(r.output_ids[-n:])
        return next((s for s in p.stop_strs if s in tail), None)

    # --- finishing -----------------------------------------------------------------------
    def _trim_routing(self, r: _Req, n: int) -> None:
        if r.routing:
            rows = np.concatenate(r.routing)[:n]
            r.routing = [rows]
        r.routing_len = min(r.routing_len, n)

    def _release_slot(self, r: _Req) -> None:
        if r.slot >= 0:
            self.free_slots.append(r.slot)
            r.slot = -1

    def _finish_locked(self, r: _Req, reason: dict) -> None:
        if r.done:
            return
        r.done = True
        if r in self.running:
            self.running.remove(r)
        else:
            try:
                self.waiting.remove(r)
            except ValueError:
                pass
        self._release_slot(r)
        self.by_rid.pop(r.rid, None)
        self.stats["finished_" + reason["type"]] += 1
        # Rows cover the forwarded tokens: seqlen-1 once the last sampled token is appended.
        self._trim_routing(r, max(0, len(r.req.input_ids) + len(r.output_ids) - 1))
        r.deliver(self._response(r, reason))

    def _response(self, r: _Req, reason: dict | None) -> dict:
        version = r.versions[-1] if r.versions else self.weight_version
        meta: dict[str, Any] = {
            "id": r.rid,
            "finish_reason": reason,
            "prompt_tokens": len(r.req.input_ids),
            "completion_tokens": len(r.output_ids),
            "cached_tokens": 0,
            "weight_version": version,
            "weight_versions": P.version_spans(r.versions) or [{"version": version, "start": 0, "end": 0}],
            "output_token_weight_versions": list(r.versions),
            "num_retractions": r.retractions,
            "e2e_latency": time.monotonic() - r.created,
        }
        if r.req.return_logprob:  # SGLang's keys, in its order; [logprob, token id, text] tuples
            start = r.req.input_logprob_start
            meta["input_token_logprobs"] = [[lp, t, None] for lp, t in zip(r.input_logprobs or [], r.req.input_ids[start:])]
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(r.logprobs, r.output_ids)]
            meta["output_token_logprobs_length"] = len(r.logprobs)
            if r.req.top_logprobs_num:
                meta["input_top_logprobs"] = [None if row is None else [[lp, t, None] for lp, t in row]
                                              for row in r.input_top or []]
                meta["output_top_logprobs"] = [[[lp, t, None] for lp, t in row] for row in r.output_top]
        if r.req.return_routed_experts and reason is not None:
            rows = np.concatenate(r.routing) if r.routing else np.zeros((0, self.num_layers, self.top_k), np.int32)
            meta["routed_experts"] = P.encode_routed_experts(rows[r.req.routed_experts_start_len :])
        return {"output_ids": list(r.output_ids), "meta_info": meta}
