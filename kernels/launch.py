"""The device a Triton kernel is launched on."""
from __future__ import annotations

import contextlib

import torch


def on_device_of(t: torch.Tensor):
    """Context in which to launch a Triton kernel on ``t``'s memory. Triton launches on the
    calling thread's current CUDA device (and that device's current stream), and
    ``torch.cuda.set_device`` sets it for the calling thread only: a kernel launched from a worker
    thread (the engine's step thread, ``asyncio.to_thread``, an executor) on any GPU but the first
    would run on device 0 with pointers into another GPU. A no-op for a CPU tensor (Triton's
    interpreter)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
