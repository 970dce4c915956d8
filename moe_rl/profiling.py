"""torch.profiler's figures as the benches report them: the ops with the most self time (device
time on a GPU, CPU time otherwise) and torch's op table in a file."""
from __future__ import annotations

from pathlib import Path


def activities(cuda: bool) -> list:
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])


def top_ops(prof, cuda: bool, n: int = 15) -> list[dict]:
    """The ``n`` entries of ``prof.key_averages()`` with the most self time: op (or kernel)
    name, milliseconds, share of the summed self time (an op and the kernels it launched are
    both entries on a GPU) and call count."""
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)
    total = sum(getattr(e, key) for e in events) or 1.0
    return [dict(op=e.key, self_ms=getattr(e, key) / 1e3, share=getattr(e, key) / total, calls=e.count)
            for e in events[:n]]


def write_ops_table(prof, cuda: bool, path: Path, rows: int = 60) -> None:
    """torch's op table, by self device time on a GPU (then by self CPU time, where the host's
    share shows), by self CPU time otherwise."""
    path.parent.mkdir(parents=True, exist_ok=True)
    avg = prof.key_averages()
    tables = [avg.table(sort_by="self_device_time_total", row_limit=rows)] if cuda else []
    tables.append(avg.table(sort_by="self_cpu_time_total", row_limit=rows))
    path.write_text("\n\n".join(tables) + "\n")
