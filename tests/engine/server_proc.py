"""Starts ``moe-rl serve`` as a subprocess on a free port (one torch thread) for tests."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "tiny.yaml")
# 3 layers with a dense one in the middle, so routed_experts rows of dense layers are exercised
OVERRIDES = ["model.num_hidden_layers=3", "model.mlp_only_layers=[1]", "model.max_position_embeddings=1024",
             "engine.max_context=1024", "engine.threads=1", "engine.max_running_requests=16"]


class ServerProc:
    def __init__(self, overrides=(), api_key: str | None = None, timeout: float = 90.0):
        cmd = [sys.executable, "-m", "moe_rl.cli", "serve", CONFIG, "--port", "0", *OVERRIDES, *overrides]
        if api_key:
            cmd += ["--api-key", api_key]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._url: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()
        if not self._ready.wait(timeout) or self._url is None:
            self.stop()
            raise RuntimeError("engine server did not start:\n" + "".join(self.lines[-40:]))
        self.url = self._url

    def _drain(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.search(r"listening on (http://\S+)", line)
            if m and self._url is None:
                self._url = m.group(1)
                self._ready.set()
        self._ready.set()  # exited

    def kill(self):
        self.proc.kill()
        self.proc.wait(10)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def wait_for(pred, timeout: float = 30.0, interval: float = 0.02):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return False
