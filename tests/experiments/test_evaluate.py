"""Final-policy evaluation (moe_rl/experiments/evaluate.py, with the eval section's prompts and
metrics) against a plain greedy decode."""
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
    cfg = load_config(TINY, ["data.task_args.long_tail=true", "eval.prompts=6", "eval.samples=2",
                             "eval.temperature=0"])
    model = _model(cfg)
    ref = _greedy_reference(model, cfg, prompts=6)
    got = evaluate_policy(model, cfg)
    assert 0.0 < ref < 1.0  # a test that can tell prompts and outputs apart
    assert got["eval/reward_mean"] == pytest.approx(ref, abs=1e-12)
    assert got["eval/prompts"] == 6 and got["eval/samples"] == 2
    assert got["eval/pass@1"] == got["eval/pass@2"]  # greedy: a prompt's two samples are one
    assert got["eval"]["temperature"] == 0 and got["eval_data_seed"] == EVAL_DATA_SEED


def test_sampled_eval_is_the_same_for_every_training_seed(tmp_path):
    """The prompt set and sampling seeds are fixed, whatever data.seed the run trained with."""
    a = load_config(TINY, ["data.seed=0", "eval.prompts=4", "eval.samples=3"])
    b = load_config(TINY, ["data.seed=4", f"output_dir={tmp_path}", "eval.prompts=4", "eval.samples=3"])
    model = _model(a)
    ra = evaluate_policy(model, a)
    save_hf(model, tmp_path / "checkpoints" / "step_7" / "hf")
    (tmp_path / "checkpoints" / "latest").write_text("step_7")
    rb = evaluate_run(tmp_path, b)  # through the checkpoint on disk
    assert rb["eval/reward_mean"] == pytest.approx(ra["eval/reward_mean"], abs=1e-12)
    assert rb["eval/pass@3"] == pytest.approx(ra["eval/pass@3"], abs=1e-12)
    assert rb["checkpoint"].endswith("step_7/hf")
    assert evaluate_run(tmp_path / "none", b) is None


def test_a_held_out_file_is_evaluated_in_place_of_the_training_prompts(tmp_path):
    """eval.data: the prompts come from the held-out file (all of it when it holds fewer than
    eval.prompts), read like data.path (the same keys)."""
    import json

    from moe_rl.rollout.evaluation import eval_prompts, eval_task
    from moe_rl.tasks.jsonl import ByteTokenizer

    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps({"q": f"{i}+1?", "a": str(i + 1)}) + "\n" for i in range(20)))
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"q": f"{i}*2?", "a": str(2 * i)}) + "\n" for i in range(3)))
    cfg = load_config(TINY, ["data.task=jsonl", f"data.path={train}", "data.prompt_key=q", "data.answer_key=a",
                             "model.vocab_size=259", f"eval.data={held}", "eval.prompts=8", "eval.samples=1"])
    task = eval_task(cfg)
    prompts = eval_prompts(cfg, task)
    assert len(prompts) == 3 and {p.meta["answer"] for p in prompts} == {"0", "2", "4"}
    tok = ByteTokenizer()
    assert {tok.decode(p.input_ids).split("\n")[0] for p in prompts} == {"0*2?", "1*2?", "2*2?"}
    got = evaluate_policy(MoEForCausalLM(cfg.model.arch()).init_weights(seed=0, std=0.02).eval(), cfg)
    assert got["eval/prompts"] == 3 and got["eval"]["data"] == str(held)
