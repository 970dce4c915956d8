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
