"""Host syncs of one real training step, counted on ``fakedev`` and listed by where they happen.

    python scripts/host_syncs.py [OVERRIDE ...]     # e.g. train.fused_loss=false lora.rank=4

Runs ``Trainer.train_step`` once on the batch of tests/train/test_device_discipline.py (replayed
and stale samples, a multi-turn episode) with the model on ``fakedev`` (tests/fake_device.py: a
second device with real values on which every host read is recorded) and prints the count and
each site (the innermost moe_rl / kernels frame). The target is 1: the step's read of its
metrics at its end.
"""
from __future__ import annotations

import collections
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import fake_device as fd  # noqa: E402
from tests.train import test_device_discipline as harness  # noqa: E402


def main(overrides: list[str]) -> int:
    from moe_rl.config import load_config

    fd.install()
    cfg = load_config(None, [*harness.TINY, *overrides])
    with tempfile.TemporaryDirectory() as tmp:
        batch = harness._batch(cfg, tmp)
        trainer = harness._trainer(cfg.model_copy(deep=True), fd.NAME, tmp)
        with fd.recording(stacks=True) as rec:
            trainer.train_step(batch)
    sites = collections.Counter()
    for e in rec.events:
        if e.kind in fd.SYNC_KINDS:
            frames = [f for f in e.stack if "/moe_rl/" in f or "/kernels/" in f]
            sites[e.kind, frames[-1].strip().splitlines()[0] if frames else "?"] += 1
    print(f"host syncs in one train step ({' '.join(overrides) or 'defaults'}): {rec.syncs}  {dict(rec.counts())}")
    for (kind, site), n in sites.most_common():
        print(f"  {n:4d}  {kind:12s} {site}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
