"""Start-up hook for the processes of a `moe-rl train` run launched by tests/megatron (put first
on PYTHONPATH, active only with MOE_RL_MEGATRON_CPU_SHIMS=1): the shims of megatron-core's
CUDA calls that test_forward_cpu's ``cpu_megatron`` fixture applies (moe_rl.train.megatron.model
``cpu_shim_patches``: current device -> "cpu", CUDA RNG tracker and RNG state calls -> no-ops,
CPU stand-ins for streams), so megatron's GPTModel runs on CPU inside
the real main job (trainer rank and torchrun's workers alike). The shims are applied when a
process first imports megatron.core: the launcher and the engine rank never pay its import."""
import os
import sys


def apply_megatron_cpu_shims() -> None:
    """moe_rl.train.megatron.model's cpu_shim_patches, for the rest of this process."""
    from moe_rl.train.megatron.model import cpu_shim_patches

    for obj, name, value in cpu_shim_patches():
        setattr(obj, name, value)


class _ShimsAfterMegatronImport:
    """A meta path finder that runs apply_megatron_cpu_shims right after megatron.core's
    package is imported (its __init__ done, before any other megatron module runs)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "megatron.core":
            return None
        sys.meta_path.remove(self)
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module

        def exec_then_shim(module):
            exec_module(module)
            apply_megatron_cpu_shims()

        spec.loader.exec_module = exec_then_shim
        return spec


if os.environ.get("MOE_RL_MEGATRON_CPU_SHIMS") == "1":
    sys.meta_path.insert(0, _ShimsAfterMegatronImport())
