"""The rollout manager's side of agent rollouts (``env.openai_agent``; ``moe_rl/rollout/agent.py``
says who does what): a prompt's GRPO group becomes a :class:`GroupJob` for the players (in
``env.agent_workers`` processes, or one in this loop), and what they return becomes Samples,
routing records included."""
from __future__ import annotations

import logging
import math
import uuid

from moe_rl.engine.gateway import GatewaySpec
from moe_rl.replay import record_from_responses

from .agent import AgentPlayer, EpisodeResult, GroupJob, PlayerSettings, check_agent
from .agent_workers import AgentWorkers
from .requests import sampling_seed
from .sample import Group, Sample

log = logging.getLogger(__name__)


class AgentRunner:
    """Runs a prompt's GRPO group as ``group_size`` agent episodes, for a RolloutManager."""

    def __init__(self, cfg, task):
        self.cfg, self.task = cfg, task
        env = cfg.env
        check_agent(env.openai_agent, dict(env.args))  # a bad plug-in fails here, in the trainer, at start
        self.workers = env.agent_worker_count()
        self.settings = PlayerSettings(
            env.openai_agent, dict(env.args), cfg.engine.api_key, cfg.engine.request_timeout_s, env.episode_timeout_s,
            math.ceil(env.max_concurrent_episodes / max(1, self.workers)),
            GatewaySpec.from_config(cfg) if env.uses_gateway(cfg.engine.kind) else None)
        self.turn_tokens = env.max_new_tokens_per_turn or cfg.rollout.max_new_tokens
        self.max_tokens = env.max_episode_tokens or cfg.engine.max_context
        self.players = None  # AgentWorkers, or an AgentPlayer in this loop (env.agent_workers=0)
        if self.workers:
            self.players = AgentWorkers(self.workers, self.settings)  # start-up overlaps the engines'

    async def close(self) -> None:
        if self.players is not None:
            await self.players.close()
            self.players = None

    async def run_group(self, mgr, index: int, version: int) -> None:
        prompt = self.task.prompt(index)
        n = self.cfg.rollout.group_size
        await mgr._ready.wait()
        if self.players is None:
            self.players = AgentPlayer(self.settings)
        rc = self.cfg.rollout
        uids = [mgr._uid(index, j) for j in range(n)]
        job = GroupJob(mgr.client.pick(), [f"{u}-{uuid.uuid4().hex[:8]}" for u in uids],
                       [sampling_seed(self.cfg.data.seed, index, j, 0) for j in range(n)], prompt, {
                           "sampling_params": {"temperature": rc.temperature, "top_p": rc.top_p, "top_k": rc.top_k},
                           "return_routed_experts": mgr.replay_log is not None, "max_tokens": self.turn_tokens,
                           "max_total_tokens": self.max_tokens, "ttl_s": self.settings.episode_timeout_s + 600})
        mgr._mark(+n)
        try:
            results = await self.players.play_group(job)
        finally:
            mgr._mark(-n)
        errors = [res.engine_error for res in results if res.engine_error is not None]
        if errors:  # keep new groups off it for a while, as the token-level path does
            backoff = mgr.client.mark_down(job.url)
            log.warning("engine %s failed %d of the group's %d episodes (%s); no new group goes to it for %.0f s",
                        job.url, len(errors), n, errors[0], backoff)
            mgr.stats["engine_failures"] += 1
        samples = []
        for j, res in enumerate(results):
            if res.failed is not None:
                log.warning("episode %s failed: %s", uids[j], res.failed)
                mgr.stats["env_failures"] += 1
            samples += self._samples(mgr, uids[j], index, j, prompt, res)
        group = Group(index, samples, version)
        with mgr.lock:
            mgr.inflight.pop(index, None)
            mgr.buffer.put(group)
            mgr.stats["groups_done"] += 1

    def _samples(self, mgr, uid: str, index: int, j: int, prompt, res: EpisodeResult) -> list[Sample]:
        if res.failed is not None:
            return [Sample(uid, index, list(prompt.input_ids), [], [], [], finish_reason="failed", failed=res.failed)]
        samples = []
        for k, s in enumerate(res.sequences):
            suid = mgr._uid(index, j, k)
            sample = Sample(suid, index, s.prompt_ids, s.ids, s.logps, s.versions, reward=res.reward,
                            finish_reason="agent", loss_mask=list(s.mask), turns=s.calls, metrics=dict(res.metrics))
            if mgr.replay_log is not None and any(s.mask):
                rec = record_from_responses(s.metas, mgr.spec, num_tokens=sample.num_tokens, starts=s.starts)
                mgr.replay_log.append(suid, rec, sorted(set(sample.model_versions)))
                sample.has_routing = True
            if not any(s.mask):
                sample.failed = "the sequence has no model tokens"
            samples.append(sample)
        return samples
