"""moe_rl's modules import one another without a circle (function-level imports included)."""
import ast
from pathlib import Path

import moe_rl

ROOT = Path(moe_rl.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names}  # `from pkg import module`
    return out


def import_graph(under: str) -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py") if "kernels" not in p.parts}
    graph = {}
    for name, path in files.items():
        if name.startswith(under):
            graph[name] = {m for m in _imports(path, name) if m in files and m != name and m.startswith(under)}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (c := visit(m)):
                return c
        state[n] = 2
        stack.pop()
        return None

    for n in sorted(graph):
        if n not in state and (c := visit(n)):
            return c
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_train_backends_import_without_a_circle():
    graph = import_graph("moe_rl.train")
    assert "moe_rl.train.megatron.backend" in graph and "moe_rl.train.factory" in graph
    assert find_cycle(graph) is None, find_cycle(graph)


def test_the_package_imports_without_a_circle():
    """The whole package, the rollout's episode runner included: it takes the request
    conventions from their own modules, not from the manager that imports it."""
    graph = import_graph("moe_rl")
    assert "moe_rl.rollout.manager" not in graph["moe_rl.rollout.episode"]
    assert find_cycle(graph) is None, find_cycle(graph)


# loaded by the worker ranks, never by the `moe-rl train` launcher (it only needs torch for torchrun)
WORKER_ONLY = ("triton", "moe_rl.kernels", "moe_rl.model.ops", "moe_rl.model.transformer", "moe_rl.model.attention.mha",
               "aiohttp", "transformers", "torch._dynamo", "matplotlib")


def test_the_launcher_loads_no_model_code():
    """What `moe-rl train` does before it starts torchrun (read and check the config, its
    dataset and placement) loads neither the model code nor its Triton kernels: each costs the
    launcher start-up time (and exit time: more objects to free) on every run."""
    import subprocess
    import sys

    code = ("import sys, torch.distributed.run; from moe_rl.cli import _load; from moe_rl.tasks import task_from_config; "
            "from moe_rl.placement import check_before_launch; from moe_rl.dist import Layout; "
            "cfg = _load(['configs/tiny.yaml']); task_from_config(cfg); check_before_launch(cfg, 0, None); "
            "Layout.from_config(cfg); print(sorted(m for m in sys.argv[1:] if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, *WORKER_ONLY], capture_output=True, text=True,
                         cwd=ROOT.parent, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_reading_a_config_loads_no_torch():
    """`moe-rl validate` and `moe-rl keys` (and a launcher refusing a bad config) read configs
    only: importing torch would be most of their time."""
    import subprocess
    import sys

    code = ("import sys; from moe_rl.cli import main; main(['validate', 'configs/tiny.yaml']); main(['keys', 'model']); "
            "print('loaded:', sorted(m for m in ('torch', 'triton', 'moe_rl.model.ops') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT.parent, check=True)
    assert out.stdout.splitlines()[-1] == "loaded: []", out.stdout[-2000:] + out.stderr
