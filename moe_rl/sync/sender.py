"""Trainer side of the weight sync: gather, pack and broadcast bucket by bucket.

Roles in the trainer pool (``moe_rl.dist`` layout):

- the *source* (trainer rank 0 = EP rank 0 of EP block 0) talks to the engines, owns the
  weight-sync group (rank 0 of it) and broadcasts each bucket;
- the other ranks of EP block 0 (*helpers*) contribute the expert tensors they own (and their
  rows of a tensor that stacks a layer's experts, gpt-oss's), bucket by bucket: for each bucket the source broadcasts its index over the EP group, every EP rank
  packs its own tensors of that bucket, and the helpers send them to the source point to
  point, straight into the bucket buffer (one message per run of consecutive tensors). Only
  one bucket (two while double buffering) is ever gathered, never the whole model;
- every other EP block (expert-DP replicas) holds the same weights and only learns the result.

Per bucket the source posts SGLang's ``/update_weights_from_distributed`` to every engine,
starts one broadcast, and meanwhile gathers and packs the next bucket (double buffering); it
then waits for the broadcast and the engines' replies before posting the next bucket (replies
must not be reordered). Any failure is raised on every trainer rank (``WeightSyncError``).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moe_rl import faults
from moe_rl.engine.client import EngineError, EngineHTTPError, EngineTimeoutError
from moe_rl.kernels.bucket_pack import pack

from ..model.hf_io import bind_hf_views, expert_owner, stacked_expert_rows
from .engines import EngineCallError, as_engine
from .group import DEFAULT_TIMEOUT_S, SyncGroup, free_port
from .plan import Bucket, Plan, checksum, plan_buckets
from .source import ModelSource
from .receiver import WeightSyncError

log = logging.getLogger(__name__)

_STOP, _ABORT = -1, -2


@dataclass
class SyncStats:
    """What the last push did (source rank)."""

    version: str | None = None
    buckets: int = 0
    bytes: int = 0
    seconds: float = 0.0
    pack_seconds: float = 0.0  # gather + pack (overlapped with broadcasts)
    peak_extra_bytes: int = 0  # most bytes of sender-allocated buffers alive at once
    skipped: list = field(default_factory=list)  # engines that were down: not updated (see update_engines)
    history: list = field(default_factory=list)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0


async def _probe(engine, timeout_s: float) -> EngineError | None:
    """None when ``engine`` answers ``/health`` within ``timeout_s`` (or has no such endpoint),
    else the error that says so."""
    health = getattr(getattr(engine, "client", None), "health", None)
    if not callable(health):
        return None
    if await health(timeout_s=timeout_s):
        return None
    return EngineError(engine.name, "/health", f"no healthy answer within {timeout_s:g} s (skipped at the last sync too)")


def _unreachable(reply) -> bool:
    """The engine gave no answer at all (refused, dropped, timed out): it is down, not refusing."""
    return isinstance(reply, EngineError) and not isinstance(reply, EngineHTTPError)


class _Mem:
    """Bytes of buffers the sender allocated and still holds (thread-safe), with the peak."""

    def __init__(self):
        self.cur = self.peak = 0
        self._lock = threading.Lock()

    def alloc(self, n: int) -> None:
        with self._lock:
            self.cur += n
            self.peak = max(self.peak, self.cur)

    def free(self, n: int) -> None:
        with self._lock:
            self.cur -= n


class WeightSender:
    """One per trainer rank; every rank of the trainer pool calls ``sync``/``sync_async``."""

    def __init__(
        self,
        model,
        *,
        ep_group=None,
        trainer_group=None,
        ep_wait_group=None,
        trainer_wait_group=None,
        dp_rank: int = 0,
        engines=(),
        bucket_mb: float = 64.0,
        verify: bool = False,
        group_name: str = "moe_rl_weight_sync",
        master_address: str = "127.0.0.1",
        port: int = 0,
        backend: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        pause_mode: str = "abort",
        wire_dtype: torch.dtype | None = None,
        use_triton: bool | None = None,
        keep_buffers: bool | None = None,
        bind_params: bool = False,
        dense_params: bool = False,
        skip_down_engines: bool = True,
    ):
        # ``model``: the native model, or a weights source (moe_rl.sync.source) of any backend
        self.source = model if hasattr(model, "cache_key") else ModelSource(model)
        self.arch = self.source.arch
        self.ep_group, self.trainer_group = ep_group, trainer_group
        # the same ranks with a long timeout (moe_rl.dist): the other ranks wait on these while
        # the source talks to the engines
        self.ep_wait_group, self.trainer_wait_group = ep_wait_group or ep_group, trainer_wait_group or trainer_group
        self.ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
        self.ep_rank = dist.get_rank(ep_group) if ep_group is not None else 0
        self.dp_rank = dp_rank
        self.active = dp_rank == 0  # only EP block 0 sends
        self.is_source = self.active and self.ep_rank == 0
        # an engine's answer to a bucket comes after the broadcast (timeout_s); then as long again, at most a minute
        self.engines = [as_engine(e, timeout_s=timeout_s + min(60.0, timeout_s)) for e in engines]
        self._down: set[str] = set()  # engines the last sync skipped: probed before this one pauses them
        self.verify, self.group_name = verify, group_name
        self.master_address, self.port = master_address, port
        self.device = self.source.device
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        self.timeout_s, self.pause_mode = timeout_s, pause_mode
        self.skip_down_engines = skip_down_engines
        self.use_triton = use_triton
        # CPU: keep the two bucket buffers between syncs (fresh pages cost more than the copy);
        # CUDA: torch's caching allocator already reuses them, and training wants the memory,
        # except over ipc, which shares a kept buffer once instead of every bucket of every sync
        if keep_buffers is None:
            keep_buffers = self.device.type == "cpu" or self.backend == "ipc"
        self.keep_buffers = keep_buffers
        self._pool: list[torch.Tensor] = []
        self._views: dict[int, list[torch.Tensor]] = {}
        self._views_key = None
        self.plan: Plan = plan_buckets(self.source.specs(wire_dtype), int(bucket_mb * 2**20))
        self.group: SyncGroup | None = None
        self._group_key = None
        self._checksum_ok = False
        self.stats = SyncStats()
        self._mem = _Mem()
        self._ep_exec = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sync-pack")
        self._bc_exec = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sync-bcast")
        self._layout = [self._bucket_layout(b) for b in self.plan.buckets]
        self._bound: list[torch.Tensor] | None = None
        if bind_params:
            self._bind_params(dense_params)

    def _bind_params(self, dense: bool) -> None:
        """EP=1 native model, no dtype cast on the wire: moves the parameters into the bucket
        buffers (one copy, now), so every later sync broadcasts them as they are, with no pack.
        Needs each layer's experts inside one bucket (see plan_buckets), and with ``dense`` (the
        trainer's fused AdamW) each expert stack back to back; otherwise says so and packs each
        sync."""
        if self.ep_size != 1 or not isinstance(self.source, ModelSource) or not self.is_source:
            return
        model = self.source.model
        bufs, views = [], {}
        for b in self.plan.buckets:
            buf = torch.empty(b.numel, dtype=b.dtype, device=self.device)
            for name, shape, off in zip(b.names, b.shapes, b.offsets):
                t = self.source.tensor(name)
                if t.dtype != b.dtype:
                    log.info("weight sync: parameters stay where they are (wire dtype %s differs from %s)", b.dtype, t.dtype)
                    return
                v = buf[off : off + t.numel()].view(shape)
                v.copy_(t.detach())
                views[name] = v
            bufs.append(buf)
        with torch.no_grad():
            if bind_hf_views(model, views, dense=dense) is None:
                why = ("the optimizer's fused AdamW takes only dense parameters and HF order interleaves each "
                       "expert's projections" if dense else
                       f"a layer's experts span buckets (sync.bucket_mb={self.plan.bucket_bytes / 2**20:.0f})")
                log.info("weight sync: %s, so the parameters cannot live in the buckets; packing every sync", why)
                return
        self._bound = bufs
        log.info("weight sync: parameters live in %d bucket buffers; syncs send them without packing", len(bufs))

    @classmethod
    def from_config(cls, model, sync_cfg, groups=None, engines=(), wire_dtype=None, **kw) -> "WeightSender":
        """``sync_cfg`` is ``cfg.sync``; ``groups`` a ``moe_rl.dist.Groups`` (None: one rank)."""
        g = {}
        if groups is not None:
            ep, trainers = groups.layout.ep_size > 1, len(groups.layout.trainer_ranks) > 1
            g = dict(ep_group=groups.ep if ep else None, trainer_group=groups.trainer if trainers else None,
                     ep_wait_group=groups.ep_wait if ep else None,
                     trainer_wait_group=groups.trainer_wait if trainers else None, dp_rank=groups.dp_rank)
        return cls(
            model, engines=engines, bucket_mb=sync_cfg.bucket_mb, verify=sync_cfg.verify,
            group_name=sync_cfg.group_name, master_address=sync_cfg.master_address, port=sync_cfg.port,
            timeout_s=sync_cfg.timeout_s, pause_mode=sync_cfg.pause_mode, wire_dtype=wire_dtype,
            bind_params=sync_cfg.bind_params, skip_down_engines=sync_cfg.skip_down_engines,
            backend=None if sync_cfg.backend == "auto" else sync_cfg.backend, **g, **kw,
        )

    # --- who packs what ---------------------------------------------------------------------
    def _owner(self, name: str) -> int:
        o = expert_owner(name, self.arch, self.ep_size)
        return 0 if o is None else o

    def _bucket_layout(self, b: Bucket):
        """(my pieces, remote runs). A piece is (slot, element offset in the bucket, numel): a
        whole tensor, packed by its owner (EP rank 0 for a tensor every rank holds), or, for a
        tensor that stacks a layer's experts (``stacked_expert_rows``), each EP rank's block of
        rows, packed by that rank. For the source, the runs of consecutive pieces each helper
        sends, as (ep_rank, element offset, numel)."""
        numels = b.numels()
        pieces = []  # (owner, slot, offset, numel) in bucket order
        for j, name in enumerate(b.names):
            if self.ep_size > 1 and stacked_expert_rows(name, self.arch) is not None:
                n = numels[j] // self.ep_size
                pieces += [(r, j, b.offsets[j] + r * n, n) for r in range(self.ep_size)]
            else:
                pieces.append((self._owner(name), j, b.offsets[j], numels[j]))
        mine = [(j, off, n) for o, j, off, n in pieces if o == self.ep_rank]
        runs = []  # (owner, offset, numel) for maximal runs of one owner
        for o, _, off, n in pieces:
            if runs and runs[-1][0] == o and runs[-1][1] + runs[-1][2] == off:
                runs[-1] = (o, runs[-1][1], runs[-1][2] + n)
            else:
                runs.append((o, off, n))
        return mine, runs

    def _cast(self, t: torch.Tensor | None, name: str, dtype: torch.dtype) -> torch.Tensor:
        if t is None:
            raise RuntimeError(f"{name} is not held by EP rank {self.ep_rank}")
        t = t.detach()
        return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()

    def _alloc(self, numel: int, dtype) -> torch.Tensor:
        """A bucket buffer: from the pool (sized for the largest bucket of its dtype) when
        buffers are kept between syncs, else fresh. The pool holds at most two per dtype."""
        if self.keep_buffers:
            for i, base in enumerate(self._pool):
                if base.dtype == dtype and base.numel() >= numel:
                    return self._pool.pop(i)[:numel]
            cap = max(b.numel for b in self.plan.buckets if b.dtype == dtype)
            base = torch.empty(max(cap, numel), dtype=dtype, device=self.device)
            self._mem.alloc(base.numel() * base.element_size())
            return base[:numel]
        buf = torch.empty(numel, dtype=dtype, device=self.device)
        self._mem.alloc(buf.numel() * buf.element_size())
        return buf

    def _is_bound(self, buf: torch.Tensor) -> bool:
        """Whether ``buf`` is a bucket the parameters live in (``bind_params``)."""
        return self._bound is not None and any(buf is b for b in self._bound)

    def _kept(self, buf: torch.Tensor) -> bool:
        """Whether ``buf``'s storage outlives this sync (a bound bucket, or the kept pool's)."""
        return self.keep_buffers or self._is_bound(buf)

    def _release(self, buf: torch.Tensor | None) -> None:
        if buf is None or self._is_bound(buf):
            return
        if self.keep_buffers:
            base = buf if buf._base is None else buf._base
            self._pool.append(base)
        else:
            self._mem.free(buf.numel() * buf.element_size())

    def _local_tensors(self, i: int, pieces: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """This rank's pieces of bucket i (``_bucket_layout``), as views (cached; rebuilt if a
        parameter moved)."""
        key = self.source.cache_key()
        if key is None or key != self._views_key:
            self._views, self._views_key = {}, key
        views = self._views.get(i)
        if views is None:
            b = self.plan.buckets[i]
            slots = [j for j, _, _ in pieces]
            originals = [self.source.tensor(b.names[j]) for j in slots]
            views = [self._cast(t, b.names[j], b.dtype) for t, j in zip(originals, slots)]
            if key is not None and all(v.data_ptr() == t.data_ptr() for v, t in zip(views, originals)):
                self._views[i] = views  # plain views of the parameters (no cast copies): reusable
        return views

    # --- EP gather ----------------------------------------------------------------------------
    def _ctl(self, value: int) -> int:
        """The source tells its EP helpers the next bucket (or stop / abort); a helper waits here
        while the source waits for the engines."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device if self.backend == "nccl" else "cpu")
        dist.broadcast(t, group=self.ep_wait_group, group_src=0)
        return int(t.item())

    def _prepare(self, i: int):
        """Source: gather + pack bucket i into a fresh buffer (runs in the pack thread)."""
        t0 = time.perf_counter()
        b = self.plan.buckets[i]
        if self._bound is not None:  # the parameters are the bucket: nothing to gather or pack
            buf = self._bound[i]
            return buf, (checksum(buf) if self.verify else None)
        mine, runs = self._layout[i]
        if self.ep_size > 1:
            self._ctl(i)
        buf = self._alloc(b.numel, b.dtype)
        works = []
        tag = 0
        for owner, off, n in runs:
            if owner != 0:
                works.append(dist.irecv(buf[off : off + n], group=self.ep_group, group_src=owner, tag=tag))
                tag += 1
        pack(self._local_tensors(i, mine), buf, [off for _, off, _ in mine], use_triton=self.use_triton)
        for w in works:
            w.wait()
        cs = checksum(buf) if self.verify else None
        self.stats.pack_seconds += time.perf_counter() - t0
        return buf, cs

    def _stop_helpers(self, value: int) -> None:
        if self.ep_size > 1:
            self._ctl(value)

    def _helper_loop(self) -> bool:
        """Helper: serve buckets until the source says stop (True) or abort (False)."""
        self.source.begin()
        while True:
            i = self._ctl(0)
            if i < 0:
                return i == _STOP
            b = self.plan.buckets[i]
            mine, runs = self._layout[i]
            if not mine:
                continue
            send = self._alloc(sum(n for _, _, n in mine), b.dtype)
            try:
                pack(self._local_tensors(i, mine), send, use_triton=self.use_triton)
                works, pos, tag = [], 0, 0
                for owner, off, n in runs:
                    if owner == self.ep_rank:
                        works.append(dist.isend(send[pos : pos + n], group=self.ep_group, group_dst=0, tag=tag))
                        pos += n
                    if owner != 0:
                        tag += 1
                for w in works:
                    w.wait()
            finally:
                self._release(send)

    # --- weight-sync group ----------------------------------------------------------------
    async def _ensure_group(self, engines) -> None:
        key = tuple(e.name for e in engines)
        if self.group is not None and not self.group.closed and self._group_key == key:
            return
        self._close_group()
        # an engine still holding a group of this name refuses a new one (SGLang: "group name
        # already created"): destroy it first; one that holds none answers "does not exist"
        await asyncio.gather(*(e.destroy_weights_update_group(group_name=self.group_name) for e in engines),
                             return_exceptions=True)
        infos = await asyncio.gather(*(e.server_info() for e in engines), return_exceptions=True)
        bad = [f"{e.name}: {r}" for e, r in zip(engines, infos) if isinstance(r, BaseException)]
        if bad:
            raise WeightSyncError("get_server_info failed on " + "; ".join(bad))
        self._checksum_ok = all(bool(i.get("moe_rl_checksum")) for i in infos)
        if self.verify and not self._checksum_ok:
            others = [e.name for e, i in zip(engines, infos) if not i.get("moe_rl_checksum")]
            raise WeightSyncError(f"sync.verify: engine(s) {others} do not check bucket checksums (SGLang drops the "
                                  "field); verify works with the embedded engine (moe-rl serve) only: set sync.verify false")
        port = self.port or free_port(self.master_address)
        world = 1 + sum(e.num_ranks for e in engines)  # SGLang joins with rank_offset + tp_rank
        loop = asyncio.get_running_loop()
        offsets, off = [], 1
        for e in engines:
            offsets.append(off)
            off += e.num_ranks
        calls = [
            asyncio.ensure_future(e.init_weights_update_group(
                master_address=self.master_address, master_port=port, rank_offset=ro, world_size=world,
                group_name=self.group_name, backend=self.backend))
            for e, ro in zip(engines, offsets)
        ]
        try:
            group = await loop.run_in_executor(
                self._bc_exec, SyncGroup, self.master_address, port, 0, world, self.group_name, self.backend, self.timeout_s)
        except Exception as e:
            for c in calls:
                c.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
            raise WeightSyncError(f"could not form the weight-sync group {self.group_name!r} "
                                  f"({world} ranks at {self.master_address}:{port}): {e}") from e
        replies = await asyncio.gather(*calls, return_exceptions=True)
        bad = [f"{e.name}: {r}" for e, r in zip(engines, replies) if isinstance(r, BaseException)]
        if bad:
            group.close()
            raise WeightSyncError("init_weights_update_group failed on " + "; ".join(bad))
        self.group, self._group_key = group, key

    def _close_group(self) -> None:
        if self.group is not None:
            self.group.close()
        self.group = None

    # --- the push (source) ------------------------------------------------------------------
    async def push(self, version, engines=None) -> SyncStats:
        """Source only: sends every bucket to every engine (or to ``engines``, a subset). Raises
        WeightSyncError."""
        if not self.is_source:
            raise RuntimeError("push runs on trainer rank 0 only; other ranks call sync()")
        engines = self.engines if engines is None else engines
        if not engines:
            raise WeightSyncError("no engines to sync to")
        version = None if version is None else str(version)
        self.source.begin()
        await self._ensure_group(engines)
        begun = await asyncio.gather(*(e.begin_weight_update() for e in engines), return_exceptions=True)
        bad = [f"{e.name}: {r}" for e, r in zip(engines, begun) if isinstance(r, BaseException)]
        if bad:
            await asyncio.gather(*(e.end_weight_update() for e, r in zip(engines, begun)
                                   if not isinstance(r, BaseException)), return_exceptions=True)
            raise WeightSyncError("begin_weight_update failed on " + "; ".join(bad))
        loop = asyncio.get_running_loop()
        stats = SyncStats(version=version)
        self.stats = stats
        if not self.keep_buffers:
            self._mem = _Mem()
        self._mem.peak = self._mem.cur
        t0 = time.perf_counter()
        n = len(self.plan.buckets)
        nxt = loop.run_in_executor(self._ep_exec, self._prepare, 0)
        end = _ABORT
        cur = None
        stuck: set[str] = set()  # engines that gave no answer: not asked again (a frozen one costs a timeout each time)
        try:
            for i, b in enumerate(self.plan.buckets):
                cur, cs = await nxt
                nxt = None
                # SGLang fails the call when it must flush while requests run or wait: only
                # "abort" pauses leave none (in_place keeps them running, retract queues them)
                body = dict(b.request_fields(), group_name=self.group_name,
                            flush_cache=(i == n - 1 and self.pause_mode == "abort"), weight_version=version)
                if cs is not None and self._checksum_ok:
                    body["checksum"] = cs
                calls = [asyncio.ensure_future(e.update_weights_from_distributed(**body)) for e in engines]
                await asyncio.sleep(0)  # let the requests go out
                work = self.group.broadcast(cur, src=0, persistent=self._kept(cur))
                faults.point("sync.bucket")  # a test run's crash with the engines mid-update
                if i + 1 < n:
                    nxt = loop.run_in_executor(self._ep_exec, self._prepare, i + 1)
                try:
                    await loop.run_in_executor(self._bc_exec, self.group.wait_work, work)
                except Exception as e:
                    self._close_group()
                    waiting = [eng.name for eng, c in zip(engines, calls) if not c.done()]
                    stuck.update(waiting)
                    for c in calls:
                        c.cancel()
                    await asyncio.gather(*calls, return_exceptions=True)
                    raise WeightSyncError(f"broadcast of bucket {i + 1}/{n} (first tensor {b.names[0]}) failed: {e}"
                                          + (f"; engines still taking it (stuck?): {', '.join(waiting)}" if waiting else "")) from e
                replies = await asyncio.gather(*calls, return_exceptions=True)
                bad = [(eng, r) for eng, r in zip(engines, replies) if isinstance(r, BaseException)]
                if bad:
                    stuck.update(eng.name for eng, r in bad if isinstance(r, EngineTimeoutError))
                    msg = "; ".join(f"{eng.name}: {r}" for eng, r in bad)
                    if any(not isinstance(r, EngineCallError) for _, r in bad):
                        self._close_group()  # an engine died or timed out: the group is suspect
                    raise WeightSyncError(f"bucket {i + 1}/{n} of version {version} rejected: {msg}")
                self._release(cur)
                cur = None
                stats.buckets += 1
                stats.bytes += b.nbytes
            end = _STOP
        finally:
            answering = [e for e in engines if e.name not in stuck]
            ended = await asyncio.gather(*(e.end_weight_update() for e in answering), return_exceptions=True)
            bad = [f"{e.name}: {r}" for e, r in zip(answering, ended) if isinstance(r, BaseException)]
            end_err = None
            if bad:
                log.error("end_weight_update failed on %s", "; ".join(bad))
                if end == _STOP:  # e.g. the engine did not get every tensor: nothing was applied
                    end, end_err = _ABORT, "end_weight_update failed on " + "; ".join(bad)
            self._release(cur)
            if nxt is not None:
                try:
                    buf, _ = await nxt
                    self._release(buf)
                except Exception:
                    pass
            try:
                await loop.run_in_executor(self._ep_exec, self._stop_helpers, end)
            except Exception as e:  # never mask the error that got us here
                log.error("could not tell the EP helpers to stop: %s", e)
            stats.seconds = time.perf_counter() - t0
            stats.peak_extra_bytes = self._mem.peak
        if end_err is not None:
            raise WeightSyncError(end_err)
        return stats

    # --- the protocol: pause, sync, continue ----------------------------------------------
    async def update_engines(self, version) -> SyncStats:
        """Source only: pause every engine (``pause_mode``), push, continue. A failed push
        leaves the engines on their previous weights; they are resumed and the error raised.

        With ``skip_down_engines`` an engine that gives no answer at all (refused, dropped, timed
        out: it crashed) is left out of this sync and named in ``stats.skipped``: the others are
        updated in a weight-sync group formed without it, and it must serve no rollouts (its
        weights are behind). Every sync tries all engines again, so one restarted at the same
        address is back in the group, fully updated, at the next sync. An engine the last sync
        skipped is first asked for ``/health`` (a few seconds at most): one that stays frozen
        costs each sync that probe, not a whole call's timeout."""
        probed = await asyncio.gather(*(_probe(e, min(5.0, self.timeout_s)) for e in self.engines
                                        if e.name in self._down))
        gone = {e.name: err for e, err in zip([e for e in self.engines if e.name in self._down], probed) if err}
        asked = [e for e in self.engines if e.name not in gone]
        replies = dict(zip((e.name for e in asked), await asyncio.gather(
            *(e.pause_generation(mode=self.pause_mode) for e in asked), return_exceptions=True)))
        paused = [replies[e.name] if e.name in replies else gone[e.name] for e in self.engines]
        down = [e for e, r in zip(self.engines, paused) if self.skip_down_engines and _unreachable(r)]
        live = [e for e, r in zip(self.engines, paused) if not isinstance(r, BaseException)]
        self._down = {e.name for e in down}
        err = None
        try:
            bad = [f"{e.name}: {r}" for e, r in zip(self.engines, paused)
                   if isinstance(r, BaseException) and e not in down]
            if bad:
                raise WeightSyncError("pause_generation failed on " + "; ".join(bad))
            if not live:
                raise WeightSyncError("every engine is down: " + "; ".join(f"{e.name}: {r}" for e, r in zip(self.engines, paused)))
            if down:
                log.warning("weight sync %s: skipping %d engine(s) that are down (%s); they serve no rollouts "
                            "until a sync reaches them", version, len(down), ", ".join(e.name for e in down))
            stats = await self.push(version, live)
            stats.skipped = [e.name for e in down]
            return stats
        except BaseException as e:
            err = e
            raise
        finally:
            resumed = await asyncio.gather(*(e.continue_generation() for e in live), return_exceptions=True)
            bad = [f"{e.name}: {r}" for e, r in zip(live, resumed) if isinstance(r, BaseException)]
            if bad and err is None:
                raise WeightSyncError("continue_generation failed on " + "; ".join(bad))

    async def sync_async(self, version) -> SyncStats | None:
        """Collective over the trainer pool: every trainer rank calls it after an optimizer
        step. Rank 0 returns the stats; every rank raises WeightSyncError on failure."""
        loop = asyncio.get_running_loop()
        err: str | None = None
        stats = None
        if self.is_source:
            try:
                stats = await self.update_engines(version)
            except Exception as e:
                err = f"{type(e).__name__}: {e}"
                if self.trainer_group is None:
                    raise
                await loop.run_in_executor(self._ep_exec, self._share_status, err)
                raise
        elif self.active and self.ep_size > 1:
            ok = await loop.run_in_executor(self._ep_exec, self._helper_loop)
            if not ok:
                err = "aborted by trainer rank 0"
        if self.trainer_group is not None:
            err = await loop.run_in_executor(self._ep_exec, self._share_status, err)
            if err is not None:
                raise WeightSyncError(f"weight sync to version {version} failed on trainer rank 0: {err}")
        elif err is not None:
            raise WeightSyncError(f"weight sync to version {version} failed on trainer rank 0: {err}")
        return stats

    def _share_status(self, err: str | None) -> str | None:
        """The outcome of the sync, from the source to every trainer rank (which waited for it)."""
        obj = [err]
        dist.broadcast_object_list(obj, group=self.trainer_wait_group, group_src=0)
        return obj[0]

    def sync(self, version) -> SyncStats | None:
        """Blocking ``sync_async`` for a trainer loop without an event loop of its own (engines
        given as URLs; pass client handles only to ``sync_async``, inside their event loop)."""

        async def run():
            try:
                return await self.sync_async(version)
            finally:
                await self._close_clients()  # their sessions belong to this event loop

        return asyncio.run(run())

    async def _close_clients(self) -> None:
        for e in self.engines:
            if getattr(e, "owned_client", None) is not None:
                await e.owned_client.close()

    def close(self) -> None:
        self._close_group()
        self._ep_exec.shutdown(wait=False)
        self._bc_exec.shutdown(wait=False)
