"""``train.minibatches``: several optimizer updates per rollout batch (train/loop.py's
train_step), checked against a plain-torch reference written out here: per-sequence forwards
of a plain model, the proximal log-probs taken once with the weights the batch started from,
the decoupled PPO clip written token by token, torch's own grad-norm clip and SGD."""
import math

import pytest
import torch

from moe_rl.config import ConfigError, load_config
from moe_rl.dist import Groups, Layout
from moe_rl.model.transformer import MoEForCausalLM
from moe_rl.train.loop import Trainer

TINY = ["model.vocab_size=32", "model.hidden_size=32", "model.intermediate_size=64", "model.moe_intermediate_size=16",
        "model.num_hidden_layers=2", "model.num_attention_heads=4", "model.num_key_value_heads=2", "model.head_dim=8",
        "model.num_experts=4", "model.num_experts_per_tok=2", "model.max_position_embeddings=64",
        "rollout.prompts_per_step=3", "rollout.group_size=2", "train.micro_batch_size=2", "train.lr=3.0",
        "replay.enabled=false", "algo.tis_cap=null", "algo.icepop_low=null", "algo.icepop_high=null"]


def _batch(model, temp, n=6, seed=0):
    """Samples whose behaviour log-probs are the initial model's plus noise (a stale engine)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(0, 32, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g).tolist()
        resp = torch.randint(0, 32, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
        with torch.no_grad():
            behav = _seq_logp(model, prompt, resp, temp) + 0.3 * torch.randn(len(resp), generator=g)
        out.append(dict(uid=i, group_id=i // 2, prompt_ids=prompt, response_ids=resp, behaviour_logprobs=behav.tolist(),
                        versions=[0] * len(resp), advantage=float(torch.randn((), generator=g)), has_routing=False,
                        loss_mask=None))
    return out


def _seq_logp(model, prompt, resp, temp):
    ids = torch.tensor(prompt + resp)[None]
    logits = model(ids)[0][len(prompt) - 1 : len(prompt) - 1 + len(resp)]
    return torch.log_softmax(logits / temp, -1)[torch.arange(len(resp)), torch.tensor(resp)]


def _reference(cfg, batch, n_mini):
    """Plain torch: split the batch in order, proximal log-probs from the initial weights, one
    clipped-PPO token-mean loss, grad-norm clip and SGD step per minibatch."""
    model = MoEForCausalLM(cfg.model.arch()).init_weights(cfg.model.init_seed, std=cfg.model.init_std)
    temp, a = cfg.rollout.temperature, cfg.algo
    opt = torch.optim.SGD(model.parameters(), lr=cfg.train.lr)
    with torch.no_grad():
        prox = [_seq_logp(model, s["prompt_ids"], s["response_ids"], temp) for s in batch]
    if a.ratio_anchor == "behaviour":  # coupled PPO: ratios against the sampler, no behaviour weight
        prox = [torch.tensor(s["behaviour_logprobs"]) for s in batch]
    clipped = 0
    size = len(batch)
    for j in range(n_mini):
        idx = range(size * j // n_mini, size * (j + 1) // n_mini)
        n_tok = sum(len(batch[i]["response_ids"]) for i in idx)
        loss = 0.0
        for i in idx:
            s = batch[i]
            logp = _seq_logp(model, s["prompt_ids"], s["response_ids"], temp)
            for t in range(len(s["response_ids"])):
                u = torch.exp(logp[t] - prox[i][t])
                w = math.exp(float(prox[i][t]) - s["behaviour_logprobs"][t])
                A = s["advantage"]
                lo, hi = 1 - a.clip_low, 1 + a.clip_high
                clipped += int((A > 0 and u.item() > hi) or (A < 0 and u.item() < lo))
                loss = loss + w * torch.maximum(-A * u, -A * u.clamp(lo, hi)) / n_tok
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        opt.step()
        opt.zero_grad()
    return model, clipped


def _trainer(cfg):
    """A trainer without engines, its AdamW swapped for SGD: Adam's first step is about
    lr * sign(g), which would turn float32 rounding in near-zero gradients into differences of
    lr between two correct implementations. The backend's step (grad-norm clip) is kept."""
    layout = Layout(world_size=1, trainer_ranks=[0], rollout_ranks=[], ep_size=1)
    trainer = Trainer(cfg, Groups(layout=layout, rank=0, role="trainer"))
    b = trainer.backend
    b.optimizer = torch.optim.SGD(b.dense_params + b.expert_params, lr=cfg.train.lr)
    return trainer


@pytest.mark.parametrize("fused", ["auto", "false"])
@pytest.mark.parametrize("n_mini, anchor", [(1, "proximal"), (3, "proximal"), (3, "behaviour")])
def test_minibatch_updates_match_plain_torch(n_mini, anchor, fused):
    # train.fused_loss=auto: this ppo/token loss runs fused into the LM head (its gradients made
    # in the forward); false: the general path. Both must match the plain-torch reference.
    cfg = load_config(None, [*TINY, f"train.minibatches={n_mini}", f"algo.ratio_anchor={anchor}",
                             f"train.fused_loss={fused}"])
    trainer = _trainer(cfg)
    assert trainer.fused_loss is (fused == "auto")
    init = MoEForCausalLM(cfg.model.arch()).init_weights(cfg.model.init_seed, std=cfg.model.init_std)
    batch = _batch(init, cfg.rollout.temperature)
    metrics = trainer.train_step(batch)
    ref, clipped = _reference(cfg, batch, n_mini)
    got = dict(trainer.backend.model.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name].detach(), p.detach(), rtol=1e-4, atol=1e-5, msg=name)
    moved = sum(float((p.detach() - q.detach()).abs().sum()) for p, q in zip(ref.parameters(), init.parameters()))
    assert moved > 1.0  # the updates did something
    if n_mini == 1:  # one update: the proximal policy is the forward itself, no clip can act
        assert clipped == 0 and metrics["clip_frac"] == 0
    else:  # later minibatches see the earlier updates through the clip
        assert clipped > 0
        assert metrics["clip_frac"] == pytest.approx(clipped / sum(len(s["response_ids"]) for s in batch))


def test_recomputing_the_proximal_after_each_update_would_differ():
    """The reference can tell: a proximal policy taken afresh before each update (no clip can
    act) gives different weights than the trainer's (decoupled loss; the coupled one's anchor,
    the sampler, does not move between updates)."""
    cfg = load_config(None, [*TINY, "train.minibatches=3", "algo.ratio_anchor=proximal"])
    trainer = _trainer(cfg)
    init = MoEForCausalLM(cfg.model.arch()).init_weights(cfg.model.init_seed, std=cfg.model.init_std)
    batch = _batch(init, cfg.rollout.temperature)
    trainer.train_step(batch)
    one_each = _trainer(load_config(None, [*TINY, "train.minibatches=1", "algo.ratio_anchor=proximal"]))
    for j in range(3):  # three single-update steps: the proximal is refreshed each time
        one_each.train_step(batch[2 * j : 2 * j + 2])
    diff = max(float((p - q).detach().abs().max()) for p, q in zip(trainer.backend.model.parameters(),
                                                           one_each.backend.model.parameters()))
    assert diff > 1e-3


def test_more_minibatches_than_samples_is_refused():
    with pytest.raises(ConfigError, match="train.minibatches"):
        load_config(None, [*TINY, "train.minibatches=7"])


def test_fused_loss_choice_is_explicit_and_logged(caplog):
    import logging

    from moe_rl.train.loop import use_fused_loss

    with caplog.at_level(logging.INFO, logger="moe_rl.train.loop"):
        assert use_fused_loss(load_config(None, TINY), logging.getLogger("moe_rl.train.loop"))
        assert not use_fused_loss(load_config(None, [*TINY, "algo.policy_loss=gspo"]),
                                  logging.getLogger("moe_rl.train.loop"))
        assert not use_fused_loss(load_config(None, [*TINY, "train.fused_loss=false"]),
                                  logging.getLogger("moe_rl.train.loop"))
    text = caplog.text
    assert "fused into the LM head (train.fused_loss=auto, algo.policy_loss=ppo" in text
    assert "general path" in text and "algo.policy_loss=gspo" in text and "train.fused_loss=false" in text
    with pytest.raises(ConfigError, match="train.fused_loss=true: algo.tis_level=sequence"):
        use_fused_loss(load_config(None, [*TINY, "train.fused_loss=true", "algo.tis_level=sequence",
                                          "algo.ratio_anchor=proximal"]))
    assert use_fused_loss(load_config(None, [*TINY, "train.fused_loss=true", "algo.policy_loss=cispo",
                                             "algo.loss_agg=sequence"]))
