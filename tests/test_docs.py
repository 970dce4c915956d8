"""The documentation a user reads: the config reference is the schema's, every relative link resolves, every
command the docs show names what exists, every config validates, the version is one, and no page speaks of
issues or of how the work was done.

The commands of fenced code blocks are checked in this process: `moe-rl validate`/`train` load their config
with its overrides on every page; on the pages in PARSED every argparse-based command (`moe-rl
bench|sweep|serve`, `python -m ...`, `python scripts/...`) also parses its arguments and stops right there.
When docs/config.md is stale, `python -m moe_rl.config_doc` rewrites it.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import re
import runpy
import shlex
import sys
import tomllib
from pathlib import Path

import pytest

import moe_rl
from moe_rl import cli, config_doc
from moe_rl.config import ExperimentConfig, load_config

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
# plug-ins that live in an example's directory (the docs run them with PYTHONPATH=that directory)
# configs/*.yaml are validated by tests/test_config.py; these are the other configs the docs name
OTHER_CONFIGS = sorted([*(ROOT / "configs" / "experiments").glob("*.yaml"), *(ROOT / "examples").glob("*/config.yaml")])


def rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


# --- the config reference ------------------------------------------------------------------------
def test_config_reference_is_the_schemas():
    doc = ROOT / "docs" / "config.md"
    assert doc.exists() and doc.read_text() == config_doc.render_markdown(), (
        f"docs/config.md is stale: regenerate it with `{config_doc.COMMAND}` (writes docs/config.md) and commit it")


def test_every_key_has_a_description():
    keys = config_doc.all_keys()
    assert len(keys) > 150 and keys[0].path == "name"
    missing = [k.path for k in keys if len(k.description.strip()) < 10]
    assert not missing, f"config keys without a Field(description=...) a user can act on: {missing}"


def test_reference_shows_types_bounds_choices_and_defaults():
    doc = config_doc.render_markdown()
    assert "| `train.lr` | float, > 0 | `0.001` |" in doc
    assert "| `rollout.top_p` | float, > 0, ≤ 1 | `1.0` |" in doc
    assert "| `algo.advantage` | one of `grpo`, `drgrpo`, `rloo` | `grpo` |" in doc
    assert "| `algo.tis_cap` | float or null, > 0 | `2.0` |" in doc
    assert "| `train.compile` | `auto` or bool | `auto` |" in doc
    assert "| `model.mlp_only_layers` | list of int | `[]` |" in doc
    # sections in the schema's order, each key under its own
    order = [s.path for s in config_doc.sections()]
    assert order[:4] == ["", "model", "pools", "engine"] and order.index("train") > order.index("algo")
    assert {k.path.split(".")[0] for k in config_doc.all_keys() if "." in k.path} == {
        n for n, f in ExperimentConfig.model_fields.items() if config_doc._is_section(f.annotation)}


def test_keys_command(capsys):
    assert cli.main(["keys", "train.lr", "algo"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("train.lr: float, > 0 (default 0.001)\n    AdamW") and "algo.clip_high:" in out
    assert cli.main(["keys", "trian.lr"]) == 2
    assert "no config key 'trian.lr' (did you mean 'train.lr'?)" in capsys.readouterr().err


def test_check_mode_names_the_fix(tmp_path, capsys):
    stale = tmp_path / "config.md"
    stale.write_text("old\n")
    assert config_doc.main(["--check", "--out", str(stale)]) == 1
    assert f"run `{config_doc.COMMAND}`" in capsys.readouterr().err
    assert config_doc.main(["--out", str(stale)]) == 0 and config_doc.main(["--check", "--out", str(stale)]) == 0


def test_validate_help_points_to_the_reference(capsys):
    assert cli.main(["validate", "--help"]) == 0
    assert "docs/config.md" in capsys.readouterr().out


@pytest.mark.parametrize("path", OTHER_CONFIGS, ids=rel)
def test_every_other_config_validates(path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    if path.is_relative_to(ROOT / "examples"):  # its plug-ins live beside it
        monkeypatch.syspath_prepend(str(path.parent))
    assert cli.main(["validate", rel(path)]) == 0, capsys.readouterr().err
    assert "train:" in capsys.readouterr().out


# --- the version ---------------------------------------------------------------------------------
def test_one_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"moe-rl {moe_rl.__version__}\n"
    installed = importlib.metadata.version("moe-rl")
    assert installed == moe_rl.__version__, (
        f"installed metadata says {installed}, moe_rl/__init__.py {moe_rl.__version__}: reinstall "
        "(pip install -e .) after changing the version")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "moe_rl.__version__"}
    top = re.search(r"^## \[(\d+\.\d+\.\d+)\]", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert top and top.group(1) == moe_rl.__version__, "CHANGELOG.md's newest entry names another version"


# --- links ---------------------------------------------------------------------------------------
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code, inline code spans removed."""
    out, fenced = [], False
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((i, re.sub(r"`[^`]*`", "", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)):
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
        out |= set(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", line))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_relative_links_resolve(doc):
    bad = []
    for n, line in prose_lines(doc):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            if not dest.exists():
                bad.append(f"{rel(doc)}:{n}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{rel(doc)}:{n}: {target} (no heading #{anchor} in {dest.name})")
    assert not bad, "\n".join(bad)


def test_the_readme_links_the_index_and_the_index_links_what_exists():
    readme = (ROOT / "README.md").read_text()
    assert "(docs/README.md)" in readme and "(docs/config.md)" in readme and "(CHANGELOG.md)" in readme
    index = (ROOT / "docs" / "README.md").read_text()
    for page in ("config.md", "benchmarks.md", "gpu.md", "environments.md", "lora.md", "run_safety.md"):
        assert f"]({page}" in index, page


# --- words ---------------------------------------------------------------------------------------
# how the work went is not the product: no issue numbers, no sessions or helpers, no "this change"
FORBIDDEN = re.compile(
    r"\bissues? \d|\bitems? \d+(-\d+)? of|\bsession \d|\b(first|second|third|fourth|fifth|this|that|earlier|"
    r"the same|a later) session\b|\bno GPU (was|is) lent|\bthis (change|branch)\b|\bthe lead\b(?! (trainer )?rank)(?!'s exception)|\bengineers?\b"
    r"|\bhelpers? (work|ran|running)|\(items? \d", re.I)


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_docs_speak_of_the_product(doc):
    bad = [f"{rel(doc)}:{n}: {line.strip()[:120]}" for n, line in enumerate(doc.read_text().splitlines(), 1)
           if FORBIDDEN.search(line)]
    assert not bad, "lines about issues or how the work went:\n" + "\n".join(bad)


CODE_FORBIDDEN = re.compile(r"\b[Ii]ssues? #?\d+(?![\d-])|\bsession \d|\b(first|second|third|fourth|fifth|this|that|earlier) "
                            r"session\b|\bno GPU (was|is) lent|\bengineers?\b|\(items? \d")
CODE = [p for d in ("moe_rl", "kernels", "scripts", "tests", "configs", "examples", "csrc")
        for p in sorted((ROOT / d).rglob("*")) if p.suffix in (".py", ".sh", ".yaml", ".cpp", ".h", ".cu")
        and p != Path(__file__).resolve()]


def test_code_comments_speak_of_the_product():
    assert len(CODE) > 100
    bad = [f"{rel(p)}:{n}: {line.strip()[:120]}" for p in CODE
           for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if CODE_FORBIDDEN.search(line)]
    assert not bad, "code that speaks of issues or of how the work went:\n" + "\n".join(bad)


# --- commands ------------------------------------------------------------------------------------
def commands(path: Path) -> list[tuple[int, str]]:
    """Shell commands the page shows in its fenced code blocks (lines joined at trailing backslashes), and in
    benchmarks.md's tables, that start with moe-rl, python or bash (elsewhere an inline code span is a name
    in prose, not a command to run)."""
    out, fenced, pending, start = [], False, "", 0
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            text = line.strip().removeprefix("$ ")
            if not pending:
                start = n
            if text.endswith("\\"):
                pending += text[:-1] + " "
                continue
            out.append((start, pending + text))
            pending = ""
        elif path == BENCHMARKS and line.startswith("|"):  # its tables' command column
            out += [(n, span.replace("\\|", "|")) for span in re.findall(r"`([^`]+)`", line)]
    found = []
    for n, text in out:
        for part in re.split(r"\s(?:&&|;|\|\|)\s", text):
            part = re.sub(r"^(?:[A-Z_]+=\S*\s+)+", lambda m: m.group(0) if "PYTHONPATH" in m.group(0) else "",
                          part.strip())
            if re.match(r"(PYTHONPATH=\S+\s+)?(moe-rl|python3? |bash scripts/)", part):
                found.append((n, part))
    return found


class _Parsed(Exception):
    def __init__(self, ns):
        self.ns = ns


def _stop_after_parsing(monkeypatch):
    """argparse parses as usual (an unknown flag still exits 2), then the command stops."""
    for name in ("parse_args", "parse_intermixed_args"):
        orig = getattr(argparse.ArgumentParser, name)

        def parsed(self, *a, _orig=orig, **kw):
            raise _Parsed(_orig(self, *a, **kw))

        monkeypatch.setattr(argparse.ArgumentParser, name, parsed)


def _expand(cmd: str) -> list[str]:
    """A command with `a|b` or `{a,b}` alternatives -> one command per alternative (first such token)."""
    toks = cmd.split(" ")
    for i, t in enumerate(toks):
        m = re.fullmatch(r"(.*?)\{([\w,-]+)\}(.*)", t)
        if m:
            return [x for alt in m.group(2).split(",") for x in _expand(" ".join(
                [*toks[:i], m.group(1) + alt + m.group(3), *toks[i + 1:]]))]
        if "|" in t and not t.startswith("|") and "=[" not in t:
            head, _, alts = t.rpartition("=") if "=" in t else ("", "", t)
            return [x for alt in alts.split("|") for x in _expand(" ".join(
                [*toks[:i], (head + "=" if head else "") + alt, *toks[i + 1:]]))]
    return [cmd]


PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$|^\.\.\.$|[<>$]")


def _check(cmd: str, monkeypatch, parse: bool) -> str | None:
    """None if ``cmd`` names what exists (a moe-rl command, a module, a script; a config that loads with its
    overrides), else why not; with ``parse`` also that its arguments parse."""
    cmd = re.sub(r"(?<=\s)\[[^\]=]*\]|(?<=\s)\[[^\]]*\.\.\.\]", "", cmd)  # optional: [--json], [key.sub=value ...]
    cmd = cmd.replace(" CONFIG", " configs/tiny.yaml")
    try:
        argv = shlex.split(cmd, comments=True)
    except ValueError as e:
        return f"does not split: {e}"
    env = {}
    while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):
        k, _, v = argv.pop(0).partition("=")
        env[k] = v
    if "PYTHONPATH" in env:
        for d in env["PYTHONPATH"].split(":"):
            monkeypatch.syspath_prepend(str(ROOT / d))
    rough = any(PLACEHOLDER.search(t) for t in argv)
    prog, args = argv[0], argv[1:]
    if prog == "bash":
        script = ROOT / args[0]
        if not script.exists():
            return f"{args[0]}: no such script"
        if script.name == "gpu_round.sh" and len(args) > 1 and not rough:
            text = script.read_text()
            stages = {"fetch", "all"} | {s for m in re.findall(r"_STAGES=\(([^)]*)\)", text) for s in m.split()}
            if args[1] not in stages:
                return f"gpu_round.sh has no stage {args[1]!r}"
        return None
    if prog.startswith("python"):
        if args[:1] in (["-c"], ["-"]):  # an inline program
            return None
        if args[:1] == ["-m"]:
            module, args = args[1], args[2:]
            root = module.split(".")[0]
            # another project's module: that it is installed (finding a submodule would import the package)
            if importlib.util.find_spec(module if root in ("moe_rl", "kernels", "tests") else root) is None:
                return f"no module {module}"
            if rough or not parse:
                return None
            main = getattr(importlib.import_module(module), "main", None)
            return _run(lambda: main(args), monkeypatch) if main else None
        script = ROOT / args[0]
        if not script.exists():
            return f"{args[0]}: no such script"
        if rough or not parse or "argparse" not in script.read_text():
            return None
        monkeypatch.setattr(sys, "argv", [str(script), *args[1:]])
        return _run(lambda: runpy.run_path(str(script), run_name="__main__"), monkeypatch)
    # moe-rl
    if not args or args[0] in ("--version", "--help"):
        return None
    sub = args[0]
    if sub not in cli.COMMANDS:
        return f"moe-rl has no command {sub!r}"
    if rough:
        try:
            rc = cli.main([sub, "--help"])
        except SystemExit as e:  # argparse's --help
            rc = e.code
        return None if rc in (0, None) else f"moe-rl {sub} --help fails"
    if sub in ("validate", "train"):
        if len(args) < 2:
            return "no config"
        load_config(args[1], args[2:])
        return None
    return _run(lambda: cli.main(args), monkeypatch) if parse else None


def _run(fn, monkeypatch) -> str | None:
    _stop_after_parsing(monkeypatch)
    try:
        rc = fn()
    except _Parsed as p:
        overrides = getattr(p.ns, "overrides", None)
        config = getattr(p.ns, "config", None)
        if isinstance(config, str) and config.endswith(".yaml") or overrides:
            load_config(config if isinstance(config, str) and config.endswith(".yaml") else "configs/tiny.yaml",
                        list(overrides or []))
        return None
    except SystemExit as e:
        return None if e.code in (0, None) else f"exit {e.code}"
    return None if rc in (0, None) else f"returned {rc} before parsing its arguments"


BENCHMARKS = ROOT / "docs" / "benchmarks.md"
# the pages whose commands are parsed in full (argparse run up to its result); elsewhere a command is checked
# for what it names (the moe-rl command, module or script; validate/train: the config with its overrides)
PARSED = {ROOT / "README.md", ROOT / "docs" / "README.md", ROOT / "docs" / "benchmarks.md"}
ALL_COMMANDS = [(doc, n, c) for doc in DOCS for n, c in commands(doc)]


def test_the_docs_show_commands():
    readme = [c for d, _, c in ALL_COMMANDS if d == ROOT / "README.md"]
    assert any(c.startswith("moe-rl train configs/gpu_1x.yaml") for c in readme) and len(readme) > 5
    assert len(ALL_COMMANDS) > 50


@pytest.mark.parametrize("doc", DOCS, ids=rel)
def test_every_command_parses(doc, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    bad = []
    for n, cmd in [(n, c) for d, n, c in ALL_COMMANDS if d == doc]:
        for one in _expand(cmd):
            with monkeypatch.context() as m:
                try:
                    why = _check(one, m, parse=doc in PARSED)
                except Exception as e:  # a config error names its key
                    why = f"{type(e).__name__}: {e}"
            if why:
                bad.append(f"{rel(doc)}:{n}: {one}\n    {why}")
    capsys.readouterr()
    assert not bad, "\n".join(bad)
