"""Datasets as verl and slime users have them, read by the file-backed math task: verl's Parquet
schema, slime-style JSONL with its own keys, HF `datasets` directories, chat-message prompts;
and bad files or rows refused naming the file and the row."""
import json

import pytest

from moe_rl.config import ConfigError, DataConfig, load_config
from moe_rl.tasks import ByteTokenizer, DatasetError, get_task, load_examples

from tests.tasks.test_tasks_jsonl import _tiny_hf_tokenizer

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

TOK = ByteTokenizer()
SYSTEM = "You are a careful solver."


def verl_row(i: int, answer="7") -> dict:
    """One row as verl's examples/data_preprocess/gsm8k.py writes it."""
    return {"data_source": "openai/gsm8k",
            "prompt": [{"role": "system", "content": SYSTEM},
                       {"role": "user", "content": f"What is {i} + 3? Let's think step by step and output the final "
                                                   "answer after \"####\"."}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": "train", "index": i, "answer": f"{i} + 3 = {i + 3} #### {i + 3}"}}


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_verl_parquet_reads_as_it_is(tmp_path):
    p = write_parquet(tmp_path / "train.parquet", [verl_row(i, str(i + 3)) for i in range(5)])
    t = get_task(DataConfig(task="jsonl", path=str(p)))
    assert t.num_prompts == 5
    i = t.example_at(0)
    pr = t.prompt(0)
    assert pr.meta["answer"] == str(i + 3) and pr.meta["row"] == i and pr.meta["data_source"] == "openai/gsm8k"
    assert pr.meta["extra_info"]["index"] == i  # carried for a reward.fn plug-in, as verl's compute_score gets it
    # the byte tokenizer has no chat template: the messages' contents, joined by blank lines
    user = verl_row(i)["prompt"][1]["content"]
    assert t.decode(pr.input_ids) == f"{SYSTEM}\n\n{user}"
    assert t.reward(pr, TOK.encode(f"so the answer is {i + 3}")[1:]) == 1.0
    assert t.reward(pr, TOK.encode(f"so the answer is {i + 4}")[1:]) == 0.0


def test_chat_message_prompts_go_through_the_tokenizers_chat_template(tmp_path):
    tok = _tiny_hf_tokenizer(tmp_path / "model")
    p = write_parquet(tmp_path / "train.parquet", [verl_row(1, "4")])
    t = get_task(DataConfig(task="jsonl", path=str(p)), model_path=str(tmp_path / "model"))
    user = verl_row(1)["prompt"][1]["content"]
    # the template is the tokenizer's, applied to the messages as they are (no task template added)
    assert tok.decode(t.prompt(0).input_ids) == f"<system>{SYSTEM}<im_end><user>{user}<im_end><assistant>"


def test_slime_style_jsonl_with_its_own_keys(tmp_path):
    p = tmp_path / "slime.jsonl"
    rows = [{"input": [{"role": "user", "content": "2+2?"}], "label": "4", "metadata": {"id": 1}},
            {"input": "What is 3*3?", "label": 9}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = get_task(DataConfig(task="jsonl", path=str(p), prompt_key="input", answer_key="label",
                            task_args={"template": "Q: {prompt}"}))
    by_line = {t.prompt(i).meta["line"]: t.prompt(i) for i in range(2)}
    assert t.decode(by_line[1].input_ids) == "2+2?"  # chat messages: as they are
    assert t.decode(by_line[2].input_ids) == "Q: What is 3*3?"  # a string: through the task's template
    assert [by_line[1].meta["answer"], by_line[2].meta["answer"]] == ["4", "9"]
    with pytest.raises(DatasetError, match=r"slime\.jsonl:1: missing prompt key 'question' \(data\.prompt_key\)"):
        load_examples(p, prompt_key="question", answer_key="label")


def test_dotted_keys_read_nested_fields(tmp_path):
    p = write_parquet(tmp_path / "t.parquet", [verl_row(2, "5")])
    ex = load_examples(p, prompt_key="extra_info.answer", answer_key="reward_model.ground_truth")
    assert ex[0]["prompt"] == "2 + 3 = 5 #### 5" and ex[0]["answer"] == "5"


def test_hf_datasets_directory(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [verl_row(i, str(i + 3)) for i in range(3)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    t = get_task(DataConfig(task="jsonl", path=str(tmp_path / "ds")))
    assert t.num_prompts == 3 and {t.prompt(i).meta["answer"] for i in range(3)} == {"3", "4", "5"}
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows)}) \
        .save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DatasetError, match=r"dd: holds a DatasetDict with splits \['test', 'train'\]; set data.path "
                                           r"to one split's directory"):
        load_examples(tmp_path / "dd")
    assert len(load_examples(tmp_path / "dd" / "train")) == 3
    bad = [verl_row(0), {**verl_row(1), "reward_model": {"style": "rule", "ground_truth": None}}]
    datasets.Dataset.from_list(bad).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(DatasetError, match=r"bad: row 1: 'reward_model.ground_truth' is null"):
        load_examples(tmp_path / "bad")


def test_format_is_detected_or_named(tmp_path):
    p = write_parquet(tmp_path / "train.bin", [verl_row(0)])
    with pytest.raises(DatasetError, match=r"train\.bin: a Parquet file read as JSONL: name it \.parquet or set "
                                           r"data\.format=parquet"):  # not .parquet: read as JSONL
        load_examples(p)
    (tmp_path / "latin.jsonl").write_bytes(json.dumps({"prompt": "x", "answer": "1"}).encode() + b"\n\xe9t\xe9\n")
    with pytest.raises(DatasetError, match=r"latin\.jsonl:2: not UTF-8 text"):
        load_examples(tmp_path / "latin.jsonl")
    assert len(load_examples(p, format="parquet")) == 1
    j = tmp_path / "a.jsonl"
    j.write_text(json.dumps({"prompt": "x", "answer": "1"}) + "\n")
    with pytest.raises(DatasetError, match=r"a\.jsonl: not a readable Parquet file"):
        load_examples(j, format="parquet")
    with pytest.raises(DatasetError, match=r"data\.format=hf_disk reads a directory"):
        load_examples(j, format="hf_disk")


@pytest.mark.parametrize("bad, message", [
    ({"prompt": [{"role": "user"}]}, r"'prompt' message 0 is not a chat message"),
    ({"prompt": []}, r"'prompt' is an empty list of chat messages"),
    ({"prompt": [{"role": "user", "content": " "}]}, r"empty 'prompt'"),
    ({"reward_model": {"style": "rule"}}, r"'reward_model.ground_truth' is null"),  # a struct field missing: null
])
def test_bad_parquet_row_names_file_and_row(tmp_path, bad, message):
    rows = [verl_row(0), verl_row(1), {**verl_row(2), **bad}, verl_row(3)]
    p = write_parquet(tmp_path / "d.parquet", rows)
    with pytest.raises(DatasetError, match=rf"d\.parquet: row 2: {message}"):
        load_examples(p)


def test_bad_parquet_is_refused_before_launch(tmp_path, capsys):
    from moe_rl.cli import main

    p = write_parquet(tmp_path / "d.parquet", [verl_row(0), {**verl_row(1), "prompt": []}])
    held = write_parquet(tmp_path / "held.parquet", [verl_row(0), {**verl_row(1), "prompt": [{"role": "user"}]}])
    tiny = ["configs/tiny.yaml", f"output_dir={tmp_path}/run", "data.task=jsonl", "model.vocab_size=259"]
    assert main(["train", *tiny, f"data.path={p}"]) == 2  # before torchrun starts any process
    assert f"error: {p}: row 1: 'prompt' is an empty list of chat messages" in capsys.readouterr().err
    good = write_parquet(tmp_path / "good.parquet", [verl_row(0)])
    assert main(["train", *tiny, f"data.path={good}", f"eval.data={held}"]) == 2
    assert f"error: {held}: row 1: 'prompt' message 0 is not a chat message" in capsys.readouterr().err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_file_keys_belong_to_file_backed_tasks():
    with pytest.raises(ConfigError, match=r"data.prompt_key set, but they apply to data.task=jsonl"):
        load_config(None, ["data.task=echo", "data.prompt_key=input"])
    with pytest.raises(ConfigError, match=r"eval.data is a held-out dataset for data.task=jsonl"):
        load_config(None, ["data.task=echo", "eval.data=x.parquet"])
    with pytest.raises(ConfigError, match=r"data.format: Input should be"):
        load_config(None, ["data.task=jsonl", "data.path=x", "data.format=csv"])
