"""The embedded rollout engine: continuous batching over the native MoE model with a KV cache.

One background thread runs the model. Each step forwards, in ONE call of
``model.forward_tokens``, the whole prompt of every newly admitted request (prefill) and the
last sampled token of every running request (decode); embeddings, projections, norms, routers
and experts see all of those tokens at once. Each layer keeps a per-request decode state in
cache slots, of the form its attention kind declares (``moe_rl.model.attention.state``; K/V
``[slots, kv_heads, max_context, head_dim]`` for softmax attention): decode rows of all
requests go through one padded, masked SDPA call; each prefill segment gets its own causal call.

A decode-only step (no request prefilling) can instead go through ``decode.StaticDecoder``
(engine.static_decode): the batch padded to a batch-size bucket, attention over a
context-length bucket, inputs in preallocated buffers; with engine.cuda_graph each shape is
a CUDA graph captured at ``start`` and replayed (SGLang's decode graphs). Either way sampling
runs on the device after the forward, and a step reads the device once: its sampled tokens,
their log-probs and the routing record, in one copy.

Under ``true_on_policy`` (the model's ops exact, ``moe_rl.model.ops``) a step writes every
forwarded row's K/V into its slot and attends all of its sequences in one exact call
(``decode.ExactStepAttention``), takes log-probs with the exact log-softmax and samples with
``sampling.sample_seeded``: a request's tokens, log-probs and routing are then the same bits
whatever else is in its steps and whenever it joined, and equal the trainer's forward.

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

from . import protocol as P
from moe_rl.model.attention import Scan, Sequences, Steps, sdpa, state_specs, visible
from moe_rl.model.ops import tempered

from .decode import CudaGraphs, DecodeAttention, ExactStepAttention, StaticDecoder
from .step_profiler import StepProfiler
from .protocol import GenerateRequest, RequestError
from .sampling import Uniforms, apply_penalties, sample_seeded, sample_tokens, to_device

__all__ = ["Engine", "apply_penalties"]

log = logging.getLogger(__name__)


@dataclass
class _Req:
    req: GenerateRequest
    rid: str
    uniforms: Uniforms  # the sampler's draws, from the request's seeded generator
    seed: int  # the generator's seed: the exact sampler's key (sample_seeded)
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


@dataclass
class _Forward:
    """What a step's forward hands to sampling: fp32 logits of each request's last row; the
    input-log-prob rows' logits and targets (a prefill's); the routing record of the
    forwarded tokens when a request asked for it ([tokens, moe_layers, top_k]); each
    request's (first row, rows) among the forwarded tokens; the weight version used."""

    logits: torch.Tensor
    in_logits: torch.Tensor | None
    in_targets: torch.Tensor | None
    in_spans: list[tuple[int, int, int]]
    routing: torch.Tensor | None
    spans: list[tuple[int, int]]
    version: str


class _StepAttention:
    """The ``attend`` layout of one engine step (see the module docstring)."""

    def __init__(self, states, segments, dec_rows, dec_slots, dec_pos, lmax: int):
        """``states``: each layer's decode state; ``dec_*``: the decode rows' token rows, cache
        slots and positions, already on the cache's device; ``lmax``: 1 + their largest
        position (known on the host: no sync)."""
        self.states = states
        self.prefill = [s for s in segments if not (s[2] == 1 and s[1] > 0)]
        self.dec_rows = dec_rows
        self.decode = DecodeAttention(states, dec_slots, dec_pos, lmax) if lmax else None
        self._scan: Scan | None = None

    def state(self, layer: int):
        return self.states[layer]

    def scan(self, device) -> Scan:
        """For recurrent kinds: the prefill segments as whole sequences (each from its slot's
        state, or from zeros at position 0), the decode rows as one-token steps. Made at the
        first recurrent layer, in one host-to-device copy."""
        if self._scan is None:
            seqs = None
            if self.prefill:
                rows = [r for _, _, n, off in self.prefill for r in range(off, off + n)]
                cu = [0]
                for _, _, n, _ in self.prefill:
                    cu.append(cu[-1] + n)
                meta = [(slot, int(start > 0)) for slot, start, _, _ in self.prefill]
                r, c, sl, res = to_device(device, rows + cu + [m[0] for m in meta] + [m[1] for m in meta],
                                          torch.long).split([len(rows), len(cu), len(meta), len(meta)])
                seqs = Sequences(r, c, sl, res.bool())
            steps = Steps(self.dec_rows, self.decode.slots) if self.decode is not None else None
            self._scan = Scan(seqs, steps)
        return self._scan

    def __call__(self, layer, q, k, v, *, scale=None, sinks=None, window=None):
        cache = self.states[layer]
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        for slot, start, n, off in self.prefill:
            ks, vs, kpos = cache.span(slot, start, k[off : off + n], v[off : off + n])
            qs = q[off : off + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            if start == 0 and window is None:  # the keys are exactly this segment's
                o = sdpa(qs, ks, vs, is_causal=True, scale=scale, sinks=sinks)
            else:
                qpos = torch.arange(start, start + n, device=q.device)
                o = sdpa(qs, ks, vs, mask=visible(qpos[:, None], kpos[None, :], window), scale=scale, sinks=sinks)
            out[off : off + n] = o.squeeze(0).transpose(0, 1)
        if self.decode is not None:
            rows = self.dec_rows
            out[rows] = self.decode(layer, q[rows], k[rows], v[rows], scale=scale, sinks=sinks, window=window)
        return out


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
        static_decode: bool | None = None,
        cuda_graph: bool | None = False,
        cuda_graph_max_bs: int | None = None,
        graphs=None,
        max_waiting_requests: int | None = None,
        compile: bool | dict = False,
    ):
        """``static_decode``: decode-only steps of up to ``cuda_graph_max_bs`` requests
        (default: all) run with static shapes (``moe_rl.engine.decode``); ``cuda_graph``: and
        are captured as CUDA graphs at ``start`` (a CUDA model), or by ``graphs``, a capture
        backend with ``CudaGraphs``' interface. None (the config's unset): ``cuda_graph`` on
        where graphs can be made (a GPU, or ``graphs``) and the step can be captured (checked
        at ``start``), ``static_decode`` as ``cuda_graph``. ``max_waiting_requests``: requests
        queued beyond the free KV slots before ``submit`` raises ``QueueFull`` (None: no bound).
        ``compile``: ``torch.compile`` the static decode step (a dict: ``torch.compile``'s options,
        e.g. another backend); needs ``static_decode``, compiled at ``start``."""
        self.model = model.eval()
        self.arch = model.arch
        self.model_path = model_path
        self.max_running = max_running_requests
        self.max_waiting = max_waiting_requests
        self.max_context = min(max_context, self.arch.max_position_embeddings)
        self.threads = threads
        self.weight_version = str(weight_version)
        self.num_layers = self.arch.num_hidden_layers
        self.top_k = self.arch.num_experts_per_tok
        self.moe_layers = list(model.moe_layers)
        self.exact = model.ops.exact  # true_on_policy: the exact kernels, the seeded sampler
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        on_gpu = self.device.type == "cuda"
        if cuda_graph and graphs is None and not on_gpu:
            raise ValueError(f"engine.cuda_graph=true needs the engine on a CUDA device; it is on {self.device}")
        if cuda_graph and static_decode is False:
            raise ValueError("engine.cuda_graph=true with engine.static_decode=false: the graphs capture the "
                             "static-shape decode step")
        self._asked = {"cuda_graph": cuda_graph, "static_decode": static_decode}
        can_capture = on_gpu or graphs is not None
        self.cuda_graph = bool(cuda_graph) if cuda_graph is not None else (can_capture and static_decode is not False)
        self.static_decode = bool(static_decode) if static_decode is not None else self.cuda_graph
        # each layer's decode state (its kind's spec: K/V for softmax attention), per cache slot;
        # a static decode batch pads with rows that write one spare slot, owned by no request
        slots = self.max_running + (1 if self.static_decode else 0)
        specs = state_specs(self.arch)
        # a compiled step gets one position more than its longest span, so that no span is all of
        # the cache: a slice of all of it is contiguous, of fewer positions not, and dynamo would
        # make the full span a graph of its own (twice the compile at start)
        positions = self.max_context + (1 if compile else 0)
        self.states = [spec.allocate(slots, positions, self.dtype, self.device) for spec in specs]
        elem = torch.empty((), dtype=self.dtype).element_size()
        self.state_bytes = slots * sum(spec.bytes_per_slot(positions, elem) for spec in specs)
        if compile and self.exact:
            raise ValueError("engine.compile: the exact kernels (true_on_policy) are not custom ops torch.compile "
                             "can trace; run the decode step eagerly")
        if compile and not self.static_decode:
            raise ValueError("engine.compile: it compiles the static decode step, which is off "
                             "(engine.static_decode / engine.cuda_graph)")
        self.static_decoder: StaticDecoder | None = None
        if self.static_decode:
            if self.cuda_graph and graphs is None:
                graphs = CudaGraphs(self.device)
            self.static_decoder = StaticDecoder(
                self.model, self.states, max_bs=min(cuda_graph_max_bs or self.max_running, self.max_running),
                max_context=self.max_context, pad_slot=self.max_running, graphs=graphs if self.cuda_graph else None,
                compile=({} if compile is True else compile) if compile else None)

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
        self.step_profiler = StepProfiler(cuda=on_gpu)  # /start_profile, /stop_profile

    # --- lifecycle -----------------------------------------------------------------------
    def start(self) -> "Engine":
        """Captures the decode graphs (when on; compiling the step first with ``compile``), then
        starts the engine thread."""
        if self._thread is None:
            if self.static_decoder is not None:
                with torch.inference_mode(), self.model_lock:
                    if self.static_decoder.graphs is not None:
                        self._capture_graphs()  # the capture compiles the step first (warm_up)
                    if self.static_decoder is not None:  # (the capture's check may turn it off)
                        self.static_decoder.warm_up()  # without graphs: a compile at start, not in a step
            self._thread = threading.Thread(target=self._run, name="moe-rl-engine", daemon=True)
            self._thread.start()
        return self

    def _capture_graphs(self) -> None:
        """Captures every decode shape, once the step is known to read nothing on the host (a
        graph cannot capture that). Unset, engine.cuda_graph then turns off (logged); set, it
        is an error naming the read."""
        dec = self.static_decoder
        reads = dec.host_reads()
        if reads:
            why = (f"the decode step reads device values on the host ({', '.join(reads)}), which a CUDA graph "
                   f"cannot capture (e.g. float64 experts run padded_grouped_mm, which reads the largest group's "
                   f"size; float32/bfloat16/float16 experts read nothing)")
            if self._asked["cuda_graph"]:
                raise ValueError(f"engine.cuda_graph=true: {why}")
            if self._asked["static_decode"] is None and dec.compiled:
                raise ValueError(f"engine.compile=true compiles the static decode step, which follows "
                                 f"engine.cuda_graph, and {why}; set engine.static_decode=true")
            log.warning("engine.cuda_graph: off (unset, and %s)", why)
            dec.graphs, self.cuda_graph = None, False
            if self._asked["static_decode"] is None:  # it followed engine.cuda_graph
                self.static_decoder, self.static_decode = None, False
            return
        dec.capture()
        self.stats["decode_graphs"] = len(dec.replays)

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
        r = _Req(req=req, rid=rid, uniforms=Uniforms(gen, min(64, req.sampling_params.max_new_tokens)),
                 seed=gen.initial_seed(), deliver=deliver, on_update=on_update)
        with self.cond:
            if self.error is not None:
                raise RuntimeError(f"engine is not running: {self.error}")
            if rid in self.by_rid:
                raise RequestError("rid", f"a request with rid {rid!r} is already in flight")
            queued = len(self.waiting) - len(self.free_slots)  # those no free slot awaits
            if self.max_waiting is not None and queued >= self.max_waiting:
                raise P.QueueFull(f"The request queue is full. {queued} requests wait for one of the "
                                  f"{self.max_running} KV slots (engine.max_waiting_requests={self.max_waiting})")
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
            if self.static_decoder is not None:
                self.static_decoder.check_weights()
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
                "max_waiting_requests": self.max_waiting,
                # KV cache: slots not held by a request, tokens held by running ones
                "kv_slots_free": len(self.free_slots),
                "kv_tokens_used": sum(r.kv_len for r in self.running),
                "waiting_tokens": sum(len(r.req.input_ids) + len(r.output_ids) for r in self.waiting),
                "max_context": self.max_context,
                "dtype": str(self.dtype).replace("torch.", ""),
                "static_decode": self.static_decode,
                "cuda_graph": self.cuda_graph,
                "cuda_graph_max_bs": self.static_decoder.max_bs if self.static_decoder is not None else None,
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

    # --- profiling (SGLang's /start_profile, /stop_profile) --------------------------------
    def start_profile(self, output_dir: str | None = None, num_steps: int | None = None,
                      activities=("CPU", "GPU"), timeout_s: float = 120.0) -> None:
        """Profiles the engine's steps from the next one (``moe_rl.engine.step_profiler``), all
        of them until ``stop_profile`` or the first ``num_steps``. Returns once the engine
        thread has started the profiler (at once when idle, else after the step under way), as
        SGLang's returns once its scheduler has: the profiler's own start-up (seconds, the first
        time on a GPU) is then not in the steps that follow. ValueError: one is running, or the
        arguments are not valid."""
        prof = self.step_profiler
        with self.cond:
            prof.request_start(output_dir, num_steps, activities)
            self.cond.notify_all()
            if not self.cond.wait_for(lambda: not prof.starting or self.error is not None, timeout=timeout_s):
                raise TimeoutError(f"the engine did not start its profile within {timeout_s:.0f} s")
        if prof.error:
            raise RuntimeError(f"the profiler could not start: {prof.error}")

    def stop_profile(self, timeout_s: float = 120.0) -> list[str]:
        """Ends the running profile at the next step boundary (at once when idle) and returns
        the files written; a profile of ``num_steps`` that already ended returns its files."""
        prof = self.step_profiler
        with self.cond:
            if prof.running:
                prof.request_stop()
                self.cond.notify_all()
            elif prof.files is None:
                raise ValueError("no profile is running: /start_profile first")
            if not self.cond.wait_for(lambda: not prof.running or self.error is not None, timeout=timeout_s):
                raise TimeoutError(f"the engine did not end its profile within {timeout_s:.0f} s")
        if prof.error:
            raise RuntimeError(f"the profile could not be written: {prof.error}")
        return list(prof.files or [])

    # --- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)
        try:
            with torch.inference_mode():
                while True:
                    prof = self.step_profiler
                    with self.cond:
                        while not self._stop and not prof.due() and (self.paused or not (self.waiting or self.running)):
                            self.cond.wait()
                        if self._stop:
                            prof.close()  # a profile still running is written
                            return
                        work = not self.paused and bool(self.waiting or self.running)
                        segments = self._schedule_locked() if work else None
                        self.in_step = work
                    if prof.due():
                        prof.turn()
                        with self.cond:
                            self.cond.notify_all()  # a /stop_profile waits for its files
                    if segments is None:
                        continue
                    try:
                        self._step(segments)
                        prof.count_step()
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
        dec = self.static_decoder
        if dec is not None and dec.fits(len(batch)) and all(start > 0 and len(toks) == 1 for _, toks, start in batch):
            fwd = self._forward_static(batch)  # decode only
        else:
            fwd = self._forward_eager(batch)
        self._sample_and_record(batch, fwd)

    def _forward_eager(self, batch: list[tuple[_Req, list[int], int]]) -> _Forward:
        """Prefills and decodes of any lengths in one forward (see the module docstring)."""
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
        # every index of the step in one host-to-device copy
        exact = []  # exact attention: each row's slot; each sequence's row bounds, slot, first position
        if self.exact:
            exact = ([s[0] for s in segments for _ in range(s[2])] + [s[3] for s in segments] + [off]
                     + [s[0] for s in segments] + [s[1] for s in segments])
        host = (ids + pos + last + [s[3] for s in dec] + [s[0] for s in dec] + [s[1] for s in dec]
                + in_rows + in_targets + exact)
        S = len(segments)
        idx = to_device(self.device, host, torch.long).split(
            [off, off, len(last), len(dec), len(dec), len(dec), len(in_rows), len(in_targets)]
            + ([off, S + 1, S, S] if self.exact else []))
        input_ids, positions, last_rows = idx[0], idx[1], idx[2]
        if self.exact:
            attend = ExactStepAttention(self.states, idx[8], positions, idx[9], idx[10], idx[11])
        else:
            lmax = max(s[1] for s in dec) + 1 if dec else 0
            attend = _StepAttention(self.states, segments, idx[3], idx[4], idx[5], lmax)
        record: list[torch.Tensor] = []
        with self.model_lock:
            hidden = self.model.forward_tokens(input_ids, positions, attend, record=record)
            # one lm_head call: the last row of every request, then the input-log-prob rows
            logits = self.model.lm_head(hidden.index_select(0, torch.cat([last_rows, idx[6]]))).float()
            version = self.weight_version
        want_routing = record and any(r.req.return_routed_experts for r, _, _ in batch)
        return _Forward(logits=logits[: len(last)], in_logits=logits[len(last) :], in_targets=idx[7],
                        in_spans=in_spans, routing=torch.stack(record, 1) if want_routing else None,
                        spans=[(s[3], s[2]) for s in segments], version=version)

    def _forward_static(self, batch: list[tuple[_Req, list[int], int]]) -> _Forward:
        """A decode-only step through the static-shape decoder (a CUDA graph replay when
        captured): the same outputs as ``_forward_eager`` would give."""
        with self.model_lock:
            logits, routing = self.static_decoder.run([toks[0] for _, toks, _ in batch], [start for _, _, start in batch],
                                               [r.slot for r, _, _ in batch])
            version = self.weight_version
        self.stats["decode_graph_steps" if self.static_decoder.graphs is not None else "decode_static_steps"] += 1
        want_routing = routing is not None and any(r.req.return_routed_experts for r, _, _ in batch)
        return _Forward(logits=logits, in_logits=None, in_targets=None, in_spans=[],
                        routing=routing if want_routing else None, spans=[(i, 1) for i in range(len(batch))],
                        version=version)

    def _sample_and_record(self, batch: list[tuple[_Req, list[int], int]], fwd: _Forward) -> None:
        """Penalties, sampling and log-probs on the device, the step's one device-to-host copy,
        then each request's bookkeeping."""
        logits, version = fwd.logits, fwd.version
        n_top = max((r.req.top_logprobs_num for r, _, _ in batch), default=0)
        pen = [i for i, (r, _, _) in enumerate(batch) if r.params.penalized]
        if pen:  # SGLang processes the logits before sampling and before its output log-probs
            rows = to_device(self.device, pen, torch.long)
            sub = logits.index_select(0, rows)
            apply_penalties(sub, [batch[i][0].params for i in pen], [batch[i][0].output_ids for i in pen])
            logits.index_copy_(0, rows, sub)
        ops = self.model.ops
        temps = to_device(self.device, [r.params.logprob_temperature for r, _, _ in batch], torch.float32)
        logp = ops.log_softmax(tempered(logits, temps))
        reqs = [r for r, _, _ in batch]
        if self.exact:
            tokens_dev = sample_seeded([r.params for r in reqs], [r.seed for r in reqs],
                                       [len(r.req.input_ids) + len(r.output_ids) for r in reqs], logits, logp)
        else:
            tokens_dev = self._sample_batch(reqs, logits, logp)
        lps_dev = logp.gather(1, tokens_dev[:, None]).squeeze(1)
        # the step's one device-to-host copy: tokens, log-probs and the routing record (token
        # and expert ids are exact in float64)
        B, n_in = len(batch), 0 if fwd.in_targets is None else fwd.in_targets.numel()
        parts = [tokens_dev.double(), lps_dev.double()]
        if n_in:  # input log-probs at temperature 1, as SGLang's logits processor
            in_logp = ops.log_softmax(fwd.in_logits)
            parts.append(in_logp.gather(1, fwd.in_targets[:, None]).squeeze(1).double())
        if n_top:  # top-k of the sampling distribution (output) and of the input rows
            out_top = logp.topk(n_top, dim=-1)
            parts += [out_top.values.reshape(-1).double(), out_top.indices.reshape(-1).double()]
            if n_in:
                in_top = in_logp.topk(n_top, dim=-1)
                parts += [in_top.values.reshape(-1).double(), in_top.indices.reshape(-1).double()]
        n_route = 0
        if fwd.routing is not None:
            parts.append(fwd.routing.reshape(-1).double())
            n_route = fwd.routing.numel()
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
        off = sum(n for _, n in fwd.spans)
        routing = None
        if any(r.req.return_routed_experts for r, _, _ in batch):
            routing = np.zeros((off, self.num_layers, self.top_k), dtype=np.int32)  # dense layers: 0
            if n_route:
                routing[:, self.moe_layers, :] = f_route.view(off, len(self.moe_layers), self.top_k).to(torch.int32).numpy()
        # SGLang's layout: the first input token of the span has no log-prob (None)
        for i, at, n in fwd.in_spans:
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
                o, n = fwd.spans[i]
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

    @staticmethod
    def _sample_batch(reqs: list[_Req], logits: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
        """One token per row on the logits' device (``sampling.sample_tokens``)."""
        return sample_tokens([r.params for r in reqs], [r.uniforms for r in reqs], logits, logp)

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
