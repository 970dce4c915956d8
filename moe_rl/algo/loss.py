"""The policy loss: decoupled PPO (AReaL), GSPO or CISPO, with TIS, IcePop, k3 KL and an
entropy bonus.

Three policies meet here, all as per-token log-probs of the sampled response tokens:

* ``logp``            pi_theta: the trainer's current parameters (carries the gradient);
* ``proximal_logp``   pi_prox: the trainer's parameters *before* this step's update,
                      recomputed by a forward pass (routing replayed);
* ``behaviour_logp``  pi_behav: the engine that sampled the token (possibly stale and in
                      another precision).

Per token t (A = advantage, u = pi_theta/pi_prox, w = pi_prox/pi_behav)::

    pg_t = w_t * max(-A_t * u_t, -A_t * clip(u_t, 1 - clip_low, 1 + clip_high))

``algo.policy_loss`` replaces the bracket (sg = stop-gradient, A_i the sequence's advantage)::

    ppo:   max(-A u_t, -A clip(u_t))                      u_t = exp(logp_t - prox_t)
    gspo:  max(-A r_t, -A clip(r_t))   r_t = exp(logp_t - sg(logp_t) + sg(log s_i)),
           s_i = exp(mean over the loss-mask tokens of sequence i of (logp - prox))
           (value s_i at every token, gradient s_i * d logp_t: one clip decision per sequence)
    cispo: -sg(clip(u_t)) * A * logp_t                    (the clip bounds the weight only)

``w`` is detached and, with ``tis_cap``, truncated at the cap (TIS). IcePop: a token whose
train/infer ratio w lies outside [icepop_low, icepop_high] is masked out (contributes zero)
before truncation. ``tis_level="sequence"`` replaces w_t by one weight per sequence,
W_i = prod over its tokens not masked by IcePop of w_t, truncated at ``tis_cap``: the
likelihood ratio of the whole response, which a per-token w leaves out for a stale sample
(the prefix that led to token t was drawn by the older policy too). With ``kl_coef`` the k3
estimator of KL(pi_theta || pi_ref), ``exp(ref - logp) - (ref - logp) - 1``, is added per
token; with ``entropy_coef`` the per-token entropy (given) is subtracted.

Aggregation and distributed training
-----------------------------------
The trainer loop splits a step's batch over data-parallel ranks and micro-batches and sums
the gradients. So the normaliser is the step's GLOBAL one, passed in:

* ``loss_agg="token"``:    loss = sum_t mask_t * l_t / num_tokens_global
* ``loss_agg="sequence"``: loss = sum_s mean_{t in s} l_t / num_seqs_global
* ``loss_agg="token_sum_norm"`` (Dr. GRPO): loss = sum_t mask_t * l_t / algo.loss_norm_tokens,
  a constant (the loop's default: rollout.max_new_tokens x sequences in the step), so a long
  response's tokens weigh no less than a short one's

``num_tokens_global`` counts the tokens with ``mask == 1`` in the whole step (all ranks, all
micro-batches); ``num_seqs_global`` counts the sequences that have at least one such token.
IcePop-masked tokens stay in both counts (they are dropped from the numerator only), so the
normalisers are known before the loss runs; :func:`loss_normalisers` computes the local
counts to all-reduce. For sequence aggregation and for gspo (whose ratio is a mean over the
sequence) every sequence must lie entirely inside one call (the loop splits by sequences).
With the normalisers left ``None`` the given tensors are the whole batch. Either way, the sum of the returned losses over all calls is the step's
loss, and so are the summed gradients.

Metrics are 0-dim tensors on the inputs' device over the given (local) tokens; ``num_tokens``
lets the caller weight them when averaging over micro-batches. Nothing here reads a device
value on the host (no ``.item()``, no data-dependent shape): the trainer sums the metrics on
the device and reads them once per step.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ..config import AlgoConfig


def k3(log_ratio: Tensor) -> Tensor:
    """k3 = exp(d) - d - 1 >= 0 for d = log q - log p (Schulman's low-variance KL estimator);
    zero iff d == 0. Computed with expm1 for accuracy at small d."""
    return torch.expm1(log_ratio) - log_ratio


def loss_normalisers(mask: Tensor, seq_ids: Tensor) -> tuple[int, int]:
    """(tokens with mask==1, sequences with at least one such token) of one micro-batch;
    sum them over micro-batches and ranks for ``num_tokens_global`` / ``num_seqs_global``
    (host integers: the loop counts them from the host's copy of the batch)."""
    keep = mask > 0
    return int(keep.sum()), int(torch.unique(seq_ids[keep]).numel())


def sequence_index(seq_ids: Tensor) -> Tensor:
    """[T] -> the dense index 0..S-1 of each token's sequence, in order of value (what
    ``torch.unique(seq_ids, return_inverse=True)`` gives) without reading S on the host: a
    sort and a cumsum. Per-sequence sums go into T bins (a static bound on S); the unused
    bins stay zero."""
    srt, order = torch.sort(seq_ids, stable=True)
    first = torch.ones_like(srt, dtype=torch.long)
    first[1:] = (srt[1:] != srt[:-1]).long()
    rank = first.cumsum(0) - 1
    return torch.empty_like(rank).scatter_(0, order, rank)


@torch.no_grad()
def mismatch_metrics(proximal_logp: Tensor, behaviour_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Train/infer mismatch over the tokens with mask==1, as 0-dim tensors (no host read).

    ``mismatch_k3``: mean of exp(b - p) - (b - p) - 1 (p = trainer, b = engine log-prob);
    ``mismatch_max_ratio`` / ``mismatch_min_ratio``: extreme of exp(p - b);
    ``num_tokens``: how many tokens were measured. With none: 0, 1, 1, 0.
    """
    keep = mask > 0
    dev = proximal_logp.device
    if keep.numel() == 0:
        zero, one = torch.zeros((), dtype=torch.float64, device=dev), torch.ones((), dtype=torch.float64, device=dev)
        return {"mismatch_k3": zero, "mismatch_max_ratio": one, "mismatch_min_ratio": one,
                "num_tokens": torch.zeros((), dtype=torch.long, device=dev)}
    n = keep.sum()
    log_r = torch.where(keep, proximal_logp.detach().double() - behaviour_logp.detach().double(), 0.0)
    any_kept = n > 0
    return {
        "mismatch_k3": k3(-log_r).sum() / n.clamp(min=1),  # k3(0) = 0 at the tokens not kept
        "mismatch_max_ratio": torch.where(any_kept, torch.where(keep, log_r, -math.inf).max().exp(), 1.0),
        "mismatch_min_ratio": torch.where(any_kept, torch.where(keep, log_r, math.inf).min().exp(), 1.0),
        "num_tokens": n,
    }


def policy_loss(
    logp: Tensor,
    proximal_logp: Tensor,
    behaviour_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    seq_ids: Tensor,
    cfg: AlgoConfig,
    ref_logp: Tensor | None = None,
    entropy: Tensor | None = None,
    num_tokens_global: int | float | None = None,
    num_seqs_global: int | float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The policy loss (``cfg.policy_loss``) of one micro-batch; every input is per response
    token, 1-D [T].

    ``mask``: 1 (or True) where the token counts. ``seq_ids``: the sample each token belongs
    to (any integers). ``advantages``: per token (a sequence's advantage repeated). Returns
    ``(loss, metrics)``; the loss is a scalar whose sum over a step's micro-batches and ranks
    is the step's loss (see the module docstring for the normalisers).
    """
    T = logp.shape[0]
    for name, t in (("proximal_logp", proximal_logp), ("behaviour_logp", behaviour_logp),
                    ("advantages", advantages), ("mask", mask), ("seq_ids", seq_ids),
                    ("ref_logp", ref_logp), ("entropy", entropy)):
        if t is not None and t.shape != (T,):
            raise ValueError(f"policy_loss: {name} has shape {tuple(t.shape)}, expected ({T},) like logp")
    if cfg.loss_agg not in ("token", "sequence", "token_sum_norm"):
        raise ValueError(f"algo.loss_agg={cfg.loss_agg!r}: expected 'token', 'sequence' or 'token_sum_norm'")
    if cfg.policy_loss not in ("ppo", "gspo", "cispo"):
        raise ValueError(f"algo.policy_loss={cfg.policy_loss!r}: expected 'ppo', 'gspo' or 'cispo'")
    if cfg.loss_agg == "token_sum_norm" and cfg.loss_norm_tokens is None:
        raise ValueError("algo.loss_agg=token_sum_norm needs algo.loss_norm_tokens (the trainer loop sets it to "
                         "rollout.max_new_tokens x sequences in the step when it is null)")

    dtype = torch.promote_types(logp.dtype, torch.float32)
    logp = logp.to(dtype)
    behav = behaviour_logp.detach().to(dtype)
    # coupled PPO: the ratio is against the sampling policy itself, so w = 1 below
    prox = behav if cfg.ratio_anchor == "behaviour" else proximal_logp.detach().to(dtype)
    adv = advantages.detach().to(dtype)
    keep = mask > 0
    n_local = keep.sum()
    zero = torch.zeros((), dtype=dtype, device=logp.device)

    # per-sequence bookkeeping (GSPO's ratio, sequence aggregation): S <= T bins, no host read
    need_seqs = cfg.policy_loss == "gspo" or cfg.loss_agg == "sequence" or cfg.tis_level == "sequence"
    if need_seqs:
        inv = sequence_index(seq_ids)
        S = T
        tok_count = torch.zeros(S, dtype=dtype, device=logp.device).index_add_(0, inv, keep.to(dtype))

    # behaviour weight w = pi_prox / pi_behav: IcePop mask, then TIS truncation
    log_w = prox - behav
    w = log_w.exp()
    ice = torch.zeros_like(keep)
    if cfg.icepop_low is not None:
        ice |= w < cfg.icepop_low
    if cfg.icepop_high is not None:
        ice |= w > cfg.icepop_high
    ice &= keep
    live = keep & ~ice
    if cfg.tis_level == "sequence":  # W_i = prod of the live tokens' w, on each of them
        log_W = torch.zeros(S, dtype=dtype, device=logp.device).index_add_(0, inv, torch.where(live, log_w, zero))
        w = log_W.exp()[inv]
    if cfg.tis_cap is not None:
        tis = (w > cfg.tis_cap) & live
        w = w.clamp(max=cfg.tis_cap)
    else:
        tis = torch.zeros_like(keep)

    # GSPO's sequence ratio s_i = exp(mean over the loss-mask tokens of (logp - prox)), taken
    # before IcePop drops tokens (IcePop/TIS weigh the token losses afterwards)
    if cfg.policy_loss == "gspo":
        d = torch.where(keep, logp.detach() - prox, zero)
        log_s = torch.zeros(S, dtype=dtype, device=logp.device).index_add_(0, inv, d) / tok_count.clamp(min=1.0)

    # Tokens that do not count see logp := prox (ratio 1, zero gradient), so garbage values at
    # padding or huge ratios at IcePop-masked tokens cannot turn into inf * 0 = NaN.
    logp = torch.where(live, logp, prox)
    w = torch.where(live, w, torch.ones_like(w))
    adv = torch.where(live, adv, torch.zeros_like(adv))

    lo, hi = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high
    if cfg.policy_loss == "cispo":
        # CISPO (MiniMax-M1): REINFORCE on logp weighted by the clipped, detached ratio; a token
        # outside the clip range keeps its gradient (only its weight is bounded)
        ratio = (logp - prox).exp()
        pg = -(ratio.clamp(lo, hi).detach() * adv * logp) * w
        clip_active = ((ratio < lo) | (ratio > hi)) & live
    else:
        if cfg.policy_loss == "gspo":
            # value s_i at every token of sequence i, gradient d r_it / d logp_it = s_i
            ratio = (logp - logp.detach() + log_s[inv]).exp()
        else:
            ratio = (logp - prox).exp()
        # PPO clip against the proximal policy, min form (max of the negated objectives)
        unclipped = -adv * ratio
        clipped = -adv * ratio.clamp(lo, hi)
        pg = torch.maximum(unclipped, clipped) * w
        clip_active = (clipped > unclipped) & live

    per_token = pg
    kl = None
    if ref_logp is not None and cfg.kl_coef > 0:
        kl = k3(ref_logp.detach().to(dtype) - logp)
        per_token = per_token + cfg.kl_coef * kl
    if entropy is not None and cfg.entropy_coef > 0:
        ent = torch.where(live, entropy.to(dtype), zero)
        per_token = per_token - cfg.entropy_coef * ent

    # the normaliser: a host number when given (the step's global count), else this call's count
    if cfg.loss_agg == "sequence":
        per_tok_scale = 1.0 / tok_count.clamp(min=1.0)[inv]
        denom = (max(float(num_seqs_global), 1.0) if num_seqs_global is not None
                 else (tok_count > 0).sum().to(dtype).clamp(min=1.0))

        def agg(x: Tensor) -> Tensor:
            return (torch.where(live, x, zero) * per_tok_scale).sum() / denom
    else:
        if cfg.loss_agg == "token":
            denom = (max(float(num_tokens_global), 1.0) if num_tokens_global is not None
                     else n_local.to(dtype).clamp(min=1.0))
        else:  # token_sum_norm (Dr. GRPO): a constant, not the token count
            denom = max(float(cfg.loss_norm_tokens), 1.0)

        def agg(x: Tensor) -> Tensor:
            return torch.where(live, x, zero).sum() / denom

    loss = agg(per_token)

    with torch.no_grad():
        nk, nl = n_local.clamp(min=1).to(dtype), live.sum().clamp(min=1).to(dtype)
        metrics: dict[str, Tensor] = {
            "pg_loss": agg(pg.detach()),
            "clip_frac": clip_active.sum() / nl,  # of the live tokens (GSPO: token-weighted sequences)
            "tis_frac": tis.sum() / nk,
            "icepop_frac": ice.sum() / nk,
            "ratio_mean": torch.where(live, ratio.detach(), zero).sum() / nl,
            "kl": torch.where(live, kl.detach(), zero).sum() / nl if kl is not None else zero,
            "num_tokens": n_local,
        }
        if entropy is not None:
            metrics["entropy"] = torch.where(keep, entropy.detach().to(dtype), zero).sum() / nk
        mm = mismatch_metrics(prox, behav, keep)
        metrics["mismatch_k3"] = mm["mismatch_k3"]
        metrics["mismatch_max_ratio"] = mm["mismatch_max_ratio"]
        if cfg.policy_loss == "gspo":
            live_seq = torch.zeros(S, dtype=dtype, device=logp.device).index_add_(0, inv, live.to(dtype)) > 0
            clipped_seq = torch.zeros(S, dtype=dtype, device=logp.device).index_add_(0, inv, clip_active.to(dtype)) > 0
            metrics["clip_frac_seq"] = clipped_seq.sum() / live_seq.sum().clamp(min=1)
        metrics["loss"] = loss.detach()
    return loss, metrics
