import os
import platform

# Triton's interpreter (TRITON_INTERPRET=1) runs tl.dot as numpy's matmul. OpenBLAS's Haswell
# sgemm kernel (its choice on AMD Zen, or where OPENBLAS_CORETYPE=Haswell is set, as on some CI
# machines) rounds a row differently by its place in the tile (rows 6+ of 16), so the exact
# kernels' batch-invariance tests would test OpenBLAS and not the kernels. The Sandybridge kernel
# (any AVX CPU) rounds every row alike. Set before numpy loads OpenBLAS, which reads it once.
if platform.machine() in ("x86_64", "AMD64"):
    os.environ["OPENBLAS_CORETYPE"] = "Sandybridge"

import pytest  # noqa: E402
import torch  # noqa: E402

# Tests are small: one thread per process keeps the 2-core CI machine responsive when tests
# start subprocesses (servers, gloo ranks).
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):
        # an xdist worker: the long tests (marked slow) first. With --dist worksteal (pyproject.toml)
        # the workers start on them, and the end of the run is short tests either worker takes
        # (neither idles while the other finishes a long one). Every worker sorts alike.
        # slow(longest=True): the few longest, started before the rest (one of them starting last
        # would leave the other worker idle for its whole length)
        def rank(item):
            slow = item.get_closest_marker("slow")
            return 2 if slow is None else (0 if slow.kwargs.get("longest") else 1)

        items.sort(key=rank)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _grad_mode_is_restored():
    """A test that leaves autograd off would silently break the tests after it."""
    yield
    if not torch.is_grad_enabled():
        torch.set_grad_enabled(True)
        pytest.fail("the test left autograd disabled")
