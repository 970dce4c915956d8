"""Tasks and rewards plugged in by import path from a package outside moe_rl; every bad
plug-in gets an error naming its config key and itself."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from moe_rl.config import load_config
from moe_rl.rollout.buffer import RolloutBuffer
from moe_rl.rollout.manager import RolloutManager
from moe_rl.tasks import PluginError, RewardError, task_from_config
from moe_rl.tasks.base import Prompt

REPO = Path(__file__).resolve().parents[2]

USER_PKG = textwrap.dedent('''
    import asyncio
    from moe_rl.tasks import PatternTask

    def make_echo(seed, num_symbols=4, max_new_tokens=16):
        return PatternTask("echo", seed=seed, num_symbols=num_symbols, max_new_tokens=max_new_tokens)

    def make_raising(num_symbols=4):
        raise RuntimeError("no data here")

    def make_not_a_task():
        return object()

    def count_fives(prompt, response_ids, response_text):
        return {"reward": response_ids.count(5) / len(response_ids), "length": len(response_ids)}

    async def async_len(prompt, response_ids, response_text):
        await asyncio.sleep(0)
        return len(response_text)

    def two_args(prompt, response_ids):
        return 1.0

    def raises_on_odd(prompt, response_ids, response_text):
        if prompt.index % 2:
            raise ValueError("odd prompt")
        return 1.0

    def returns_text(prompt, response_ids, response_text):
        return "great"

    def returns_nan(prompt, response_ids, response_text):
        return float("nan")

    def bad_metric(prompt, response_ids, response_text):
        return {"reward": 1.0, "note": "fine"}

    NOT_CALLABLE = 3
''')


@pytest.fixture
def userpkg(tmp_path, monkeypatch):
    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "plugins.py").write_text(USER_PKG)
    (pkg / "broken.py").write_text("import not_a_module_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def cfg_with(*overrides):
    return load_config("configs/tiny.yaml", list(overrides))


def test_task_and_rewards_plug_in_through_config(userpkg):
    task = task_from_config(cfg_with("data.task=userpkg.plugins:make_echo", "data.task_args.num_symbols=3",
                                     "data.seed=7"))
    assert task.num_symbols == 3 and task.seed == 7 and task.max_new_tokens == 16  # seed/max_new from the run
    p = task.prompt(0)
    task = task_from_config(cfg_with("data.task=userpkg.plugins:make_echo", "reward.fn=userpkg.plugins:count_fives"))
    assert task.reward(p, [5, 5, 6, 3]) == {"reward": 0.5, "length": 4.0}
    task = task_from_config(cfg_with("reward.fn=userpkg.plugins:async_len"))
    text = task.decode([5, 6])  # the response text is cut at the stop token (EOS = 3)
    assert task.reward(p, [5, 6, 3, 7]) == float(len(text))


@pytest.mark.parametrize("overrides, message", [
    (["data.task=userpkg.nope:make_echo"], "data.task (userpkg.nope:make_echo): cannot import module 'userpkg.nope'"),
    (["data.task=userpkg.broken:make"], "data.task (userpkg.broken:make): cannot import module 'userpkg.broken': "
                                        "ModuleNotFoundError"),
    (["data.task=userpkg.plugins:make_eko"], "data.task (userpkg.plugins:make_eko): module 'userpkg.plugins' has "
                                             "no attribute 'make_eko'"),
    (["data.task=userpkg.plugins:NOT_CALLABLE"], "data.task (userpkg.plugins:NOT_CALLABLE): int object is not callable"),
    (["data.task=userpkg.plugins:make_echo", "data.task_args.colour=2"],
     "data.task (userpkg.plugins:make_echo): wrong signature (seed, num_symbols=4, max_new_tokens=16)"),
    (["data.task=userpkg.plugins:make_raising"], "data.task (userpkg.plugins:make_raising) with data.task_args={}: "
                                                 "raised RuntimeError: no data here"),
    (["data.task=userpkg.plugins:make_not_a_task"], "data.task (userpkg.plugins:make_not_a_task): returned a object, "
                                                    "not a Task: it lacks name"),
    (["reward.fn=userpkg.plugins:two_args"], "reward.fn (userpkg.plugins:two_args): wrong signature "
                                             "(prompt, response_ids)"),
    (["reward.fn=userpkg.nope:f"], "reward.fn (userpkg.nope:f): cannot import module"),
])
def test_bad_plugins_name_their_key(userpkg, overrides, message):
    with pytest.raises(PluginError) as e:
        task_from_config(cfg_with(*overrides))
    assert message in str(e.value)


def test_bad_plugin_path_is_a_config_error():
    with pytest.raises(ValueError, match="reward.fn: 'userpkg.plugins' is not an import path"):
        cfg_with("reward.fn=userpkg.plugins")


@pytest.mark.parametrize("fn, message", [
    ("returns_text", "reward.fn (userpkg.plugins:returns_text): returned str 'great'"),
    ("returns_nan", "reward.fn (userpkg.plugins:returns_nan): returned nan; the reward must be finite"),
    ("bad_metric", "reward.fn (userpkg.plugins:bad_metric): metric 'note'='fine' is not a finite number"),
    ("raises_on_odd", "reward.fn (userpkg.plugins:raises_on_odd): raised ValueError: odd prompt"),
])
def test_bad_reward_values_raise_naming_the_plugin(userpkg, fn, message):
    task = task_from_config(cfg_with(f"reward.fn=userpkg.plugins:{fn}"))
    with pytest.raises(RewardError) as e:
        task.reward(Prompt(1, [1, 4, 2], 4), [4, 4])
    assert message in str(e.value)


def test_raising_reward_plugin_fails_its_samples_and_the_run_goes_on(userpkg):
    from tests.rollout.test_manager import StubEngines

    cfg = cfg_with("reward.fn=userpkg.plugins:raises_on_odd", "rollout.prompts_per_step=4", "rollout.group_size=2",
                   "rollout.max_new_tokens=3")
    buffer = RolloutBuffer()
    m = RolloutManager(cfg, task_from_config(cfg), StubEngines(), buffer)
    m.start()
    try:
        groups = buffer.take(4, 0, timeout=30, alive=m.check)
    finally:
        m.stop()
    for g in groups:
        for s in g.samples:
            if g.group_id % 2:
                assert "reward.fn (userpkg.plugins:raises_on_odd): raised ValueError" in s.failed
            else:
                assert s.failed is None and s.reward == 1.0
    assert m.stats["reward_failures"] >= 4  # more groups may have finished by the stop


def test_shipped_example_plugs_in_and_validates(monkeypatch):
    """examples/custom_reward: the files a user copies, checked as CI runs them."""
    monkeypatch.syspath_prepend(str(REPO / "examples/custom_reward"))
    cfg = load_config(REPO / "examples/custom_reward/config.yaml")
    task = task_from_config(cfg)
    p = task.prompt(3)
    answer = p.meta["answer"]
    symbols = p.input_ids[1:-1]
    assert symbols.count(answer) == max(symbols.count(s) for s in symbols)  # independent majority check
    assert task.reward(p, [answer] * p.max_new_tokens) == {"reward": 1.0, "hit_first": 1.0}
    assert task.reward(p, [3])["reward"] == 0.0
    env = {"PYTHONPATH": f"{REPO}:{REPO / 'examples/custom_reward'}", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "moe_rl.cli", "validate", "examples/custom_reward/config.yaml"],
                         cwd=REPO, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "# plug-ins import: data.task=my_plugins:make_task, reward.fn=my_plugins:majority_reward" in out.stdout
    env["PYTHONPATH"] = str(REPO)  # without the example's directory: a clear error, exit 2
    out = subprocess.run([sys.executable, "-m", "moe_rl.cli", "validate", "examples/custom_reward/config.yaml"],
                         cwd=REPO, env=env, capture_output=True, text=True)
    assert out.returncode == 2 and "data.task (my_plugins:make_task): cannot import module 'my_plugins'" in out.stderr
