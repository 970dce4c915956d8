"""Multi-turn episodes: a sample is an episode of alternating model turns (the engines) and
environment turns (``env.factory``, :mod:`moe_rl.tasks.env`), kept as ONE token sequence
(DESIGN.md contract 7)::

    [reset observation] [model turn 1] [obs 1] [model turn 2] [obs 2] ... [model turn k]
     prompt_ids          response_ids ------------------------------------------------>
                         loss_mask 1..1 0..0    1..1          0..0        1..1

* Ids end to end: turn t+1's request is the exact id sequence so far (the model's tokens as
  generated, the observations as the environment returned them); nothing is re-tokenised.
* Each model token keeps the policy version that produced it. A weight update inside a turn
  is handled like any partial rollout (``abort``: resubmit history + partial turn once the
  engines continue; ``in_place``: the engine goes on with the new version).
* Routing record: every request asks for the routing rows from the first position not yet
  covered (``routed_experts_start_len``), which is also how a partial rollout resumes, so the
  joined record covers positions [0, len - 1) exactly once: the prompt's and observations'
  rows come from the prefill of the turn after them, the model tokens' from the forward that
  sampled them. The sequence always ends with a model token (the last observation is dropped).
* Reward: the sum of the environment's per-turn rewards (kept in ``turn_rewards``). An
  environment that raises, returns a bad value or passes ``env.episode_timeout_s`` marks that
  episode failed (counted in ``env_failures``); the run goes on.
"""
from __future__ import annotations

import asyncio
import logging

from moe_rl.engine.protocol import output_logprobs, token_weight_versions, version_number
from moe_rl.replay import record_from_responses, routing_covers
from moe_rl.tasks.env import EnvError, EnvFactory

from .requests import attempt_rid, sampling_seed
from .sample import Group, Sample

log = logging.getLogger(__name__)


class EpisodeRunner:
    """Runs the GRPO group of a prompt as ``group_size`` episodes, for a RolloutManager."""

    def __init__(self, cfg, task, factory: EnvFactory):
        self.cfg, self.task, self.factory = cfg, task, factory
        env = cfg.env
        self.max_turns = env.max_turns
        self.turn_tokens = env.max_new_tokens_per_turn or cfg.rollout.max_new_tokens
        self.max_tokens = env.max_episode_tokens or cfg.engine.max_context
        self.timeout_s = env.episode_timeout_s
        self.slots = asyncio.Semaphore(env.max_concurrent_episodes)  # bound on episodes in flight

    @classmethod
    def from_config(cls, cfg, task) -> "EpisodeRunner":
        return cls(cfg, task, EnvFactory(cfg.env.factory, cfg.env.args, task, cfg.model.arch().vocab_size))

    async def run_group(self, mgr, index: int, version: int) -> None:
        prompt = self.task.prompt(index)
        n = self.cfg.rollout.group_size
        samples = await asyncio.gather(*(self._episode(mgr, prompt, index, j) for j in range(n)))
        group = Group(index, list(samples), version)
        with mgr.lock:
            mgr.inflight.pop(index, None)
            mgr.buffer.put(group)
            mgr.stats["groups_done"] += 1

    async def _episode(self, mgr, prompt, index: int, j: int) -> Sample:
        uid = mgr._uid(index, j)
        async with self.slots:
            ep = _Episode(uid, index, j)
            try:
                async with asyncio.timeout(self.timeout_s):
                    await self._play(mgr, prompt, ep)
            except (EnvError, TimeoutError) as e:
                why = str(e) if isinstance(e, EnvError) else f"episode timed out after env.episode_timeout_s={self.timeout_s}"
                log.warning("episode %s failed: %s", uid, why)
                mgr.stats["env_failures"] += 1
                ep.failed = why
        return ep.sample(mgr, self.task)

    async def _play(self, mgr, prompt, ep: "_Episode") -> None:
        env = self.factory.make()
        ep.prompt_ids = self.factory.check_ids(await self.factory.call(env, "reset", prompt), "reset()'s observation")
        if not ep.prompt_ids:
            raise EnvError(f"{self.factory.who}: reset() returned an empty observation")
        for turn in range(self.max_turns):
            budget = min(self.turn_tokens, self.max_tokens - len(ep.prompt_ids) - len(ep.ids))
            if budget < 1:
                ep.finish = "max_episode_tokens"
                break
            out = await self._model_turn(mgr, ep, turn, budget)
            ep.turns += 1
            action_text = self.task.decode(out)
            res = self.factory.check_step(await self.factory.call(env, "step", out, action_text))
            ep.turn_rewards.append(res.reward)
            if res.done:
                ep.finish = "done"
                break
            if turn + 1 == self.max_turns:
                ep.finish = "max_turns"  # the last observation is not needed: nothing follows it
                break
            ep.add(res.observation, mask=0, logp=0.0, version=ep.versions[-1])

    async def _model_turn(self, mgr, ep: "_Episode", turn: int, budget: int) -> list[int]:
        """One model turn of up to ``budget`` tokens; a weight update cutting it short
        resubmits the history + partial turn (as the manager does for single-turn samples)."""
        rc = self.cfg.rollout
        out: list[int] = []
        resumes = 0
        want_routing = mgr.replay_log is not None
        while True:
            await mgr._ready.wait()
            history = ep.prompt_ids + ep.ids  # holds this turn's tokens so far too
            start = ep.covered  # first routing row not covered yet
            sp = {"max_new_tokens": budget - len(out), "temperature": rc.temperature, "top_p": rc.top_p,
                  "top_k": rc.top_k, "stop_token_ids": list(self.task.stop_token_ids),
                  "sampling_seed": sampling_seed(self.cfg.data.seed, ep.index, ep.j, len(history))}
            rid = f"{ep.uid}-t{turn}-r{resumes}"
            mgr._mark(+1)
            try:
                resp = await mgr._resubmitting(lambda k: mgr.client.generate(
                    history, sp, return_logprob=True, return_routed_experts=want_routing,
                    rid=attempt_rid(rid, k), routed_experts_start_len=start), f"episode {ep.uid} turn {turn}")
            finally:
                mgr._mark(-1)
            meta = resp["meta_info"]
            new = list(resp["output_ids"])
            finish = meta["finish_reason"]["type"] if meta.get("finish_reason") else "length"
            if want_routing and new and finish == "abort" and not routing_covers(meta, mgr.spec, len(history), len(new), start):
                new = []  # aborted without routing for its tokens (SGLang, a queued request): generated again
                mgr.stats["aborted_without_routing"] += 1
            logps = output_logprobs(meta)[: len(new)]
            tv = token_weight_versions(meta)
            versions = [version_number(v) for v in (tv if tv is not None else [meta["weight_version"]] * len(new))][: len(new)]
            if not (len(logps) == len(versions) == len(new)):
                raise RuntimeError(f"episode {ep.uid}: engine returned {len(new)} tokens, {len(logps)} log-probs, "
                                   f"{len(versions)} versions")
            out += new
            for t, lp, v in zip(new, logps, versions):
                ep.add([t], mask=1, logp=lp, version=v)
            if new:  # a request aborted before its first token may not have been forwarded at all
                ep.metas.append(meta)
                ep.starts.append(start)
                ep.covered = len(history) + len(new) - 1
            if not (finish == "abort" and len(out) < budget and not mgr._stop):
                return out
            resumes += 1
            ep.resumes += 1
            mgr.stats["resumed_requests"] += 1


class _Episode:
    """The growing token sequence of one episode and everything aligned with it."""

    def __init__(self, uid: str, index: int, j: int):
        self.uid, self.index, self.j = uid, index, j
        self.prompt_ids: list[int] = []
        self.ids: list[int] = []  # model and environment tokens after the first observation
        self.mask: list[int] = []
        self.logps: list[float] = []
        self.versions: list[int] = []
        self.metas: list[dict] = []
        self.starts: list[int] = []
        self.covered = 0  # routing rows [0, covered) are in metas
        self.turns = 0
        self.turn_rewards: list[float] = []
        self.resumes = 0
        self.finish = "max_turns"
        self.failed: str | None = None

    def add(self, ids: list[int], *, mask: int, logp: float, version: int) -> None:
        self.ids += ids
        self.mask += [mask] * len(ids)
        self.logps += [logp] * len(ids)
        self.versions += [version] * len(ids)

    def sample(self, mgr, task) -> Sample:
        s = Sample(self.uid, self.index, list(self.prompt_ids), list(self.ids), list(self.logps), list(self.versions),
                   reward=float(sum(self.turn_rewards)), finish_reason=self.finish, failed=self.failed,
                   resumes=self.resumes, loss_mask=list(self.mask), turns=self.turns,
                   turn_rewards=list(self.turn_rewards))
        if self.failed is None and not any(self.mask):
            s.failed = "episode has no model tokens"
        if self.failed is None and mgr.replay_log is not None:
            rec = record_from_responses(self.metas, mgr.spec, num_tokens=s.num_tokens, starts=self.starts)
            mgr.replay_log.append(self.uid, rec, sorted(set(s.model_versions)))
            s.has_routing = True
        return s
