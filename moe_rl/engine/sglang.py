"""Launching a real SGLang server for the rollout pool (``engine.kind: sglang``).

``sglang_command`` builds the ``python -m sglang.launch_server`` command line from the
config's ``engine`` section; ``moe-rl serve CONFIG`` execs it when ``engine.kind`` is
``sglang`` (``--dry-run`` prints it). The flags that matter to moe-rl:

* ``--enable-return-routed-experts``: SGLang records the routed experts (R3); requests still
  ask for them with ``return_routed_experts: true``;
* ``--skip-tokenizer-init``: token ids in, token ids out, as the stack sends them;
* ``--ep-size`` / ``--tp-size``: expert (and tensor) parallelism over the server's GPUs;
* ``--weight-version``: the version reported before the first update (``engine.weight_version``).
* ``--max-queued-requests``: past it a request is refused with 503 (``engine.max_waiting_requests``).
"""
from __future__ import annotations

import shlex
import sys


def sglang_command(cfg, *, host: str | None = None, port: int | None = None, python: str | None = None) -> list[str]:
    """The command that starts SGLang for ``cfg`` (an ``ExperimentConfig``)."""
    e = cfg.engine
    model_path = e.sglang_model_path or cfg.model.path
    if not model_path:
        raise ValueError("engine.sglang_model_path (or model.path) must name the HF checkpoint SGLang serves")
    port = e.port if port is None else port
    if not port:
        raise ValueError("engine.port: SGLang needs a fixed port (0 is only for the embedded engine)")
    cmd = [
        python or sys.executable, "-m", "sglang.launch_server",
        "--model-path", model_path,
        "--host", host or e.host,
        "--port", str(port),
        "--tp-size", str(e.sglang_tp_size),
        "--ep-size", str(e.sglang_ep_size),
        "--dtype", e.dtype,
        "--context-length", str(e.max_context),
        "--max-running-requests", str(e.max_running_requests),
        "--weight-version", e.weight_version,
        "--enable-return-routed-experts",
        "--skip-tokenizer-init",
    ]
    if e.max_waiting_requests is not None:
        cmd += ["--max-queued-requests", str(e.max_waiting_requests)]
    if e.api_key:
        cmd += ["--api-key", e.api_key]
    return cmd + list(e.sglang_extra_args)


def format_command(cmd: list[str]) -> str:
    return shlex.join(cmd)
