"""The config reference, generated from the schema (``moe_rl.config.ExperimentConfig``).

  python -m moe_rl.config_doc            write docs/config.md
  python -m moe_rl.config_doc --check    exit 1 when docs/config.md is not what the schema gives
  moe-rl keys [PREFIX ...]               the same reference as text, for the keys under PREFIX

Every key's type, allowed values (``Literal`` choices, ``ge``/``gt``/``le``/``lt`` bounds), default
and ``Field(description=...)``, grouped by section in the schema's order.
"""
from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from .config import ExperimentConfig

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "config.md"
COMMAND = "python -m moe_rl.config_doc"


@dataclass(frozen=True)
class Key:
    path: str  # dotted, e.g. train.lr
    type: str  # with its allowed values and bounds
    default: str
    description: str


@dataclass(frozen=True)
class Section:
    path: str  # "" for the top level
    intro: str
    keys: list[Key]


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def sections(model: type[BaseModel] = ExperimentConfig, prefix: str = "") -> list[Section]:
    """The keys of ``model`` (its plain fields first, as one section), then each sub-section, depth first,
    in the order the schema declares them."""
    plain = [Key(prefix + name, type_text(f), default_text(f), f.description or "")
             for name, f in model.model_fields.items() if not _is_section(f.annotation)]
    out = [Section(prefix.rstrip("."), _intro(model), plain)] if plain else []
    for name, f in model.model_fields.items():
        if _is_section(f.annotation):
            out += sections(f.annotation, prefix + name + ".")
    return out


def all_keys() -> list[Key]:
    return [k for s in sections() for k in s.keys]


def _intro(model: type[BaseModel]) -> str:
    doc = (model.__doc__ or "").split("\n\n")[0]
    return " ".join(doc.replace("``", "`").split())


# --- types, bounds, defaults -----------------------------------------------------------------
def _type_name(t: Any) -> str:
    origin, args = typing.get_origin(t), typing.get_args(t)
    if t is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args) if len(args) > 1 else f"`{args[0]}`"
    if origin in (typing.Union, types.UnionType):
        parts = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(parts) + (" or null" if type(None) in args else "")
    if origin is list:
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is tuple:
        return "[" + ", ".join(_type_name(a) for a in args) + "]"
    if origin is dict:
        return "mapping"
    if t is typing.Any:
        return "any"
    if t is dict:
        return "mapping"
    return getattr(t, "__name__", str(t))


_BOUNDS = ((at.Ge, "ge", "≥"), (at.Gt, "gt", ">"), (at.Le, "le", "≤"), (at.Lt, "lt", "<"))


def type_text(f: FieldInfo) -> str:
    bounds = [f"{sign} {_num(getattr(m, attr))}" for m in f.metadata for cls, attr, sign in _BOUNDS
              if isinstance(m, cls)]
    return _type_name(f.annotation) + (", " + ", ".join(bounds) if bounds else "")


def _num(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _plain(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def default_text(f: FieldInfo) -> str:
    v = _plain(f.get_default(call_default_factory=True))
    if isinstance(v, str):
        return v if v else '""'
    return json.dumps(v) if isinstance(v, (bool, list, dict, type(None))) else repr(v)


# --- markdown ------------------------------------------------------------------------------
def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _anchor(section: Section) -> str:
    return re.sub(r"[^a-z0-9_ -]", "", (section.path or "top level").lower()).replace(" ", "-")


def _title(section: Section) -> str:
    return f"`{section.path}`" if section.path else "Top level"


def render_markdown() -> str:
    secs = sections()
    lines = [
        "# Config reference",
        "",
        f"<!-- generated from moe_rl/config.py by `{COMMAND}`: edit the schema's descriptions, not this file -->",
        "",
        "Every key of an experiment config, as `moe-rl validate` and `moe-rl train` accept it. A YAML file sets",
        "keys by section (`train:` then `lr: 0.001`); the command line overrides any key as `section.key=value`",
        "(`moe-rl train configs/tiny.yaml train.lr=3e-4 lora.rank=16`). An unknown key or a value out of range",
        "is refused with the key named; `moe-rl validate CONFIG` prints the resolved config, and",
        "`moe-rl keys PREFIX` prints this reference for the keys under PREFIX in a terminal.",
        "",
        "Sections: " + ", ".join(f"[{_title(s)}](#{_anchor(s)})" for s in secs) + ".",
        "",
    ]
    for s in secs:
        lines += [f"## {_title(s)}", ""]
        if s.intro:
            lines += [s.intro, ""]
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        lines += [f"| `{k.path}` | {_cell(k.type)} | `{_cell(k.default)}` | {_cell(k.description)} |" for k in s.keys]
        lines.append("")
    return "\n".join(lines)


# --- text (moe-rl keys) ----------------------------------------------------------------------
def render_text(prefixes: list[str]) -> str:
    """The keys equal to, or under, any of ``prefixes`` (all keys when none); ValueError naming a prefix
    that matches no key, with the closest key."""
    keys = all_keys()
    chosen: list[Key] = []
    for p in prefixes or [""]:
        p = p.strip(".")
        hit = [k for k in keys if not p or k.path == p or k.path.startswith(p + ".")]
        if not hit:
            names = [k.path for k in keys] + sorted({k.path.rsplit(".", 1)[0] for k in keys if "." in k.path})
            close = difflib.get_close_matches(p, names, n=1)
            raise ValueError(f"no config key {p!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        chosen += [k for k in hit if k not in chosen]
    out = []
    for k in chosen:
        out.append(f"{k.path}: {k.type.replace('`', '')} (default {k.default})")
        out += textwrap.wrap(k.description.replace("`", ""), 96, initial_indent="    ", subsequent_indent="    ")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=COMMAND, description="Write the config reference (docs/config.md) from "
                                 "the schema in moe_rl/config.py.")
    ap.add_argument("--out", type=Path, default=DOC, help=f"where to write it (default {DOC})")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when the file differs from the schema")
    a = ap.parse_args(argv)
    text = render_markdown()
    if a.check:
        if not a.out.exists() or a.out.read_text() != text:
            print(f"{a.out} is not what the schema gives: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(text)
    print(f"wrote {a.out} ({len(all_keys())} keys)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
