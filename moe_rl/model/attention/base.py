"""What a token mixer (one attention kind) provides to the model, the HF I/O and the engine."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..ops import TORCH
from .layouts import Attention

if TYPE_CHECKING:  # annotations only: arch.py imports the mixers
    from ..arch import MoEArch


class Mixer(nn.Module):
    """One decoder layer's token mixer. A kind subclasses this and registers in ``MIXERS``
    (``moe_rl.model.attention``); ``Family.attention`` in ``arch.py`` picks the kind per layer.

    * ``hf_name``: the mixer's module name in the decoder layer, as HF names it (its parameter
      names are ``model.layers.{i}.{hf_name}.<HF name>``).
    * ``hf_specs(arch, layer)``: its HF tensors (name relative to the mixer, full shape), in
      HF's order: ``hf_io`` loads, saves and syncs exactly these.
    * ``lora_targets``: names of its ``nn.Linear`` projections a LoRA adapter may target.
    * ``state_spec(arch, layer)``: what the engine keeps per cache slot for this layer
      (``moe_rl.model.attention.state``).
    * ``forward(x, cos, sin, attend)``: x [N, H] -> [N, H]; ``cos``/``sin`` are the forward's
      rope tables (``Rope.cos_sin``), ``attend`` its layout (``layouts.Attention``). It must
      compile with ``fullgraph=True`` (no host reads, no branch on tensor values).
    * ``exact_path``: whether its arithmetic is all its model's ops' (``self.ops``, its
      projections ``moe_rl.model.ops.Linear``, its norms ``RMSNorm``) and its attention the
      layout's, so that ``true_on_policy`` gives a token the same bits in the engine and the
      trainer; a kind without one is refused under that key.
    """

    hf_name = "self_attn"
    lora_targets: tuple[str, ...] = ()
    exact_path = False
    ops = TORCH  # its model's ops (moe_rl.model.ops)

    def __init__(self, arch: MoEArch, layer: int):
        super().__init__()
        self.layer = layer

    @classmethod
    def hf_specs(cls, arch: MoEArch, layer: int) -> list[tuple[str, tuple[int, ...]]]:
        raise NotImplementedError

    @classmethod
    def state_spec(cls, arch: MoEArch, layer: int):
        raise NotImplementedError

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attention) -> torch.Tensor:
        raise NotImplementedError

    def init_special(self, generator: torch.Generator) -> None:
        """Re-draws the parameters a plain normal draw does not fit (a decay rate, a conv
        kernel), after ``MoEForCausalLM.init_weights``' draw; nothing by default."""


def linear_weight(linear) -> torch.Tensor:
    """The weight ``linear`` applies, with the delta s * B @ A of a LoRA adapter served in the
    forward (``moe_rl.model.lora`` hooks the module's output and leaves ``lora_delta`` on it),
    for a kind that uses a projection's weight other than by calling the module."""
    delta = getattr(linear, "lora_delta", None)
    if delta is None:
        return linear.weight
    A, B, scaling = delta
    return linear.ops.lora_weight(linear.weight, A, B, scaling)
