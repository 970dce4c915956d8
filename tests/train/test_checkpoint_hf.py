"""A checkpoint's hf/ is a complete model directory: transformers loads model and tokenizer
from it as they are and gives the native model's logits; ``moe-rl serve`` finds it from a
checkpoint step or run directory and serves chat with its template; a directory without a
model is a one-line error."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from moe_rl.config import load_config  # noqa: E402
from moe_rl.rundir import resolve_model_dir  # noqa: E402
from moe_rl.train.backend import NativeBackend  # noqa: E402
from moe_rl.train.checkpoint import save_checkpoint  # noqa: E402
from tests.engine.openai_server import CONFIG, EXAMPLE, OVERRIDES  # noqa: E402

MESSAGES = [{"role": "user", "content": "guess 0 to 3"}]


def _checkpoint(run, overrides=()):
    backend = NativeBackend(load_config(CONFIG, [*OVERRIDES, *overrides]))
    return backend, save_checkpoint(run, 3, backend, None, {"step": 3, "version": 3}, {"next_index": 3}, keep=2)


def test_hf_dir_loads_in_transformers_with_its_tokenizer(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    backend, ckpt = _checkpoint(tmp_path)
    hf = ckpt / "hf"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json"):
        assert (hf / name).is_file(), name
    tok = AutoTokenizer.from_pretrained(hf)
    src = AutoTokenizer.from_pretrained(EXAMPLE / "tokenizer")
    ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(ids) == list(src.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False))
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    assert model.generation_config.eos_token_id == json.loads((EXAMPLE / "tokenizer" / "generation_config.json")
                                                              .read_text())["eos_token_id"]
    x = torch.tensor([list(ids)])
    with torch.no_grad():
        ref = backend.model(x).float()
        got = model(x).logits.float()
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_model_path_files_and_token_ids_are_kept(tmp_path):
    from moe_rl.model import save_hf

    src = tmp_path / "base"
    cfg = load_config(CONFIG, OVERRIDES)
    save_hf(NativeBackend(cfg).model, src)
    for f in (EXAMPLE / "tokenizer").iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [2], "temperature": 0.7}))
    conf = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**conf, "eos_token_id": 2, "bos_token_id": 1}))
    _, ckpt = _checkpoint(tmp_path / "run", [f"model.path={src}", "model.tokenizer_path=null"])
    hf = ckpt / "hf"
    assert json.loads((hf / "generation_config.json").read_text()) == {"eos_token_id": [2], "temperature": 0.7}
    saved = json.loads((hf / "config.json").read_text())
    assert saved["eos_token_id"] == 2 and saved["bos_token_id"] == 1
    assert (hf / "chat_template.jinja").read_text() == (EXAMPLE / "tokenizer" / "chat_template.jinja").read_text()


def test_serve_finds_the_model_of_a_checkpoint_or_run_directory(tmp_path):
    openai = pytest.importorskip("openai")
    from moe_rl.engine.server import _serve_config
    from tests.engine.openai_server import InProcessServer

    _, ckpt = _checkpoint(tmp_path)
    hf = ckpt / "hf"
    for d in (tmp_path, tmp_path / "checkpoints", ckpt, hf):
        assert resolve_model_dir(d) == hf
    cfg = _serve_config(str(tmp_path), ["engine.threads=1"])
    assert cfg.model.path == str(hf) and cfg.model.tokenizer_path is None
    server = InProcessServer(cfg=cfg)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model="x", messages=MESSAGES, max_tokens=2, seed=1,
                                           extra_body={"return_token_ids": True})
        assert r.choices[0].prompt_token_ids[:2] == [1, 7]  # <|im_start|> user: the checkpoint's template
        assert client.models.list().data[0].id == str(hf)
    finally:
        server.stop()


def test_serve_a_directory_without_a_model_is_one_line(tmp_path, capsys):
    from moe_rl.cli import main

    with pytest.raises(FileNotFoundError, match="holds no model"):
        resolve_model_dir(tmp_path)
    assert main(["serve", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.strip().count("\n") == 0 and "holds no model" in err
