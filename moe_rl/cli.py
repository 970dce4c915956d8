"""The ``moe-rl`` command line.

  moe-rl validate CONFIG [key=value ...]   print the resolved config, or exit 2 naming the bad key
  moe-rl train CONFIG [key=value ...]      launch the local torchrun world for CONFIG
  moe-rl keys [PREFIX ...]                 what each config key means: type, allowed values, default
  moe-rl serve CONFIG [--host H] [--port N] [--api-key K]   an embedded engine, SGLang's HTTP API
  moe-rl bench NAME [--json] [...]         microbenchmarks: %s
  moe-rl sweep CONFIG [--grid KEY=V1,V2 ...] [--seeds N] [--steps S] [--parallel P]
                                           arms x seeds, each a `moe-rl train` run; summary + plots
  moe-rl --version                         the installed version

Every config key, its type, default and meaning: docs/config.md (or `moe-rl keys PREFIX`).
"""
from __future__ import annotations

import importlib
import os
import sys

from . import __version__
from .config import ConfigError, dump_config, load_config

# bench name -> module with ``main(argv: list[str]) -> int``
BENCHES = {
    "logprobs": "moe_rl.kernels.bench.logprobs",
    "exact": "moe_rl.kernels.bench.exact",
    "gated-delta": "moe_rl.kernels.bench.gated_delta",
    "grouped-gemm": "moe_rl.kernels.bench.grouped_gemm",
    "replay": "moe_rl.bench.replay",
    "engine": "moe_rl.bench.engine",
    "sync": "moe_rl.bench.sync",
    "async": "moe_rl.bench.async_rl",
    "routing": "moe_rl.bench.routing",
    "on-policy": "moe_rl.bench.on_policy",
}
USAGE = (__doc__ or "") % ", ".join(BENCHES)
CONFIG_HELP = """CONFIG is an experiment YAML (configs/ has the shipped ones); each key=value overrides one key,
e.g. train.lr=3e-4 lora.rank=16 (a value is read as YAML: true, null, [a, b]).
Every key, its type, allowed values, default and meaning: docs/config.md, or `moe-rl keys PREFIX`."""
HELP = {
    "validate": "usage: moe-rl validate CONFIG [key=value ...]\n\nPrint the resolved config (and check that "
                "its plug-ins import), or exit 2 naming the bad key.\n\n" + CONFIG_HELP,
    "train": "usage: moe-rl train CONFIG [key=value ...]\n\nLaunch the local torchrun world for CONFIG. "
             "resume=true continues a run from its latest\ncheckpoint, overwrite_output_dir=true starts over "
             "(docs/run_safety.md).\n\n" + CONFIG_HELP,
}


def _wants_help(name: str, argv: list[str]) -> bool:
    if argv and argv[0] in ("-h", "--help"):
        print(HELP[name])
        return True
    return False


def _load(argv: list[str]):
    if not argv:
        raise ConfigError("a CONFIG file is required (moe-rl validate --help)")
    return load_config(argv[0], argv[1:])


def cmd_validate(argv: list[str]) -> int:
    if _wants_help("validate", argv):
        return 0
    cfg = _load(argv)
    from .tasks.plugins import check_plugins

    checked = check_plugins(cfg)  # plug-ins named by import path must import (PluginError otherwise)
    from .train.trackers import check_trackers

    check_trackers(cfg.logging)  # logging.wandb / logging.mlflow need their packages (ConfigError naming the extra)
    print(dump_config(cfg), end="")
    if checked:
        print("# plug-ins import: " + ", ".join(checked))
    return 0


def cmd_train(argv: list[str]) -> int:
    from .lifetime import PARENT_ENV, die_with_parent

    if _wants_help("train", argv):
        return 0
    if os.environ.get(PARENT_ENV):  # started by `moe-rl sweep`: the run ends with the sweep
        die_with_parent(int(os.environ[PARENT_ENV]))
    cfg = _load(argv)  # fail here, before any process starts, on a bad config ...
    from .rundir import RunDirError, lock_output_dir

    try:  # ... or on output_dir in use by another run (one run per directory: docs/run_safety.md) ...
        locks = lock_output_dir(cfg)  # held until the run ends
    except RunDirError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return _launch(cfg, argv)
    finally:
        for lock in locks:
            lock.release()


def _launch(cfg, argv: list[str]) -> int:
    """The rest of ``moe-rl train`` once output_dir is locked: checks, then the torchrun world."""
    from .rundir import LAUNCHER_ENV, RunDirError, prepare_output_dir
    from .tasks import DatasetError, task_from_config

    from .train.trackers import check_trackers

    check_trackers(cfg.logging)  # ... or a tracker whose package is missing (ConfigError naming the extra) ...
    try:
        task_from_config(cfg)  # ... or a bad dataset (reported with its file and line)
        if cfg.eval.data:
            from .rollout.evaluation import eval_task

            eval_task(cfg)  # ... or a bad held-out dataset
    except (DatasetError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import torch

    from .placement import check_before_launch

    gpus = torch.cuda.device_count() if cfg.train.device == "cuda" else 0
    check_before_launch(cfg, gpus, torch.cuda.get_device_properties(0).total_memory if gpus else None)
    from torch.distributed.run import main as torchrun

    nproc = cfg.pools.nproc_per_node or cfg.world_size
    if cfg.pools.nnodes > 1:
        raise ConfigError(
            f"pools.nnodes={cfg.pools.nnodes}: run `torchrun --nnodes {cfg.pools.nnodes} "
            f"--nproc-per-node {nproc} ... -m moe_rl.launch CONFIG` on every node"
        )
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from .dist import Layout

    try:  # no process of an earlier run left; a fresh start only with resume / overwrite_output_dir
        prepare_output_dir(cfg)
    except RunDirError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.environ[LAUNCHER_ENV] = str(os.getpid())  # the workers: their parent holds the claim
    try:
        torchrun(["--standalone", "--nnodes", "1", "--nproc-per-node", str(nproc), "-m", "moe_rl.launch", *argv])
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        role = "trainer" if Layout.from_config(cfg).role(rank) == "trainer" else "engine host"
        how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        print(f"error: the run failed: rank {rank} ({role}) ended first, with {how}; the other ranks were "
              f"stopped. Its log is above; resume=true continues from the latest checkpoint.", file=sys.stderr)
        for r, f in sorted(e.failures.items()):  # what each rank that failed (not killed) recorded
            if f.error_file and f.error_file != "<N/A>":  # torch elastic's mark of a rank without an error file
                why = f.message.get("message", f.message) if isinstance(f.message, dict) else f.message
                r_role = "trainer" if Layout.from_config(cfg).role(r) == "trainer" else "engine host"
                print(f"error: rank {r} ({r_role}): {why}", file=sys.stderr)
        return 1
    except Exception as e:  # torchrun's agent itself failed (its traceback is above); its workers are stopped
        print(f"error: the run failed: torchrun's agent raised {type(e).__name__}: {e}; the ranks' logs are "
              f"above; resume=true continues from the latest checkpoint.", file=sys.stderr)
        return 1
    return 0


def cmd_serve(argv: list[str]) -> int:
    from .engine.server import serve_main

    return int(serve_main(argv) or 0)


def cmd_bench(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHES:
        print("usage: moe-rl bench {%s} [--json] [options]" % ",".join(BENCHES), file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(BENCHES[argv[0]])
    return int(module.main(argv[1:]) or 0)


def cmd_sweep(argv: list[str]) -> int:
    from .experiments.sweep import main as sweep_main

    return sweep_main(argv)


def cmd_keys(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print("usage: moe-rl keys [PREFIX ...]\n\nEvery config key under PREFIX (a section such as train, or a key "
              "such as train.lr; all keys without one): its type, allowed values, default and meaning, as in "
              "docs/config.md.")
        return 0
    from .config_doc import render_text

    try:
        print(render_text(argv), end="")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


COMMANDS = {"validate": cmd_validate, "train": cmd_train, "serve": cmd_serve, "bench": cmd_bench,
            "sweep": cmd_sweep, "keys": cmd_keys}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-V", "--version"):
        print(f"moe-rl {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(USAGE, file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run() -> None:
    """The ``moe-rl`` command (and ``python -m moe_rl.cli``): ``main``, then the process ends
    without the interpreter's teardown, half a second of the launcher's exit with torch loaded
    (moe_rl.lifetime.exit_without_teardown). ``main`` is what to call from Python."""
    from .lifetime import exit_without_teardown

    exit_without_teardown(main())


if __name__ == "__main__":
    run()
