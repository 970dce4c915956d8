"""How often trainer and engine routed a token to the same experts."""
from __future__ import annotations

import torch


def routing_match(used: list[torch.Tensor], engine: list[torch.Tensor], rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(matching, total) (token, MoE layer) pairs whose expert *sets* agree, over the tokens
    where ``rows`` is set. ``used`` and ``engine`` hold one [tokens, top_k] tensor per layer;
    every tensor on one device. Two 0-dim int64 tensors on that device: no host read, so a
    trainer can add them up over a step and read the total once."""
    match = torch.zeros((), dtype=torch.long, device=rows.device)
    for u, e in zip(used, engine):
        match += ((u.sort(dim=1).values == e.sort(dim=1).values).all(dim=1) & rows).sum()
    return match, rows.sum() * len(used)
