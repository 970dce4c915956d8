"""How often trainer and engine routed a token to the same experts."""
from __future__ import annotations

import torch


def routing_match(used: list[torch.Tensor], engine: list[torch.Tensor], has_rec: torch.Tensor) -> tuple[int, int]:
    """(matching, total) (token, MoE layer) pairs whose expert *sets* agree, over the tokens
    where ``has_rec`` is set. ``used`` and ``engine`` hold one [tokens, top_k] tensor per layer."""
    match = 0
    for u, e in zip(used, engine):
        u, e = u[has_rec].sort(dim=1).values, e[has_rec].sort(dim=1).values
        match += int((u == e).all(dim=1).sum())
    return match, int(has_rec.sum()) * len(used)
