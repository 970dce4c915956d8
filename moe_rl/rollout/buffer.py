"""Thread-safe rollout buffer: the manager puts finished groups, the trainer takes batches.

A batch for trainer version v only holds groups whose oldest token is at least v - eta
(``min_version``); older groups are dropped and counted, never trained on.
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
        self.closed = False

    def put(self, group: Group) -> None:
        with self._cv:
            self._groups.append(group)
            self._cv.notify_all()

    def __len__(self) -> int:
        with self._cv:
            return len(self._groups)

    def take(self, n: int, min_version: int, timeout: float | None = None, alive=None) -> list[Group]:
        """Blocks until n groups with min_version >= ``min_version`` are there; oldest first.

        ``alive`` (a callable) is polled while waiting, so a dead producer raises instead of
        hanging the trainer.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while True:
                self._drop_stale(min_version)
                if len(self._groups) >= n:
                    return [self._groups.popleft() for _ in range(n)]
                if self.closed:
                    raise RuntimeError("rollout buffer closed while the trainer waits for data")
                if alive is not None:
                    alive()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"waited {timeout}s for {n} groups, have {len(self._groups)}")
                self._cv.wait(timeout=1.0 if left is None else min(left, 1.0))

    def _drop_stale(self, min_version: int) -> None:
        keep = deque(g for g in self._groups if g.min_version >= min_version)
        self.dropped_stale += len(self._groups) - len(keep)
        self._groups = keep

    def close(self) -> None:
        with self._cv:
            self.closed = True
            self._cv.notify_all()

    def state_dict(self) -> dict:
        with self._cv:
            return {"groups": [g.to_dict() for g in self._groups], "dropped_stale": self.dropped_stale}

    def load_state_dict(self, state: dict) -> None:
        with self._cv:
            self._groups = deque(Group.from_dict(g) for g in state["groups"])
            self.dropped_stale = state["dropped_stale"]
