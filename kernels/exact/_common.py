"""What every exact op shares: the C++ kernels (``moe_rl._C.exact_*``), dtype codes, the thread
count, argument checks and the choice of implementation.

The CPU kernels take data pointers, strides and shapes (no torch in the C++): the wrappers here
check every tensor they hand over (device, dtype, the contiguous last dimension), own the memory
for the duration of the call, and pass ``threads`` (``torch.get_num_threads()`` unless
``set_num_threads`` says otherwise); threads split rows, never one output's reduction.
"""
from __future__ import annotations

import os

import torch

from moe_rl import _C

try:  # Triton is optional: the CPU kernels need none of it
    import triton
    import triton.language as tl
except Exception:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

# Triton's interpreter is chosen when the kernels are decorated, i.e. at import of the modules.
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DTYPES = (torch.float32, torch.bfloat16)
CODE = {torch.float32: 0, torch.bfloat16: 1}
IMPLS = ("cpu", "triton")

_threads: int | None = None


def set_num_threads(n: int | None) -> None:
    """Threads of the CPU kernels (None: ``torch.get_num_threads()`` at each call). Any count
    gives the same bits."""
    global _threads
    if n is not None and n < 1:
        raise ValueError(f"set_num_threads: n must be >= 1 or None, got {n}")
    _threads = n


def num_threads() -> int:
    return _threads if _threads is not None else torch.get_num_threads()


def isa() -> str:
    """The instruction set the CPU kernels run ("avx2" or "generic": the same bits)."""
    return _C.exact_isa()


def set_isa(name: str) -> None:
    _C.exact_set_isa(name)


def pick_impl(op: str, t: torch.Tensor, impl: str | None) -> str:
    """"cpu" (the C++ kernels) for CPU tensors, "triton" for CUDA tensors; "triton" on CPU
    tensors needs ``TRITON_INTERPRET=1`` set before import. Nothing falls back silently."""
    if impl is None:
        impl = "triton" if t.is_cuda else "cpu"
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {IMPLS}, got {impl!r}")
    if impl == "cpu" and t.device.type != "cpu":
        raise ValueError(f"{op}(impl='cpu'): the tensors are on {t.device}")
    if impl == "triton" and (triton is None or not (t.is_cuda or TRITON_INTERPRET)):
        raise RuntimeError(f"{op}(impl='triton'): needs triton and CUDA tensors (or TRITON_INTERPRET=1 set "
                           "before importing moe_rl.kernels.exact)")
    return impl


def check_dtype(op: str, name: str, t: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    if dtype is None:
        if t.dtype not in DTYPES:
            raise TypeError(f"{op}: {name} must be float32 or bfloat16, got {t.dtype}")
    elif t.dtype != dtype:
        raise TypeError(f"{op}: {name} must be {dtype} (as the input), got {t.dtype}")


def rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, last dim] with the last dimension contiguous (a view where possible)."""
    t2 = t.reshape(-1, t.shape[-1]) if t.dim() != 2 else t
    if t2.stride(-1) != 1 and t2.shape[-1] > 1:
        t2 = t2.contiguous()
    return t2


def needs_grad(*ts) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
