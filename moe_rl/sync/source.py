"""Where the sender reads a trainer rank's weights, under HuggingFace names.

``ModelSource`` wraps the native model: every HF tensor is a view of a parameter, so bucket
views can be cached between syncs. ``StreamSource`` wraps an in-order iterator of (HF name,
tensor), such as Megatron -> HF conversion, which makes new tensors (fused QKV and fc1 are
split): the sender asks for this rank's tensors in canonical order, so the iterator is consumed
once per sync, one tensor at a time, and never holds the whole model.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch

from ..model import MoEArch, hf_dtype, hf_param_specs, local_hf_tensor
from ..model.hf_io import hf_named_tensors
from .plan import model_specs


class ModelSource:
    def __init__(self, model):
        self.model, self.arch = model, model.arch
        self.device = next(model.parameters()).device

    def specs(self, wire_dtype: torch.dtype | None = None):
        return model_specs(self.model, wire_dtype)

    def begin(self) -> None:
        pass

    def tensor(self, name: str) -> torch.Tensor | None:
        return local_hf_tensor(self.model, name)

    def cache_key(self):
        """Changes when a parameter moved, invalidating cached bucket views."""
        return tuple(t.data_ptr() for _, t in hf_named_tensors(self.model))


class StreamSource:
    def __init__(self, arch: MoEArch, device: torch.device, dtype: torch.dtype,
                 make_iter: Callable[[], Iterator[tuple[str, torch.Tensor]]]):
        self.arch, self.device, self.dtype, self.make_iter = arch, device, dtype, make_iter
        self._it: Iterator[tuple[str, torch.Tensor]] | None = None

    def specs(self, wire_dtype: torch.dtype | None = None):
        return [(n, tuple(s), hf_dtype(n, wire_dtype or self.dtype)) for n, s in hf_param_specs(self.arch)]

    def begin(self) -> None:
        self._it = self.make_iter()

    def tensor(self, name: str) -> torch.Tensor:
        if self._it is None:
            raise RuntimeError("StreamSource.begin() was not called for this sync")
        for n, t in self._it:
            if n == name:
                return t
        raise KeyError(f"{name}: not produced by this rank's weights (asked out of canonical order?)")

    def cache_key(self):
        return None  # fresh tensors every sync: nothing to cache
