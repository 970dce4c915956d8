"""What a file-backed task hands an OpenAI-API agent: the question as meta["text"], the
dataset's chat messages as meta["messages"] (rendered by the chat template for token-level
use), and the answer."""
import json

import pytest

from moe_rl.config import DataConfig
from moe_rl.tasks import DatasetError, get_task


def _task(tmp_path, lines, model_path=None):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return get_task(DataConfig(task="jsonl", path=str(p)), model_path=model_path)


def test_meta_text_and_messages(tmp_path):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 2+3?"}]
    t = _task(tmp_path, [{"prompt": "What is 6*7?", "answer": "42"}, {"messages": msgs, "answer": "5"}])
    metas = {t.prompt(i).meta["answer"]: t.prompt(i).meta for i in range(2)}
    assert metas["42"]["text"] == "What is 6*7?" and "messages" not in metas["42"]
    assert metas["5"]["text"] == "What is 2+3?" and metas["5"]["messages"] == msgs


def test_messages_through_the_chat_template(tmp_path):
    from tests.tasks.test_tasks_jsonl import _tiny_hf_tokenizer

    tok = _tiny_hf_tokenizer(tmp_path / "model")
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+3?"}]
    t = _task(tmp_path, [{"messages": msgs, "answer": "5"}], model_path=str(tmp_path / "model"))
    assert tok.decode(t.prompt(0).input_ids) == "<system>be brief<im_end><user>2+3?<im_end><assistant>"


def test_bad_messages_name_the_line(tmp_path):
    with pytest.raises(DatasetError, match=r"d.jsonl:2: 'messages' message 0 is not a chat message"):
        _task(tmp_path, [{"prompt": "q", "answer": "1"}, {"messages": [{"role": "user"}], "answer": "1"}])
