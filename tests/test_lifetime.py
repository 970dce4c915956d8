"""moe_rl.lifetime: a process that asked to die with its parent is gone when the parent is."""
import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

CHILD = "from moe_rl.lifetime import die_with_parent; die_with_parent(); import time; print('ready', flush=True); time.sleep(600)"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("from_thread", [False, True])
def test_the_child_dies_with_its_parent(from_thread):
    """The parent (its own session, like torchrun's workers) starts the child from its main
    thread or from a thread that stays alive with it; SIGKILL of the parent takes the child."""
    start = f"subprocess.Popen([sys.executable, '-c', {CHILD!r}], stdout=w)"
    if from_thread:  # a sweep thread blocked on its child: the thread outlives the child's start
        start = f"threading.Thread(target=lambda: ({start}, time.sleep(600))).start()"
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import os, subprocess, sys, threading, time\nr, w = os.pipe()\n{start}\n"
                               f"print(os.read(r, 100).decode().strip(), flush=True)\ntime.sleep(600)"],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert parent.stdout.readline().strip() == "ready"
        child = [int(c) for t in os.listdir(f"/proc/{parent.pid}/task")
                 for c in open(f"/proc/{parent.pid}/task/{t}/children").read().split()]
        assert len(child) == 1
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        t0 = time.monotonic()
        while _alive(child[0]):
            assert time.monotonic() - t0 < 5, "the child outlived its parent by 5 s"
            time.sleep(0.02)
    finally:
        parent.kill()


def test_a_parent_already_gone_kills_at_once():
    code = "import os; from moe_rl.lifetime import die_with_parent; die_with_parent(os.getppid() + 10**7); print('alive')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == -signal.SIGKILL and "alive" not in r.stdout


EXITING = """
import atexit, sys, threading, time
from moe_rl.lifetime import exit_without_teardown

class Teardown:  # freed only by the interpreter's teardown
    def __del__(self):
        print("teardown", flush=True)

kept = Teardown()
out = open(sys.argv[1], "a")
def late():  # a non-daemon thread still working when the main thread is done
    time.sleep(0.3)
    out.write("thread ")
threading.Thread(target=late).start()
atexit.register(lambda: (out.write("atexit"), out.close()))
sys.stdout.write("buffered")  # no newline, no flush: written at the exit
exit_without_teardown(3)
"""


def test_exit_without_teardown_does_what_an_exit_does_but_the_teardown(tmp_path):
    """Its threads joined first, then the atexit handlers, stdout flushed, the exit code kept;
    only the interpreter's teardown (objects freed one by one: the __del__ here) is skipped."""
    log = tmp_path / "log"
    r = subprocess.run([sys.executable, "-c", EXITING, str(log)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 3, r.stderr
    assert r.stdout == "buffered"
    assert log.read_text() == "thread atexit"
    normal = subprocess.run([sys.executable, "-c", EXITING.replace("exit_without_teardown(3)", "sys.exit(3)"),
                             str(tmp_path / "log2")], capture_output=True, text=True, timeout=60)
    assert (normal.returncode, normal.stdout, (tmp_path / "log2").read_text()) == (3, "bufferedteardown\n", "thread atexit")
