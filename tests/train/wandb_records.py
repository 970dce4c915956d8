"""Reads back what W&B wrote for an offline run: the records of its ``run-<id>.wandb`` file.

The file is W&B's transaction log: a 7-byte header (``:W&B``, magic, version), then records in
LevelDB's log framing (32 KiB blocks; each chunk a 7-byte header: CRC32C, length, type FULL /
FIRST / MIDDLE / LAST) whose payloads are W&B's own protobuf ``Record`` messages, decoded here
with wandb's generated classes (``wandb.proto.wandb_internal_pb2``). wandb has no public reader
for the file (``wandb sync`` reads it in its Go core).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    out, pos, buf = [], HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if kind == 0 and n == 0:
            break
        buf += data[pos + HEADER : pos + HEADER + n]
        pos += HEADER + n
        if kind in (FULL, LAST):
            r = pb.Record()
            r.ParseFromString(buf)
            out.append(r)
            buf = b""
    return out


def offline_run(wandb_dir: Path, run_id: str) -> list[Path]:
    """The ``.wandb`` files of the offline runs with ``run_id`` under ``wandb_dir`` (a resumed
    run adds one per start), oldest first."""
    return sorted(Path(wandb_dir).glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))


def read_run(path: Path) -> dict:
    """{"run": the run record (project, display_name, tags, config), "history": [{key: value}],
    "config": {key: value}} of one ``.wandb`` file."""
    run, history, config = None, [], {}
    for r in records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run = r.run
            config.update({u.key: json.loads(u.value_json) for u in r.run.config.update})
        elif kind == "config":
            config.update({u.key: json.loads(u.value_json) for u in r.config.update})
        elif kind == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
    return {"run": run, "history": history, "config": config}
