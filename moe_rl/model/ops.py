"""The arithmetic the model's layers call, behind one switch: torch's own ops or the exact ones.

A model holds one ops object (``MoEForCausalLM.use_ops``; the config's ``true_on_policy``
picks it) and hands it to every module that computes: ``Linear`` (every projection, the
routers' logits, the LM head), ``RMSNorm``, the routers' softmax / sigmoid and their top-k
renormalisation, the experts' grouped GEMMs and SiLU-and-multiply, the combine over the top-k
slots, MLA's per-head projections, the adapters a LoRA serves in the forward. The attention
layouts read ``ops.exact`` once when a forward builds them (``moe_rl.model.attention.layouts``,
``moe_rl.engine.decode``). The engine's log-softmax and the trainer's LM-head log-prob and
token-loss paths are here too, so that both sides take the log-probs of one set of kernels.

* ``TORCH``: torch's ops, HF's order of operations; the trainer's LM head through the fused
  Triton kernels (``moe_rl.kernels.fused_logprobs`` / ``fused_token_loss``). Fast, and a
  row's bits may depend on the rows computed with it.
* ``EXACT``: ``moe_rl.kernels.exact`` (docs/exact_kernels.md): every reduction in an order
  fixed by one row's shape, so a token's result is the same alone or batched, in a prefill or
  a decode step, in the engine or the trainer (DESIGN.md, contract 12; docs/true_on_policy.md).
  The combine keeps the gate weights in fp32 (one rounding per token), and the trainer's
  log-probs come from the exact linear and log-softmax, chunked over rows: the fused LM-head
  kernels reduce in another order and are not used.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moe_rl.kernels import exact
from moe_rl.kernels.fused_logprobs import fused_logprobs
from moe_rl.kernels.fused_token_loss import fused_token_loss

from .grouped import grouped_mm

# the exact LM head computes this many logits (fp32) at a time at most
LOGITS_CHUNK_ELEMENTS = 1 << 24


class TorchOps:
    """torch's own ops (the default)."""

    exact = False
    name = "torch"

    def linear(self, x, w, b=None):
        return F.linear(x, w, b)

    def rms_norm(self, x, w, eps: float):
        # HF's order: normalise in fp32, cast back, then scale (one fused op for the first part)
        return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)

    def softmax(self, x):
        """fp32 softmax over the last dimension (the softmax router's probabilities)."""
        return F.softmax(x, dim=-1, dtype=torch.float)

    def sigmoid(self, x):
        return x.sigmoid()

    def row_sum(self, x):
        """[N, k] -> [N, 1]: the sum of a router's top-k weights (their renormalisation)."""
        return x.sum(dim=-1, keepdim=True)

    def silu_mul(self, gate, up):
        return F.silu(gate) * up

    def grouped_mm(self, x, w, offs):
        return grouped_mm(x, w, offs)

    def combine(self, expert_out, weights):
        """expert_out [N * k, H] in (token, slot) order, weights [N, k] (fp32) -> [N, H]: a
        batched [1, k] x [k, H] product with the weights in expert_out's dtype."""
        N, k = weights.shape
        w = weights.to(expert_out.dtype).unsqueeze(1)
        return torch.bmm(w, expert_out.view(N, k, expert_out.shape[-1])).squeeze(1)

    def head_linear(self, x, w):
        """Per-head projection: x [N, heads, d_in], w [heads, d_out, d_in] -> [N, heads, d_out]."""
        return torch.einsum("nhd,hcd->nhc", x, w)

    def lora_weight(self, w, A, B, scaling: float):
        """w + scaling * B @ A: the weight a LoRA-adapted projection applies."""
        return torch.addmm(w, B, A, alpha=scaling)

    def log_softmax(self, x):
        """fp32 log-softmax over the last dimension (the engine's sampling distribution)."""
        return torch.log_softmax(x.float(), dim=-1)

    def lm_logprobs(self, hidden, weight, labels, temperature: float, with_entropy: bool = False):
        """(fp32 log-probs [N] of ``labels`` under ``log_softmax(hidden @ weight.T / T)``,
        entropies [N] or None); label -100: 0. Differentiable."""
        out = fused_logprobs(hidden, weight, labels, temperature=temperature, return_entropy=with_entropy)
        return out if with_entropy else (out, None)

    def lm_token_loss(self, hidden, weight, labels, token_loss, temperature: float, with_entropy: bool = False):
        """(loss = sum of ``token_loss``'s per-token terms, log-probs, entropies or None), the
        last two detached: ``moe_rl.kernels.fused_token_loss``'s contract."""
        return fused_token_loss(hidden, weight, labels, token_loss, temperature=temperature,
                                return_entropy=with_entropy)


class ExactOps(TorchOps):
    """``moe_rl.kernels.exact``: every row's result independent of the others (module docstring)."""

    exact = True
    name = "exact"

    def linear(self, x, w, b=None):
        return exact.linear(x, w, b)

    def rms_norm(self, x, w, eps: float):
        return exact.rms_norm(x, w, eps)

    def softmax(self, x):
        return exact.softmax(x)

    def sigmoid(self, x):
        return exact.sigmoid(x)

    def row_sum(self, x):
        # a dot product with ones: the linear kernel's fixed lane order, whatever the row count
        return exact.linear(x, torch.ones(1, x.shape[-1], dtype=x.dtype, device=x.device))

    def silu_mul(self, gate, up):
        return exact.silu_mul(gate, up)

    def grouped_mm(self, x, w, offs):
        return exact.grouped_linear(x, w, offs)

    def combine(self, expert_out, weights):
        # the slots in slot order, in fp32 with the fp32 gate weights, rounded once
        return exact.moe_combine(expert_out, weights.float())

    def head_linear(self, x, w):
        # one grouped GEMM whose groups are the heads (rows head-major)
        N, heads, d = x.shape
        rows = x.transpose(0, 1).reshape(heads * N, d)
        offs = torch.arange(1, heads + 1, dtype=torch.int32, device=x.device) * N
        out = exact.grouped_linear(rows, w.contiguous(), offs)
        return out.view(heads, N, w.shape[1]).transpose(0, 1)

    def lora_weight(self, w, A, B, scaling: float):
        return w + scaling * exact.linear(B, A.t().contiguous())

    def log_softmax(self, x):
        return exact.log_softmax(x.float())

    def lm_logprobs(self, hidden, weight, labels, temperature: float, with_entropy: bool = False):
        """The engine's arithmetic: ``log_softmax(linear(h, W).float() / T)`` at the labels,
        ``LOGITS_CHUNK_ELEMENTS`` logits at a time (their autograd keeps each chunk's logits for
        the backward: the fused kernels' memory saving is given up)."""
        N, V = hidden.shape[0], weight.shape[0]
        rows = max(1, LOGITS_CHUNK_ELEMENTS // max(V, 1))
        labels = labels.to(hidden.device, non_blocking=True)
        lps, ents = [], []
        for r0 in range(0, N, rows):
            z = tempered(exact.linear(hidden[r0 : r0 + rows], weight), temperature)
            lab = labels[r0 : r0 + rows]
            if not with_entropy:
                lps.append(exact.token_logprobs(z, lab))  # label -100: 0
                continue
            lp = exact.log_softmax(z)  # its gather equals token_logprobs bit for bit
            keep = lab >= 0
            lps.append(torch.where(keep, lp.gather(1, lab.clamp(min=0)[:, None]).squeeze(1), 0.0))
            ents.append(torch.where(keep, -(lp.exp() * lp).sum(-1), 0.0))
        if not lps:
            empty = hidden.new_zeros(0, dtype=torch.float32)
            return empty, (empty if with_entropy else None)
        return torch.cat(lps), (torch.cat(ents) if with_entropy else None)

    def lm_token_loss(self, hidden, weight, labels, token_loss, temperature: float, with_entropy: bool = False):
        """The exact log-probs (``lm_logprobs``), then the per-token loss on them: the loss's
        backward runs through the exact ops' autograd (the fused kernel, which makes d_hidden
        in its forward, reduces in another order)."""
        logp, ent = self.lm_logprobs(hidden, weight, labels, temperature, with_entropy)
        loss = token_loss(logp, ent, slice(0, logp.shape[0])).sum()
        return loss, logp.detach(), None if ent is None else ent.detach()


def tempered(logits: torch.Tensor, temperature) -> torch.Tensor:
    """fp32 logits divided by the temperature (a float, or a tensor of one per row): one IEEE
    division per element with the divisor on the logits' device, the engine's order and the
    trainer's (a CUDA division by a host scalar is a multiplication by its reciprocal)."""
    t = torch.as_tensor(temperature, dtype=torch.float32).to(logits.device, non_blocking=True)
    return logits.float() / (t.view(-1, 1) if t.dim() else t.view(1, 1))


TORCH = TorchOps()
EXACT = ExactOps()


def model_ops(cfg):
    """The ops of an experiment (``cfg``: an ExperimentConfig): ``EXACT`` under ``true_on_policy``."""
    return EXACT if cfg.true_on_policy else TORCH


class Linear(nn.Linear):
    """``nn.Linear`` whose product is its model's ops' (``ops.linear``); parameters, names and
    hooks are nn.Linear's."""

    ops = TORCH

    def forward(self, x):
        return self.ops.linear(x, self.weight, self.bias)
