"""Every Triton launch of moe_rl.kernels goes to its tensors' device, from any thread.

Triton launches on the calling thread's current CUDA device, and ``torch.cuda.set_device`` holds
only for the thread that called it: the engine's step thread, the weight commit's
``asyncio.to_thread`` and the sender's pack executor would launch on device 0 with pointers on
another GPU. Each launch site enters ``moe_rl.kernels.launch.on_device_of(tensor)``; this test
drives every launch (sm90_compile.drive_every_launch, the kernels replaced by a recorder) from a
worker thread and checks that each one happens inside that context, for a tensor of the launch.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import threading

import pytest
import torch

from . import sm90_compile

from moe_rl.kernels import launch


def test_a_cuda_tensor_gets_its_own_device_and_a_cpu_tensor_none():
    class CudaLike:  # a CUDA tensor's two attributes on a machine without CUDA
        is_cuda, device = True, torch.device("cuda", 1)

    ctx = launch.on_device_of(CudaLike())
    assert isinstance(ctx, torch.cuda.device) and ctx.idx == 1
    assert isinstance(launch.on_device_of(torch.zeros(1)), contextlib.nullcontext)


def test_every_triton_launch_runs_inside_its_tensors_device_context(monkeypatch):
    current = threading.local()
    launches = []

    @contextlib.contextmanager
    def on_device_of(t):
        prev = getattr(current, "device", None)
        current.device = t.device
        try:
            yield
        finally:
            current.device = prev

    class Launch:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def record(*args, **kwargs):
                devices = {a.device for a in args if isinstance(a, torch.Tensor)}
                launches.append((self.name, getattr(current, "device", None), devices))
            return record

    for module, names in sm90_compile.LAUNCHES.items():
        mod = importlib.import_module(module)
        monkeypatch.setattr(mod, "on_device_of", on_device_of)
        for n in names:
            monkeypatch.setattr(mod, n, Launch(n))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a worker thread, as the engine's
        pool.submit(sm90_compile.drive_every_launch).result()
    assert {n for n, _, _ in launches} == {n for names in sm90_compile.LAUNCHES.values() for n in names}
    outside = [(n, devices) for n, dev, devices in launches if dev is None or devices != {dev}]
    assert not outside, f"Triton launches outside their tensors' device context: {outside}"


@pytest.mark.gpu
def test_a_grouped_gemm_from_a_worker_thread_on_the_last_gpu():
    """On a machine with several GPUs: the Triton grouped GEMM launched from a thread whose
    current device is 0, on tensors of the last GPU (one GPU: the same device, still checked)."""
    from moe_rl.kernels.grouped_gemm import grouped_gemm, grouped_gemm_reference

    dev = torch.device("cuda", torch.cuda.device_count() - 1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=g).to(dev)
    w = torch.randn(4, 48, 32, generator=g).to(dev)
    offs = torch.tensor([10, 30, 30, 64], dtype=torch.int32, device=dev)

    def run():
        torch.cuda.set_device(0)
        return grouped_gemm(x, w, offs, impl="triton")

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        y = pool.submit(run).result()
    torch.testing.assert_close(y, grouped_gemm_reference(x, w, offs), rtol=1e-4, atol=1e-4)
