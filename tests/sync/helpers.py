"""Processes for the weight-sync tests (module level: spawned processes import them)."""
from __future__ import annotations

import contextlib
import hashlib
import os

import torch
import torch.distributed as dist

from moe_rl.model import MoEArch, MoEForCausalLM, bind_hf_views, iter_local_hf_tensors
from moe_rl.sync import WeightReceiver, WeightSender
from moe_rl.sync.local import LocalEngine, serve_receiver
from tests.distributed import process_context

# Small, but several MoE layers so buckets mix expert and shared tensors.
ARCH = dict(vocab_size=48, hidden_size=32, moe_intermediate_size=16, intermediate_size=64, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
            mlp_only_layers=[1])
BUCKET_MB = 0.02  # ~20 KB: many buckets, runs of experts from both EP ranks in one bucket


def arch(**kw) -> MoEArch:
    return MoEArch(**{**ARCH, **kw})


def tensor_hash(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def model_hashes(model) -> dict[str, str]:
    return {n: tensor_hash(t) for n, t in iter_local_hf_tensors(model)}


class RecordingReceiver(WeightReceiver):
    last_error: str | None = None

    def receive_bucket(self, *a, **kw):
        try:
            return super().receive_bucket(*a, **kw)
        except Exception as e:
            self.last_error = str(e)
            raise


def receiver_main(conns, seed: int, arch_kw: dict, rebind: bool = False):
    """Engine stand-in: an EP=1 model (init seed ``seed``) served on each pipe in turn; with
    ``rebind`` its commits swap storage (moe_rl.model.bind_hf_views) when buckets allow."""
    torch.set_num_threads(1)
    model = MoEForCausalLM(arch(**arch_kw)).init_weights(seed)
    rx = RecordingReceiver(dict(iter_local_hf_tensors(model)), timeout_s=30,
                           rebind=(lambda staged: bind_hf_views(model, staged)) if rebind else None)
    extra = {
        "hashes": lambda: model_hashes(model),
        "state": lambda: {"version": rx.weight_version, "last_error": rx.last_error,
                          "zero_copy_commits": rx.zero_copy_commits},
    }
    serve_receiver(conns, rx, extra)


def trainer_sync(rank, world, conn, seed, version, verify, kill_after, arch_kw=None):
    """A trainer rank (EP=world): model with init seed ``seed``, syncs once to the engine.
    ``kill_after``: rank 0 dies (os._exit) right after posting that bucket's request."""
    ep = dist.new_group(list(range(world))) if world > 1 else None
    model = MoEForCausalLM(arch(**(arch_kw or {})), ep_group=ep).init_weights(seed)
    engines = []
    if rank == 0:
        engines = [LocalEngine(conn, timeout_s=60)]
        if kill_after is not None:
            engines = [_DyingEngine(conn, kill_after)]
    sender = WeightSender(model, ep_group=ep, trainer_group=ep, engines=engines, bucket_mb=BUCKET_MB,
                          verify=verify, timeout_s=30)
    assert len(sender.plan.buckets) > 4
    stats = sender.sync(version)
    if rank == 0:
        assert stats.buckets == len(sender.plan.buckets)
        # the buffers alive at once: at most two buckets (double buffering)
        assert stats.peak_extra_bytes <= 2 * sender.plan.max_bucket_bytes
    sender.close()


class _DyingEngine(LocalEngine):
    def __init__(self, conn, kill_after):
        super().__init__(conn, timeout_s=60)
        self.kill_after, self.calls = kill_after, 0

    async def update_weights_from_distributed(self, **body):
        self.calls += 1
        if self.calls > self.kill_after:
            self.conn.send(("update_weights_from_distributed", body))  # the engine waits for the broadcast
            os._exit(1)  # the sender is killed mid-update, before broadcasting this bucket
        return await super().update_weights_from_distributed(**body)


def trainer_mismatch(rank, world, conn):
    """EP=2 trainers whose experts are wider than the engine's: every rank must see the error."""
    from moe_rl.sync import WeightSyncError

    ep = dist.new_group(list(range(world)))
    model = MoEForCausalLM(arch(moe_intermediate_size=24), ep_group=ep).init_weights(3)
    engines = [LocalEngine(conn, timeout_s=60)] if rank == 0 else []
    sender = WeightSender(model, ep_group=ep, trainer_group=ep, engines=engines, bucket_mb=BUCKET_MB, timeout_s=30)
    try:
        sender.sync("bad")
    except WeightSyncError as e:
        raise AssertionError(f"rank {rank} saw: {e}") from None
    finally:
        sender.close()
    raise RuntimeError("the sync should have failed")


@contextlib.contextmanager
def spawn_receiver(seed: int = 0, arch_kw: dict | None = None, rebind: bool = False):
    """A receiver process (``receiver_main``): yields (trainer pipe, control engine, process)."""
    ctx = process_context()
    a_tr, b_tr = ctx.Pipe()
    a_ctl, b_ctl = ctx.Pipe()
    p = ctx.Process(target=receiver_main, args=([b_tr, b_ctl], seed, arch_kw or {}, rebind), daemon=True)
    p.start()
    b_tr.close(), b_ctl.close()
    try:
        yield a_tr, LocalEngine(a_ctl, name="control", timeout_s=60), p
    finally:
        try:
            a_tr.close()
            LocalEngine(a_ctl, timeout_s=5).call("stop")
        except Exception:
            pass
        p.join(10)
        if p.is_alive():
            p.kill()
