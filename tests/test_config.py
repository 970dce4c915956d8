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


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_validates(path, capsys):
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
