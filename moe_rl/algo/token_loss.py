"""The policy loss as one function per token, for the fused LM-head loss (moe_rl.kernels
.fused_token_loss): the op calls it on each slab's log-probs as soon as they are known and
takes its gradient there, so d_hidden and d_weight come out of the forward (three GEMMs).

It is the same loss as :func:`moe_rl.algo.loss.policy_loss` (tests/algo/test_token_loss.py
checks value and gradients for every option below against it); ``policy_loss`` stays the
general path and still reports the metrics. A configuration is covered when every token's
term depends on that token's own log-prob and entropy and on constants known before the
forward:

* ``algo.policy_loss``: ``ppo``, ``cispo`` (not ``gspo``: its ratio is a mean over the sequence);
* ``algo.loss_agg``: ``token``, ``token_sum_norm``, ``sequence`` (the per-sequence normaliser
  ``1 / (tokens in the sequence x sequences)`` comes from the mask, not from log-probs);
* ``algo.ratio_anchor``: ``behaviour``; ``proximal`` with the proximal log-probs given (a
  minibatch after the first) or taken from this very forward (``proximal_logp=None``: the ratio
  is 1 with gradient, the behaviour weight exp(logp - behav) is per token);
* ``algo.tis_cap`` and ``algo.icepop_low``/``icepop_high`` (on or off);
* ``algo.tis_level``: ``token``; ``sequence`` unless the proximal is this forward (the weight
  is then a product over the sequence of this forward's log-probs);
* ``algo.kl_coef`` (k3 to the given reference log-probs) and ``algo.entropy_coef`` (the op's
  entropy, with its gradient).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..config import AlgoConfig
from .loss import k3, sequence_index


def fused_loss_unsupported(cfg: AlgoConfig) -> str | None:
    """Why the configured loss cannot run as per-token terms inside the LM-head op (then the
    trainer takes the general path), or None when it can."""
    if cfg.policy_loss == "gspo":
        return "algo.policy_loss=gspo: its ratio is a mean over the sequence's log-probs"
    if cfg.tis_level == "sequence" and cfg.ratio_anchor == "proximal":
        return ("algo.tis_level=sequence with algo.ratio_anchor=proximal: the behaviour weight is a "
                "product over the sequence of the proximal log-probs, which the first minibatch "
                "takes from this very forward")
    return None


class TokenLoss:
    """``policy_loss`` of one micro-batch as per-token terms ``l_t(logp_t, H_t)`` whose sum is
    the loss: ``TokenLoss(...)(logp[rows], entropy[rows], rows)`` gives the terms of the
    tokens ``rows``. Arguments as :func:`moe_rl.algo.loss.policy_loss`, except that
    ``proximal_logp=None`` means "the log-probs of this forward, detached" (what the trainer
    passes when the proximal policy is the forward being differentiated) and that
    ``num_tokens_global``/``num_seqs_global`` default to this micro-batch's counts."""

    def __init__(self, cfg: AlgoConfig, behaviour_logp: Tensor, advantages: Tensor, mask: Tensor,
                 seq_ids: Tensor, proximal_logp: Tensor | None = None, ref_logp: Tensor | None = None,
                 num_tokens_global: int | float | None = None, num_seqs_global: int | float | None = None):
        T = behaviour_logp.shape[0]
        for name, t in (("advantages", advantages), ("mask", mask), ("seq_ids", seq_ids),
                        ("proximal_logp", proximal_logp), ("ref_logp", ref_logp)):
            if t is not None and t.shape != (T,):
                raise ValueError(f"TokenLoss: {name} has shape {tuple(t.shape)}, expected ({T},)")
        if cfg.policy_loss not in ("ppo", "cispo"):
            raise ValueError(f"TokenLoss: algo.policy_loss={cfg.policy_loss!r} has no per-token form "
                             "(expected 'ppo' or 'cispo')")
        if cfg.loss_agg not in ("token", "sequence", "token_sum_norm"):
            raise ValueError(f"algo.loss_agg={cfg.loss_agg!r}: expected 'token', 'sequence' or 'token_sum_norm'")
        if cfg.loss_agg == "token_sum_norm" and cfg.loss_norm_tokens is None:
            raise ValueError("algo.loss_agg=token_sum_norm needs algo.loss_norm_tokens (the trainer loop sets it "
                             "to rollout.max_new_tokens x sequences in the step when it is null)")
        self.cfg = cfg
        dtype = torch.promote_types(behaviour_logp.dtype, torch.float32)
        dev = behaviour_logp.device
        self.behav = behaviour_logp.detach().to(dtype)
        # coupled PPO: the ratio is against the sampling policy itself, so w = 1
        if cfg.ratio_anchor == "behaviour":
            self.prox = self.behav
        else:
            self.prox = None if proximal_logp is None else proximal_logp.detach().to(dtype)
        if self.prox is None and cfg.tis_level == "sequence":
            raise ValueError("TokenLoss: algo.tis_level=sequence needs the proximal log-probs given (or "
                             "algo.ratio_anchor=behaviour): with the proximal policy taken from this forward the "
                             "weight is a product over the sequence")
        self.adv = advantages.detach().to(dtype)
        self.keep = mask > 0
        self.ref = ref_logp.detach().to(dtype) if ref_logp is not None and cfg.kl_coef > 0 else None

        # the aggregation as a per-token factor (known before the forward: it counts mask tokens)
        if cfg.loss_agg == "sequence":
            inv = sequence_index(seq_ids)  # S <= T bins: no host read
            S = T
            tok_count = torch.zeros(S, dtype=dtype, device=dev).index_add_(0, inv, self.keep.to(dtype))
            denom = (torch.tensor(float(num_seqs_global), dtype=dtype, device=dev) if num_seqs_global is not None
                     else (tok_count > 0).sum().to(dtype))
            self.scale = 1.0 / tok_count.clamp(min=1.0)[inv] / denom.clamp(min=1.0)
        else:
            if cfg.loss_agg == "token":
                denom = (torch.tensor(float(num_tokens_global), dtype=dtype, device=dev) if num_tokens_global is not None
                         else self.keep.sum().to(dtype))
            else:  # token_sum_norm (Dr. GRPO): a constant
                denom = torch.tensor(float(cfg.loss_norm_tokens), dtype=dtype, device=dev)
            self.scale = (1.0 / denom.clamp(min=1.0)).expand(T)

        # the behaviour weight, IcePop and TIS, when they do not depend on this forward
        self.seq_weight = None
        if self.prox is not None:
            self.w, self.live = self._weights(self.prox, self.behav, self.keep)
            if cfg.tis_level == "sequence":  # W_i = prod of the live tokens' w, on each of them
                inv = sequence_index(seq_ids)
                log_w = torch.where(self.live, self.prox - self.behav, torch.zeros((), dtype=dtype, device=dev))
                S = T
                log_W = torch.zeros(S, dtype=dtype, device=dev).index_add_(0, inv, log_w)
                w = log_W.exp()[inv]
                self.w = w.clamp(max=cfg.tis_cap) if cfg.tis_cap is not None else w

    def _weights(self, prox: Tensor, behav: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
        """(w = pi_prox / pi_behav truncated at tis_cap, live = kept and not masked by IcePop)."""
        cfg = self.cfg
        w = (prox - behav).exp()
        ice = torch.zeros_like(keep)
        if cfg.icepop_low is not None:
            ice |= w < cfg.icepop_low
        if cfg.icepop_high is not None:
            ice |= w > cfg.icepop_high
        live = keep & ~ice
        if cfg.tis_cap is not None and cfg.tis_level == "token":
            w = w.clamp(max=cfg.tis_cap)
        return w, live

    def __call__(self, logp: Tensor, entropy: Tensor | None, rows: slice) -> Tensor:
        cfg = self.cfg
        dtype = torch.promote_types(logp.dtype, torch.float32)
        logp = logp.to(dtype)
        behav, adv, keep = self.behav[rows].to(dtype), self.adv[rows].to(dtype), self.keep[rows]
        if self.prox is None:  # the proximal policy is this forward
            prox = logp.detach()
            w, live = self._weights(prox, behav, keep)
        else:
            prox, w, live = self.prox[rows].to(dtype), self.w[rows].to(dtype), self.live[rows]
        zero = torch.zeros((), dtype=dtype, device=logp.device)
        # tokens that do not count see logp := prox (ratio 1, zero gradient), as in policy_loss
        logp = torch.where(live, logp, prox)
        w = torch.where(live, w, torch.ones_like(w))
        adv = torch.where(live, adv, zero)
        lo, hi = 1.0 - cfg.clip_low, 1.0 + cfg.clip_high
        ratio = (logp - prox).exp()
        if cfg.policy_loss == "cispo":
            pg = -(ratio.clamp(lo, hi).detach() * adv * logp) * w
        else:
            pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(lo, hi)) * w
        per_token = pg
        if self.ref is not None:
            per_token = per_token + cfg.kl_coef * k3(self.ref[rows].to(dtype) - logp)
        if entropy is not None and cfg.entropy_coef > 0:
            per_token = per_token - cfg.entropy_coef * torch.where(live, entropy.to(dtype), zero)
        return torch.where(live, per_token, zero) * self.scale[rows].to(dtype)
