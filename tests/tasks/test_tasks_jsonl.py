import json
import pickle
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from moe_rl.config import DataConfig
from moe_rl.tasks import (
    ARITH_EXAMPLE,
    ByteTokenizer,
    DatasetError,
    get_task,
    load_examples,
    math_reward,
    reference_answer,
)

TOK = ByteTokenizer()


def write(tmp_path, lines, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("".join(line + "\n" for line in lines))
    return p


@pytest.mark.parametrize(
    "response, ref, reward",
    [
        ("\\boxed{42}", "42", 1.0),
        ("the answer is 1,234", "1234", 1.0),
        ("\\boxed{$1,234$}", "1234", 1.0),
        ("so x = -7.", "-7", 1.0),
        ("so x = 7", "-7", 0.0),
        ("3.50", "3.5", 1.0),
        ("\\boxed{0.75}", "\\frac{3}{4}", 1.0),
        ("\\boxed{3/4}", "0.75", 1.0),
        ("\\boxed{\\text{blue}}", "blue", 1.0),
        ("\\boxed{x^2+1}", "x^2 + 1", 1.0),
        ("\\boxed{}", "1", 0.0),
        ("I do not know", "5", 0.0),
        ("", "5", 0.0),
        ("41.9", "42", 0.0),
        ("\\boxed{12} and later 13", "12", 1.0),  # a box beats a later number
        ("We get 3 apples, then 1,234 pears", "1234", 1.0),  # else the last number
        ("\\boxed{\\text{blue}}", "red", 0.0),
        # correct answers a string and number matcher scores 0 (math-verify compares them as math)
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
        ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", 1.0),
        ("\\boxed{0.50}", "\\frac12", 1.0),
        ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
        ("\\boxed{10\\%}", "0.1", 1.0),
        ("\\boxed{\\pi/2}", "\\frac{\\pi}{2}", 1.0),
        ("\\boxed{x^2+2x+2}", "(x+1)^2", 0.0),
        ("\\boxed{\\{1,3\\}}", "\\{2,1\\}", 0.0),
    ],
)
def test_math_reward(response, ref, reward):
    assert math_reward(response, ref) == reward


def test_a_pathological_answer_cannot_stall_a_reward_thread():
    """Rewards run in the rollout manager's threads, where math-verify's SIGALRM timeout does not
    work; sympy would spend forever on 9^(9^(9^9)). The worker is killed at the deadline, the
    answer scores 0, and the next check runs on a fresh worker."""
    from moe_rl.tasks.answers import default_verifier

    before = default_verifier().timeouts
    with ThreadPoolExecutor(2) as pool:
        assert pool.submit(math_reward, "\\boxed{1}", "1").result(timeout=120) == 1.0  # workers are up
        t0 = time.monotonic()
        stuck = pool.submit(math_reward, "so \\boxed{9^{9^{9^{9}}}}", "1", timeout_s=1.0)
        assert stuck.result(timeout=60) == 0.0
        assert time.monotonic() - t0 < 30  # the deadline (1 CPU-s, 10 s wall at most) and the kill, not forever
        assert pool.submit(math_reward, "\\boxed{2\\sqrt{2}}", "\\sqrt{8}").result(timeout=120) == 1.0
    assert default_verifier().timeouts == before + 1


def test_reference_answers_from_gsm8k_and_math_formats():
    assert reference_answer("Tom has 3+4=7 apples.\n#### 7") == "7"
    assert reference_answer("Thus the area is $\\boxed{\\frac{1}{2}}$.") == "\\frac{1}{2}"
    assert reference_answer(" 12 ") == "12"


def test_loader_accepts_key_aliases_and_numbers(tmp_path):
    p = write(tmp_path, [
        json.dumps({"prompt": "1+1?", "answer": "2"}),
        "",
        json.dumps({"question": "Tom?", "answer": "3+4=7\n#### 7", "id": 5}),
        json.dumps({"problem": "Area?", "solution": "It is $\\boxed{12}$."}),
        json.dumps({"prompt": "2*3?", "answer": 6}),
    ])
    ex = load_examples(p)
    assert [e["answer"] for e in ex] == ["2", "7", "12", "6"]
    assert [e["line"] for e in ex] == [1, 3, 4, 5]


@pytest.mark.parametrize(
    "bad, message",
    [
        ('{"prompt": "x", "answer": ', "invalid JSON"),
        ('["prompt", "answer"]', "expected a JSON object"),
        ('{"answer": "1"}', "missing prompt key"),
        ('{"prompt": "x"}', "missing answer key"),
        ('{"prompt": 3, "answer": "1"}', "'prompt' must be a string"),
        ('{"prompt": "x", "answer": [1]}', "'answer' must be a string or a number"),
        ('{"prompt": "x", "answer": true}', "'answer' must be a string or a number"),
    ],
)
def test_bad_line_names_file_and_line_number(tmp_path, bad, message):
    good = json.dumps({"prompt": "1+1?", "answer": "2"})
    p = write(tmp_path, [good, good, "", bad, good])
    with pytest.raises(DatasetError, match=rf"d\.jsonl:4: {message}"):
        load_examples(p)
    with pytest.raises(ValueError, match=r"d\.jsonl:4"):  # DatasetError is a ValueError
        get_task(DataConfig(task="jsonl", path=str(p)))


def test_empty_and_missing_files(tmp_path):
    for lines in ([], ["", "   "]):
        p = write(tmp_path, lines, "empty.jsonl")
        with pytest.raises(DatasetError, match="empty.jsonl: the file holds no examples"):
            load_examples(p)
    with pytest.raises(DatasetError, match="no such dataset file"):
        load_examples(tmp_path / "nope.jsonl")


def test_epochs_cycle_in_seeded_shuffled_order(tmp_path):
    p = write(tmp_path, [json.dumps({"prompt": f"q{i}", "answer": str(i)}) for i in range(10)])
    t = get_task(DataConfig(task="jsonl", path=str(p), seed=1))
    assert t.num_prompts == 10 and t.vocab_size_needed == 259
    e0 = [t.prompt(i).meta["example"] for i in range(10)]
    e1 = [t.prompt(i).meta["example"] for i in range(10, 20)]
    assert sorted(e0) == sorted(e1) == list(range(10))  # each epoch visits every line once
    assert e0 != e1 and e0 != list(range(10))  # reshuffled per epoch
    again = get_task(DataConfig(task="jsonl", path=str(p), seed=1))
    assert [again.prompt(i).input_ids for i in (17, 3, 12)] == [t.prompt(i).input_ids for i in (17, 3, 12)]
    assert pickle.loads(pickle.dumps(t)).prompt(5) == t.prompt(5)  # usable from worker processes


def test_jsonl_reward_on_token_ids_with_byte_tokenizer(tmp_path):
    p = write(tmp_path, [json.dumps({"prompt": "What is 6*7?", "answer": "42"})])
    t = get_task(DataConfig(task="jsonl", path=str(p), task_args={"template": "Q: {prompt}\nA:"}))
    pr = t.prompt(0)
    assert t.decode(pr.input_ids) == "Q: What is 6*7?\nA:" and pr.input_ids[0] == TOK.BOS
    ids = TOK.encode("It is \\boxed{42}")[1:]
    assert t.reward(pr, ids) == 1.0
    assert t.reward(pr, ids + [TOK.EOS] + TOK.encode(" no, 43")[1:]) == 1.0  # cut at the stop token
    assert t.reward(pr, TOK.encode("It is 41")[1:]) == 0.0
    assert t.reward(pr, []) == 0.0


def test_shipped_example_file_is_valid_and_self_consistent():
    assert ARITH_EXAMPLE.is_file()
    ex = load_examples(ARITH_EXAMPLE)
    assert len(ex) >= 24
    t = get_task(DataConfig(task="arith"))
    for i in range(t.num_prompts):
        pr = t.prompt(i)
        assert t.reward(pr, TOK.encode(f"\\boxed{{{pr.meta['answer']}}}")[1:]) == 1.0
    # the shipped answers are right
    for e in ex:
        nums = [float(x) for x in re.findall(r"\d+(?:\.\d+)?", e["prompt"])]
        op = next(o for w, o in (("+", "+"), (" - ", "-"), ("*", "*"), ("times", "*"), ("Divide", "/")) if w in e["prompt"])
        a, b = nums
        want = {"+": a + b, "-": a - b, "*": a * b, "/": a / b}[op]
        assert math_reward(f"\\boxed{{{round(want, 6)!r}}}", e["answer"]) == 1.0, e


def _tiny_hf_tokenizer(dirname):
    """A character-level fast tokenizer with a chat template, saved like an HF checkpoint."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {"<pad>": 0, "<eos>": 1, "<im_end>": 2, **{c: 3 + i for i, c in enumerate(chars)}}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Split("", "isolated")
    tk.decoder = tokenizers.decoders.Fuse()
    f = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<pad>",
                                             additional_special_tokens=["<im_end>"])
    f.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<im_end>{% endfor %}"
                       "{% if add_generation_prompt %}<assistant>{% endif %}")
    f.save_pretrained(dirname)
    (dirname / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    return f


def test_hf_tokenizer_from_model_path(tmp_path):
    tok = _tiny_hf_tokenizer(tmp_path / "model")
    p = write(tmp_path, [json.dumps({"prompt": "What is 6*7?", "answer": "42"})])
    t = get_task(DataConfig(task="jsonl", path=str(p)), model_path=str(tmp_path / "model"))
    pr = t.prompt(0)
    assert tok.decode(pr.input_ids) == "<user>What is 6*7?\nPut your final answer within \\boxed{}.<im_end><assistant>"
    assert t.stop_token_ids == [1, 2] and t.vocab_size_needed == len(tok)
    ids = tok.encode("so \\boxed{42}", add_special_tokens=False)
    assert t.reward(pr, ids + [2]) == 1.0
    assert t.reward(pr, tok.encode("so 24", add_special_tokens=False)) == 0.0
    plain = get_task(DataConfig(task="jsonl", path=str(p), task_args={"chat_template": False, "template": "{prompt}"}),
                     model_path=str(tmp_path / "model"))
    assert tok.decode(plain.prompt(0).input_ids) == "What is 6*7?"
