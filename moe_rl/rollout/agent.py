"""Agent rollouts: an episode is played by an agent written against the OpenAI API
(``env.openai_agent``), and trained on from the engine's record of its calls (DESIGN.md
contract 10; docs/environments.md, "Agents").

Who does what:

* ``AgentRunner`` (``moe_rl/rollout/agent_runner.py``, the rollout manager's side) turns a prompt's GRPO group into a
  :class:`GroupJob` (one engine, an episode id and seed per sample, the run's sampling and
  token budgets), hands it to the players and turns what comes back into Samples, routing
  records included.
* :class:`AgentPlayer` plays a group's episodes: it registers them on the engine
  (``POST /episodes``; episodes that start together go in one request), calls
  ``agent(client, prompt, **env.args)`` with an ``openai.AsyncOpenAI`` client whose base_url
  is ``{engine}/episodes/{id}/v1`` (one aiohttp connection pool for all episodes), and collects
  the engine's records when the agent returns, raises or times out (``POST /episodes/collect``,
  again one request for the episodes that end together). The players run in
  ``env.agent_workers`` processes of their own (``moe_rl/rollout/agent_workers.py``), so the
  agents' client work (the SDK's request and response models, HTTP) takes no CPU from the
  trainer's process; with ``env.agent_workers=0`` one player runs in the manager's thread.
  With ``engine.kind: sglang`` a player serves those endpoints itself before each SGLang URL
  (``moe_rl.engine.gateway.Gateway``) and the episodes go there.

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
from dataclasses import dataclass, field

from moe_rl.engine.client import EngineClient, EngineError
from moe_rl.engine.gateway import Gateway, GatewaySpec
from moe_rl.engine.protocol import version_number
from moe_rl.tasks.base import Prompt
from moe_rl.tasks.plugins import PluginError, RewardError, check_signature, load_plugin, reward_value

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


# --- what travels between the runner and the players (pickled to a worker process) ----------
@dataclass
class GroupJob:
    """A prompt's GRPO group for a player: one engine, an episode id and seed per sample."""

    url: str
    eids: list[str]
    seeds: list[int]
    prompt: Prompt
    settings: dict  # the POST /episodes fields the episodes share (sampling, budgets, routing, ttl)


@dataclass
class EpisodeResult:
    failed: str | None
    reward: float = 0.0
    metrics: dict = field(default_factory=dict)
    sequences: list[Sequence] = field(default_factory=list)
    engine_error: str | None = None  # the engine failed the episode (unreachable, or a call's 5xx)


@dataclass(frozen=True)
class PlayerSettings:
    """What a player needs besides the jobs (picklable: a worker process builds its player from it)."""

    agent: str  # env.openai_agent
    args: dict  # env.args
    api_key: str | None
    request_timeout_s: float
    episode_timeout_s: float
    max_concurrent: int  # episodes in flight in this player
    gateway: GatewaySpec | None = None  # SGLang engines: the OpenAI gateway each player puts before them


def check_agent(path: str, args: dict):
    """The agent function at ``path``, checked as ``env.openai_agent`` must be (PluginError)."""
    agent = load_plugin(path, KEY)
    who = f"{KEY} ({path})"
    if not inspect.iscoroutinefunction(agent):
        raise PluginError(f"{who}: must be an async function agent(client, prompt, **env.args)")
    check_signature(agent, KEY, path, None, Prompt(0, [1]), **args)
    try:
        import openai
    except ImportError as e:
        raise PluginError(f"{who}: the agent path needs the `openai` package (pip install 'openai[aiohttp]')") from e
    try:
        openai.DefaultAioHttpClient
    except AttributeError as e:
        raise PluginError(f"{who}: openai {openai.__version__} has no aiohttp client; the agent path needs "
                          "openai>=1.89 (pip install 'openai[aiohttp]>=1.89')") from e
    return agent


class _Coalesced:
    """``send(url, items) -> one result per item``, with the calls made in one event-loop
    iteration for the same engine sent as one request (the episodes of a group start together)."""

    def __init__(self, send):
        self.send, self.pending, self.sending = send, {}, set()

    async def __call__(self, url: str, item):
        batch = self.pending.get(url)
        if batch is None:
            loop = asyncio.get_running_loop()
            batch = self.pending[url] = ([], loop.create_future())
            loop.call_soon(self._flush, url)  # after the other callers woken in this iteration
        batch[0].append(item)
        i = len(batch[0]) - 1
        results = await asyncio.shield(batch[1])
        if isinstance(results[i], Exception):
            raise results[i]
        return results[i]

    def _flush(self, url: str) -> None:
        items, fut = self.pending.pop(url)

        async def go():
            try:
                fut.set_result(await self.send(url, items))
            except Exception as e:  # the request failed: every caller gets the error
                fut.set_result([e] * len(items))
            except asyncio.CancelledError:
                fut.cancel()
                raise

        task = asyncio.ensure_future(go())
        self.sending.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self.sending.discard)


class AgentPlayer:
    """Plays GroupJobs with the agent, in whichever process and event loop it is used from."""

    def __init__(self, s: PlayerSettings):
        self.s = s
        self.agent = check_agent(s.agent, s.args)
        import openai

        self.openai = openai
        self.who = f"{KEY} ({s.agent})"
        for name in ("httpx", "httpx2", "openai"):  # one INFO line per call otherwise
            logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger(name).level))
        self.slots = asyncio.Semaphore(s.max_concurrent)
        self.client = None  # one AsyncOpenAI for all episodes, over aiohttp (made per episode it cost 150 ms)
        self.http: EngineClient | None = None  # the episodes' register and collect requests
        self.platform = None  # the OS the SDK detected on an episode's first request, for the next ones
        self.gateways: dict[str, asyncio.Future] = {}  # SGLang URL -> its gateway's URL (s.gateway)
        self._gateways: list[Gateway] = []
        self._register = _Coalesced(self._register_batch)
        self._collect = _Coalesced(self._collect_batch)

    async def close(self) -> None:
        for gw in self._gateways:
            await gw.close()
        self._gateways, self.gateways = [], {}
        if self.client is not None:
            await self.client.close()
            self.client = None
        if self.http is not None:
            await self.http.close()
            self.http = None

    async def play_group(self, job: GroupJob) -> list[EpisodeResult]:
        if self.http is None:
            self.http = EngineClient(job.url, api_key=self.s.api_key, timeout_s=self.s.request_timeout_s)
        # the episodes' endpoints: the engine's, or this player's gateway before the SGLang server
        url = job.url if self.s.gateway is None else await self._gateway(job.url)
        if self.client is None:
            self.client = self.openai.AsyncOpenAI(
                base_url=f"{url}/v1", api_key=self.s.api_key or "EMPTY", max_retries=0,
                timeout=self.s.request_timeout_s, http_client=self.openai.DefaultAioHttpClient())
        return list(await asyncio.gather(*(self._episode(job, j, url) for j in range(len(job.eids)))))

    async def _gateway(self, url: str) -> str:
        started = self.gateways.get(url)
        if started is None:  # the first group on this engine starts it; the groups beside it wait for it
            gw = Gateway(url, self.s.gateway, self.http)  # its /generate calls share the player's pool
            self._gateways.append(gw)
            started = self.gateways[url] = asyncio.ensure_future(gw.start())
        return await asyncio.shield(started)

    async def _register_batch(self, url: str, items: list) -> list:
        settings = items[0][2]
        await self.http.request("POST", "/episodes", url, {
            **settings, "id": [eid for eid, _, _ in items], "seed": [seed for _, seed, _ in items]})
        return [None] * len(items)

    async def _collect_batch(self, url: str, eids: list[str]) -> list:
        out = (await self.http.request("POST", "/episodes/collect", url, {"ids": eids}))["episodes"]
        return [e if "records" in e else EngineError(url, "/episodes/collect", e.get("error", "?")) for e in out]

    async def _episode(self, job: GroupJob, j: int, url: str) -> EpisodeResult:
        """Episode j of ``job`` through the endpoints at ``url``; failures name the engine (job.url)."""
        eid = job.eids[j]
        failed, reward, metrics, records, engine_error = None, 0.0, {}, [], None
        async with self.slots:
            try:
                await self._register(url, (eid, job.seeds[j], job.settings))
            except EngineError as e:
                return EpisodeResult(f"engine {job.url}: {e}", engine_error=str(e))
            try:
                failed, reward, metrics = await self._play(url, eid, job.prompt)
            finally:
                try:
                    got = await self._collect(url, eid)
                    records, errors = got["records"], got.get("engine_errors") or []
                    if errors:  # the agent's failure (if any) is the engine's
                        engine_error = errors[0]
                        failed = failed and f"engine {job.url}: {len(errors)} call(s) failed: {errors[0]}"
                except EngineError as e:
                    engine_error = str(e)
                    failed = failed or f"engine {job.url}: the episode's records are lost: {e}"
        if failed is None and not any(r["output_ids"] for r in records):
            failed = f"{self.who} made no call that generated a token"
        seqs = []
        if failed is None:
            try:
                seqs = trajectories(records)
            except ValueError as e:
                failed = f"the engine's records of episode {eid}: {e}"
        return EpisodeResult(failed, reward, metrics, seqs, engine_error)

    async def _play(self, url: str, eid: str, prompt) -> tuple[str | None, float, dict]:
        client = self.client.with_options(base_url=f"{url}/episodes/{eid}/v1")  # shares the connection pool
        if self.platform is not None:  # the SDK detects the OS per client, in a thread, on its first request
            client._platform = self.platform
        try:
            async with asyncio.timeout(self.s.episode_timeout_s):
                out = await self.agent(client, prompt, **self.s.args)
            self.platform = getattr(client, "_platform", None)
            reward, metrics = reward_value(out, self.who)
            return None, reward, metrics
        except TimeoutError:
            return f"episode timed out after env.episode_timeout_s={self.s.episode_timeout_s}", 0.0, {}
        except RewardError as e:
            return str(e), 0.0, {}
        except Exception as e:  # the agent raised (its own bug, or an API error it did not handle)
            return f"{self.who} raised {type(e).__name__}: {e}", 0.0, {}
