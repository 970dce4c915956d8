"""The weight-sync process group: trainer rank 0 (rank 0) + every engine rank (1..n).

It is independent of the torchrun world (engines may live anywhere), built like SGLang's
``init_custom_process_group``: a TCPStore hosted by rank 0, namespaced by the group name
(``PrefixStore``), and a bare ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` over it. Used by
both sides: the sender (rank 0) and ``WeightReceiver.init_group`` (ranks 1..n).
"""
from __future__ import annotations

import datetime
import logging
import socket

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 120.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class SyncGroup:
    """A process group of ``world_size`` ranks made from a TCPStore at master_address:port."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        backend: str = "gloo",
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside the weight-sync group of size {world_size}")
        self.rank, self.world_size, self.group_name = rank, world_size, group_name
        self.backend = backend
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        store = dist.TCPStore(
            master_address,
            int(master_port),
            world_size,
            is_master=(rank == 0),
            timeout=self.timeout,
            wait_for_workers=False,
        )
        self._tcp_store = store
        self.store = dist.PrefixStore(f"moe_rl_sync/{group_name}", store)
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(self.store, rank, world_size, self.timeout)
        elif backend == "nccl":
            if not torch.cuda.is_available():
                raise RuntimeError("weight-sync backend nccl needs a CUDA device")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            self.pg = dist.ProcessGroupNCCL(self.store, rank, world_size, opts)
        elif backend == "ipc":  # same machine, shared memory (CUDA IPC): see moe_rl.sync.ipc
            from .ipc import IpcGroup

            self.pg = IpcGroup(self.store, rank, world_size)
        else:
            raise ValueError(f"weight-sync backend must be gloo, nccl or ipc, not {backend!r}")
        self.closed = False
        log.debug("weight-sync group %s: rank %d/%d (%s)", group_name, rank, world_size, backend)

    def broadcast(self, tensor: torch.Tensor, src: int = 0):
        """Starts a broadcast from ``src``; returns the work handle (``wait_work`` it)."""
        if self.closed:
            raise RuntimeError(f"weight-sync group {self.group_name!r} is closed")
        if self.backend == "ipc":
            return self.pg.broadcast(tensor, src)
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = self.timeout
        return self.pg.broadcast([tensor], opts)

    def wait_work(self, work) -> None:
        """Waits for a broadcast; raises RuntimeError after the group's timeout or when a peer died."""
        ok = work.wait(self.timeout)
        if ok is False:
            raise TimeoutError(f"weight-sync broadcast on {self.group_name!r} timed out after {self.timeout_s:.0f} s")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if hasattr(self.pg, "abort") and self.backend == "nccl":
                self.pg.abort()
            elif hasattr(self.pg, "shutdown"):
                self.pg.shutdown()
        except Exception as e:  # pragma: no cover - best effort
            log.debug("closing weight-sync group %s: %s", self.group_name, e)
        self.pg = None
        self._tcp_store = None
        self.store = None
