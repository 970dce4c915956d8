"""Weight-sync broadcast between processes of one machine by sharing memory (``sync.backend=ipc``).

For a trainer and an engine on the same GPU, where NCCL cannot form a group: rank 0 publishes
each bucket's memory handle in the group's store (a CUDA IPC handle through
``torch.multiprocessing``'s reductions; on CPU a shared-memory file), every other rank maps
it, copies the bucket into its own staging buffer and acknowledges; rank 0's broadcast is
complete once all have. The bucket never leaves the device and there is no host copy. The
receiver's staging and atomic commit are unchanged (moe_rl.sync.receiver).

A bucket buffer the sender keeps between syncs (its parameters bound into buckets, or its kept
pool: ``broadcast(..., persistent=True)``) is shared once: later broadcasts of it name the
storage the other ranks have already mapped, with the offset, length and dtype of this bucket.
Sharing it anew every time would grow torch's per-share records on the sender and leave one
opened CUDA event per share on each receiver (torch never destroys those), without bound over a
long run; mapping it anew would also cost a handle open and close per bucket. A buffer made for
one sync is shared and mapped for that broadcast only, so its memory goes when the sync ends.

The handles are pickled into the store like SGLang's ``MultiprocessingSerializer`` does: the
store belongs to this job (trainer rank 0 hosts it), so only its ranks read and write it.
"""
from __future__ import annotations

import datetime
import pickle
import time

import torch
from torch.multiprocessing.reductions import reduce_tensor


def _share(storage: torch.UntypedStorage):
    """A handle another process opens with ``_open``: the whole storage."""
    if storage.device.type == "cuda":
        whole = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        return ("cuda", reduce_tensor(whole))
    # CPU: moves the storage into shared memory (once: a kept buffer stays there)
    return ("cpu", storage._share_filename_cpu_())


def _open(handle) -> torch.UntypedStorage:
    kind, args = handle
    if kind == "cuda":
        fn, fn_args = args
        return fn(*fn_args).untyped_storage()
    return torch.UntypedStorage._new_shared_filename_cpu(*args)


class _Work:
    def __init__(self, fn):
        self.fn = fn

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return self.fn(timeout.total_seconds() if timeout is not None else 300.0)


class IpcGroup:
    """``broadcast``/``wait`` with the semantics ``SyncGroup`` gives its process groups."""

    def __init__(self, store, rank: int, world_size: int):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.seq = 0  # broadcasts so far: every rank counts the same ones
        self.shared: dict[int, torch.UntypedStorage] = {}  # rank 0: kept storages the others have mapped
        self.mapped: dict[int, torch.UntypedStorage] = {}  # other ranks: rank 0's kept storages, mapped once
        self.shares = self.opens = 0  # handles made / opened (a kept buffer's only once)

    def _describe(self, t: torch.Tensor, persistent: bool) -> bytes:
        storage = t.untyped_storage()
        if t.is_cuda:
            torch.cuda.current_stream(t.device).synchronize()  # the bucket is packed before anyone reads it
        where = (t.storage_offset(), t.numel(), t.dtype)
        if persistent and storage.data_ptr() in self.shared:
            return pickle.dumps((storage.data_ptr(), None, where))
        self.shares += 1
        handle = _share(storage)
        sid = storage.data_ptr()  # after sharing: a CPU storage has moved into shared memory
        if persistent:
            self.shared[sid] = storage
        return pickle.dumps((sid if persistent else None, handle, where))

    def _view(self, blob: bytes) -> torch.Tensor:
        sid, handle, (offset, numel, dtype) = pickle.loads(blob)
        if handle is None:
            storage = self.mapped.get(sid)
            if storage is None:
                raise RuntimeError(f"ipc bucket {self.seq}: names a shared buffer this rank never mapped")
        else:
            self.opens += 1
            storage = _open(handle)
            if sid is not None:
                self.mapped[sid] = storage
        return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, (numel,))

    def broadcast(self, tensor: torch.Tensor, src: int = 0, persistent: bool = False) -> _Work:
        """``persistent``: rank 0 keeps ``tensor``'s storage (and its contents' place) for the
        group's life, so it is shared once (module docstring)."""
        if src != 0:
            raise ValueError("the ipc weight-sync group broadcasts from rank 0 only")
        self.seq += 1
        key, ack = f"ipc/{self.seq}", f"ipc/{self.seq}/ack"
        if self.rank == 0:
            def send(timeout_s: float) -> bool:
                self.store.set(key, self._describe(tensor, persistent))
                deadline = time.monotonic() + timeout_s
                left = [_left(r) for r in range(1, self.world_size)]
                polls = 0
                while self.store.add(ack, 0) < self.world_size - 1:
                    if time.monotonic() > deadline:
                        return False
                    polls += 1
                    # a rank that left the group (as gloo's peer closing its connection) fails
                    # the broadcast now, not at its timeout
                    if polls % 100 == 0 and self.store.check(left):
                        gone = [r for r in range(1, self.world_size) if self.store.check([_left(r)])]
                        raise RuntimeError(f"ipc weight-sync group: rank(s) {gone} left it during bucket {self.seq}")
                    time.sleep(0.0005)
                self.store.delete_key(key)
                self.store.delete_key(ack)
                return True
            return _Work(send)

        def receive(timeout_s: float) -> bool:
            self.store.wait([key], datetime.timedelta(seconds=timeout_s))
            shared = self._view(self.store.get(key))
            if shared.numel() != tensor.numel() or shared.dtype != tensor.dtype:
                raise RuntimeError(f"ipc bucket {self.seq}: sent {shared.numel()} x {shared.dtype}, expected "
                                   f"{tensor.numel()} x {tensor.dtype}")
            tensor.copy_(shared)
            if tensor.is_cuda:
                torch.cuda.current_stream(tensor.device).synchronize()  # copied before rank 0 may reuse it
            del shared
            self.store.add(ack, 1)
            return True
        return _Work(receive)

    def shutdown(self) -> None:
        """The group ends: the mapped storages are let go (rank 0's memory may then be freed),
        and a rank other than 0 says it left, so that a broadcast rank 0 waits on fails now."""
        self.shared.clear()
        self.mapped.clear()
        if self.rank != 0:
            try:
                self.store.set(_left(self.rank), "1")
            except Exception:  # rank 0's store is gone: nobody waits on this rank any more
                pass


def _left(rank: int) -> str:
    return f"ipc/left/{rank}"
