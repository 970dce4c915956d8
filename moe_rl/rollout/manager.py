"""The rollout manager: draws prompts, submits GRPO groups to the engines, scores them, and
fills the rollout buffer and the replay log. It runs its own asyncio loop in a thread beside
the trainer, so generation never waits for training.

Staleness gate (AReaL-style): with B groups per trainer step, group number s (0-based, in
submission order) may only be submitted while s < (v + eta + 1) * B, v being the current policy
version. Such a group is consumed by step <= v + eta, so no token it gets at version >= v is
more than eta versions old when trained on. The buffer drops (and counts) whatever still is.
eta = 0 is the synchronous baseline: submit B groups, wait for the step, repeat.

Partial rollouts: a weight update pauses the engines. In ``abort`` mode the engines return the
partial output of every in-flight request, and the manager resubmits prompt + partial output
once the engines continue; each token keeps the version that produced it, and the routing
segments are merged so the record covers the whole sequence exactly once. In ``in_place`` mode
requests simply continue after the update with the new version.

Engine failures: a generate call whose engine cannot be reached, drops the connection, does
not answer in time or answers HTTP 5xx is resubmitted, under a new rid, to a live engine (the
client keeps off the failed one for a backoff and tries it again later, so a restarted engine
at the same URL is used again), for up to ``rollout.engine_retry_s``. Tokens only ever come
from complete answers, so no prompt is lost and none is counted twice. An engine that gives no
answer within ``engine.request_timeout_s`` is frozen (stopped or hung, not dead: nothing will
restart it): its requests go to the others, and when no other engine serves the manager fails
at once, naming it (docs/run_safety.md).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from collections import Counter

from moe_rl.engine.client import EngineError, EngineHTTPError, EngineTimeoutError
from moe_rl.engine.protocol import output_logprobs, token_weight_versions, version_number
from moe_rl.replay import RoutingSpec, record_from_responses, routing_covers
from moe_rl.tasks.plugins import reward_value

from .agent_runner import AgentRunner
from .buffer import RolloutBuffer
from .episode import EpisodeRunner
from .evaluation import score
from .requests import attempt_rid, sampling_seed
from .sample import Group, Sample

log = logging.getLogger(__name__)


class EngineFrozenError(RuntimeError):
    """Every engine that could serve gave no answer within engine.request_timeout_s."""


class RolloutManager:
    def __init__(self, cfg, task, client, buffer: RolloutBuffer, replay_log=None, routing_spec: RoutingSpec | None = None,
                 start_index: int = 0, pending: list[int] | None = None, version: int = 0, submitted: int = 0,
                 attempt: int = 0):
        self.cfg, self.task, self.client, self.buffer = cfg, task, client, buffer
        self.replay_log, self.spec = replay_log, routing_spec
        self.B = cfg.rollout.prompts_per_step
        self.eta = cfg.rollout.max_staleness
        self.version = version
        # Groups submitted so far (consumed, dropped as stale, or in the buffer); drives the gate.
        self.submitted = submitted
        self.next_index = start_index
        self.redo = list(pending or [])  # in flight at the checkpoint we resumed from
        self.attempt = attempt  # bumped on each resume so sample uids never repeat in the log
        self.inflight: dict[int, float] = {}  # group index -> submit time
        self.lock = threading.Lock()
        self.stats = Counter()
        self.busy_since: float | None = None
        self.busy_time = 0.0
        self.error: BaseException | None = None
        self._rewards = concurrent.futures.ThreadPoolExecutor(cfg.rollout.reward_workers, thread_name_prefix="reward")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._thread_main, name="rollout-manager", daemon=True)
        self._ready: asyncio.Event | None = None
        self._wake: asyncio.Event | None = None
        self._stop = False
        # env.factory set: every sample is a multi-turn episode (moe_rl/rollout/episode.py);
        # env.openai_agent: an episode played by an OpenAI-API agent (moe_rl/rollout/agent.py)
        self.episodes = (EpisodeRunner.from_config(cfg, task) if cfg.env.factory
                         else AgentRunner(cfg, task) if cfg.env.openai_agent else None)

    # --- control from the trainer thread --------------------------------------------------
    def start(self) -> "RolloutManager":
        self._thread.start()
        return self

    def check(self) -> None:
        """Raises in the trainer thread if the manager died."""
        if self.error is not None:
            raise RuntimeError(f"rollout manager failed: {self.error!r}") from self.error

    def begin_update(self) -> None:
        """Engines are about to pause for a weight update: hold back resubmissions."""
        self._call(lambda: self._ready.clear())

    def end_update(self, version: int) -> None:
        """Engines serve ``version`` now; open the gate for more groups."""

        def f():
            self.version = version
            self._ready.set()
            self._wake.set()

        self._call(f)

    def resample(self, n: int) -> None:
        """``n`` groups the trainer took were dropped (DAPO dynamic sampling): let ``n`` more be
        submitted. The gate counts only groups trained on, so the pipeline keeps its depth and a
        replacement is still no more than eta versions old when trained on."""

        def f():
            with self.lock:
                self.submitted -= n
            self._wake.set()

        self._call(f)

    def stop(self) -> None:
        self._stop = True
        if self._thread.is_alive():
            self._call(lambda: (self._wake.set(), self._ready.set()))
            self._thread.join(timeout=60)
        self._rewards.shutdown(wait=False, cancel_futures=True)

    def evaluate(self, task, prompts: list, requests: list[list[dict]], poll_s: float = 1.0) -> list[list[tuple]]:
        """Generates ``requests`` (per prompt, its samples: moe_rl/rollout/evaluation.py) on the
        engines through this manager's client (its failover included) beside the training
        rollouts, and scores them in its reward workers; waits for all. Per prompt, per sample:
        (reward, failed, response length, weight version that served it). Raises if the
        manager dies meanwhile."""
        fut = asyncio.run_coroutine_threadsafe(self._evaluate(task, prompts, requests), self._loop)
        while True:
            try:
                return fut.result(timeout=poll_s)
            except concurrent.futures.TimeoutError:
                self.check()

    async def _evaluate(self, task, prompts, requests):
        loop = asyncio.get_running_loop()

        async def one(prompt, reqs):
            resps = await self._resubmitting(lambda k: self.client.generate_batch(
                [r["input_ids"] for r in reqs], [r["sampling_params"] for r in reqs], return_logprob=False,
                rids=[attempt_rid(r["rid"], k) for r in reqs]), f"evaluation of prompt {prompt.index}")
            scores = await asyncio.gather(*(loop.run_in_executor(self._rewards, score, task, prompt, r["output_ids"])
                                            for r in resps))
            return [(rew, failed, len(r["output_ids"]), r["meta_info"].get("weight_version"))
                    for (rew, failed), r in zip(scores, resps)]

        return await asyncio.gather(*(one(p, reqs) for p, reqs in zip(prompts, requests)))

    def state_dict(self) -> dict:
        """Data position, the groups in flight (their prompts are resubmitted on resume) and the
        buffer, taken under one lock: a group is either in flight or in the buffer, never both."""
        with self.lock:
            pending = sorted(self.inflight) + list(self.redo)
            return {"next_index": self.next_index, "pending": pending, "stats": dict(self.stats),
                    "submitted": self.submitted - len(self.inflight), "attempt": self.attempt,
                    "buffer": self.buffer.state_dict()}

    def live_uids(self) -> set[str]:
        """The samples whose routing records may still be read: in the buffer or in flight
        (the replay log's retention keeps them, moe_rl/replay/log.py)."""
        n = self.cfg.rollout.group_size
        with self.lock:
            return {self._uid(i, j) for i in self.inflight for j in range(n)} | self.buffer.uids()

    def busy_fraction_since(self, t0: float) -> float:
        """Fraction of wall time since t0 with at least one request in flight."""
        with self.lock:
            busy = self.busy_time + (time.monotonic() - self.busy_since if self.busy_since else 0.0)
        return busy / max(time.monotonic() - t0, 1e-9)

    def _call(self, fn) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(fn)

    # --- the loop -------------------------------------------------------------------------
    def _thread_main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._run())
        except BaseException as e:  # surfaced to the trainer by check()
            log.exception("rollout manager failed")
            self.error = e
            self.buffer.close()
        finally:
            self._loop.close()

    async def _run(self) -> None:
        self._ready, self._wake = asyncio.Event(), asyncio.Event()
        self._ready.set()
        tasks: set[asyncio.Task] = set()
        failures: list[BaseException] = []

        def finished(t: asyncio.Task) -> None:  # every group's error is read here, none lost
            tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                failures.append(t.exception())
                self._wake.set()

        max_inflight = self.cfg.rollout.max_inflight_groups or 10**9
        try:
            while not self._stop:
                if failures:
                    raise failures[0]
                allowed = (self.version + self.eta + 1) * self.B
                if self.submitted < allowed and len(tasks) < max_inflight and self._ready.is_set():
                    index = self._next_prompt_index()
                    if index is None:
                        if not tasks:
                            break  # a finite dataset is exhausted
                    else:
                        self.buffer.expect(index, self.version)
                        t = asyncio.create_task(self._group(index, self.version))
                        tasks.add(t)
                        t.add_done_callback(finished)
                        continue
                self._wake.clear()
                wake = asyncio.create_task(self._wake.wait())
                try:
                    await asyncio.wait([wake, *tasks], timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    wake.cancel()
            if failures and not self._stop:
                raise failures[0]
        finally:  # on a failure too: no group task is left pending, none with an unread error
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if hasattr(self.episodes, "close"):  # the agent runner's OpenAI client
                await self.episodes.close()
            await self.client.close()

    def _next_prompt_index(self) -> int | None:
        """Draws the next prompt and marks it in flight in the same step, so a checkpoint taken
        at any moment finds every drawn prompt in flight, in the buffer, or consumed."""
        with self.lock:
            if self.redo:
                i = self.redo.pop(0)
            else:
                n = self.task.num_prompts
                if n is not None and self.next_index >= n and not getattr(self.task, "cycles", False):
                    return None
                i = self.next_index
                self.next_index += 1
            self.inflight[i] = time.monotonic()
            self.submitted += 1
            return i

    def _mark(self, delta: int) -> None:
        """Tracks the busy time of the rollout pool (>= 1 request in flight)."""
        with self.lock:
            now = time.monotonic()
            if self.stats["requests_inflight"] == 0 and delta > 0:
                self.busy_since = now
            self.stats["requests_inflight"] += delta
            if self.stats["requests_inflight"] == 0 and delta < 0 and self.busy_since is not None:
                self.busy_time += now - self.busy_since
                self.busy_since = None

    async def _group(self, index: int, version: int) -> None:
        if self.episodes is not None:
            return await self.episodes.run_group(self, index, version)
        prompt = self.task.prompt(index)
        n = self.cfg.rollout.group_size
        # the group's first requests go in one batched /generate (one HTTP round trip);
        # a sample cut short by a weight update continues on its own
        await self._ready.wait()
        first = [self._request(prompt, index, j, [], 0) for j in range(n)]
        self._mark(+n)
        try:
            resps = await self._resubmitting(lambda k: self.client.generate_batch(
                [f["input_ids"] for f in first], [f["sampling_params"] for f in first],
                return_logprob=True, return_routed_experts=self.replay_log is not None,
                rids=[attempt_rid(f["rid"], k) for f in first],
            ), f"group of prompt {index}")
        finally:
            self._mark(-n)
        samples = await asyncio.gather(*(self._sample(prompt, index, j, resps[j]) for j in range(n)))
        rewards = await asyncio.gather(
            *(asyncio.get_running_loop().run_in_executor(self._rewards, self._score, prompt, s) for s in samples)
        )
        for s, (r, err) in zip(samples, rewards):
            s.reward, s.failed = r, err
            if err is not None:
                self.stats["reward_failures"] += 1
        group = Group(index, list(samples), version)
        with self.lock:
            self.inflight.pop(index, None)
            self.buffer.put(group)
            self.stats["groups_done"] += 1

    async def _resubmitting(self, call, what: str):
        """``call(attempt)`` until an engine answers it: see "Engine failures" above. An HTTP 4xx
        answer is the request's fault and is raised at once, as is a failure past the deadline."""
        deadline = time.monotonic() + self.cfg.rollout.engine_retry_s
        for attempt in itertools.count():
            try:
                return await call(attempt)
            except EngineError as e:
                client_fault = isinstance(e, EngineHTTPError) and e.status < 500
                if client_fault or self._stop or time.monotonic() >= deadline:
                    raise
                backoff = self.client.mark_down(e.url)
                self.stats["engine_failures"] += 1
                if isinstance(e, EngineTimeoutError) and not self.client.serving_urls():
                    raise EngineFrozenError(f"{what}: engine {e.url} gave no answer within {self.client.timeout_s:g} s "
                                            f"(engine.request_timeout_s): it is frozen (stopped or hung), and no other "
                                            f"engine serves") from e
                live = bool(self.client.live_urls())
                log.warning("%s failed on %s (%s); resubmitting it to %s", what, e.url, e,
                            "a live engine" if live else f"the first engine back (in {backoff:.0f} s)")
                if not live:
                    await asyncio.sleep(min(backoff, max(0.0, deadline - time.monotonic())))

    def _score(self, prompt, sample: Sample) -> tuple[float, str | None]:
        try:  # a float, or a dict with 'reward' and extra metrics (reward.fn plug-ins)
            r, sample.metrics = reward_value(self.task.reward(prompt, sample.response_ids), "reward")
            return r, None
        except Exception as e:  # a raising reward (or a bad value) marks the sample failed; the run goes on
            log.warning("reward function raised on sample %s: %r", sample.uid, e)
            return 0.0, f"reward raised {type(e).__name__}: {e}"

    def _uid(self, index: int, j: int, part: int = 0) -> str:
        """Sample j of prompt ``index``; ``part`` > 0: another sequence of the same episode."""
        uid = f"p{index}-s{j}" + (f"-q{part}" if part else "")
        return uid if self.attempt == 0 else f"{uid}-a{self.attempt}"

    @staticmethod
    def next_attempt(checkpointed: int, replay_log=None) -> int:
        """The attempt of a (re)started run: above the checkpoint's and above every attempt in
        the routing log (its retention keeps a few steps' worth, so reading all is cheap). A run
        resumed twice from one checkpoint must not reuse the uids its first resumption logged."""
        logged = max((int(u.rsplit("-a", 1)[1]) if "-a" in u else 0 for u in replay_log.uids()),
                     default=-1) if replay_log is not None else -1
        return max(checkpointed, logged) + 1

    def _request(self, prompt, index: int, j: int, out: list[int], resumes: int) -> dict:
        """The /generate fields of sample j of a prompt, continuing after ``out``."""
        cfg = self.cfg.rollout
        max_new = prompt.max_new_tokens or cfg.max_new_tokens
        return {
            "input_ids": list(prompt.input_ids) + out,
            "sampling_params": {"max_new_tokens": max_new - len(out), "temperature": cfg.temperature,
                                "top_p": cfg.top_p, "top_k": cfg.top_k,
                                "stop_token_ids": list(self.task.stop_token_ids),
                                "sampling_seed": sampling_seed(self.cfg.data.seed, index, j, len(out))},
            "rid": f"{self._uid(index, j)}-r{resumes}",
            # a resumed request only needs the routing rows of tokens not covered yet
            "routed_experts_start_len": len(prompt.input_ids) + len(out) - 1 if out else 0,
        }

    async def _sample(self, prompt, index: int, j: int, resp: dict) -> Sample:
        """Collects sample j from its first response, resubmitting with the prefix while a
        weight update cuts it short (partial rollout)."""
        uid = self._uid(index, j)
        max_new = prompt.max_new_tokens or self.cfg.rollout.max_new_tokens
        out: list[int] = []
        logps: list[float] = []
        versions: list[int] = []
        metas: list[dict] = []
        starts: list[int] = [0]  # first routing row each response covers
        resumes = 0
        want_routing = self.replay_log is not None
        while True:
            meta = resp["meta_info"]
            finish = meta["finish_reason"]["type"] if meta.get("finish_reason") else "length"
            if want_routing and finish == "abort" and not routing_covers(
                    meta, self.spec, len(prompt.input_ids) + len(out), len(resp["output_ids"]), starts[-1]):
                # an aborted response whose routing does not cover its tokens: SGLang aborts a
                # queued (or just-started) request without routed_experts, an engine may abort
                # one before its first forward. Its tokens, if any, are dropped and the same
                # prefix is submitted again (nothing already kept is lost)
                starts.pop()
                if resp["output_ids"]:
                    self.stats["aborted_without_routing"] += 1
            else:
                new = list(resp["output_ids"])
                out += new
                self.stats["generated_tokens"] += len(new)  # the run's rollout tokens/s (train loop)
                logps += output_logprobs(meta)
                tv = token_weight_versions(meta)
                versions += [version_number(v) for v in (tv if tv is not None else [meta["weight_version"]] * len(new))]
                metas.append(meta)
            if not (finish == "abort" and len(out) < max_new and not self._stop):
                break
            resumes += 1
            self.stats["resumed_requests"] += 1
            await self._ready.wait()
            req = self._request(prompt, index, j, out, resumes)
            starts.append(req["routed_experts_start_len"])
            self._mark(+1)
            try:
                resp = await self._resubmitting(lambda k: self.client.generate(
                    req["input_ids"], req["sampling_params"], return_logprob=True,
                    return_routed_experts=want_routing, rid=attempt_rid(req["rid"], k),
                    routed_experts_start_len=req["routed_experts_start_len"]), f"sample {uid}")
            finally:
                self._mark(-1)
        if not (len(logps) == len(versions) == len(out)):
            raise RuntimeError(f"sample {uid}: engine returned {len(out)} tokens, {len(logps)} log-probs, "
                               f"{len(versions)} versions")
        s = Sample(uid, index, list(prompt.input_ids), out, logps, versions, finish_reason=finish, resumes=resumes)
        if want_routing and out:
            rec = record_from_responses(metas, self.spec, num_tokens=s.num_tokens, starts=starts)
            self.replay_log.append(uid, rec, sorted(set(versions)))
            s.has_routing = True
        return s
