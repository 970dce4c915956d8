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
memory-bound; TE's GroupedLinear takes the same per-expert list). gpt-oss's experts: with
``add_bias_linear`` the biases ``linear_fc{1,2}.bias{j}`` (TE's names too), and megatron's clamped
quick-GELU GLU (``activation_func=quick_gelu``, ``glu_linear_offset``,
``activation_func_clamp_value``) computed as megatron's MLP computes it.
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
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        silu = config.activation_func is F.silu and not config.add_bias_linear and config.glu_linear_offset == 0 \
            and config.activation_func_clamp_value is None
        clamped = config.activation_func is quick_gelu and config.add_bias_linear
        if not config.gated_linear_unit or not (silu or clamped):
            raise ValueError("TorchGroupedMLP implements bias-free SwiGLU experts (Qwen3-MoE, GLM) and biased "
                             "clamped quick-GELU GLU experts (gpt-oss); set train.megatron_grouped_gemm=false for "
                             "other expert MLPs")
        if getattr(config, "expert_tensor_parallel_size", 1) not in (None, 1):
            raise ValueError("TorchGroupedMLP does not shard experts over tensor parallelism "
                             "(expert_tensor_parallel_size must be 1)")
        self.config = config
        self.num_local_experts = num_local_experts
        H, I = config.hidden_size, config.moe_ffn_hidden_size
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        # TEGroupedMLP's state-dict names: "linear_fc1.weight{j}", "linear_fc2.weight{j}" (and "bias{j}")
        make = lambda *shape: _WeightList(num_local_experts, shape, device, config)  # noqa: E731
        self.linear_fc1, self.linear_fc2 = make(2 * I, H), make(H, I)
        if config.add_bias_linear:
            self.linear_fc1.add_biases(2 * I)
            self.linear_fc2.add_biases(H)

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor):
        counts = tokens_per_expert.to(device=tokens.device, non_blocking=True)  # the dispatcher's pinned host copy
        probs = probs.unsqueeze(-1)
        d, x = None, tokens
        align = group_align(tokens)
        biased = self.config.add_bias_linear
        if align == 1 and not biased:
            offs = counts.cumsum(0).to(torch.int32)
        else:  # CUTLASS wants aligned group starts: pad each group as the native model does; biases need row ids
            ids = torch.repeat_interleave(torch.arange(self.num_local_experts, device=tokens.device), counts,
                                          output_size=tokens.shape[0])  # output_size: no host sync
            d = dispatch(ids, self.num_local_experts, align)
            x, probs, offs = permute(tokens, d), permute(probs, d), d.offs
            if biased:
                row_expert = permute(ids[:, None], d)[:, 0]  # padding rows: expert 0 (their outputs are dropped)
        w1 = torch.stack(self.linear_fc1.weights())  # [E, 2I, H]
        w2 = torch.stack(self.linear_fc2.weights())  # [E, H, I]
        h = grouped_mm(x, w1, offs)
        if biased:
            h = h + torch.stack(self.linear_fc1.biases())[row_expert]
        gate, up = h.chunk(2, dim=-1)
        if biased:  # gpt-oss: megatron's MLP glu with the clamp and the offset
            val = self.config.activation_func_clamp_value
            if val is not None:
                gate, up = gate.clamp(max=val), up.clamp(-val, val)
            act = self.config.activation_func(gate) * (up + self.config.glu_linear_offset)
        else:
            act = F.silu(gate) * up
        # megatron's MLP order: activation, times the router prob, back to the input dtype, fc2 (+ its bias
        # times the prob)
        out = grouped_mm((act * probs).to(tokens.dtype), w2, offs)
        if biased:
            out = out + torch.stack(self.linear_fc2.biases())[row_expert] * probs
        return (out if d is None else unpermute(out, d)), None


class _WeightList(nn.Module):
    """Parameters ``weight0..weight{n-1}`` of one projection, one per local expert (TE's naming)."""

    def __init__(self, n: int, shape: tuple[int, ...], device, config):
        super().__init__()
        for j in range(n):
            p = nn.Parameter(torch.empty(shape, device=device, dtype=config.params_dtype))
            p.allreduce = config.expert_model_parallel_size == 1  # megatron's flag on expert params
            self.register_parameter(f"weight{j}", p)

    def add_biases(self, size: int) -> None:
        """``bias0..bias{n-1}`` beside the weights (TE GroupedLinear's names)."""
        like = self._parameters["weight0"]
        for j in range(len(self.weights())):
            p = nn.Parameter(torch.empty(size, device=like.device, dtype=like.dtype))
            p.allreduce = like.allreduce
            self.register_parameter(f"bias{j}", p)

    def weights(self) -> list[torch.Tensor]:
        return [p for n, p in self._parameters.items() if n.startswith("weight")]

    def biases(self) -> list[torch.Tensor]:
        return [p for n, p in self._parameters.items() if n.startswith("bias")]
