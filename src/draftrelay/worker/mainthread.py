"""A CPU drafter's steps on the worker process's main thread.

The worker serves each connection on its own thread, and a STEP used to run its forwards there. On a
CPU that costs: torch's intra-op work runs on an OpenMP team per calling thread, and a process whose
main thread already made one (the model load, the warm-up) runs every forward slower once a second
thread makes another (two teams on the same cores; libgomp throttles its spin-wait when there are more
OpenMP threads than CPUs). The reference 0.5B drafter's rounds cost about 121 ms a draft with the STEP
on the connection's thread and about 69 ms with it on the main thread (docs/ENGINE.md, "A draft on the
CPU"). So the main thread,
which otherwise only waits for the stop, runs the drafter's steps: a connection thread hands the call
over and waits for its result (a queue and an event: microseconds against a draft's tens of ms).

`MainThreadCalls.call` runs the function inline when called on the main thread itself or while nobody
serves (tests, a drafter used outside a worker), so a drafter works the same either way.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

SLICE_S = 0.5  # the serving loop re-checks its stop event this often while idle


class WorkerStopping(RuntimeError):
    """The worker stopped before a handed-over call ran."""


class MainThreadCalls:
    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._mu = threading.Lock()
        self._serving = False
        self._owner: int | None = None

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the serving thread (inline when this is that thread, or none serves); its result
        or its exception."""
        box: list = [None, None]
        done = threading.Event()
        with self._mu:
            if not self._serving or threading.get_ident() == self._owner:
                handed = False
            else:
                self._q.put((fn, args, box, done))
                handed = True
        if not handed:
            return fn(*args)
        done.wait()
        if box[1] is not None:
            raise box[1]
        return box[0]

    def serve(self, stop: threading.Event) -> None:
        """Run handed-over calls on this thread until `stop` is set; calls still queued then fail with
        WorkerStopping (their connections are closing)."""
        with self._mu:
            self._serving, self._owner = True, threading.get_ident()
        try:
            while not stop.is_set():
                try:
                    item = self._q.get(timeout=SLICE_S)
                except queue.Empty:
                    continue
                if item is not None:
                    self._run(item)
        finally:
            with self._mu:
                self._serving, self._owner = False, None
            while True:  # nothing enters the queue now: what is left is refused
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[2][1] = WorkerStopping("the worker is stopping")
                    item[3].set()

    def wake(self) -> None:
        """Let a waiting `serve` see its stop event at once."""
        self._q.put(None)

    @staticmethod
    def _run(item) -> None:
        fn, args, box, done = item
        try:
            box[0] = fn(*args)
        except BaseException as exc:  # the caller's thread re-raises it
            box[1] = exc
        finally:
            done.set()
