"""Package layout and the C++ routing-log extension (csrc/ -> moe_rl._C).

kernels/ is installed as the subpackage moe_rl.kernels, as DESIGN.md lays out.
"""
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent

packages = find_packages(include=["moe_rl", "moe_rl.*"])
packages += ["moe_rl.kernels"] + [
    "moe_rl.kernels." + p for p in find_packages(where="kernels")
]
package_dir = {"moe_rl": "moe_rl", "moe_rl.kernels": "kernels"}

ext_modules = []
sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").glob("*.cpp"))
if sources:
    from pybind11.setup_helpers import ParallelCompile, Pybind11Extension

    # one source per core (MAX_JOBS, as torch's extensions read it; every core by default): built
    # serially, the nine sources take about a minute
    ParallelCompile("MAX_JOBS").install()

    ext_modules.append(
        Pybind11Extension(
            "moe_rl._C",
            sources,
            cxx_std=17,
            # no contraction of a * b + c into an FMA behind the kernels' back: csrc/exact.h
            # fixes where fused multiply-adds are
            extra_compile_args=["-O3", "-ffp-contract=off"],
        )
    )

setup(
    packages=packages,
    package_dir=package_dir,
    ext_modules=ext_modules,
    package_data={"moe_rl.tasks": ["data/*.jsonl"], "moe_rl.kernels": ["configs/*.json"]},
    include_package_data=True,
)
