"""Architecture hyper-parameters of a Qwen3-MoE decoder, with HuggingFace's field names."""
from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, model_validator


class MoEArch(BaseModel):
    """The fields of HF's ``Qwen3MoeConfig`` that define the computation.

    Names are HF's, so ``config.json`` round-trips. Defaults give the tiny CPU model.
    """

    model_config = ConfigDict(extra="forbid")

    vocab_size: int = 64
    hidden_size: int = 64
    intermediate_size: int = 128  # dense MLP width (mlp_only_layers)
    moe_intermediate_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    num_experts: int = 8
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True
    mlp_only_layers: list[int] = []
    decoder_sparse_step: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False

    @model_validator(mode="after")
    def _check(self) -> "MoEArch":
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError("num_experts_per_tok must be in [1, num_experts]")
        if self.decoder_sparse_step < 1:
            raise ValueError("decoder_sparse_step must be >= 1")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"mlp_only_layers has layer indices out of range: {bad}")
        return self

    def is_moe_layer(self, i: int) -> bool:
        """HF's rule for which decoder layers have a sparse MoE block."""
        return (
            i not in self.mlp_only_layers
            and self.num_experts > 0
            and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    # --- HF config.json -------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict) -> "MoEArch":
        d = dict(d)
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if "rope_theta" not in d and "rope_theta" in rope:
            d["rope_theta"] = rope["rope_theta"]
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"unsupported rope_type {rope_type!r} (only default RoPE)")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d['hidden_act']!r} (only silu)")
        if d.get("attention_bias"):
            raise ValueError("attention_bias=True is not supported (Qwen3-MoE has none)")
        if d.get("num_experts") is None and d.get("num_local_experts") is not None:
            d["num_experts"] = d["num_local_experts"]  # transformers v5 spelling
        if d.get("head_dim") is None:
            d["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        return cls(**{k: d[k] for k in cls.model_fields if d.get(k) is not None})

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "MoEArch":
        p = Path(path) / "config.json"
        if not p.exists():
            raise FileNotFoundError(f"{p}: no config.json in the checkpoint directory")
        return cls.from_hf_dict(json.loads(p.read_text()))

    def to_hf_dict(self) -> dict:
        d = self.model_dump()
        d.update(
            architectures=["Qwen3MoeForCausalLM"],
            num_local_experts=self.num_experts,
            model_type="qwen3_moe",
            hidden_act="silu",
            attention_bias=False,
            attention_dropout=0.0,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            output_router_logits=False,
            router_aux_loss_coef=0.0,
            use_cache=True,
            sliding_window=None,
            use_sliding_window=False,
        )
        return d
