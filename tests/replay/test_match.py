"""routing_match against a plain-Python count of (token, layer) pairs with equal expert sets."""
import torch

from moe_rl.replay.match import routing_match


def test_routing_match_counts_equal_expert_sets_over_the_given_rows():
    g = torch.Generator().manual_seed(0)
    T, k, E, L = 11, 3, 6, 2
    used = [torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) for _ in range(L)]
    engine = [u.clone() for u in used]
    engine[0][2] = engine[0][2].flip(0)  # same set, another order: a match
    engine[1][4] = torch.tensor([x for x in range(E) if x not in used[1][4].tolist()][:k])  # disjoint: no match
    engine[0][7, 1] = next(x for x in range(E) if x not in used[0][7].tolist())  # one expert differs
    rows = torch.ones(T, dtype=torch.bool)
    rows[9] = False
    want = sum(set(u[t].tolist()) == set(e[t].tolist()) for u, e in zip(used, engine) for t in range(T) if rows[t])
    match, total = routing_match(used, engine, rows)
    assert isinstance(match, torch.Tensor) and match.dim() == 0  # summed on the device, read by the caller
    assert int(match) == want == 2 * (T - 1) - 2
    assert int(total) == 2 * (T - 1)
