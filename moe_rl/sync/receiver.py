"""Engine side of the weight sync: receive buckets, stage them, commit atomically.

The embedded engine's aiohttp handlers drive it, one call per SGLang endpoint:

- ``/init_weights_update_group``       -> ``init_group(...)`` (blocks until rank 0 and every
  engine rank have joined);
- ``/update_weights_from_distributed`` -> ``receive_bucket(...)`` (blocks on the broadcast);
  when it returns True every parameter has been staged for this update and the engine calls
  ``commit()`` paused, under its lock, then sets its weight_version.

Staging keeps each received bucket whole and holds views into it (no per-tensor copies);
``commit`` copies them into the live parameters in one pass (one Triton launch per bucket on
CUDA). Until then the live parameters are untouched, so a transfer that fails midway (the
sender died, a timeout, a bad checksum, an unknown name) leaves the engine on its previous
version: the error says so, and the staged buckets are dropped.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import torch

from moe_rl.kernels.bucket_pack import unpack

from .group import DEFAULT_TIMEOUT_S, SyncGroup
from .plan import _prod, parse_dtype, verify_checksum

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """A weight update that did not complete; the message says which version is live."""


@dataclass(eq=False)
class _Layout:
    """One bucket layout (names and shapes in order) as sent, with what is derived from it."""

    names: list[str]
    shapes: list[list[int]]  # as sent, to compare the next request against
    dims: list[tuple[int, ...]]
    numels: list[int]
    numel: int
    checked: bool = False  # names, shapes and dtype found in the model
    views: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # buffer address -> views


class WeightReceiver:
    def __init__(self, named_params: dict[str, torch.Tensor], timeout_s: float = DEFAULT_TIMEOUT_S,
                 keep_buffers: bool | None = None, rebind=None):
        """``keep_buffers``: reuse the staging buffers across updates (default on CPU, where
        fresh pages cost more than the copy; on CUDA torch's caching allocator does it).
        ``rebind(staged)``: optional; re-points the model's parameters at the staged views
        (e.g. ``moe_rl.model.bind_hf_views``) and returns the new name -> live tensor map, or
        None if it cannot; then commit swaps storage instead of copying (the received buckets
        become the live weights, and the previous ones are reused for the next update)."""
        self.params = dict(named_params)
        self.rebind = rebind
        self._live_buffers: list[torch.Tensor] = []  # received buckets the parameters now live in
        self.zero_copy_commits = 0
        self._layouts: dict[tuple, _Layout] = {}  # bucket layouts seen, by a cheap key
        self._bind_cache: dict = {}  # for ``rebind``: its plan per set of buffers
        if not self.params:
            raise ValueError("WeightReceiver needs at least one named parameter")
        self.device = next(iter(self.params.values())).device
        self.keep_buffers = (self.device.type == "cpu") if keep_buffers is None else keep_buffers
        self._pool: list[torch.Tensor] = []
        self.timeout_s = timeout_s
        self.groups: dict[str, SyncGroup] = {}
        self.weight_version: str | None = None  # version of the last committed update
        self._lock = threading.Lock()
        self._reset()

    # --- group ----------------------------------------------------------------------------
    def init_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "gloo",
    ) -> None:
        """Joins the weight-sync group as rank ``rank_offset`` (one rank per engine here).
        A group of the same name is replaced (a sender that re-creates it after a failure)."""
        old = self.groups.pop(group_name, None)
        if old is not None:
            old.close()
        self.groups[group_name] = SyncGroup(
            master_address, master_port, rank_offset, world_size, group_name, backend, self.timeout_s
        )

    def destroy_group(self, group_name: str) -> None:
        g = self.groups.pop(group_name, None)
        if g is not None:
            g.close()

    # --- update -----------------------------------------------------------------------------
    def _reset(self) -> None:
        if self.keep_buffers and getattr(self, "_buffers", None):
            self._pool = self._buffers  # the same plan next time: same sizes, in order
        if getattr(self, "_layouts", None):  # forget views of buffers no longer held
            held = {b.data_ptr() for b in self._pool + self._live_buffers}
            for lay in self._layouts.values():
                for ptr in [p for p in lay.views if p not in held]:
                    del lay.views[ptr]
        self._staged: dict[str, torch.Tensor] = {}
        self._buffers: list[torch.Tensor] = []
        self._pending_version: str | None = None
        self._received_buckets = 0

    def receive_bucket(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        load_format: str | None = "flattened_bucket",
        weight_version: str | None = None,
        checksum: str | None = None,
    ) -> bool:
        """Receives one bucket's broadcast and stages it. Returns True once every parameter of
        the model is staged for this update (then call ``commit``). Raises ``WeightSyncError``
        (naming the tensor, for a mismatch) and drops the partial update on any failure."""
        with self._lock:
            try:
                return self._receive(names, dtypes, shapes, group_name, load_format, weight_version, checksum)
            except BaseException as e:
                done = self._received_buckets
                self._reset()
                live = f"version {self.weight_version}" if self.weight_version is not None else "the initial weights"
                what = str(e) if isinstance(e, WeightSyncError) else f"{type(e).__name__}: {e}"
                raise WeightSyncError(
                    f"weight update to version {weight_version} aborted after {done} buckets: {what}; "
                    f"parameters unchanged (still {live})"
                ) from (None if isinstance(e, WeightSyncError) else e)

    def _receive(self, names, dtypes, shapes, group_name, load_format, weight_version, checksum) -> bool:
        group = self.groups.get(group_name)
        if group is None:
            raise WeightSyncError(f"no weight-sync group {group_name!r}; call init_weights_update_group first")
        if load_format not in ("flattened_bucket", None):
            # the size of what the sender broadcasts is unknown: leaving the group makes its
            # broadcast fail at once instead of at its timeout
            self.destroy_group(group_name)
            raise WeightSyncError(f"load_format {load_format!r} is not supported (SGLang's are 'flattened_bucket' "
                                  f"and none = one broadcast per tensor); left group {group_name!r} so the sender fails now")
        if not (len(names) == len(dtypes) == len(shapes)) or not names:
            raise WeightSyncError(f"a bucket needs equal, non-empty names/dtypes/shapes "
                                  f"(got {len(names)}/{len(dtypes)}/{len(shapes)})")
        wire = {parse_dtype(d) for d in set(dtypes)}
        if load_format is None or len(wire) != 1:
            return self._receive_by_bytes(group, names, [parse_dtype(d) for d in dtypes], shapes,
                                          per_tensor=load_format is None, weight_version=weight_version,
                                          checksum=checksum)
        dtype = wire.pop()
        lay = self._layout(dtype, names, shapes)
        if self._pending_version != weight_version and self._received_buckets:
            log.warning("weight update %s was incomplete (%d buckets) when %s started; dropped",
                        self._pending_version, self._received_buckets, weight_version)
            self._reset()
        self._pending_version = weight_version

        # Receive first, so the collective completes on every rank even if the metadata is bad.
        buf = self._buffer(lay.numel, dtype)
        work = group.broadcast(buf, src=0)
        try:
            group.wait_work(work)
        except Exception as e:
            self.destroy_group(group_name)  # a broken group: the sender re-creates it
            raise WeightSyncError(f"receiving the bucket starting with {names[0]} failed (is the sender "
                                  f"alive?): {e}") from e
        if checksum is not None and not verify_checksum(buf, checksum):
            raise WeightSyncError(f"checksum mismatch on the bucket starting with {names[0]}")

        if not lay.checked:  # against the model, once per layout (after the receive, see above)
            for name, shape in zip(names, shapes):
                self._check_tensor(name, shape, dtype)
            if len(set(names)) != len(names):
                dup = next(n for n in names if names.count(n) > 1)
                raise WeightSyncError(f"tensor {dup} sent twice in update {weight_version}")
            lay.checked = True
        # the same layout into the same buffer (every update after the first two on CPU): the
        # views exist already; thousands of small experts make this count
        views = lay.views.get(buf.data_ptr()) if self.keep_buffers else None
        if views is None:
            views, pos = [], 0
            for shape, n in zip(lay.dims, lay.numels):
                views.append(buf[pos : pos + n].view(shape))
                pos += n
            if self.keep_buffers:
                lay.views[buf.data_ptr()] = views
        if not self._staged.keys().isdisjoint(names):
            dup = next(n for n in names if n in self._staged)
            raise WeightSyncError(f"tensor {dup} sent twice in update {weight_version}")
        self._staged.update(zip(names, views))
        self._buffers.append(buf)
        self._received_buckets += 1
        return len(self._staged) == len(self.params)

    def _check_tensor(self, name: str, shape, dtype: torch.dtype) -> None:
        live = self.params.get(name)
        if live is None:
            raise WeightSyncError(f"unknown tensor {name!r}: the engine's model has no such parameter")
        if tuple(live.shape) != tuple(shape):
            raise WeightSyncError(f"shape mismatch for {name}: sent {tuple(shape)}, the model has {tuple(live.shape)}")
        if live.dtype != dtype:
            raise WeightSyncError(f"dtype mismatch for {name}: sent {dtype}, the model has {live.dtype}")

    def _receive_by_bytes(self, group, names, dtypes, shapes, *, per_tensor, weight_version, checksum) -> bool:
        """SGLang's other two wire forms: one broadcast per tensor (no load_format), or a
        flattened bucket of several dtypes (bytes, each tensor at its byte offset). Everything
        is received before anything is checked, so the sender never hangs on a bad request."""
        if self._pending_version != weight_version and self._received_buckets:
            self._reset()
        self._pending_version = weight_version
        shapes = [tuple(int(d) for d in sh) for sh in shapes]
        nbytes = [_prod(sh) * dt.itemsize for sh, dt in zip(shapes, dtypes)]
        if per_tensor:
            bufs = [torch.empty(_prod(sh), dtype=dt, device=self.device) for sh, dt in zip(shapes, dtypes)]
            works = [group.broadcast(b, src=0) for b in bufs]  # posted in order, like SGLang
            views = [b.view(sh) for b, sh in zip(bufs, shapes)]
        else:
            offs = [sum(nbytes[:i]) for i in range(len(nbytes))]
            bad = [n for n, o, dt in zip(names, offs, dtypes) if o % dt.itemsize]
            buf = torch.empty(sum(nbytes), dtype=torch.uint8, device=self.device)
            works = [group.broadcast(buf, src=0)]
            bufs = [buf]
            views = [buf[o:o + nb].view(dt).view(sh) for o, nb, dt, sh in zip(offs, nbytes, dtypes, shapes)] if not bad else []
        try:
            for w in works:
                group.wait_work(w)
        except Exception as e:
            self.destroy_group(group.group_name)
            raise WeightSyncError(f"receiving the tensors starting with {names[0]} failed (is the sender alive?): {e}") from e
        if not per_tensor and bad:
            raise WeightSyncError(f"tensor {bad[0]} is not aligned to its dtype in the flattened bucket")
        if checksum is not None:
            raise WeightSyncError("a checksum is only checked on a single-dtype flattened bucket")
        for n, sh, dt in zip(names, shapes, dtypes):
            self._check_tensor(n, sh, dt)
        if len(set(names)) != len(names) or not self._staged.keys().isdisjoint(names):
            dup = next(n for n in names if n in self._staged or names.count(n) > 1)
            raise WeightSyncError(f"tensor {dup} sent twice in update {weight_version}")
        self._staged.update(zip(names, views))
        self._buffers.extend(bufs)
        self._received_buckets += 1
        return len(self._staged) == len(self.params)

    def _layout(self, dtype: torch.dtype, names: list[str], shapes: list[list[int]]) -> "_Layout":
        """The bucket layout of this request: found by a cheap key and confirmed by comparing
        the lists (hashing 18,000 freshly decoded names would cost more), else made."""
        key = (dtype, len(names), names[0], names[-1])
        lay = self._layouts.get(key)
        if lay is not None and lay.names == names and lay.shapes == shapes:
            return lay
        if any(int(d) < 0 for s in shapes for d in s):
            raise WeightSyncError(f"negative dimension in the shapes of {names[0]}...")
        shapes = [tuple(int(d) for d in s) for s in shapes]
        numels = [_prod(s) for s in shapes]
        lay = _Layout(list(names), [list(s) for s in shapes], shapes, numels, sum(numels))
        if len(self._layouts) >= 256:  # a sender with a new plan: the old layouts go
            self._layouts.clear()
        self._layouts[key] = lay
        return lay

    def _buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        for i, b in enumerate(self._pool):
            if b.dtype == dtype and b.numel() == numel:
                return self._pool.pop(i)
        return torch.empty(numel, dtype=dtype, device=self.device)

    @property
    def complete(self) -> bool:
        return len(self._staged) == len(self.params)

    @property
    def pending_version(self) -> str | None:
        return self._pending_version

    def commit(self) -> None:
        """Copies every staged tensor into the live parameters (call paused, under the engine's
        lock). Refuses an incomplete update."""
        with self._lock:
            if not self.complete:
                missing = [n for n in self.params if n not in self._staged]
                n = len(missing)
                self._reset()
                raise WeightSyncError(f"commit of an incomplete update: {n} tensors missing, e.g. {missing[0]}; "
                                      f"parameters unchanged")
            if self.rebind is not None:
                live = self.rebind(self._staged)
                if live is not None:  # zero-copy commit: the buckets are the weights now
                    self.params = live
                    previous, self._live_buffers = self._live_buffers, self._buffers
                    # the buckets the weights lived in so far take the next update (_reset pools them)
                    self._buffers = previous if self.keep_buffers else []
                    self.zero_copy_commits += 1
                    self.weight_version = self._pending_version
                    self._reset()
                    return
            with torch.no_grad():
                # group by source buffer: one unpack (one launch on CUDA) per bucket
                by_buf: dict[int, tuple[torch.Tensor, list, list]] = {}
                for name, view in self._staged.items():
                    key = view.untyped_storage().data_ptr()
                    base = by_buf.setdefault(key, (view, [], []))
                    base[1].append(self.params[name])
                    base[2].append(view)
                for buf in self._buffers:
                    entry = by_buf.get(buf.untyped_storage().data_ptr())
                    if entry is None:
                        continue
                    _, dsts, views = entry
                    offs = [v.storage_offset() - buf.storage_offset() for v in views]
                    if all(d.is_contiguous() for d in dsts) and all(v.dtype == buf.dtype for v in views):
                        unpack(buf, dsts, offs)
                    else:  # a bucket of several dtypes (bytes); parameters are contiguous
                        for d, v in zip(dsts, views):
                            d.copy_(v)
            self.weight_version = self._pending_version
            self._reset()

    def abort(self) -> None:
        """Drops a partial update (the live parameters were never touched)."""
        with self._lock:
            if self._received_buckets:
                log.warning("weight update %s aborted after %d buckets", self._pending_version, self._received_buckets)
            self._reset()
