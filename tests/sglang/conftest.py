"""The conformance suite runs against SGLang's own code (the wheel, installed without its
dependencies by ``scripts/install.sh test``; version pinned there). Modules that import on CPU
are imported; ``sglang.srt.managers.io_struct`` cannot (it pulls the model configs, torchvision,
tvm_ffi and kernels), so its request types are read from the installed source file with ``ast``
(see ``sglang_schema``)."""
from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

SGLANG_VERSION = "0.5.23"


def require_sglang(module: str):
    """Imports an SGLang module for a test module. Skipped only where the sglang wheel is not
    installed at all (the GPU image); where it is (CI), a failing import is an error, never a
    silent skip: a dependency the test extra lacks must show."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed (scripts/install.sh test installs it)", allow_module_level=True)
    return importlib.import_module(module)


def sglang_source(relpath: str) -> Path:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang is not installed (scripts/install.sh test installs it)")
    return Path(list(spec.submodule_search_locations)[0]) / relpath


@functools.lru_cache(None)
def sglang_schema(relpath: str = "srt/managers/io_struct.py") -> dict[str, dict[str, tuple[str, bool]]]:
    """{class name: {field: (annotation source, required)}} for every class of an SGLang module
    (dataclasses and msgspec Structs: annotated class-level names; inherited fields included)."""
    tree = ast.parse(sglang_source(relpath).read_text())
    out: dict[str, dict[str, tuple[str, bool]]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields: dict[str, tuple[str, bool]] = {}
        for b in node.bases:
            if isinstance(b, ast.Name) and b.id in out:
                fields.update(out[b.id])
        for st in node.body:
            if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
                ann = ast.unparse(st.annotation)
                if ann.startswith("ClassVar"):
                    continue
                fields[st.target.id] = (ann, st.value is None)
        out[node.name] = fields
    return out


def check_request(cls: str, body: dict, extensions: frozenset = frozenset()) -> None:
    """Asserts ``body`` is a valid ``cls`` by SGLang's field list: every key is one of its fields
    (SGLang drops unknown keys silently) and every required field is there."""
    fields = sglang_schema()[cls]
    unknown = set(body) - set(fields) - set(extensions)
    assert not unknown, f"{cls}: SGLang has no field(s) {sorted(unknown)} (they would be dropped)"
    missing = [f for f, (_, req) in fields.items() if req and f not in body]
    assert not missing, f"{cls}: required field(s) {missing} missing"


def sglang_methods(relpath: str, cls: str, names: tuple[str, ...], **globals_) -> dict:
    """SGLang's own functions, compiled from the installed source: methods ``names`` of class
    ``cls`` (or module-level functions/classes when ``cls`` is None) of a module that cannot be
    imported on CPU (tokenizer_manager needs fastapi, detokenizer_manager torchvision through
    the multimodal processors). ``globals_`` supply the names they use. Decorators are dropped
    (staticmethods come back as plain functions)."""
    tree = ast.parse(sglang_source(relpath).read_text())
    body = tree.body
    if cls is not None:
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    found = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name in names:
            if isinstance(node, ast.FunctionDef):
                node.decorator_list = []
            found[node.name] = node
    missing = set(names) - set(found)
    assert not missing, f"{relpath}: {cls}.{sorted(missing)} not found (SGLang changed?)"
    import dataclasses
    import typing

    ns = {"dataclasses": dataclasses, **{k: getattr(typing, k) for k in typing.__all__}, **globals_}
    exec(compile(ast.Module(body=[found[n] for n in names], type_ignores=[]), str(sglang_source(relpath)), "exec"), ns)
    return {n: ns[n] for n in names}


# --- a model directory with a tokenizer: `moe-rl serve` then answers "text" like SGLang --------
SPECIAL = ["<unk>", "<|endoftext|>", "<|im_end|>", "<s3>", "<s4>", "<s5>", "<s6>", "<s7>"]  # ids 0..7
EOS_ID = 1


def build_tokenizer(vocab_size: int):
    """A SentencePiece-style word-level tokenizer over the tiny model's vocabulary: ids 0..7
    special, then words ``▁w8``.. and continuation pieces ``p36``.. . Decoding drops the
    leading space of a string, so the text of an output depends on the prompt tokens before it
    (what SGLang's detokenizer handles by decoding 5 prompt tokens of context)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    half = (vocab_size + len(SPECIAL)) // 2
    vocab = {t: i for i, t in enumerate(SPECIAL)}
    vocab.update({f"\u2581w{i}": i for i in range(len(SPECIAL), half)})
    vocab.update({f"p{i}": i for i in range(half, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>",
                                   additional_special_tokens=SPECIAL[2:])


@pytest.fixture(scope="session")
def tok_model_dir(tmp_path_factory):
    """The test server's model (the seeded init of tests/engine/helpers' config) saved as an HF
    directory with the tokenizer above and ``eos_token_id`` 1."""
    import json

    from moe_rl.engine.server import build_model
    from moe_rl.model import save_hf
    from tests.engine.helpers import ARCH, CFG

    path = tmp_path_factory.mktemp("tok_model") / "model"
    save_hf(build_model(CFG), path)
    build_tokenizer(ARCH.vocab_size).save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS_ID}))
    return path


@pytest.fixture(scope="session")
def tok_server(tok_model_dir):
    from tests.engine.helpers import ServerProc

    s = ServerProc([f"model.path={tok_model_dir}"])
    yield s
    s.stop()


def sglang_text(tokenizer, prompt, output, finish_reason, *, skip=True, spaces=True, no_stop_trim=False):
    """The detokenizer's answer for a finished request, from the scheduler's inputs to it
    (Req.init_incremental_detokenize: the last 5 prompt tokens, then the output)."""
    from collections import defaultdict

    from sglang.utils import find_printable_text

    status = sglang_methods("srt/managers/detokenizer_manager.py", None, ("DecodeStatus",))["DecodeStatus"]
    dm = sglang_methods("srt/managers/detokenizer_manager.py", "DetokenizerManager",
                        ("trim_matched_stop", "_clamp_decode_ids", "_grouped_batch_decode",
                         "_decode_batch_token_id_output"),
                        find_printable_text=find_printable_text, defaultdict=defaultdict, DecodeStatus=status,
                        DETOKENIZER_MAX_STATES=1 << 16, decode_without_hf_kwargs=None)
    DM = type("DetokenizerRef", (), {**dm, "_clamp_decode_ids": staticmethod(dm["_clamp_decode_ids"])})
    d = DM()
    d.tokenizer, d.vocab_size, d.decode_status = tokenizer, len(tokenizer), {}
    d.disable_tokenizer_batch_decode, d.is_tool_call_parser_gpt_oss, d.tool_close_token_ids = False, False, set()
    surr = max(len(prompt) - 5, 0)
    recv = SimpleNamespace(rids=["r"], decoded_texts=[""], decode_ids=[list(prompt[surr:]) + list(output)],
                           read_offsets=[len(prompt) - surr], finished_reasons=[finish_reason],
                           no_stop_trim=[no_stop_trim], skip_special_tokens=[skip], spaces_between_special_tokens=[spaces])
    return d._decode_batch_token_id_output(recv)[0]


@pytest.fixture(scope="session")
def tokenizer(tok_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_model_dir)
