"""The embedded engine's logit processing and sampling, on the logits' device.

``apply_penalties`` is SGLang's penaltylib; ``sample_tokens`` draws one token per row:
greedy rows take the argmax, every other row is sampled by inverse CDF with one uniform draw
from its request's own seeded (CPU) generator (``Uniforms``), after SGLang's top-k / top-p / min-p truncation
where asked. The inputs built on the host go over with non-blocking copies, so nothing here
waits for the device.

``sample_seeded`` is the sampler of ``true_on_policy``: a row's token is a function of its
log-probs, its request's seed and the token's position only (``moe_rl.kernels.exact.
seeded_sample``: Gumbel-max with counter-based noise), so a request draws the same tokens
alone or batched, and after a retraction; truncation is a ``-inf`` mask on the log-probs first.
"""
from __future__ import annotations

import torch

from moe_rl.kernels.exact import seeded_sample

from . import protocol as P


def to_device(dev: torch.device, values, dtype) -> torch.Tensor:
    """``values`` on ``dev`` without waiting: on a GPU from pinned memory (torch's caching host
    allocator), since a copy from pageable memory may wait for the stream, i.e. for the step's
    forward, before the sampling's kernels are even launched."""
    return torch.tensor(values, dtype=dtype, pin_memory=dev.type == "cuda").to(dev, non_blocking=True)


class Uniforms:
    """A request's uniform draws from its own seeded CPU generator, ``block`` at a time: the
    same floats as one ``torch.rand(())`` per token (CPU ``uniform_`` draws element by element),
    without an op per row and step (at 64 rows those were a third of the engine step's host
    time)."""

    def __init__(self, generator: torch.Generator, block: int = 64):
        self.generator = generator
        self.block = max(1, block)
        self._left: list[float] = []

    def next(self) -> float:
        if not self._left:
            self._left = torch.rand(self.block, generator=self.generator).tolist()[::-1]
        return self._left.pop()


def apply_penalties(logits: torch.Tensor, params: list[P.SamplingParams], outputs: list[list[int]]) -> None:
    """SGLang's penaltylib on ``logits`` [R, V] (fp32, one row per request) in place, from each
    request's output tokens so far: ``frequency_penalty`` * count and ``presence_penalty`` once
    per generated token, ``-inf`` on ``min_new_tokens_ids`` while fewer than ``min_new_tokens``
    tokens are out (the additive ones, summed first as SGLang's overlap scheduler does), then
    ``repetition_penalty`` on generated tokens (logit * p when negative, / p otherwise).
    Prompt tokens are not penalized (SGLang feeds its penalizers the output tokens only)."""
    R, V = logits.shape
    dev = logits.device

    def padded(lists):  # ragged id lists -> [R, n] padded with V (a scratch column)
        n = max(map(len, lists), default=0)
        return to_device(dev, [x + [V] * (n - len(x)) for x in lists], torch.long).view(R, n)

    def column(values):
        return to_device(dev, values, torch.float32)[:, None]

    out = padded([list(o) for o in outputs])
    counts = torch.zeros(R, V + 1, dtype=torch.float32, device=dev).scatter_add_(
        1, out, torch.ones(out.shape, dtype=torch.float32, device=dev))[:, :V]
    seen = counts > 0
    additive = counts * -column([p.frequency_penalty for p in params])
    additive -= seen * column([p.presence_penalty for p in params])
    masked = [sorted(p.min_new_tokens_ids) if len(o) < p.min_new_tokens else [] for p, o in zip(params, outputs)]
    if any(masked):
        stop = torch.zeros(R, V + 1, dtype=torch.float32, device=dev).scatter_(1, padded(masked), float("-inf"))
        additive += stop[:, :V]
    logits.add_(additive)
    scale = torch.where(seen, column([p.repetition_penalty for p in params]), 1.0)
    logits.copy_(torch.where(logits < 0, logits * scale, logits / scale))


def truncate(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """SGLang's truncation of ``probs`` [R, V] (unnormalised is fine), per row, in this order:
    keep the ``top_k`` largest (ties with the k-th kept; k >= V keeps all), then the smallest
    prefix of them (by decreasing probability) whose mass reaches ``top_p`` of what is left,
    then those with at least ``min_p`` times the largest. Dropped entries become 0; the
    result is in vocabulary order. One sort per row, whatever the mix of settings."""
    V = probs.shape[1]
    srt, order = probs.sort(dim=-1, descending=True)
    kth = srt.gather(1, (top_k.clamp(1, V) - 1)[:, None])
    srt = torch.where(srt >= kth, srt, 0.0)
    cum = srt.cumsum(dim=-1)
    srt = srt.masked_fill((cum - srt) > top_p[:, None] * cum[:, -1:], 0.0)
    srt = torch.where(srt >= srt[:, :1] * min_p[:, None], srt, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, srt)


def sample_tokens(params: list[P.SamplingParams], uniforms: list[Uniforms],
                  logits: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logits`` [R, V] (processed) and ``logp`` (their log-softmax at
    each row's temperature), as a long tensor on their device. A sampled row picks the first
    token whose cumulative probability exceeds u times the row's total, u the next draw of its
    request's ``Uniforms``: token i with probability p_i exactly, and a request's tokens depend
    on its seed alone, not on its batch-mates or the device."""
    R, V = logits.shape
    dev = logits.device
    greedy = [i for i, p in enumerate(params) if p.greedy]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        return logits.argmax(dim=-1)
    all_sampled = len(sampled) == R
    rows = None if all_sampled else to_device(dev, sampled, torch.long)
    probs = (logp if all_sampled else logp.index_select(0, rows)).exp()
    cut = [j for j, i in enumerate(sampled) if params[i].top_k > 0 or params[i].top_p < 1.0 or params[i].min_p > 0.0]
    if cut:
        ps = [params[sampled[j]] for j in cut]
        whole = len(cut) == len(sampled)
        cut_rows = None if whole else to_device(dev, cut, torch.long)
        kept = truncate(probs if whole else probs.index_select(0, cut_rows),
                        to_device(dev, [p.top_k if p.top_k > 0 else V for p in ps], torch.long),
                        to_device(dev, [p.top_p for p in ps], torch.float32), to_device(dev, [p.min_p for p in ps], torch.float32))
        probs = kept if whole else probs.index_copy_(0, cut_rows, kept)
    u = to_device(dev, [uniforms[i].next() for i in sampled], torch.float32)
    cdf = probs.cumsum(dim=-1)
    picked = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1).clamp_(max=V - 1)
    if all_sampled:
        return picked
    tokens = logits.argmax(dim=-1) if greedy else torch.zeros(R, dtype=torch.long, device=dev)
    return tokens.index_copy_(0, rows, picked)


def sample_seeded(params: list[P.SamplingParams], seeds: list[int], positions: list[int],
                  logits: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """One token per row, as a long tensor on the logits' device: greedy rows the argmax of
    their logits, the others ``seeded_sample`` of ``logp`` (the log-softmax at the row's
    temperature) with the entries that top-k / top-p / min-p (``truncate``) drop set to
    ``-inf``, keyed by the row's request seed and the position of the token it samples."""
    R, V = logits.shape
    dev = logits.device
    cut = [i for i, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0]
    if cut:
        ps = [params[i] for i in cut]
        rows = to_device(dev, cut, torch.long)
        kept = truncate(logp.index_select(0, rows).exp(),
                        to_device(dev, [p.top_k if p.top_k > 0 else V for p in ps], torch.long),
                        to_device(dev, [p.top_p for p in ps], torch.float32), to_device(dev, [p.min_p for p in ps], torch.float32))
        logp = logp.index_copy(0, rows, logp.index_select(0, rows).masked_fill(kept == 0, float("-inf")))
    seed_t = to_device(dev, [s & 0x7FFFFFFFFFFFFFFF for s in seeds], torch.long)
    tokens = seeded_sample(logp.contiguous(), seed_t, to_device(dev, positions, torch.long))
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        g = to_device(dev, greedy, torch.long)
        tokens = tokens.index_copy(0, g, logits.index_select(0, g).argmax(dim=-1))
    return tokens
