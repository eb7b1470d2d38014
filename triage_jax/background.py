"""Compiles on background threads that a process exiting stops and joins.

The engine compiles decode rounds ahead and the trainer compiles the learner's programs while the rollout
generates, each on a daemon thread. A thread still inside XLA's compiler when the interpreter finalizes aborts
the process (measured: rc 134), so at exit every such thread finishes the compile under way, and the work it has
queued checks `stopping()` before starting another.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import threading
from typing import Callable, Sequence

_STOP = threading.Event()
_THREADS: list[threading.Thread] = []
_LOCK = threading.Lock()
_REGISTERED = False  # the exit handler


def stopping() -> bool:
    """True once the process is exiting: queued compiles should not start."""
    return _STOP.is_set()


def _stop_and_join() -> None:
    _STOP.set()
    with _LOCK:
        threads = list(_THREADS)
    for t in threads:
        t.join()


def start(thread: threading.Thread) -> None:
    """Start a daemon thread that the process joins at exit (after `stopping()` turns true)."""
    global _REGISTERED
    with _LOCK:
        if not _REGISTERED:
            # Registered after JAX's own exit handlers, so it runs before them (atexit runs last-in first-out).
            atexit.register(_stop_and_join)
            _REGISTERED = True
        _THREADS[:] = [t for t in _THREADS if t.is_alive()] + [thread]
    thread.start()


def run(thunks: Sequence[Callable[[], object]], name: str) -> list[concurrent.futures.Future]:
    """Each thunk on a background thread of its own; a future per thunk (its result or exception). A thunk not
    started when the process begins exiting is not run (its future raises RuntimeError)."""
    futures = []
    for k, thunk in enumerate(thunks):
        future: concurrent.futures.Future = concurrent.futures.Future()

        def work(thunk=thunk, future=future):
            if stopping():
                future.set_exception(RuntimeError("background compile stopped at exit"))
                return
            try:
                future.set_result(thunk())
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(e)

        start(threading.Thread(target=work, name=f"{name}-{k}", daemon=True))
        futures.append(future)
    return futures
