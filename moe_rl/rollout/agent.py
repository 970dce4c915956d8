"""Agent rollouts: an episode is played by an agent written against the OpenAI API
(``env.openai_agent``), and trained on from the engine's record of its calls (DESIGN.md
contract 10; docs/environments.md, "Agents").

Per episode the runner registers the episode on one engine (``POST /episodes``: the run's
temperature/top_p/top_k, a seed from (data.seed, prompt, sample), the token budgets, whether
to record routing), calls ``agent(client, prompt, **env.args)`` with an
``openai.AsyncOpenAI`` client whose base_url is ``{engine}/episodes/{id}/v1``, and collects
the engine's records (``DELETE /episodes/{id}``) when the agent returns, raises or times out.

The trajectory comes from the records only, never from chat text (:func:`trajectories`):
in the order the calls finished, a call whose prompt extends an earlier sequence's
prompt + outputs token for token continues that sequence (the tokens in between: loss mask
0); any other call starts a new sequence. Each sequence is one Sample of the prompt's group,
every one with the episode's reward. A sequence's routing record joins its calls' segments:
rows before a call's ``routing_start`` are those of the call it continued (its ``parent``).
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import uuid
from dataclasses import dataclass, field

from moe_rl.engine.client import EngineError
from moe_rl.engine.protocol import version_number
from moe_rl.replay import record_from_responses
from moe_rl.tasks.base import Prompt
from moe_rl.tasks.plugins import PluginError, RewardError, check_signature, load_plugin, reward_value

from .requests import sampling_seed
from .sample import Group, Sample

log = logging.getLogger(__name__)
KEY = "env.openai_agent"


@dataclass
class Sequence:
    """One token sequence of an episode, built from its calls' records."""

    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)  # after the prompt: outputs and the tokens between them
    mask: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    metas: list[dict] = field(default_factory=list)  # routing segments (meta_info) and their starts
    starts: list[int] = field(default_factory=list)
    calls: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.ids

    def add_call(self, rec: dict, between: list[int]) -> None:
        last = self.versions[-1] if self.versions else 0
        self.ids += between
        self.mask += [0] * len(between)
        self.logps += [0.0] * len(between)
        self.versions += [last] * len(between)
        out = rec["output_ids"]
        self.ids += out
        self.mask += [1] * len(out)
        self.logps += [float(x) for x in rec["output_logprobs"]]
        self.versions += [version_number(v) for v in rec["output_versions"]]
        for seg in rec.get("routing") or []:
            self.metas.append(seg["meta_info"])
            self.starts.append(seg["start"])
        self.calls += 1


def trajectories(records: list[dict]) -> list[Sequence]:
    """The episode's sequences from its records (module docstring). Records must hold
    ``prompt_ids``, ``output_ids``, ``output_logprobs``, ``output_versions`` and, with
    routing, ``routing`` segments and ``parent``."""
    seqs: list[Sequence] = []
    chain: dict[int, tuple[list[dict], list[int]]] = {}  # record -> routing segments covering it
    for i, rec in enumerate(records):
        prompt, out = list(rec["prompt_ids"]), list(rec["output_ids"])
        if not (len(out) == len(rec["output_logprobs"]) == len(rec["output_versions"])):
            raise ValueError(f"record {i}: {len(out)} output ids, {len(rec['output_logprobs'])} log-probs, "
                             f"{len(rec['output_versions'])} versions")
        target = None
        for s in reversed(seqs):  # the latest sequence this call extends token for token
            t = s.tokens
            if len(t) <= len(prompt) and prompt[: len(t)] == t:
                target = s
                break
        if target is None:
            target = Sequence(prompt)
            parent = rec.get("parent")
            segs = rec.get("routing") or []
            if segs and segs[0]["start"] > 0:  # rows before it are in the parent's record
                if parent is None or parent not in chain:
                    raise ValueError(f"record {i}: routing starts at {segs[0]['start']} without a parent record")
                target.metas, target.starts = [dict(m) for m in chain[parent][0]], list(chain[parent][1])
            target.add_call(rec, [])
            seqs.append(target)
        else:
            target.add_call(rec, prompt[len(target.tokens):])
        chain[i] = (list(target.metas), list(target.starts))
    return seqs


class AgentRunner:
    """Runs a prompt's GRPO group as ``group_size`` agent episodes, for a RolloutManager."""

    def __init__(self, cfg, task):
        self.cfg, self.task = cfg, task
        env = cfg.env
        self.path, self.args = env.openai_agent, dict(env.args)
        self.who = f"{KEY} ({self.path})"
        self.agent = load_plugin(self.path, KEY)
        if not inspect.iscoroutinefunction(self.agent):
            raise PluginError(f"{self.who}: must be an async function agent(client, prompt, **env.args)")
        check_signature(self.agent, KEY, self.path, None, Prompt(0, [1]), **self.args)
        try:
            import openai
        except ImportError as e:
            raise PluginError(f"{self.who}: the agent path needs the `openai` package (pip install openai)") from e
        self.openai = openai
        for name in ("httpx", "httpx2", "openai"):  # one INFO line per call otherwise, in the trainer's log
            logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger(name).level))
        self.turn_tokens = env.max_new_tokens_per_turn or cfg.rollout.max_new_tokens
        self.max_tokens = env.max_episode_tokens or cfg.engine.max_context
        self.timeout_s = env.episode_timeout_s
        self.slots = asyncio.Semaphore(env.max_concurrent_episodes)
        self.client = None  # one AsyncOpenAI (one connection pool) for all episodes: made per episode it cost 150 ms

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None

    async def run_group(self, mgr, index: int, version: int) -> None:
        prompt = self.task.prompt(index)
        n = self.cfg.rollout.group_size
        await mgr._ready.wait()
        episodes = await asyncio.gather(*(self._episode(mgr, prompt, index, j) for j in range(n)))
        group = Group(index, [s for ep in episodes for s in ep], version)
        with mgr.lock:
            mgr.inflight.pop(index, None)
            mgr.buffer.put(group)
            mgr.stats["groups_done"] += 1

    async def _episode(self, mgr, prompt, index: int, j: int) -> list[Sample]:
        uid = mgr._uid(index, j)
        async with self.slots:
            url = mgr.client.pick()
            eid = f"{uid}-{uuid.uuid4().hex[:8]}"
            rc = self.cfg.rollout
            mgr._mark(+1)
            failed, reward, metrics, records = None, 0.0, {}, []
            try:
                await mgr.client.request("POST", "/episodes", url, {
                    "id": eid, "sampling_params": {"temperature": rc.temperature, "top_p": rc.top_p, "top_k": rc.top_k},
                    "seed": sampling_seed(self.cfg.data.seed, index, j, 0), "return_routed_experts": mgr.replay_log is not None,
                    "max_tokens": self.turn_tokens, "max_total_tokens": self.max_tokens, "ttl_s": self.timeout_s + 600})
                failed, reward, metrics = await self._play(url, eid, prompt)
            except EngineError as e:
                failed = f"engine {url}: {e}"
            finally:
                try:
                    records = (await mgr.client.request("DELETE", f"/episodes/{eid}", url))["records"]
                except EngineError as e:
                    failed = failed or f"engine {url}: the episode's records are lost: {e}"
                mgr._mark(-1)
        if failed is None and not any(r["output_ids"] for r in records):
            failed = f"{self.who} made no call that generated a token"
        if failed is not None:
            log.warning("episode %s failed: %s", uid, failed)
            mgr.stats["env_failures"] += 1
        return self._samples(mgr, uid, index, j, prompt, records, failed, reward, metrics)

    async def _play(self, url: str, eid: str, prompt) -> tuple[str | None, float, dict]:
        if self.client is None:
            self.client = self.openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=self.cfg.engine.api_key or "EMPTY",
                                                  max_retries=0, timeout=self.cfg.engine.request_timeout_s)
        client = self.client.with_options(base_url=f"{url}/episodes/{eid}/v1")  # shares the connection pool
        try:
            async with asyncio.timeout(self.timeout_s):
                out = await self.agent(client, prompt, **self.args)
            reward, metrics = reward_value(out, self.who)
            return None, reward, metrics
        except TimeoutError:
            return f"episode timed out after env.episode_timeout_s={self.timeout_s}", 0.0, {}
        except RewardError as e:
            return str(e), 0.0, {}
        except Exception as e:  # the agent raised (its own bug, or an API error it did not handle)
            return f"{self.who} raised {type(e).__name__}: {e}", 0.0, {}

    def _samples(self, mgr, uid: str, index: int, j: int, prompt, records: list[dict], failed: str | None,
                 reward: float, metrics: dict) -> list[Sample]:
        seqs = []
        if failed is None:
            try:
                seqs = trajectories(records)
            except ValueError as e:
                failed = f"the engine's records of episode {uid}: {e}"
        if failed is not None:
            return [Sample(uid, index, list(prompt.input_ids), [], [], [], finish_reason="failed", failed=failed)]
        samples = []
        for k, s in enumerate(seqs):
            suid = mgr._uid(index, j, k)
            sample = Sample(suid, index, s.prompt_ids, s.ids, s.logps, s.versions, reward=reward,
                            finish_reason="agent", loss_mask=list(s.mask), turns=s.calls, metrics=dict(metrics))
            if mgr.replay_log is not None and any(s.mask):
                rec = record_from_responses(s.metas, mgr.spec, num_tokens=sample.num_tokens, starts=s.starts)
                mgr.replay_log.append(suid, rec, sorted(set(sample.model_versions)))
                sample.has_routing = True
            if not any(s.mask):
                sample.failed = "the sequence has no model tokens"
            samples.append(sample)
        return samples
