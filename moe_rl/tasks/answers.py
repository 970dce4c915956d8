"""Answer checking for math-style tasks: HF's math-verify, bounded in time.

``reference_answer(raw)``: the ground truth from a dataset's answer field. A GSM8K-style
worked solution (``... #### 42``) gives what follows the last ``####``; a MATH-style solution
with a ``\\boxed{}`` gives the boxed content; anything else is used as it is.

``math_reward(response_text, reference)``: 1.0 when math-verify finds the response's answer
(its ``\\boxed{}``, else its last expression) equal to the reference, else 0.0. math-verify
parses LaTeX and plain expressions into sympy and compares them symbolically and numerically:
``2\\sqrt{2}`` equals ``\\sqrt{8}``, ``\\{1,2\\}`` equals ``\\{2,1\\}``, ``0.50`` equals
``\\frac12``, ``10\\%`` equals ``0.1``.

Time bound: sympy can take without end on a pathological answer (``9^{9^{9^{9}}}``), and
math-verify's own timeout is SIGALRM, which works only on a process's main thread, while
rewards run in the rollout manager's worker threads. So every check runs in a worker process
(``verify_worker.py``, one per concurrent caller, kept between calls) and the caller waits until
the worker has spent ``timeout_s`` of CPU time on it (CPU time, so that a machine short of
cores does not make correct answers late; ``WALL_FACTOR`` x that in wall-clock time at most): a
worker that is late is killed, the answer scores 0.0 (math-verify's own verdict on a timeout)
with a warning, and the next call starts a fresh worker.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

VERIFY_TIMEOUT_S = 5.0  # per answer, as math-verify's own default
_WORKER = Path(__file__).with_name("verify_worker.py")
_START_TIMEOUT_S = 120.0  # importing sympy on a loaded machine
WALL_FACTOR = 10.0  # a check's wall-clock bound, in units of its CPU-time bound (a worker stuck without using CPU)
_POLL_S = 0.05  # how often a waiting caller reads the worker's CPU time
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` with balanced braces, or None."""
    found = None
    for m in _BOXED.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            found = text[m.end() : i - 1]
    return found


def reference_answer(raw: str) -> str:
    if "####" in raw:
        return raw.rsplit("####", 1)[1].strip()
    boxed = last_boxed(raw)
    return boxed.strip() if boxed is not None else raw.strip()


class VerifierError(RuntimeError):
    """math-verify raised on an answer, or its worker process could not run."""


class _Worker:
    """One ``verify_worker.py`` process and its pipes."""

    def __init__(self):
        try:
            import math_verify  # noqa: F401  (a clear error here, not a dead worker later)
        except ImportError as e:
            raise VerifierError("the math reward needs math-verify: pip install 'math-verify>=0.8' "
                                "(a dependency of moe-rl; reinstall with scripts/install.sh)") from e
        self.proc = subprocess.Popen([sys.executable, str(_WORKER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        if self._read(_START_TIMEOUT_S) != {"ready": True}:
            self.kill()
            raise VerifierError(f"math-verify worker ({_WORKER}) did not start within {_START_TIMEOUT_S:g} s")

    def _read(self, timeout_s: float) -> dict | None:
        """The next reply line, or None when none comes within ``timeout_s`` (or the worker died)."""
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        return json.loads(line) if line else None

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the worker has used: /proc/<pid>/stat, fields 14 and 15."""
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # it has exited
            return float("inf")
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK

    def ask(self, response: str, reference: str, timeout_s: float) -> dict | None:
        """The worker's reply, or None once it has spent ``timeout_s`` of CPU time on the request
        without one (or WALL_FACTOR x that in wall-clock time, or it died). CPU time, not wall
        time: a machine short of cores slows a worker down without making its answer late."""
        try:
            self.proc.stdin.write(json.dumps({"response": response, "reference": reference}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return None
        cpu0, wall_end = self.cpu_s(), time.monotonic() + WALL_FACTOR * timeout_s
        while True:
            reply = self._read(_POLL_S)
            if reply is not None or self.proc.poll() is not None:
                return reply
            if self.cpu_s() - cpu0 > timeout_s or time.monotonic() > wall_end:
                return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class MathVerifier:
    """math-verify in worker processes, each answer bounded by a deadline (module docstring).
    Thread-safe: a caller takes an idle worker (or starts one), so there are as many workers as
    callers at once, and gives it back after a timely answer."""

    def __init__(self):
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()
        self.timeouts = 0  # answers that ran past their deadline (their worker was killed)

    def correct(self, response: str, reference: str, timeout_s: float = VERIFY_TIMEOUT_S) -> bool:
        for attempt in range(2):  # a worker found dead (killed from outside) is replaced once
            with self._lock:
                w = self._idle.pop() if self._idle else None
            w = w or _Worker()
            reply = w.ask(response, reference, timeout_s)
            if reply is not None:
                with self._lock:
                    self._idle.append(w)
                if "error" in reply:
                    raise VerifierError(f"math-verify raised: {reply['error']}")
                return bool(reply["correct"])
            late = w.proc.poll() is None  # alive but silent: past the deadline
            w.kill()
            if late:
                self.timeouts += 1
                log.warning("math-verify gave no verdict within %g s of CPU time on a response (%d chars, ends %r) "
                            "against reference %r: scored 0; its worker was killed and is replaced", timeout_s,
                            len(response), response[-60:], reference[:60])
                return False
        raise VerifierError("math-verify worker died twice in a row on one answer")

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for w in idle:
            w.kill()


_verifier: MathVerifier | None = None  # one pool per process, shared by every math_reward caller
_verifier_lock = threading.Lock()


def default_verifier() -> MathVerifier:
    global _verifier
    with _verifier_lock:
        if _verifier is None:
            _verifier = MathVerifier()
            atexit.register(_verifier.close)
        return _verifier


def math_reward(response_text: str, reference: str, *, timeout_s: float = VERIFY_TIMEOUT_S) -> float:
    """1.0 when the response's answer equals ``reference`` (already a reference answer, see
    :func:`reference_answer`) by math-verify, else 0.0 (also when no answer is found, or
    when math-verify gives no verdict within ``timeout_s`` of CPU time). Safe to call from any thread."""
    if not response_text.strip():
        return 0.0
    return 1.0 if default_verifier().correct(response_text, reference, timeout_s) else 0.0
