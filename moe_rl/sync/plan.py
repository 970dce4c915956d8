"""Bucket planning and the wire format of one bucket.

A bucket is a run of HF tensors of one dtype, laid back to back in a flat 1-D buffer of
that dtype (SGLang's ``flattened_bucket``): tensor ``i`` occupies elements
``[offsets[i], offsets[i] + numel_i)``. Every trainer rank computes the same plan from the
model's architecture, so no plan is ever exchanged.
"""
from __future__ import annotations

import re
import zlib
from dataclasses import dataclass, field

import torch

from ..engine.protocol import FrozenList
from ..model.hf_io import hf_dtype, hf_param_specs, local_hf_tensor, parse_expert_name

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "float8_e4m3fn": getattr(torch, "float8_e4m3fn", None),
    "float8_e5m2": getattr(torch, "float8_e5m2", None),
}


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's spelling on the wire: ``"bfloat16"`` (``getattr(torch, name)`` gives it back)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    dt = _DTYPES.get(str(name).removeprefix("torch."))
    if dt is None:
        raise ValueError(f"unknown dtype {name!r}")
    return dt


@dataclass(frozen=True)
class Bucket:
    index: int
    dtype: torch.dtype
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]  # element offsets into the flat buffer
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def numels(self) -> list[int]:
        return [_prod(s) for s in self.shapes]

    def request_fields(self) -> dict:
        """The bucket's part of SGLang's ``/update_weights_from_distributed`` body (built once;
        callers get a fresh dict around the same read-only lists, whose JSON text is made once)."""
        fields = self.__dict__.get("_fields")
        if fields is None:
            fields = {
                "names": FrozenList(self.names),
                "dtypes": FrozenList([dtype_name(self.dtype)] * len(self.names)),
                "shapes": FrozenList([list(s) for s in self.shapes]),
                "load_format": "flattened_bucket",
            }
            object.__setattr__(self, "_fields", fields)
        return dict(fields)


@dataclass
class Plan:
    buckets: list[Bucket]
    bucket_bytes: int
    total_bytes: int = 0
    largest_tensor_bytes: int = 0
    num_tensors: int = 0
    by_name: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (bucket, slot)

    @property
    def max_bucket_bytes(self) -> int:
        return max((b.nbytes for b in self.buckets), default=0)


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


# SGLang fuses a latent-attention layer's q_a_proj and kv_a_proj_with_mqa into one parameter and
# writes it only when both arrive in one load_weights call (one bucket): they travel together
_FUSED_A_RE = re.compile(r"model\.layers\.(\d+)\.self_attn\.(?:q_a_proj|kv_a_proj_with_mqa)\.")


def _unit_key(name: str):
    """Tensors that must share a bucket share a key: one layer's experts, one layer's fused pair."""
    parsed = parse_expert_name(name)
    if parsed is not None:
        return "experts", parsed[0]
    fused = _FUSED_A_RE.match(name)
    return ("fused_qkv_a", int(fused.group(1))) if fused else None


def _units(items):
    """(key, unit): runs of consecutive tensors with one ``_unit_key`` form a unit; other
    tensors are units alone (key None)."""
    unit, key = [], None
    for name, shape in items:
        k = _unit_key(name)
        if unit and (k is None or k != key):
            yield key, unit
            unit = []
        unit.append((name, shape))
        key = k
    if unit:
        yield key, unit


def plan_buckets(specs: list[tuple[str, tuple[int, ...], torch.dtype]], bucket_bytes: int) -> Plan:
    """Buckets of at most ``bucket_bytes`` over ``specs`` (name, shape, dtype), in the given
    (canonical) order within each dtype; dtypes are planned in order of first appearance.
    A tensor larger than a bucket gets a bucket of its own."""
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be positive")
    by_dtype: dict[torch.dtype, list[tuple[str, tuple[int, ...]]]] = {}
    seen: set[str] = set()
    for name, shape, dtype in specs:
        if name in seen:
            raise ValueError(f"tensor {name!r} appears twice in the parameter list")
        seen.add(name)
        by_dtype.setdefault(dtype, []).append((name, tuple(int(s) for s in shape)))
    buckets: list[Bucket] = []
    total = largest = 0

    for dtype, items in by_dtype.items():
        es = torch.empty((), dtype=dtype).element_size()
        cur: list[tuple[str, tuple[int, ...]]] = []
        cur_bytes = 0

        def close():
            nonlocal cur, cur_bytes
            if cur:
                offs, pos = [], 0
                for _, s in cur:
                    offs.append(pos)
                    pos += _prod(s)
                buckets.append(Bucket(len(buckets), dtype, tuple(n for n, _ in cur), tuple(s for _, s in cur), tuple(offs), pos))
            cur, cur_bytes = [], 0

        for key, unit in _units(items):
            unit_bytes = sum(_prod(s) for _, s in unit) * es
            # a layer's experts stay in one bucket when they fit in one: the receiver (and a
            # bound trainer) can then use the bucket as the stacked expert storage itself; a
            # fused pair always does (a bucket of its own if it is larger than one)
            whole = key is not None and key[0] == "fused_qkv_a"
            if cur and (unit_bytes <= bucket_bytes or whole) and cur_bytes + unit_bytes > bucket_bytes:
                close()
            for name, shape in unit:
                nbytes = _prod(shape) * es
                total += nbytes
                largest = max(largest, nbytes)
                if cur and cur_bytes + nbytes > bucket_bytes and not whole:
                    close()
                cur.append((name, shape))
                cur_bytes += nbytes
                if cur_bytes >= bucket_bytes and not whole:
                    close()
            if whole and cur_bytes >= bucket_bytes:
                close()
        close()
    plan = Plan(buckets, bucket_bytes, total, largest, len(seen))
    for b in buckets:
        for j, n in enumerate(b.names):
            plan.by_name[n] = (b.index, j)
    return plan


def model_specs(model, dtype: torch.dtype | None = None) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(HF name, full shape, wire dtype) for every tensor of ``model``, in canonical order.

    Known on every EP rank: an expert tensor another rank holds has the dtype of this rank's
    stacked expert parameter of the same projection. ``dtype`` overrides (cast on the wire).
    """
    out = []
    for name, shape in hf_param_specs(model.arch):
        if dtype is not None:
            dt = hf_dtype(name, dtype)  # the correction bias stays fp32 on the wire
        else:
            parsed = parse_expert_name(name)
            if parsed is None:
                dt = local_hf_tensor(model, name).dtype
            else:
                layer, _, proj = parsed
                dt = getattr(model.model.layers[layer].mlp.experts, proj).dtype
        out.append((name, tuple(shape), dt))
    return out


# --- checksum ---------------------------------------------------------------------------
def checksum(buf: torch.Tensor) -> str:
    """A checksum of a flat buffer's bytes, ``"<algo>:<hex>"``.

    CPU: CRC-32 of the bytes (zero-copy). CUDA: a position-weighted sum of the 32-bit words,
    computed on the device (no device-to-host copy of the bucket)."""
    if buf.device.type == "cpu":
        b = buf.detach().contiguous().view(torch.uint8).numpy()
        return "crc32:%08x" % zlib.crc32(memoryview(b))
    return "wsum32:%016x" % _wsum32(buf)


def _wsum32(buf: torch.Tensor) -> int:
    b = buf.detach().contiguous().view(torch.uint8)
    pad = (-b.numel()) % 4
    if pad:
        b = torch.cat([b, b.new_zeros(pad)])
    w = b.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    idx = torch.arange(1, w.numel() + 1, device=w.device, dtype=torch.int64) % 65521 + 1
    return int(((w * idx) % (2**61 - 1)).sum().item()) & (2**64 - 1)


def verify_checksum(buf: torch.Tensor, expected: str) -> bool:
    algo = expected.split(":", 1)[0]
    if algo == "crc32":
        if buf.device.type != "cpu":
            buf = buf.cpu()
        return checksum(buf) == expected
    if algo == "wsum32":
        return "wsum32:%016x" % _wsum32(buf) == expected
    raise ValueError(f"unknown checksum algorithm in {expected!r}")
