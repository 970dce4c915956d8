"""Start-up hook for the processes of a `moe-rl train` run launched by tests/megatron (put first
on PYTHONPATH, active only with MOE_RL_MEGATRON_CPU_SHIMS=1): the same shims of megatron-core's
CUDA calls as test_forward_cpu's ``cpu_megatron`` fixture (current device -> "cpu", CUDA RNG
tracker and RNG state calls -> no-ops; dropout is 0), so megatron's GPTModel runs on CPU inside
the real main job (trainer rank and torchrun's workers alike)."""
import os



def apply_megatron_cpu_shims() -> None:
    import contextlib

    import torch

    torch.cuda.current_device = lambda: "cpu"
    torch._dynamo.config.disable = True
    try:
        from megatron.core.tensor_parallel import random as _mrandom
    except ImportError:
        pass
    else:
        _tracker = _mrandom.get_cuda_rng_tracker()
        _tracker.fork = lambda *a, **k: contextlib.nullcontext()
        _tracker.get_states = lambda: {}
        _tracker.set_states = lambda states: None
        _mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
        _mrandom._set_cuda_rng_state = lambda *a, **k: None


if os.environ.get("MOE_RL_MEGATRON_CPU_SHIMS") == "1":
    apply_megatron_cpu_shims()
