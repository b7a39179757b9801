"""The worker's main-thread calls (worker/mainthread.py): a handed-over call runs on the serving thread and
returns its result or raises its exception there; nobody serving, or the serving thread itself, runs it
inline; calls left when the worker stops are refused, none hangs."""

from __future__ import annotations

import threading
import time

import pytest

from draftrelay.worker.mainthread import MainThreadCalls, WorkerStopping


def serving(calls: MainThreadCalls):
    stop = threading.Event()
    th = threading.Thread(target=calls.serve, args=(stop,), name="serving")
    th.start()
    deadline = time.monotonic() + 5
    while not calls._serving and time.monotonic() < deadline:
        time.sleep(0.001)
    return stop, th


def test_inline_while_nobody_serves():
    calls = MainThreadCalls()
    assert calls.call(lambda a, b: (threading.current_thread().name, a + b), 2, 3) == (
        threading.current_thread().name, 5)


def test_handed_over_calls_run_on_the_serving_thread_and_keep_their_exceptions():
    calls = MainThreadCalls()
    stop, th = serving(calls)
    try:
        got = []

        def client(i: int) -> None:
            got.append(calls.call(lambda: (threading.current_thread().name, i)))

        clients = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for c in clients:
            c.start()
        for c in clients:
            c.join(5)
        assert sorted(got) == [("serving", i) for i in range(8)]

        def boom():
            raise ValueError("drafter failed")

        with pytest.raises(ValueError, match="drafter failed"):
            calls.call(boom)
        # a call made on the serving thread itself runs inline (no wait on its own queue)
        assert calls.call(lambda: calls.call(lambda: threading.current_thread().name)) == "serving"
    finally:
        stop.set()
        calls.wake()
        th.join(5)
    assert not th.is_alive()


def test_calls_left_at_the_stop_are_refused_and_later_ones_run_inline():
    calls = MainThreadCalls()
    stop, th = serving(calls)
    started, release = threading.Event(), threading.Event()
    results: dict[str, object] = {}

    def long_call():
        started.set()
        release.wait(5)
        return "long done"

    def client(name, fn):
        try:
            results[name] = calls.call(fn)
        except WorkerStopping as exc:
            results[name] = exc

    a = threading.Thread(target=client, args=("a", long_call))
    a.start()
    assert started.wait(5)
    b = threading.Thread(target=client, args=("b", lambda: "queued"))
    b.start()
    time.sleep(0.05)  # b is queued behind a
    stop.set()
    release.set()
    a.join(5)
    b.join(5)
    th.join(5)
    assert results["a"] == "long done"
    assert isinstance(results["b"], WorkerStopping)
    assert calls.call(lambda: threading.current_thread().name) == threading.current_thread().name
