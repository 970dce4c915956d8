"""Grouped-GEMM experts for megatron-core's MoELayer that need only torch.

megatron-core 0.16 has two grouped expert modules: ``TEGroupedMLP`` (Transformer Engine) and
the legacy ``GroupedMLP`` (the ``grouped_gemm`` CUDA package, bf16 only); 0.19 only
``TEGroupedMLP``. Without TE, the local spec of both runs ``SequentialMLP``: a Python loop over
experts with a ``tolist()`` host sync.
``TorchGroupedMLP`` is a drop-in expert module (MoELayer builds it as ``cls(num_local_experts,
config, pg_collection=..., name=...)`` and calls ``experts(tokens, tokens_per_expert, probs)``)
that runs the native model's grouped GEMMs (``moe_rl.model.grouped.grouped_mm``:
``torch._grouped_mm`` for bf16 on sm_90+ and on a CPU, a Triton grouped GEMM on other GPUs and
dtypes). Its parameters carry
``TEGroupedMLP``'s names and shapes (``linear_fc1.weight{j}`` = ``[gate; up]`` [2I, H],
``linear_fc2.weight{j}`` [H, I]), so conversion and checkpoints are shared with the TE layout.
The per-expert weights are stacked once per forward (one copy of the layer's expert weights,
memory-bound; TE's GroupedLinear takes the same per-expert list).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_rl.model.grouped import dispatch, group_align, grouped_kernel, grouped_mm, permute, unpermute


KERNEL_NAMES = {"cutlass": "torch._grouped_mm", "torch": "torch._grouped_mm (CPU kernel)",
                "triton": "Triton grouped GEMM (moe_rl.kernels.grouped_gemm)",
                "padded": "padded bmm fallback (one host sync per layer)"}


def grouped_kernel_name(device: torch.device | str, dtype: torch.dtype) -> str:
    """Which grouped GEMM ``grouped_mm`` takes for this device and dtype (for the log line)."""
    return KERNEL_NAMES[grouped_kernel(torch.empty(0, device=device, dtype=dtype))]


class TorchGroupedMLP(nn.Module):
    """``num_local_experts`` SwiGLU experts computed as two grouped GEMMs over the expert-sorted
    tokens megatron's dispatcher hands over (``tokens_per_expert`` rows per expert, in order)."""

    def __init__(self, num_local_experts: int, config, pg_collection=None, name: str | None = None):
        super().__init__()
        if config.add_bias_linear or not config.gated_linear_unit or config.activation_func is not F.silu:
            raise ValueError("TorchGroupedMLP implements bias-free SwiGLU experts (Qwen3-MoE); "
                             "set train.megatron_grouped_gemm=false for other expert MLPs")
        if getattr(config, "expert_tensor_parallel_size", 1) not in (None, 1):
            raise ValueError("TorchGroupedMLP does not shard experts over tensor parallelism "
                             "(expert_tensor_parallel_size must be 1)")
        self.config = config
        self.num_local_experts = num_local_experts
        H, I = config.hidden_size, config.moe_ffn_hidden_size
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        # TEGroupedMLP's state-dict names: "linear_fc1.weight{j}", "linear_fc2.weight{j}"
        make = lambda *shape: _WeightList(num_local_experts, shape, device, config)  # noqa: E731
        self.linear_fc1, self.linear_fc2 = make(2 * I, H), make(H, I)

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor):
        counts = tokens_per_expert.to(device=tokens.device)
        probs = probs.unsqueeze(-1)
        d, x = None, tokens
        align = group_align(tokens)
        if align == 1:
            offs = counts.cumsum(0).to(torch.int32)
        else:  # CUTLASS wants aligned group starts: pad each group as the native model does
            ids = torch.repeat_interleave(torch.arange(self.num_local_experts, device=tokens.device), counts,
                                          output_size=tokens.shape[0])  # output_size: no host sync
            d = dispatch(ids, self.num_local_experts, align)
            x, probs, offs = permute(tokens, d), permute(probs, d), d.offs
        w1 = torch.stack(self.linear_fc1.weights())  # [E, 2I, H]
        w2 = torch.stack(self.linear_fc2.weights())  # [E, H, I]
        gate, up = grouped_mm(x, w1, offs).chunk(2, dim=-1)
        # megatron's MLP order: activation, times the router prob, back to the input dtype, fc2
        out = grouped_mm((F.silu(gate) * up * probs).to(tokens.dtype), w2, offs)
        return (out if d is None else unpermute(out, d)), None


class _WeightList(nn.Module):
    """Parameters ``weight0..weight{n-1}`` of one projection, one per local expert (TE's naming)."""

    def __init__(self, n: int, shape: tuple[int, ...], device, config):
        super().__init__()
        for j in range(n):
            p = nn.Parameter(torch.empty(shape, device=device, dtype=config.params_dtype))
            p.allreduce = config.expert_model_parallel_size == 1  # megatron's flag on expert params
            self.register_parameter(f"weight{j}", p)

    def weights(self) -> list[torch.Tensor]:
        return list(self._parameters.values())
