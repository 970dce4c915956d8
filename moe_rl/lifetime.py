"""Processes that do not outlive their parent: Linux's parent-death signal.

torchrun starts each worker in a session of its own (``start_new_session``) and stops them
only when it is itself alive to do so (a SIGTERM or SIGINT it can catch); a launcher killed by
SIGKILL (a scheduler, the OOM killer) left its workers running on, writing into the run
directory. ``die_with_parent`` asks the kernel to SIGKILL the calling process as soon as its
parent exits, however the parent dies.

The signal fires when the *thread* that created the process exits, not the whole parent
process: the launchers here (torchrun's agent, ``moe-rl sweep``'s runs) start their children
from a thread that lives as long as the child (the agent's main thread; a sweep thread blocked
in ``subprocess.run``). The setting survives ``exec`` and is not inherited by children.

``exit_without_teardown`` ends a command's process once it is done, without the interpreter's
teardown (the launcher's and the worker ranks' last line).
"""
from __future__ import annotations

import atexit
import ctypes
import logging
import os
import signal
import sys
import threading

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# set by a parent (moe-rl sweep) for a `moe-rl train` child that must end with it: the parent's pid
PARENT_ENV = "MOE_RL_DIE_WITH_PARENT"


def die_with_parent(expected_parent: int | None = None, sig: int = signal.SIGKILL) -> bool:
    """Sends this process ``sig`` when its parent exits. ``expected_parent``: the pid the parent
    must have; if it is already gone (reparented before this call) ``sig`` comes at once. False
    (and a log line) where the kernel has no such signal (not Linux)."""
    if not sys.platform.startswith("linux"):
        log.warning("not Linux: this process will not be stopped when its launcher dies")
        return False
    parent = os.getppid() if expected_parent is None else expected_parent
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(int(sig)), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if os.getppid() != parent:  # the parent died before the prctl took effect
        os.kill(os.getpid(), sig)
    return True


def exit_without_teardown(code: int | None):
    """Ends this process with ``code`` (None: 0) as ``sys.exit`` would, less the interpreter's
    teardown.

    What a normal exit does that anyone sees still happens, in its order: non-daemon threads
    and thread pools' workers are joined, the atexit handlers run (logging's flush, trackers,
    ``weakref.finalize``, multiprocessing's children), stdout and stderr are flushed. Then
    ``os._exit``: the
    teardown it skips frees every object one by one and runs native libraries' exit hooks, and
    with torch loaded that is most of a process's exit (1.3 s of a trainer rank's, 0.5 s of the
    launcher's, on 2 CPU cores: docs/benchmarks.md). The OS releases the files, locks and
    sockets the process still holds. Only for a process's last line: nothing runs after it.
    """
    # the first steps of CPython's own exit (Py_FinalizeEx), by the functions it calls: join the
    # non-daemon threads and run threading's exit hooks (concurrent.futures' pools finish their
    # work), then the atexit handlers
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: as at a normal exit, nothing more to write
            pass
    os._exit(code or 0)
