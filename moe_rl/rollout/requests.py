"""How the rollout names and seeds its ``/generate`` requests: the conventions the rollout
manager (single-turn samples) and the episode runner (multi-turn) share."""
from __future__ import annotations

import numpy as np


def attempt_rid(rid: str, attempt: int) -> str:
    """A resubmitted request gets a new rid: the engine that failed may still hold the old one."""
    return rid if attempt == 0 else f"{rid}-e{attempt}"


def sampling_seed(seed: int, index: int, j: int, offset: int) -> int:
    """A distinct, reproducible sampling seed per (prompt, sample, resume point)."""
    return int(np.random.SeedSequence([seed, index, j, offset]).generate_state(1)[0] & 0x7FFFFFFF)
