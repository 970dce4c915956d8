"""The engine's decode step with static shapes, and its CUDA graphs (SGLang's decode graphs).

A decode-only step (every running request forwards its one last token) is padded up to a
batch-size bucket (``decode_batch_sizes``: SGLang's list) and attends over a context-length
bucket (``context_sizes``: powers of two up to ``max_context``), so each (batch, context)
pair has one shape. Its inputs (token ids, positions, KV-cache slots) live in preallocated
device buffers, filled by one host-to-device copy; padding rows read and write a spare
KV-cache slot that no request owns. Its outputs (fp32 logits and the routing record) land in
preallocated buffers too, shared by every shape.

With ``graphs`` (``CudaGraphs`` on a GPU) the step of each (batch, context) pair is captured
once, largest first into one memory pool as SGLang does, and replayed; batches larger than the
largest bucket, and steps with a prefill, run the engine's eager path. The capture mechanics
sit behind ``graphs.capture(fn) -> replay``, so everything else here (bucketing, padding, the
buffers, which shape runs) is the same, and tested, on a CPU. Before capturing, the engine
checks that the step reads no device value on the host (``host_reads``): a graph would bake
in whatever the host read at capture.
"""
from __future__ import annotations

import bisect
import logging
import time
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_rl.model.attention import KVCache, Scan, Steps, decode_sdpa, visible
from moe_rl.model.attention.layouts import cached_sdpa

log = logging.getLogger(__name__)


aten = torch.ops.aten


class _HostReads(TorchDispatchMode):
    """Notes the ops by which the host reads device values: a scalar read (item, int(),
    bool()), an op whose output size the host must read (nonzero, masked_select, unique,
    bincount, repeat_interleave without ``output_size``, indexing with a boolean mask), a copy
    from a device to the CPU (cpu(), tolist()). Under inference mode the composite ops (item,
    is_nonzero, to) arrive undecomposed."""

    READ = {aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default, aten.nonzero.default,
            aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
            aten.unique_consecutive.default, aten.bincount.default}
    REPEAT = {aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor}
    INDEX = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
    TO = {aten._to_copy.default, aten.to.dtype_layout, aten.to.device, aten.to.other}

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._reads_host(func, args, kwargs):
            self.reads.append(str(func))
        return func(*args, **kwargs)

    def _reads_host(self, func, args, kwargs) -> bool:
        def on_device(t):
            return isinstance(t, torch.Tensor) and t.device.type != "cpu"

        if func in self.READ:
            return any(on_device(a) for a in args)
        if func in self.REPEAT:
            return kwargs.get("output_size") is None and any(on_device(a) for a in args)
        if func in self.INDEX:
            return on_device(args[0]) and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                              for i in (args[1] or ()))
        if func is aten.copy_.default:
            return args[0].device.type == "cpu" and on_device(args[1])
        if func in self.TO and on_device(args[0]):
            dst = args[1] if func is aten.to.device else args[1].device if func is aten.to.other else kwargs.get("device")
            return dst is not None and torch.device(dst).type == "cpu"
        return False


def host_reads(fn: Callable[[], None]) -> list[str]:
    """Runs ``fn`` and returns the ops by which it read device values on the host (none on a
    CPU): a CUDA graph cannot capture them. Where such a read fails (tensors without values:
    the meta device) the reads so far are the answer."""
    mode = _HostReads()
    try:
        with mode:
            fn()
    except (RuntimeError, NotImplementedError):
        if not mode.reads:
            raise
    return sorted(set(mode.reads))


def decode_batch_sizes(max_bs: int) -> list[int]:
    """SGLang's decode capture sizes (``generate_decode_cuda_graph_batch_sizes``, no
    speculative decoding) up to ``max_bs``, with ``max_bs`` itself."""
    sizes = [1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 512, 16)) + list(range(512, max_bs + 1, 32))
    sizes = [s for s in sizes if s <= max_bs]
    return sizes if max_bs in sizes else sizes + [max_bs]


def context_sizes(max_context: int, smallest: int = 64) -> list[int]:
    """Attention spans of a decode step: powers of two from ``smallest``, then ``max_context``
    (attention work stays within 2x of the longest running request's)."""
    sizes, c = [], smallest
    while c < max_context:
        sizes.append(c)
        c *= 2
    return sizes + [max_context]


def pad_to_bucket(n: int, buckets: list[int]) -> int:
    """The smallest bucket >= n (buckets sorted); n must not exceed the largest."""
    i = bisect.bisect_left(buckets, n)
    if i == len(buckets):
        raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


class DecodeAttention:
    """Attention of a decode batch: row i is the token at position ``pos[i]`` of the request
    in cache slot ``slots[i]``; it writes its K/V there and attends to the keys of that slot it
    sees (``layouts.visible``: positions <= pos[i], within a sliding window), over the first
    ``ctx`` positions (masked; a sliding-window layer's ring holds at most its window).
    ``states``: each layer's decode state (``moe_rl.model.attention.state``)."""

    def __init__(self, states: list, slots: torch.Tensor, pos: torch.Tensor, ctx: int):
        self.states, self.slots, self.pos, self.ctx = states, slots, pos, ctx
        self.mask = torch.arange(ctx, device=pos.device)[None, :] <= pos[:, None]  # [B, ctx]

    def state(self, layer: int):
        return self.states[layer]

    def scan(self, device) -> Scan:
        """Every row a one-token step of its slot's recurrent state (a recurrent kind)."""
        return Scan(None, Steps(None, self.slots))

    def __call__(self, layer, q, k, v, *, scale=None, sinks=None, window=None):
        cache = self.states[layer]
        cache.write_rows(self.slots, self.pos, k, v)
        ks, vs = cache.gather(self.slots, self.ctx)  # [B, Hkv, S, D]
        if isinstance(cache, KVCache) and window is None:
            mask = self.mask  # every layer of a plain K/V cache shares it
        else:
            mask = visible(self.pos[:, None], cache.key_positions(self.pos, ks.shape[2]), window)
        return decode_sdpa(q, ks, vs, mask, scale, sinks=sinks)


class ExactStepAttention:
    """The attention of an engine step under ``true_on_policy`` (the model's ops exact), eager
    or static: every forwarded row writes its K/V at its position of its slot first (``rows``:
    slots and positions, one per row), then one ``cached_sdpa`` call attends every sequence
    of the step (a prefill, a re-prefill or a decode row alike: ``cu_seqlens`` over the rows,
    ``slots`` and first positions ``pos0`` per sequence), whose keys are reduced in the order
    a full prefill and the trainer's forward reduce them."""

    def __init__(self, states: list, row_slots, row_pos, cu_seqlens, slots, pos0):
        self.states = states
        self.row_slots, self.row_pos = row_slots, row_pos
        self.cu_seqlens, self.slots, self.pos0 = cu_seqlens.to(torch.int32), slots, pos0.to(torch.int32)

    @classmethod
    def decode(cls, states: list, slots: torch.Tensor, pos: torch.Tensor) -> "ExactStepAttention":
        """A decode batch: row i is the one token of sequence i."""
        cu = torch.arange(slots.shape[0] + 1, device=slots.device)
        return cls(states, slots, pos, cu, slots, pos)

    def state(self, layer: int):
        return self.states[layer]

    def __call__(self, layer, q, k, v, *, scale=None):
        cache = self.states[layer]
        cache.write_rows(self.row_slots, self.row_pos, k, v)
        return cached_sdpa(q, cache, self.cu_seqlens, self.slots, self.pos0, scale)


class CudaGraphs:
    """``torch.cuda.CUDAGraph`` capture: every graph in one memory pool (the caller captures
    the largest shape first, so the smaller ones reuse its memory), each warmed up eagerly on
    the capture stream first (lazy initialisations and caches happen outside the graph).
    ``thread_local`` capture: the server's other threads may use the GPU meanwhile."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            fn()  # warm-up
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            fn()
        return graph.replay


class StaticDecoder:
    """Decode steps of ``model`` with static shapes over the engine's per-slot decode state
    (``states``, one per layer; see the module docstring). ``pad_slot``: a cache slot that no
    request owns. ``graphs``: a capture backend (``CudaGraphs``), or None for the eager static
    path. ``compile``: ``torch.compile`` options; then the step runs compiled (fullgraph, dynamic
    batch size and span; ``warm_up`` makes its graphs at start)."""

    def __init__(self, model, states: list, *, max_bs: int, max_context: int, pad_slot: int, graphs=None,
                 compile: dict | None = None):
        self.model = model
        self.states = states
        self.batch_sizes = decode_batch_sizes(max_bs)
        # exact attention reads each request's own keys whatever the span: one span, one graph per batch size
        self.context_sizes = [max_context] if model.ops.exact else context_sizes(max_context)
        self.max_bs = max_bs
        self.pad_slot = pad_slot
        self.graphs = graphs
        self.replays: dict[tuple[int, int], Callable[[], None]] = {}
        self.weights_at_capture: tuple | None = None
        self.capture_s = 0.0
        p = next(model.parameters())
        dev, arch = p.device, model.arch
        # inputs: token ids, positions, KV slots ([3, max_bs]); outputs shared by every shape
        self.inputs = torch.zeros(3, max_bs, dtype=torch.long, device=dev)
        self.inputs[2].fill_(pad_slot)
        # the host side of the inputs' one (asynchronous) copy per step; pinned on a GPU
        self.staging = (self.inputs if dev.type == "cpu"
                        else torch.empty(3, max_bs, dtype=torch.long, pin_memory=dev.type == "cuda"))
        self.logits = torch.zeros(max_bs, arch.vocab_size, dtype=torch.float32, device=dev)
        self.num_moe = len(model.moe_layers)
        self.routing = torch.zeros(max_bs, self.num_moe, arch.num_experts_per_tok, dtype=torch.long, device=dev)
        self.compiled = compile is not None
        self._step = self._forward
        if self.compiled:
            # only the batch size and the span vary: the buffers' and decode states' sizes are
            # constants (else dynamo's duck sizing ties a span equal to the cache's length to it)
            for t in (self.inputs, self.logits, self.routing,
                      *(v for st in states for v in vars(st).values() if isinstance(v, torch.Tensor))):
                torch._dynamo.mark_static(t)
            self._step = torch.compile(self._forward, **{"fullgraph": True, "dynamic": True, **compile})
        self.compile_s = 0.0

    def _forward(self, bs: int, ctx: int) -> None:
        """The step of one shape: reads ``inputs[:, :bs]``, writes ``logits[:bs]`` and
        ``routing[:bs]`` (the body a graph captures: device work only, no host reads)."""
        ids, pos, slots = self.inputs[0, :bs], self.inputs[1, :bs], self.inputs[2, :bs]
        record: list[torch.Tensor] = []
        attend = (ExactStepAttention.decode(self.states, slots, pos) if self.model.ops.exact
                  else DecodeAttention(self.states, slots, pos, ctx))
        hidden = self.model.forward_tokens(ids, pos, attend, record=record)
        self.logits[:bs].copy_(self.model.lm_head(hidden))
        if record:
            self.routing[:bs].copy_(torch.stack(record, 1))

    def _weights(self) -> tuple:
        """Where the model's tensors live: a graph replays reads of these addresses."""
        return tuple(t.data_ptr() for t in (*self.model.parameters(), *self.model.buffers()))

    def capture(self) -> None:
        """Captures every (batch, context) shape, largest first; the inputs hold padding
        (ids 0, position 0, the spare slot), so capturing writes only the spare slot."""
        t0 = time.perf_counter()
        self.replays.clear()
        self.inputs[:2].zero_()
        self.inputs[2].fill_(self.pad_slot)
        self.warm_up()
        for bs in reversed(self.batch_sizes):
            for ctx in reversed(self.context_sizes):
                self.replays[(bs, ctx)] = self.graphs.capture(lambda bs=bs, ctx=ctx: self._step(bs, ctx))
        self.weights_at_capture = self._weights()
        self.capture_s = time.perf_counter() - t0
        log.info("captured %d decode graphs (batch sizes %s, context spans %s) in %.1f s", len(self.replays),
                 self.batch_sizes, self.context_sizes, self.capture_s)

    def warm_up(self) -> None:
        """Compiles the step (``compile``; once) at start, on padding (it writes the spare slot
        only), for every graph dynamo makes of it: batch size 1 is specialised, and so would be
        a span of all of a cache's positions (a contiguous view, fewer are not): the engine
        gives a compiled step's K/V caches one position more than the longest span, so that
        only a sliding window's ring, shorter than the spans, is read whole. In the first call
        the batch size and the span differ, so that dynamo's duck sizing does not give them one
        symbol."""
        if not self.compiled or self.compile_s:
            return
        t0 = time.perf_counter()
        self.inputs[:2].zero_()
        self.inputs[2].fill_(self.pad_slot)
        spans = [c for c in self.context_sizes[:-1] if c != self.batch_sizes[-1]] + self.context_sizes[-1:]
        for bs in sorted({self.batch_sizes[-1], self.batch_sizes[0]}, reverse=True):
            for ctx in (spans[0], spans[-1]) if len(spans) > 1 else spans:
                self._step(bs, ctx)
        self.compile_s = time.perf_counter() - t0
        log.info("compiled the decode step (torch.compile) in %.1f s", self.compile_s)

    def host_reads(self) -> list[str]:
        """What keeps the step from being captured: its reads of device values on the host,
        found by running the smallest shape once (on padding: it writes the spare slot only)."""
        self.inputs[:2].zero_()
        self.inputs[2].fill_(self.pad_slot)
        return host_reads(lambda: self._forward(self.batch_sizes[0], self.context_sizes[0]))

    def check_weights(self) -> None:
        """After a weight update: graphs that read weights at addresses the model no longer
        uses are dropped, and captured again before the next replay."""
        if self.replays and self._weights() != self.weights_at_capture:
            log.warning("the engine's weights moved to new memory: recapturing the decode graphs")
            self.replays.clear()

    def fits(self, n: int) -> bool:
        return n <= self.max_bs

    def run(self, ids: list[int], pos: list[int], slots: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decode step of ``len(ids) <= max_bs`` rows -> (fp32 logits [n, V], routing
        [n, moe_layers, top_k] or None for a dense model), views of the shared outputs that
        the next step overwrites."""
        n = len(ids)
        bs = pad_to_bucket(n, self.batch_sizes)
        ctx = pad_to_bucket(max(pos) + 1, self.context_sizes)
        pad = bs - n
        if self.graphs is not None and not self.replays:
            self.capture()  # the weights moved (check_weights)
        # the pinned staging buffer is free again: the previous step's read of its tokens
        # waited for everything before it, this copy included
        self.staging[:, :bs] = torch.tensor([ids + [0] * pad, pos + [0] * pad, slots + [self.pad_slot] * pad])
        if self.staging is not self.inputs:  # all of it: one contiguous copy (columns >= bs are not read)
            self.inputs.copy_(self.staging, non_blocking=True)
        if self.graphs is not None:
            self.replays[(bs, ctx)]()
        else:
            self._step(bs, ctx)
        return self.logits[:n], (self.routing[:n] if self.num_moe else None)
