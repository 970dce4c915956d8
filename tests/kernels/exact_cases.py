"""What the exact-kernel tests share: one row placed among other rows, run at several batch
sizes and thread counts, and the comparison of its result with the row computed alone."""
from __future__ import annotations

import contextlib

import torch

import moe_rl.kernels.exact as E
from moe_rl import _C

BATCHES = (16, 17, 40)  # other rows around the one watched (>= 15)
THREADS = (1, 2, 3)


@contextlib.contextmanager
def threads(n: int | None):
    E.set_num_threads(n)
    try:
        yield
    finally:
        E.set_num_threads(None)


@contextlib.contextmanager
def isa(name: str):
    before = _C.exact_isa()
    E.set_isa(name)
    try:
        yield
    finally:
        E.set_isa(before)


def among(row: torch.Tensor, others: torch.Tensor, at: int) -> torch.Tensor:
    """``others`` with ``row`` (one leading row) inserted at index ``at``."""
    return torch.cat([others[:at], row, others[at:]])


def row_mismatches(fn, row: torch.Tensor, others: torch.Tensor, thread_counts=THREADS, batches=BATCHES,
                   exact: bool = True) -> list[tuple[int, int]]:
    """(batch, threads) cases where ``fn(batch)[at]`` differs in any bit from ``fn(row)[0]``, the
    row placed mid-batch among ``batch - 1`` of ``others``. With ``exact`` the kernels' thread
    setting is applied (plain torch ops run at torch's own)."""
    with threads(1) if exact else contextlib.nullcontext():
        alone = fn(row)[0]
    bad = []
    for n in batches:
        at = n // 3
        batch = among(row, others[: n - 1], at)
        for t in thread_counts:
            ctx = threads(t) if exact else _torch_threads(t)
            with ctx:
                got = fn(batch)[at]
            if not torch.equal(got, alone):
                bad.append((n, t))
    return bad


def rows_differing(fn, batch: torch.Tensor, torch_threads: int | None = None) -> int:
    """How many rows r of ``batch`` give other bits computed alone, ``fn(batch[r:r+1])``, than in
    ``fn(batch)`` (with torch's thread count set to ``torch_threads`` for both)."""
    with _torch_threads(torch_threads) if torch_threads else contextlib.nullcontext():
        full = fn(batch)
        return sum(not torch.equal(fn(batch[r:r + 1])[0], full[r]) for r in range(batch.shape[0]))


@contextlib.contextmanager
def _torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def used_threads() -> int:
    """Threads the last exact kernel call ran on."""
    return _C.exact_last_threads()


def one_ulp_off(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its first element's last bit flipped: a difference the comparison must see."""
    out = t.clone()
    bits = out.view(torch.int32 if t.dtype == torch.float32 else torch.int16).view(-1)
    bits[0] ^= 1
    return out
