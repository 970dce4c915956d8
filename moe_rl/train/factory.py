"""Builds the training backend named by ``train.backend``, importing only that one.

The backends depend on ``train.backend`` (the contract and the shared optimizer step), never
the other way round: this factory is the only place that knows them all.
"""
from __future__ import annotations


def _native():
    from .backend import NativeBackend

    return NativeBackend


def _megatron():
    from .megatron import MegatronBackend  # needs megatron-core (pip install 'moe-rl[megatron]')

    return MegatronBackend


BACKENDS = {"native": _native, "megatron": _megatron}


def build_backend(cfg, groups=None):
    try:
        load = BACKENDS[cfg.train.backend]
    except KeyError:
        raise ValueError(f"train.backend={cfg.train.backend!r}: expected one of {sorted(BACKENDS)}") from None
    return load()(cfg, groups)
