"""Keep Python's cyclic collector out of the weight sync's way.

A weight-sync request carries one name and one shape list per tensor (SGLang's protocol):
18,000 small lists in a 30B-A3B bucket. Decoding them sets off collections, and the
occasional full one walks every object the process holds: with a model loaded (230,000
tracked objects) a full collection took 73 ms, and unpickling one such request 20 ms.
After ``gc.freeze()`` the same collection took 0.1 ms and the unpickling 3.9 ms (2.6 ms with
no collector at all). SGLang freezes its processes' heaps after start-up for the same reason.

- ``freeze_gc()``: once the model is built; what is alive then is never collected afterwards.
  An agent worker does the same once it has imported the openai SDK (~90,000 objects that
  its young collections kept promoting and its full ones kept walking).
- ``paused_gc()``: around decoding and handling one such request. Its lists are freed before
  the block ends, so the collector's allocation count is back where it was and no collection
  is owed afterwards (measured: a 1-2 ms young collection per request, and every few syncs a
  13 ms full one over what was made since the freeze).
"""
from __future__ import annotations

import atexit
import contextlib
import gc
import threading


def freeze_gc() -> None:
    gc.collect()  # garbage of the start-up is freed, not frozen
    gc.freeze()
    # frozen objects are skipped by the collection at exit too: native extensions (Triton's
    # nanobind) would report them as leaked
    atexit.register(gc.unfreeze)


_pause_lock = threading.Lock()
_pauses = 0
_resume = False  # whether the collector was on when the first open pause began


@contextlib.contextmanager
def paused_gc():
    """No collection inside the block; blocks may overlap (threads, coroutines): the collector
    comes back on when the last one ends, if it was on when the first began."""
    global _pauses, _resume
    with _pause_lock:
        if _pauses == 0:
            _resume = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _pause_lock:
            _pauses -= 1
            if _pauses == 0 and _resume:
                gc.enable()
