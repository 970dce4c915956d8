"""`moe-rl bench gated-delta`'s accuracy check (moe_rl.kernels.bench.gated_delta) against the float64
recurrence: it passes the chunked rule and fails a provider that leaks the state from one packed
sequence into the next, or that drops the gradient of beta; the run's own known-bad input (the
gate dropped) fails it too."""
import torch

from moe_rl.kernels import gated_delta as gd
from moe_rl.kernels.bench import gated_delta as bench

SHAPE = (3, 40, 2, 8, 12)  # lengths 77, 3, 77: a partial chunk, a short one, two chunks
CPU = torch.device("cpu")


def _torch(*args):
    return gd.chunk_gated_delta_rule(*args, impl="torch")


def test_the_chunked_rule_passes():
    acc = bench.check_accuracy(_torch, SHAPE, torch.float32, CPU)
    assert acc["ok"] and acc["tolerance"] == 1e-4
    assert set(acc["errors"]) == {"o", "final", "dq", "dk", "dv", "dg", "dbeta"}
    assert max(acc["errors"].values()) < 1e-5


def test_a_state_leak_between_sequences_fails_and_so_does_a_dropped_gate():
    def leaky(q, k, v, g, b, cu, s0):  # every sequence continues the previous one's state
        o, final = _torch(q, k, v, g, b, cu.new_tensor([0, int(cu[-1])]), s0[:1])
        return o, final.expand(s0.shape)
    acc = bench.check_accuracy(leaky, SHAPE, torch.float32, CPU)
    assert not acc["ok"] and acc["errors"]["o"] > 1e-2
    assert bench.check_can_fail(SHAPE, torch.float32, CPU)


def test_a_missing_gradient_fails():
    def no_beta_grad(q, k, v, g, b, cu, s0):
        return _torch(q, k, v, g, b.detach() + 0 * b, cu, s0)
    acc = bench.check_accuracy(no_beta_grad, SHAPE, torch.float32, CPU)
    assert not acc["ok"] and acc["errors"]["dbeta"] == 1.0 and acc["errors"]["o"] < 1e-5
