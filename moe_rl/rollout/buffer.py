"""Thread-safe rollout buffer: the manager puts finished groups, the trainer takes batches.

A batch for trainer version v only holds groups whose oldest token is at least v - eta
(``min_version``); older groups are dropped and counted, never trained on. The buffer also
knows the groups still in flight (``expect``): a group submitted at version v - eta would be
too old for the next step, so ``take`` waits for it and takes the oldest groups first. With
the manager's submission gate this keeps the bound without discarding work.
"""
from __future__ import annotations

import threading
import time
from collections import deque

from .sample import Group


class RolloutBuffer:
    def __init__(self):
        self._groups: deque[Group] = deque()
        self._cv = threading.Condition()
        self.dropped_stale = 0  # groups discarded by the staleness bound
        self.dropped_ids: list[int] = []  # their group ids, for accounting
        self.closed = False
        self._inflight: dict[int, int] = {}  # group id -> version it was submitted at

    def expect(self, group_id: int, submitted_version: int) -> None:
        with self._cv:
            self._inflight[group_id] = submitted_version

    def put(self, group: Group) -> None:
        with self._cv:
            self._inflight.pop(group.group_id, None)
            self._groups.append(group)
            self._cv.notify_all()

    def __len__(self) -> int:
        with self._cv:
            return len(self._groups)

    def uids(self) -> set[str]:
        """The uids of the samples held (their routing records are still needed)."""
        with self._cv:
            return {s.uid for g in self._groups for s in g.samples}

    def take(self, n: int, min_version: int, timeout: float | None = None, alive=None) -> list[Group]:
        """Blocks until n groups with min_version >= ``min_version`` are there and no group
        submitted at ``min_version`` or before is still in flight; returns the n groups
        submitted earliest.

        ``alive`` (a callable) is polled while waiting, so a dead producer raises instead of
        hanging the trainer.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while True:
                self._drop_stale(min_version)
                due = any(v <= min_version for v in self._inflight.values())
                if len(self._groups) >= n and not due:
                    order = sorted(self._groups, key=lambda g: g.submitted_version)
                    self._groups = deque(order[n:])
                    return order[:n]
                if alive is not None:  # first: a dead producer's own error says more than "closed"
                    alive()
                if self.closed:
                    raise RuntimeError("rollout buffer closed while the trainer waits for data")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"waited {timeout}s for {n} groups, have {len(self._groups)}")
                self._cv.wait(timeout=1.0 if left is None else min(left, 1.0))

    def _drop_stale(self, min_version: int) -> None:
        keep = deque(g for g in self._groups if g.min_version >= min_version)
        if len(keep) != len(self._groups):
            self.dropped_ids += [g.group_id for g in self._groups if g.min_version < min_version]
            self.dropped_stale = len(self.dropped_ids)
        self._groups = keep

    def close(self) -> None:
        with self._cv:
            self.closed = True
            self._cv.notify_all()

    def state_dict(self) -> dict:
        with self._cv:
            return {"groups": [g.to_dict() for g in self._groups], "dropped_ids": list(self.dropped_ids)}
        # groups in flight are the manager's to resubmit (RolloutManager.state_dict)

    def load_state_dict(self, state: dict) -> None:
        with self._cv:
            self._groups = deque(Group.from_dict(g) for g in state["groups"])
            self.dropped_ids = list(state["dropped_ids"])
            self.dropped_stale = len(self.dropped_ids)
