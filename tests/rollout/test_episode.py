"""Multi-turn episodes through the rollout manager, with a weight update in the middle of the
episodes: one token sequence, loss mask, per-token versions, routing record (contract 7)."""
import asyncio
import base64
import textwrap
import time

import numpy as np
import pytest

from moe_rl.config import load_config
from moe_rl.replay import RoutingSpec
from moe_rl.rollout.buffer import RolloutBuffer
from moe_rl.rollout.manager import RolloutManager
from moe_rl.tasks.base import Prompt

ENV_MODULE = textwrap.dedent('''
    import asyncio
    from moe_rl.tasks.env import StepResult

    class CounterEnv:
        """Observation after turn t is [20 + t, 21 + t]; reward 0.5 per turn; done after 3 turns."""
        def __init__(self, done_after=3, sleep=0.0, task=None):
            self.done_after, self.sleep, self.t = done_after, sleep, 0
        async def reset(self, prompt):
            return [1, 2, 3 + prompt.index % 3]
        async def step(self, action_ids, action_text):
            await asyncio.sleep(self.sleep)
            self.t += 1
            return StepResult([20 + self.t, 21 + self.t], 0.5, self.t >= self.done_after, {})

    class SyncEnv(CounterEnv):  # plain methods run in a worker thread
        def reset(self, prompt):
            return [1, 2, 3]
        def step(self, action_ids, action_text):
            self.t += 1
            return [30], 1.0, self.t >= 2, {}

    class BadEnv(CounterEnv):
        async def step(self, action_ids, action_text):
            return [999], "a lot", False, {}

    class RaisingEnv(CounterEnv):
        async def step(self, action_ids, action_text):
            raise KeyError("boom")

    class SlowEnv(CounterEnv):
        async def step(self, action_ids, action_text):
            await asyncio.sleep(30)
''')

E = 300  # routing rows encode [position, 100 + token, 200 + version] as three distinct "experts"


class Task:
    name, vocab_size_needed, stop_token_ids, num_prompts = "t", 16, [], None

    def prompt(self, index):
        return Prompt(index, [1, 2, 3])

    def reward(self, prompt, ids):
        raise AssertionError("an episode's reward comes from its environment")

    def decode(self, ids):
        return " ".join(map(str, ids))


class RoutingEngines:
    """Generates tokens 5..7 one at a time, each tagged with the engine's version; a pause in
    abort mode ends requests early. Routing rows from routed_experts_start_len on: row p is
    [p, 100 + seq[p], 200 + version of the forward at p] (prefill at the request's arrival
    version, decode at the version that sampled token p + 1)."""

    def __init__(self):
        self.version, self.aborting, self.rids, self.partial_aborts = 0, False, [], 0
        self.made = {}  # rid -> tokens made so far

    async def generate(self, input_ids, sampling_params, return_logprob=True, return_routed_experts=False, rid=None,
                       routed_experts_start_len=0):
        self.rids.append(rid)
        arrival = self.version
        seq, fwd_version = list(input_ids), [arrival] * (len(input_ids) - 1)
        out, versions = [], []
        for _ in range(sampling_params["max_new_tokens"]):
            await asyncio.sleep(0.003)
            if self.aborting:
                break
            tok = 5 + len(seq) % 3
            fwd_version.append(self.version)
            seq.append(tok)
            out.append(tok)
            versions.append(str(self.version))
            self.made[rid] = len(out)
        self.partial_aborts += 0 < len(out) < sampling_params["max_new_tokens"]
        rows = [[[p, 100 + seq[p], 200 + fwd_version[p]]] for p in range(routed_experts_start_len, len(seq) - 1)]
        meta = {"finish_reason": {"type": "abort" if len(out) < sampling_params["max_new_tokens"] else "length"},
                "weight_version": str(self.version), "output_token_weight_versions": versions,
                "output_token_logprobs": [[-0.5, t, None] for t in out],
                "prompt_tokens": len(input_ids), "completion_tokens": len(out)}
        if return_routed_experts:
            meta["routed_experts"] = base64.b64encode(np.asarray(rows, dtype="<i4").tobytes()).decode()
        return {"output_ids": out, "meta_info": meta}

    async def close(self):
        pass


class RecordingLog:
    def __init__(self):
        self.records, self.versions = {}, {}

    def append(self, uid, rec, versions):
        assert uid not in self.records, "a record written twice"
        self.records[uid], self.versions[uid] = np.asarray(rec), versions


@pytest.fixture
def env_module(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(ENV_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))


def make(factory, overrides=(), engines=None):
    cfg = load_config("configs/tiny.yaml", ["rollout.prompts_per_step=2", "rollout.group_size=2",
                                             "rollout.max_new_tokens=6", "rollout.max_staleness=1",
                                             f"env.factory=my_envs:{factory}", "env.max_turns=4", *overrides])
    engines, buffer, log = engines or RoutingEngines(), RolloutBuffer(), RecordingLog()
    m = RolloutManager(cfg, Task(), engines, buffer, log, RoutingSpec(1, 3, E))
    return cfg, engines, buffer, log, m


@pytest.mark.parametrize("mode", ["abort", "in_place"])
def test_episode_across_a_weight_update(env_module, mode):
    cfg, engines, buffer, log, m = make("CounterEnv", ["env.args.done_after=3"])
    m.start()
    try:
        deadline = time.monotonic() + 30
        while not any("-t1-" in r and n >= 2 for r, n in list(engines.made.items())):
            assert time.monotonic() < deadline
            time.sleep(0.001)  # until episodes are inside their second model turn
        m.begin_update()
        engines.aborting = mode == "abort"
        time.sleep(0.01)
        engines.version = 1
        engines.aborting = False
        m.end_update(1)
        groups = buffer.take(2, 0, timeout=30, alive=m.check)
    finally:
        m.stop()
    samples = [s for g in groups for s in g.samples]
    assert len(samples) == 4 and all(s.failed is None for s in samples)
    spans_update = 0
    for s in samples:
        assert s.prompt_ids == [1, 2, 3 + s.group_id % 3]
        assert s.turns == 3 and s.turn_rewards == [0.5] * 3 and s.reward == 1.5 and s.finish_reason == "done"
        seq = s.prompt_ids + s.response_ids
        assert len(s.loss_mask) == len(s.response_ids) == len(s.versions) == len(s.behaviour_logprobs)
        # the loss mask: 1 exactly on the model's tokens (5..7), 0 on the observations, which are
        # the environment's ids as returned, in order, between the turns (last one dropped)
        assert s.loss_mask == [int(t < 20) for t in s.response_ids]
        assert [t for t in s.response_ids if t >= 20] == [20 + 1, 21 + 1, 20 + 2, 21 + 2]
        assert s.response_ids[-1] < 20, "an episode ends with a model token"
        model_versions = [v for v, keep in zip(s.versions, s.loss_mask) if keep]
        assert model_versions == sorted(model_versions)
        spans_update += len(set(model_versions)) > 1
        assert all(lp == -0.5 for lp, keep in zip(s.behaviour_logprobs, s.loss_mask) if keep)
        # the routing record: every forwarded position exactly once, in order, and a model
        # token's row from the very forward that sampled it (same version as the token)
        rec = log.records[s.uid]
        assert rec.shape == (len(seq) - 1, 1, 3)
        assert rec[:, 0, 0].tolist() == list(range(len(seq) - 1))
        assert rec[:, 0, 1].tolist() == [100 + t for t in seq[:-1]]
        P = len(s.prompt_ids)
        for i, (v, keep) in enumerate(zip(s.versions, s.loss_mask)):
            if keep:
                assert rec[P + i - 1, 0, 2] == 200 + v, (s.uid, i)
        assert log.versions[s.uid] == sorted(set(model_versions))
        assert s.has_routing
    assert spans_update >= 1, "no episode had model turns before and after the update"
    if mode == "abort":
        assert sum(s.resumes for s in samples) >= 1 and m.stats["resumed_requests"] >= 1
        assert engines.partial_aborts >= 1, "no turn was cut short with tokens made (resume not exercised)"
    else:
        assert sum(s.resumes for s in samples) == 0


def test_sync_environment_and_tuple_steps(env_module):
    cfg, engines, buffer, log, m = make("SyncEnv")
    m.start()
    try:
        groups = buffer.take(2, 0, timeout=30, alive=m.check)
    finally:
        m.stop()
    for s in (s for g in groups for s in g.samples):
        assert s.failed is None and s.turns == 2 and s.reward == 2.0
        assert s.response_ids.count(30) == 1 and s.loss_mask[s.response_ids.index(30)] == 0


@pytest.mark.parametrize("factory, overrides, why", [
    ("BadEnv", [], "env.factory (my_envs:BadEnv): step()'s observation holds token id 999"),
    ("RaisingEnv", [], "env.factory (my_envs:RaisingEnv): step() raised KeyError"),
    ("SlowEnv", ["env.episode_timeout_s=0.2"], "episode timed out after env.episode_timeout_s=0.2"),
])
def test_bad_environment_fails_the_episode_and_the_run_goes_on(env_module, factory, overrides, why):
    cfg, engines, buffer, log, m = make(factory, overrides)
    m.start()
    try:
        groups = buffer.take(2, 0, timeout=30, alive=m.check)
    finally:
        m.stop()
    samples = [s for g in groups for s in g.samples]
    assert all(s.failed is not None and why in s.failed for s in samples), samples[0].failed
    assert m.stats["env_failures"] >= 4 and not log.records


def test_episode_concurrency_is_bounded(env_module):
    engines = RoutingEngines()
    active, peak = [0], [0]
    inner = engines.generate

    async def counting(*a, **k):
        active[0] += 1
        peak[0] = max(peak[0], active[0])
        try:
            return await inner(*a, **k)
        finally:
            active[0] -= 1

    engines.generate = counting
    cfg, engines, buffer, log, m = make("CounterEnv", ["env.max_concurrent_episodes=3", "env.args.sleep=0.01",
                                                       "rollout.prompts_per_step=4"], engines)
    m.start()
    try:
        buffer.take(4, 0, timeout=30, alive=m.check)
    finally:
        m.stop()
    assert 2 <= peak[0] <= 3  # 16 episodes wanted to run at once


@pytest.mark.parametrize("overrides, message", [
    (["env.factory=my_envs:CounterEnv", "env.args.colour=1"], "env.factory (my_envs:CounterEnv) with env.args="),
    (["env.factory=my_envs:Nope"], "env.factory (my_envs:Nope): module 'my_envs' has no attribute 'Nope'"),
    (["env.factory=my_envs:asyncio"], "env.factory (my_envs:asyncio): module object is not callable"),
    (["env.factory=my_envs:StepResult"], "env.factory (my_envs:StepResult) with env.args={}: StepResult.__init__()"),
])
def test_bad_environment_factories_name_their_key(env_module, overrides, message):
    from moe_rl.tasks import PluginError

    cfg = load_config("configs/tiny.yaml", overrides)
    with pytest.raises(PluginError) as e:
        RolloutManager(cfg, Task(), RoutingEngines(), RolloutBuffer())
    assert message in str(e.value)


def test_reward_fn_with_an_environment_is_refused():
    with pytest.raises(ValueError, match="reward.fn and env.factory"):
        load_config("configs/tiny.yaml", ["env.factory=a.b:C", "reward.fn=a.b:f"])


class ScriptedToolModel:
    """A "model" on the byte tokenizer: its first turn calls the calculator, its second turn
    boxes whatever the tool response in its context says (so the reward is 1 only if the tool's
    result came back as the observation)."""

    def __init__(self):
        from moe_rl.tasks import ByteTokenizer

        self.tok, self.inputs = ByteTokenizer(), []

    async def generate(self, input_ids, sampling_params, return_logprob=True, return_routed_experts=False, rid=None,
                       routed_experts_start_len=0):
        import re

        self.inputs.append(list(input_ids))
        context = self.tok.decode(input_ids)
        seen = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", context)
        text = (f"The sum is \\boxed{{{seen[-1]}}}" if seen else
                '<tool_call>{"name": "calculator", "arguments": {"expression": "5315 + 2481"}}</tool_call>')
        out = self.tok.encode_text(text)[: sampling_params["max_new_tokens"] - 1] + [self.tok.EOS]
        return {"output_ids": out, "meta_info": {"finish_reason": {"type": "stop"}, "weight_version": "0",
                                                 "output_token_weight_versions": ["0"] * len(out),
                                                 "output_token_logprobs": [[-0.1, t, None] for t in out]}}

    async def close(self):
        pass


def test_tool_calling_episode_through_the_manager(tmp_path):
    from moe_rl.tasks import task_from_config

    data = tmp_path / "sum.jsonl"
    data.write_text('{"prompt": "What is 5315 + 2481?", "answer": "7796"}\n')
    cfg = load_config("configs/tiny.yaml", ["model.vocab_size=260", "data.task=jsonl", f"data.path={data}",
                                             "data.task_args.tokenizer=byte", "env.factory=moe_rl.tasks.tools:ToolEnv",
                                             "rollout.max_new_tokens=120", "rollout.prompts_per_step=1",
                                             "rollout.group_size=2", "rollout.max_staleness=0"])
    task, engines, buffer = task_from_config(cfg), ScriptedToolModel(), RolloutBuffer()
    m = RolloutManager(cfg, task, engines, buffer)
    m.start()
    try:
        (group,) = buffer.take(1, 0, timeout=30, alive=m.check)
    finally:
        m.stop()
    for s in group.samples:
        assert s.failed is None and s.turns == 2 and s.reward == 1.0 and s.finish_reason == "done"
        model = [t for t, k in zip(s.response_ids, s.loss_mask) if k]
        env = [t for t, k in zip(s.response_ids, s.loss_mask) if not k]
        assert task.decode(env) == "\n<tool_response>\n7796\n</tool_response>\n"
        assert "<tool_call>" in task.decode(model) and task.decode(model).endswith("\\boxed{7796}")
    # the second turn's request is the first turn's exact ids plus the observation's: no re-tokenising
    first, second = engines.inputs[0], engines.inputs[-1]
    s = group.samples[-1]
    assert second == s.prompt_ids + s.response_ids[: len(second) - len(s.prompt_ids)] and second[: len(first)] == first
