"""Final-policy evaluation (moe_rl/experiments/evaluate.py) against a plain greedy decode."""
from pathlib import Path

import pytest
import torch

from moe_rl.config import load_config
from moe_rl.experiments.evaluate import EVAL_DATA_SEED, evaluate_policy, evaluate_run
from moe_rl.model.hf_io import save_hf
from moe_rl.model.transformer import MoEForCausalLM
from moe_rl.tasks import task_from_config

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny.yaml")


def _model(cfg):
    model = MoEForCausalLM(cfg.model.arch()).init_weights(seed=3, std=0.5)
    with torch.no_grad():  # make the symbols (ids 4..7) the likely tokens, so greedy rewards vary
        model.lm_head.weight[4:8] *= 8.0
    return model.eval()


@torch.no_grad()
def _greedy_reference(model, cfg, prompts: int) -> float:
    """Plain decode: the whole sequence through the model at every step, argmax, stop at EOS."""
    task = task_from_config(cfg.model_copy(update={"data": cfg.data.model_copy(update={"seed": EVAL_DATA_SEED})}))
    rewards = []
    for i in range(prompts):
        p = task.prompt(i)
        ids = list(p.input_ids)
        out = []
        for _ in range(p.max_new_tokens):
            t = int(model(torch.tensor([ids + out]))[0, -1].argmax())
            out.append(t)
            if t in task.stop_token_ids:
                break
        rewards.append(task.reward(p, out))
    return sum(rewards) / len(rewards)


def test_greedy_eval_matches_a_plain_decode():
    cfg = load_config(TINY, ["data.task_args.long_tail=true"])
    model = _model(cfg)
    ref = _greedy_reference(model, cfg, prompts=6)
    got = evaluate_policy(model, cfg, prompts=6, samples=2, temperature=0.0)
    assert 0.0 < ref < 1.0  # a test that can tell prompts and outputs apart
    assert got["eval_reward"] == pytest.approx(ref, abs=1e-12)
    assert got["eval_prompts"] == 6 and got["eval_samples"] == 2


def test_sampled_eval_is_the_same_for_every_training_seed(tmp_path):
    """The prompt set and sampling seeds are fixed, whatever data.seed the run trained with."""
    a = load_config(TINY, ["data.seed=0"])
    b = load_config(TINY, ["data.seed=4", f"output_dir={tmp_path}"])
    model = _model(a)
    ra = evaluate_policy(model, a, prompts=4, samples=3)
    save_hf(model, tmp_path / "checkpoints" / "step_7" / "hf")
    (tmp_path / "checkpoints" / "latest").write_text("step_7")
    rb = evaluate_run(tmp_path, b, prompts=4, samples=3)  # through the checkpoint on disk
    assert rb["eval_reward"] == pytest.approx(ra["eval_reward"], abs=1e-12)
    assert rb["checkpoint"].endswith("step_7/hf")
    assert evaluate_run(tmp_path / "none", b, 4, 3) is None
