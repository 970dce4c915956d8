"""The weight-sync process group: trainer rank 0 (rank 0) + every engine TP rank (1..n).

It is independent of the torchrun world (engines may live anywhere) and meets SGLang's
``init_custom_process_group`` (``sglang.srt.utils.common``, reached from
``/init_weights_update_group``) on the wire, key for key:

* rendezvous: the ``tcp://`` handler's TCPStore at master_address:master_port, hosted by rank 0,
  ``multi_tenant=True`` (built here directly: under torchrun ``rendezvous()`` would take the
  elastic agent's store instead and rank 0 would host nothing);
* ``PrefixStore(group_name, store)``, then torch's ``_new_process_group_helper`` with the same
  group name, which adds its own ``"{group_name}/"`` and device (``"cpu/"`` for gloo,
  ``"cuda/"`` for nccl) prefixes before the backend's own keys. SGLang makes those calls; this
  module lays the same keys out by hand (see below), so both sides meet.

Used by both sides: the sender (rank 0) and ``WeightReceiver.init_group`` (ranks 1..n).
``tests/sglang`` forms this group with SGLang's own ``init_custom_process_group``.
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
        if backend not in ("gloo", "nccl", "ipc"):
            raise ValueError(f"weight-sync backend must be gloo, nccl or ipc, not {backend!r}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise RuntimeError("weight-sync backend nccl needs a CUDA device")
        if not group_name:
            raise ValueError("weight-sync group name cannot be empty (SGLang refuses it)")
        # the tcp:// rendezvous's store, as torch.distributed.rendezvous builds it outside torchrun
        store = dist.TCPStore(
            master_address,
            int(master_port),
            world_size,
            is_master=(rank == 0),
            timeout=self.timeout,
            multi_tenant=True,
        )
        store.set_timeout(self.timeout)
        self._tcp_store = store
        self.store = dist.PrefixStore(group_name, store)
        # torch's _new_process_group_helper (which SGLang calls) prefixes "{group_name}/" and then
        # the first device of the backend ("cpu/" for gloo, "cuda/" for nccl). Built by hand so
        # that several ranks of one group can live in one process (tests, the in-process engine).
        inner = dist.PrefixStore("cpu/" if backend == "gloo" else "cuda/", dist.PrefixStore(f"{group_name}/", self.store))
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(inner, rank, world_size, self.timeout)
        elif backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            self.pg = dist.ProcessGroupNCCL(inner, rank, world_size, opts)
        else:  # same machine, shared memory (CUDA IPC), moe-rl's own: see moe_rl.sync.ipc
            from .ipc import IpcGroup

            self.pg = IpcGroup(inner, rank, world_size)
        self.closed = False
        log.debug("weight-sync group %s: rank %d/%d (%s)", group_name, rank, world_size, backend)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, persistent: bool = False):
        """Starts a broadcast from ``src``; returns the work handle (``wait_work`` it).
        ``persistent``: the sender keeps ``tensor``'s buffer between syncs (the ipc backend then
        shares it once; the others ignore it)."""
        if self.closed:
            raise RuntimeError(f"weight-sync group {self.group_name!r} is closed")
        if self.backend == "ipc":
            return self.pg.broadcast(tensor, src, persistent)
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
            if self.backend == "nccl" and hasattr(self.pg, "abort"):
                self.pg.abort()
        except Exception as e:  # pragma: no cover - best effort
            log.debug("aborting weight-sync group %s: %s", self.group_name, e)
        try:
            if hasattr(self.pg, "shutdown"):
                self.pg.shutdown()
        except Exception as e:  # pragma: no cover - best effort
            log.debug("closing weight-sync group %s: %s", self.group_name, e)
        self.pg = None
        self._tcp_store = None
        self.store = None
