"""``fakedev``: a second device on a machine that has only a CPU, for tests of device discipline.

Code that builds a tensor on the host and hands it to an op with a GPU tensor works on a CPU
machine (everything is on the CPU) and dies on the first GPU ("Expected all tensors to be on
the same device, but found at least two devices, cuda:0 and cpu!"). To see that without a GPU
the code must run with its model on a device that is not the CPU, with real values (a training
step has to run), and with PyTorch's own device rule enforced. The candidates:

* ``meta``: a real second device, but without values; losses, routing matches and the
  optimizer cannot run on it.
* a default-device guard (``torch.set_default_device``) or a dispatch mode that tags the
  tensors the backend makes: with the backend on the CPU, ``t.to(backend.device)`` is a no-op
  that never reaches the dispatcher, so a tensor that was moved cannot be told from one that
  was not; only a device that really differs makes the move observable.
* this module: PyTorch's PrivateUse1 backend renamed ``fakedev`` and registered as a Python
  backend (``_setup_privateuseone_for_python_backend``: device guard and hooks, so autograd and
  the optimizers treat it as an accelerator). A tensor on it is a wrapper subclass holding a CPU
  tensor; every aten op on one (``__torch_dispatch__``) first applies PyTorch's CUDA rule, all
  tensor arguments on one device except 0-dim CPU tensors (scalars) and CPU index tensors, then
  runs on the CPU data and wraps the result. Factories with ``device="fakedev"`` and the copies
  ``torch.tensor(..., device=...)`` makes reach the PrivateUse1 kernels registered below. So a
  mixed-device op raises here where it would raise on a GPU, naming the op, and the values are
  the CPU's (a step on fakedev can be compared with the same step on the CPU).

Host syncs. Every op that would make the host wait for the GPU is recorded in the active
:func:`recording` (``Event.kind``): ``item`` (``.item()``, ``int()``, ``float()``, ``bool()`` of a
device tensor), ``d2h`` (``.cpu()``, ``.tolist()``, ``.to("cpu")``), ``h2d_blocking`` (a host to
device copy without ``non_blocking``: CUDA synchronises the stream for it), ``shape`` (an op
whose output size depends on device data: nonzero, masked_select, unique, boolean-mask
indexing, repeat_interleave without output_size). Counting them over one training step is what
the one-sync target needs; ``Recording.syncs`` is that count.

Process-global: PrivateUse1 can be renamed once per process, and the rename makes ``fakedev``
PyTorch's current accelerator. Use it in a fresh process (:func:`fresh_process`) so that no
other test in the session runs with it.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import threading
import traceback
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten, tree_map

NAME = "fakedev"
DEVICE: torch.device | None = None  # torch.device("fakedev", 0), once install() has named it
aten = torch.ops.aten

_lock = threading.Lock()
_installed = False
_library = None  # keeps the PrivateUse1 kernels registered
_recordings: list["Recording"] = []

SYNC_KINDS = ("item", "d2h", "h2d_blocking", "shape")
# ops whose output size depends on the values of a device input: the host reads that size
_DATA_DEPENDENT = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
                   aten.unique_consecutive.default, aten.nonzero_static.default}
# ops PyTorch lets take CPU index tensors with a device tensor
_INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


@dataclass
class Event:
    kind: str  # one of SYNC_KINDS, or "h2d" (an asynchronous host-to-device copy)
    op: str
    stack: list[str] = field(default_factory=list)


@dataclass
class Recording:
    """What ran on the device while active (see the module docstring)."""

    stacks: bool = False  # keep the Python stack of each event (to find where a sync comes from)
    events: list[Event] = field(default_factory=list)

    def counts(self) -> Counter:
        return Counter(e.kind for e in self.events)

    @property
    def syncs(self) -> int:
        """Host syncs: the events that make the host wait for the device."""
        return sum(1 for e in self.events if e.kind in SYNC_KINDS)


class recording:
    """``with recording() as rec:`` collects the device events of the block into ``rec``."""

    def __init__(self, stacks: bool = False):
        self.rec = Recording(stacks=stacks)

    def __enter__(self) -> Recording:
        with _lock:
            _recordings.append(self.rec)
        return self.rec

    def __exit__(self, *exc):
        with _lock:
            _recordings.remove(self.rec)
        return False


def _event(kind: str, op) -> None:
    if not _recordings:
        return
    with _lock:
        for r in _recordings:
            stack = traceback.format_stack(limit=12)[:-2] if r.stacks else []
            r.events.append(Event(kind, str(op), stack))


class DeviceTensor(torch.Tensor):
    """A tensor on ``fakedev``: its values are the CPU tensor ``data``."""

    data_: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        r = torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(), storage_offset=data.storage_offset(),
                                                dtype=data.dtype, layout=data.layout, device=DEVICE,
                                                requires_grad=data.requires_grad)
        r.data_ = data
        return r

    def __repr__(self, *, tensor_contents=None):
        return f"DeviceTensor({self.data_!r}, device='{DEVICE}')"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.tolist:  # a CUDA tensor's tolist copies to the host first
            return args[0].cpu().tolist()
        if func in (torch.Tensor.untyped_storage, torch.Tensor.data_ptr):  # a real device has storages
            return func(args[0].data_, *args[1:], **kwargs)
        if func is torch.Tensor.numpy:
            raise TypeError(f"can't convert {DEVICE} device type tensor to numpy. Use Tensor.cpu() to copy the "
                            "tensor to host memory first.")
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


def _on_dev(d) -> bool:
    return d is not None and torch.device(d).type == NAME


def _data(t):
    return t.data_ if isinstance(t, DeviceTensor) else t


def _wrap(t):
    return DeviceTensor(t) if isinstance(t, torch.Tensor) and not isinstance(t, DeviceTensor) else t


def _check_devices(func, args, kwargs) -> bool:
    """PyTorch's rule on CUDA: one device, except CPU scalars and CPU indices. True when the
    op runs on fakedev."""
    checked = args
    if func in _INDEX_OPS:  # self, indices, values...: the indices may stay on the CPU
        checked = (args[0], *args[2:])
    flat, _ = tree_flatten((checked, kwargs))
    devices = set()
    for t in flat:
        if isinstance(t, DeviceTensor):
            devices.add(str(DEVICE))
        elif isinstance(t, torch.Tensor) and not (t.device.type == "cpu" and t.dim() == 0):
            devices.add(str(t.device))
    if len(devices) > 1:
        a, b = sorted(devices, reverse=True)[:2]
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, {a} and "
                           f"{b}! (in {func}; fakedev stands for a GPU: see tests/fake_device.py)")
    return bool(devices) or _on_dev(kwargs.get("device"))


def _run(func, args, kwargs):
    if func is aten._to_copy.default:
        x = args[0]
        kw = dict(kwargs)
        target = kw.pop("device", None)
        out = func(_data(x), **kw)
        src_dev, dst_dev = isinstance(x, DeviceTensor), (_on_dev(target) if target is not None else isinstance(x, DeviceTensor))
        if src_dev and not dst_dev:
            _event("d2h", func)
        elif dst_dev and not src_dev:
            _event("h2d" if kw.get("non_blocking") else "h2d_blocking", func)
        return DeviceTensor(out) if dst_dev else out
    if func in (aten.copy_.default, aten._copy_from.default):
        dst, src = (args[0], args[1]) if func is aten.copy_.default else (args[1], args[0])
        non_blocking = (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        if isinstance(src, DeviceTensor) and not isinstance(dst, DeviceTensor):
            _event("d2h", func)
        elif isinstance(dst, DeviceTensor) and not isinstance(src, DeviceTensor) and src.dim() > 0:
            _event("h2d" if non_blocking else "h2d_blocking", func)
        _data(dst).copy_(_data(src))
        return dst
    on_dev = _check_devices(func, args, kwargs)
    if on_dev:
        if func is aten._local_scalar_dense.default:
            _event("item", func)
        elif func in _DATA_DEPENDENT or (func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None) or (
                func in _INDEX_OPS and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                           for i in (args[1] or ()))):
            _event("shape", func)
    kw = tree_map(_data, kwargs)
    if _on_dev(kw.get("device")):
        kw["device"] = torch.device("cpu")
    out = func(*tree_map(_data, args), **kw)
    if not on_dev:
        return out
    schema = func._schema
    if not schema.returns:  # e.g. _foreach_*_
        return None
    if schema.name.endswith("_") or "out" in kwargs:  # in place: the result is the argument itself
        mutated = [a for a, s in zip(args, schema.arguments) if s.alias_info is not None and s.alias_info.is_write]
        mutated += [v for k, v in kwargs.items() if k == "out"]
        if len(mutated) == 1:
            return mutated[0]
    return tree_map(_wrap, out)


def _factory(op):
    def kernel(*args, **kwargs):
        if op is aten._copy_from.default:  # torch.tensor(data, device=fakedev): the copy in
            return _run(op, args, kwargs)
        kw = dict(kwargs, device=torch.device("cpu"))
        return DeviceTensor(op(*args, **kw))
    return kernel


def install() -> torch.device:
    """Registers ``fakedev`` in this process (once; process-global, see the module docstring)."""
    global _installed, _library, DEVICE
    with _lock:
        if _installed:
            return DEVICE
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

        _setup_privateuseone_for_python_backend(NAME)
        lib = torch.library.Library("aten", "IMPL")
        for name, op in (("empty.memory_format", aten.empty.memory_format), ("empty_strided", aten.empty_strided.default),
                         ("_copy_from", aten._copy_from.default)):
            lib.impl(name, _factory(op), "PrivateUse1")
        _library, _installed, DEVICE = lib, True, torch.device(NAME, 0)
    return DEVICE


def _call(fn, args, kwargs):
    install()
    return fn(*args, **kwargs)


@contextlib.contextmanager
def fresh_process():
    """A fresh Python process with fakedev installed, for the block: yields ``run(fn, *args,
    **kwargs)``, which calls ``fn`` there (a module-level function, so that it can be found)
    and returns its value or re-raises its exception (the child's traceback chained to it).
    Calls share the process: one start for a module's tests (a pytest fixture)."""
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        yield lambda fn, *args, **kwargs: pool.submit(_call, fn, args, kwargs).result()

