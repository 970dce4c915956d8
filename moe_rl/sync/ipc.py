"""Weight-sync broadcast between processes of one machine by sharing memory (``sync.backend=ipc``).

For a trainer and an engine on the same GPU, where NCCL cannot form a group: rank 0 publishes
each bucket's memory handle in the group's store (a CUDA IPC handle through
``torch.multiprocessing``'s reductions; on CPU a shared-memory file), every other rank maps
it, copies the bucket into its own staging buffer and acknowledges; rank 0's broadcast is
complete once all have. The bucket never leaves the device and there is no host copy. The
receiver's staging and atomic commit are unchanged (moe_rl.sync.receiver).

The handles are pickled into the store like SGLang's ``MultiprocessingSerializer`` does: the
store belongs to this job (trainer rank 0 hosts it), so only its ranks read and write it.
"""
from __future__ import annotations

import datetime
import pickle
import time

import torch
from torch.multiprocessing.reductions import reduce_tensor


def _share(t: torch.Tensor) -> bytes:
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()  # the bucket is packed before anyone reads it
        return pickle.dumps(("cuda", reduce_tensor(t)))
    # CPU: moves the storage into shared memory once (a kept bucket buffer stays there)
    manager, handle, size = t.untyped_storage()._share_filename_cpu_()
    return pickle.dumps(("cpu", (manager, handle, size, t.dtype, t.storage_offset(), t.numel())))


def _open(blob: bytes) -> torch.Tensor:
    kind, args = pickle.loads(blob)
    if kind == "cuda":
        fn, fn_args = args
        return fn(*fn_args)
    manager, handle, size, dtype, offset, numel = args
    storage = torch.UntypedStorage._new_shared_filename_cpu(manager, handle, size)
    return torch.empty(0, dtype=dtype).set_(storage, offset, (numel,))


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

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> _Work:
        if src != 0:
            raise ValueError("the ipc weight-sync group broadcasts from rank 0 only")
        self.seq += 1
        key, ack = f"ipc/{self.seq}", f"ipc/{self.seq}/ack"
        if self.rank == 0:
            def send(timeout_s: float) -> bool:
                self.store.set(key, _share(tensor))
                deadline = time.monotonic() + timeout_s
                while self.store.add(ack, 0) < self.world_size - 1:
                    if time.monotonic() > deadline:
                        return False
                    time.sleep(0.0005)
                self.store.delete_key(key)
                self.store.delete_key(ack)
                return True
            return _Work(send)

        def receive(timeout_s: float) -> bool:
            self.store.wait([key], datetime.timedelta(seconds=timeout_s))
            shared = _open(self.store.get(key))
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
