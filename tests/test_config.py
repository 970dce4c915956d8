"""The experiment schema, YAML loading, overrides and `moe-rl validate`."""
import subprocess
import sys
from pathlib import Path

import pytest

from moe_rl.cli import main as cli_main
from moe_rl.config import ConfigError, load_config

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


def test_there_are_configs():
    assert any(p.name == "tiny.yaml" for p in CONFIGS)


# configs whose plug-ins live in an example's directory (run with PYTHONPATH=that directory)
PLUGIN_DIRS = {"openai_agent.yaml": "examples/openai_agent"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_validates(path, capsys, monkeypatch):
    if path.name in PLUGIN_DIRS:
        monkeypatch.syspath_prepend(str(path.parent.parent / PLUGIN_DIRS[path.name]))
    assert cli_main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "model:" in out and "train:" in out


def test_overrides_are_typed_and_nested():
    cfg = load_config("configs/tiny.yaml", ["train.lr=1e-4", "rollout.group_size=8", "engine.urls=[a, b]",
                                             "output_dir=/tmp/x", "replay.enabled=false"])
    assert cfg.train.lr == 1e-4 and cfg.rollout.group_size == 8
    assert cfg.engine.urls == ["a", "b"] and cfg.output_dir == "/tmp/x" and cfg.replay.enabled is False


@pytest.mark.parametrize(
    "override, expected",
    [
        ("train.lrr=1", "train.lrr: unknown key (did you mean 'train.lr'?)"),
        ("rolout.group_size=2", "rolout: unknown key (did you mean 'rollout'?)"),
        ("model.num_expert=4", "model.num_expert: unknown key (did you mean 'model.num_experts'?)"),
        ("train.lr=-1", "train.lr: Input should be greater than 0"),
        ("rollout.temperature=hot", "rollout.temperature: Input should be a valid number"),
        ("engine.kind=vllm", "engine.kind: Input should be 'embedded' or 'sglang'"),
        ("train.ep_size=3", "\n  pools.trainer=1 must be a multiple of train.ep_size=3"),
        ("pools.trainer=3 train.ep_size=3", "\n  model.num_experts=8 is not divisible by train.ep_size=3"),
        ("train.lr", "not of the form key.sub=value"),
    ],
)
def test_bad_keys_and_values_are_named(override, expected):
    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny.yaml", override.split())
    assert expected in str(e.value)


def test_bad_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: [1\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_config(bad)
    bad.write_text("train:\n  stepz: 3\n")
    with pytest.raises(ConfigError, match=r"train.stepz: unknown key \(did you mean 'train.steps'\?\)"):
        load_config(bad)
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.yaml")


def test_validate_cli_exit_codes(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("algo:\n  clip_lo: 0.1\n")
    r = subprocess.run([sys.executable, "-m", "moe_rl.cli", "validate", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2
    assert "algo.clip_lo: unknown key (did you mean 'algo.clip_low'?)" in r.stderr
    ok = subprocess.run([sys.executable, "-m", "moe_rl.cli", "validate", "configs/tiny.yaml", "train.steps=3"],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and "steps: 3" in ok.stdout


def test_a_lora_rank_turns_lora_on_as_in_verl(caplog):
    """verl: a LoRA rank > 0 is what turns LoRA on. `lora.rank=8` alone used to train without
    adapters, silently."""
    with caplog.at_level("WARNING", logger="moe_rl.config"):
        cfg = load_config("configs/tiny.yaml", ["lora.rank=8"])
    assert cfg.lora.enabled is True and cfg.lora.rank == 8
    assert "lora.rank=8" in caplog.text and "lora.enabled=true" in caplog.text
    # verl's rank 0 is its off
    assert load_config("configs/tiny.yaml", ["lora.rank=0"]).lora.enabled is False
    # an explicit lora.enabled decides: a sweep arm without LoRA keeps the LoRA settings
    off = load_config("configs/tiny.yaml", ["lora.enabled=false", "lora.rank=8", "lora.alpha=4"])
    assert off.lora.enabled is False and off.lora.rank == 8


@pytest.mark.parametrize("overrides", [["lora.alpha=8"], ["lora.targets=[q_proj]", "lora.sync=adapter"]])
def test_other_lora_keys_without_lora_enabled_are_refused_naming_both(overrides):
    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny.yaml", overrides)
    for o in overrides:
        assert o.split("=")[0] in str(e.value)
    assert "lora.enabled" in str(e.value)


def test_a_dumped_config_round_trips_with_lora_off(tmp_path):
    """`moe-rl validate` writes every key: lora.enabled: false beside the LoRA defaults loads."""
    from moe_rl.config import dump_config

    path = tmp_path / "dumped.yaml"
    path.write_text(dump_config(load_config("configs/tiny.yaml")))
    assert load_config(path).lora.enabled is False


def test_glm_keys_are_checked_by_name():
    cfg = load_config("configs/glm_tiny.yaml", ["train.expert_bias_update_rate=0.001"])
    assert cfg.model.arch().router == "sigmoid" and cfg.train.expert_bias_update_rate == 0.001
    with pytest.raises(ConfigError, match="train.expert_bias_update_rate.*qwen3_moe"):
        load_config("configs/tiny.yaml", ["train.expert_bias_update_rate=0.001"])
    with pytest.raises(ConfigError, match="n_shared_experts=1 is not supported by model_type='qwen3_moe'"):
        load_config("configs/tiny.yaml", ["model.n_shared_experts=1"])
    with pytest.raises(ConfigError, match="shared_experts.down_proj"):
        load_config("configs/glm_tiny.yaml", ["lora.enabled=true", "lora.sync=adapter", "engine.kind=sglang",
                                              "engine.urls=[http://x:1]", "pools.rollout=0",
                                              "lora.targets=[q_proj,v_proj,shared_experts.down_proj]"])


@pytest.mark.parametrize("cpus, workers", [(1, 1), (2, 1), (15, 1), (16, 2), (24, 3), (32, 4), (128, 4)])
def test_agent_workers_default_to_one_per_8_cores(cpus, workers):
    """env.agent_workers null: one agent worker per 8 CPU cores, at least 1 and at most 4; a set
    value (0 included: the manager's thread) is kept whatever the machine."""
    assert load_config("configs/tiny.yaml").env.agent_worker_count(cpus) == workers
    for n in (0, 3):
        assert load_config("configs/tiny.yaml", [f"env.agent_workers={n}"]).env.agent_worker_count(cpus) == n


def test_agent_workers_default_counts_the_cores_the_trainer_may_run_on(monkeypatch):
    """The cores of the process's CPU affinity (a container's or taskset's share), not the machine's."""
    import os

    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no CPU affinity on this platform")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(os, "cpu_count", lambda: 128)
    assert load_config("configs/tiny.yaml").env.agent_worker_count() == 2
