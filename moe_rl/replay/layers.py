"""Which decoder layers are MoE layers, and the routing shape of a model.

Standalone (no import of ``moe_rl.model``): the Qwen3-MoE rule (``mlp_only_layers``,
``decoder_sparse_step``) and GLM's / DeepSeek-V3's (``first_k_dense_replace``), which
Mixtral-style configs (every layer sparse) also satisfy with the defaults.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

__all__ = ["moe_layer_indices", "RoutingSpec"]


def moe_layer_indices(num_hidden_layers: int, mlp_only_layers: Iterable[int] = (),
                      decoder_sparse_step: int = 1, num_experts: int = 1,
                      first_k_dense_replace: int = 0) -> list[int]:
    """Indices of the sparse (MoE) decoder layers, in order.

    Layer ``i`` is sparse iff ``i >= first_k_dense_replace and i not in mlp_only_layers and
    num_experts > 0 and (i + 1) % decoder_sparse_step == 0`` (HF's Qwen3-MoE and GLM rules).
    """
    if num_hidden_layers < 0:
        raise ValueError(f"num_hidden_layers must be >= 0, got {num_hidden_layers}")
    if decoder_sparse_step < 1:
        raise ValueError(f"decoder_sparse_step must be >= 1, got {decoder_sparse_step}")
    if num_experts <= 0:
        return []
    dense = set(int(i) for i in mlp_only_layers)
    return [i for i in range(first_k_dense_replace, num_hidden_layers)
            if i not in dense and (i + 1) % decoder_sparse_step == 0]


@dataclass(frozen=True)
class RoutingSpec:
    """The routing shape of a model: what a routing record looks like.

    ``moe_layers`` are the decoder-layer indices that route (a record's layer axis follows this
    order); SGLang's rows cover all ``num_hidden_layers`` layers, dense ones included.
    """

    num_hidden_layers: int
    top_k: int
    num_experts: int
    mlp_only_layers: tuple[int, ...] = ()
    decoder_sparse_step: int = 1
    first_k_dense_replace: int = 0
    moe_layers: tuple[int, ...] = field(init=False)

    def __post_init__(self):
        if self.top_k < 1 or self.num_experts < self.top_k:
            raise ValueError(f"need 1 <= top_k <= num_experts, got top_k={self.top_k}, "
                             f"num_experts={self.num_experts}")
        layers = moe_layer_indices(self.num_hidden_layers, self.mlp_only_layers,
                                   self.decoder_sparse_step, self.num_experts, self.first_k_dense_replace)
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        object.__setattr__(self, "moe_layers", tuple(layers))

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @classmethod
    def from_hf_config(cls, config: Any) -> "RoutingSpec":
        """From a HuggingFace config (object or dict): Qwen3-MoE / Qwen2-MoE names
        (``num_experts``, ``num_experts_per_tok``, ``mlp_only_layers``, ``decoder_sparse_step``),
        Mixtral's (``num_local_experts``) or GLM's / DeepSeek-V3's (``n_routed_experts``,
        ``first_k_dense_replace``)."""
        get = config.get if isinstance(config, Mapping) else (lambda k, d=None: getattr(config, k, d))
        num_experts = get("num_experts") or get("num_local_experts") or get("n_routed_experts")
        if not num_experts:
            raise ValueError("config has no num_experts / num_local_experts / n_routed_experts")
        return cls(num_hidden_layers=int(get("num_hidden_layers")),
                   top_k=int(get("num_experts_per_tok")),
                   num_experts=int(num_experts),
                   mlp_only_layers=tuple(get("mlp_only_layers") or ()),
                   decoder_sparse_step=int(get("decoder_sparse_step") or 1),
                   first_k_dense_replace=int(get("first_k_dense_replace") or 0))
