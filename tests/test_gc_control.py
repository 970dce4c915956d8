"""gc_control: overlapping pauses restore the collector's state once, when the last one ends."""
import gc
import threading

from moe_rl.gc_control import paused_gc


def test_paused_gc_overlapping_blocks_restore_once():
    assert gc.isenabled()
    a, b = paused_gc(), paused_gc()
    a.__enter__()
    assert not gc.isenabled()
    b.__enter__()
    a.__exit__(None, None, None)  # the first one ends while the second is open
    assert not gc.isenabled()
    b.__exit__(None, None, None)
    assert gc.isenabled()


def test_paused_gc_keeps_a_disabled_collector_disabled():
    gc.disable()
    try:
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_paused_gc_across_threads():
    inside, release = threading.Event(), threading.Event()

    def other():
        with paused_gc():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=other)
    t.start()
    inside.wait(10)
    with paused_gc():
        pass
    assert not gc.isenabled()  # the other thread's block is still open
    release.set()
    t.join(10)
    assert gc.isenabled()
