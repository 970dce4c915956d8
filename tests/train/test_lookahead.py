"""sync.lookahead: engines get the trainer's weights extrapolated along its last step, and the
trainer's own weights come back bit for bit after the sync."""
import pytest
import torch

from moe_rl.config import load_config
from moe_rl.train.loop import Lookahead


def params(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, 4, generator=g), torch.randn(5, generator=g), torch.randn(2, 2, 2, generator=g)]


@pytest.mark.parametrize("k", [0.5, 1.5, 2.0])
def test_sync_sees_extrapolated_weights_and_trainer_gets_its_own_back(k):
    ps = params(0)
    la = Lookahead(ps, k)
    before = la.snapshot()
    for p, d in zip(ps, params(1)):  # "the optimizer step"
        p.add_(0.01 * d)
    after = [p.clone() for p in ps]
    seen = []
    with la.applied(before):
        seen = [p.clone() for p in ps]  # what the sender reads
    for s, a, b in zip(seen, after, before):
        want = a + k * (a - b)  # plain torch: theta + k (theta - theta_before)
        assert torch.allclose(s, want, rtol=0, atol=1e-6)
        assert not torch.equal(s, a)
    for p, a in zip(ps, after):
        assert torch.equal(p, a)  # bit for bit


def test_weights_come_back_when_the_sync_fails():
    ps = params(0)
    la = Lookahead(ps, 1.0)
    before = la.snapshot()
    ps[0].add_(1.0)
    after = [p.clone() for p in ps]
    with pytest.raises(RuntimeError):
        with la.applied(before):
            raise RuntimeError("engine down")
    assert all(torch.equal(p, a) for p, a in zip(ps, after))


def test_lookahead_validates():
    cfg = load_config("configs/tiny.yaml", ["sync.lookahead=1.5"])
    assert cfg.sync.lookahead == 1.5
    with pytest.raises(Exception, match="sync.lookahead"):
        load_config("configs/tiny.yaml", ["sync.lookahead=-1"])
