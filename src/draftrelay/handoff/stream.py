"""Engine-side stream operations, behind one interface.

A round on the engine side is five ordered operations on the engine's stream (a round packed on the
host may have its first two done by the engine thread instead: `enqueue_reply`, HandoffConfig.host_staging):

    copy_in(slot, src)        rows + descriptor -> staging[slot]        (D2H on a GPU)
    write32(GATHERED, t)      tell the proxy the round is staged
    wait_geq32(RELEASED, t)   park until the proxy (or the watchdog) releases
    copy_out(slot, dst)       reply[slot] (claim word included) -> dst   (H2D on a GPU)
    write32(CONSUMED, t)      the acknowledgment: reply[slot] may be reused

The engine thread only enqueues them and returns. Backends:
  - EmulatedStream (here): a CPU thread that executes the queued ops in order, waiting with the same
    native wait the proxy uses, so the whole protocol runs and is tested without a GPU.
  - the CUDA backend (cuda_stream.py): the same ops as cuStreamWriteValue32 / cuStreamWaitValue32
    and async copies on the engine's torch stream.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np

from . import native
from .region import Region, W


class StreamStuck(RuntimeError):
    """A stream did not drain within its bound. Never free memory it may still use."""


class Event(ABC):
    @abstractmethod
    def query(self) -> bool: ...

    @abstractmethod
    def wait(self, timeout_s: float | None = None) -> bool: ...


class StreamOps(ABC):
    """The engine-side ops of the hand-off (see module docstring). All methods only enqueue."""

    name: str = "abstract"

    def __init__(self, region: Region) -> None:
        self.region = region

    @abstractmethod
    def copy_in(self, slot: int, src: Any) -> None: ...

    @abstractmethod
    def write32(self, off: int, value: int) -> None: ...

    @abstractmethod
    def wait_geq32(self, off: int, value: int) -> None: ...

    @abstractmethod
    def copy_out(self, slot: int, dst: Any) -> None: ...

    @abstractmethod
    def record(self) -> Event: ...

    def enqueue_round(self, slot: int, t: int, src: Any, dst: Any, offs: tuple[int, int, int],
                      on_resume: Callable[[], None] | None = None) -> Event:
        """A whole round, in order (offs: the gathered, released and consumed words); returns the event
        of its end. Backends may do it in fewer driver calls (cuda_stream: one kernel launch)."""
        gathered, released, consumed = offs
        self.copy_in(slot, src)
        self.write32(gathered, t)
        self.wait_geq32(released, t)
        if on_resume is not None:
            self.host_fn(on_resume)
        self.copy_out(slot, dst)
        self.write32(consumed, t)
        return self.record()

    def enqueue_reply(self, slot: int, t: int, dst: Any, offs: tuple[int, int, int], wait: bool = True) -> Event:
        """The stream's part of a round the engine thread staged and announced itself (rounds.py,
        HandoffConfig.host_staging): wait `released >= t` (unless `wait` is False: the host saw the
        release already), copy reply[slot] out, store `consumed = t`; returns the event of its end."""
        _, released, consumed = offs
        if wait:
            self.wait_geq32(released, t)
        self.copy_out(slot, dst)
        self.write32(consumed, t)
        return self.record()

    def bind_thread(self) -> None:
        """Make this stream usable from the calling thread (the CUDA backend sets its context)."""
        return None

    def new_reply_buffer(self) -> Any:
        """A destination for copy_out (the engine's device-side reply buffer)."""
        return np.zeros(self.region.layout.reply_size, np.uint8)

    def host_bytes(self, buf: Any) -> np.ndarray:
        """The bytes of a reply buffer on the host, once its round's event completed."""
        return buf

    def preload(self, fns) -> None:
        """Launch each callable once before the first round is armed (see cuda_stream.CudaStream.preload:
        a first-use kernel launched while the stream is parked is the lazy-loading trap)."""
        for fn in fns:
            fn()

    def host_fn(self, fn: Callable[[], None]) -> None:
        """Run fn on the host once the stream reaches this point (tests and benchmarks only)."""
        raise NotImplementedError

    @abstractmethod
    def drain(self, timeout_s: float) -> bool:
        """True once everything enqueued has executed; False if it did not within timeout_s."""

    @abstractmethod
    def close(self) -> None: ...


class ExpectedWait:
    """A blocking wait that spins only around the moment its word is expected to change: sleep until
    `window_us` before the running average of the last waits, then spin through 2 x window_us (then the
    caller's wait sleeps again, woken by the writer as before). On a machine with a core to spare the
    writer's store finds the reader awake, not asleep on an idle (on a VM: halted) core, at a spin of at
    most 2 x window_us per wait. Waits that ended early (the word changed while asleep) count too."""

    def __init__(self, window_us: int, alpha: float = 0.25) -> None:
        self.window_us, self.alpha = int(window_us), alpha
        self.mean_s: float | None = None

    def before(self, addr: int, v: int, abort_addr: int, slice_us: int, end: float | None) -> int:
        """Sleep on the word until the spin window opens (or it changes, or `end`); the spin to use next."""
        if self.mean_s is None:
            return 0
        lead_us = int(self.mean_s * 1e6) - self.window_us
        if end is not None:
            lead_us = min(lead_us, int((end - time.monotonic()) * 1e6))
        if lead_us > 0:
            native.wait_geq32_block(addr, v, 0, slice_us, lead_us, abort_addr)
        return 2 * self.window_us

    def observe(self, seconds: float) -> None:
        m = self.mean_s
        self.mean_s = seconds if m is None else m + self.alpha * (seconds - m)


class _ThreadEvent(Event):
    """Set by whoever runs the batch it ends: the stream thread, or (a deferred batch, see
    EmulatedStream.enqueue_reply) the thread that waits for it."""

    __slots__ = ("_flag", "_stream")

    def __init__(self, stream: EmulatedStream | None = None) -> None:
        self._flag = threading.Event()
        self._stream = stream  # set while the batch may be deferred

    def query(self) -> bool:
        if not self._flag.is_set() and self._stream is not None:
            self._stream._run_deferred(self, 0.0)
        return self._flag.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        if self._flag.is_set():
            return True
        if self._stream is not None:
            end = None if timeout_s is None else time.monotonic() + timeout_s
            if self._stream._run_deferred(self, timeout_s):
                return self._flag.is_set()
            if end is not None:  # handed to the stream thread: wait for it there, for what is left
                timeout_s = max(0.0, end - time.monotonic())
        return self._flag.wait(timeout_s)


class _Deferred:
    """A batch kept off the stream thread until someone waits for its event (or a later batch needs
    the thread): `cursor` ops of it have run; `running` while a waiter runs it."""

    __slots__ = ("ops", "event", "cursor", "running")

    def __init__(self, ops: list, event: _ThreadEvent) -> None:
        self.ops, self.event, self.cursor, self.running = ops, event, 0, False


_COPY_IN, _WRITE, _WAIT, _COPY_OUT, _RECORD, _HOST, _STOP = range(7)


class EmulatedStream(StreamOps):
    """A CPU thread standing in for a GPU stream: executes queued ops strictly in order.

    Like a real stream it never gives up on a wait by itself (the watchdog is what guarantees
    release); it only checks every `poll_ms` whether it is being closed, so close() cannot hang.

    wait "poll" spins spin_us, then naps nap_us between polls, as a GPU polls; "block" sleeps on the
    word (native.wait_geq32_block) and is woken by the release, taking no CPU while a round is out,
    and its own writes wake a proxy blocked on them. The words and their order are the same.

    inline (default: with wait "block"): the stream's part of a host-staged round (enqueue_reply: wait
    `released`, copy the reply out, store `consumed`) is not handed to the thread; the thread that
    waits for its event runs it, when nothing else is queued: the engine thread sleeps on `released`
    itself and copies the reply, instead of the stream thread waking, taking the GIL, copying and
    waking the engine thread in turn (two thread wake-ups and a GIL hand-over on every round's
    critical path, and CPU on a machine whose cores the target and the worker need). Ops still run
    strictly in order, one batch at a time: a batch enqueued after a deferred one hands the deferred
    one to the thread first (or, while a waiter runs it, waits until it is done).
    """

    name = "emulated"

    def __init__(self, region: Region, spin_us: int = 50, nap_us: int = 20, poll_ms: int = 50,
                 wait: str = "poll", slice_us: int = 2000, inline: bool | None = None,
                 spin_window_us: int = 0) -> None:
        super().__init__(region)
        self.window = ExpectedWait(spin_window_us) if spin_window_us > 0 and wait == "block" else None
        if wait not in native.WAITS:
            raise ValueError(f"EmulatedStream wait {wait!r}: expected one of {native.WAITS}")
        self.spin_us, self.nap_us, self.poll_us = spin_us, nap_us, poll_ms * 1000
        self.wait, self.slice_us = wait, slice_us
        self.inline = wait == "block" if inline is None else bool(inline)
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._batch: list = []
        # batches handed to the thread (_sent) and finished there (_done); a deferred batch; batches
        # recorded while a waiter runs the deferred one (_held: they go to the thread after it)
        self._lock = threading.Lock()
        self._exec = threading.Lock()  # held while a batch runs, on the thread or inline
        self._sent = self._done = 0
        self._deferred: _Deferred | None = None
        self._held: list[list] = []
        self.inline_runs = 0  # deferred batches a waiter ran to the end (tests, benchmarks)
        self._closing = np.zeros(1, np.uint32)  # abort word for the native wait
        self._closing_addr = int(self._closing.ctypes.data)
        self._waiting_on = 0  # address of the word a blocking wait sleeps on (close wakes it)
        self._staging = [region.staging_view(s) for s in (0, 1)]
        self._reply = [region.reply_view(s) for s in (0, 1)]
        # a store of `gathered` stamps the announcement first (Layout.announce_stamp: the watchdog's clock)
        self._gathered_off, self._stamp_off = region.layout.word(W.GATHERED), region.layout.announce_stamp
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="draftrelay-emulated-stream", daemon=True)
        self._thread.start()

    # -- enqueue side (engine thread) ----------------------------------------------------------
    # Ops collect in a list and reach the "device" thread as one batch at record() (or drain): one
    # wake-up per round instead of five, which is what keeps the engine-side submit cheap; an inline
    # enqueue_reply's batch reaches it only if something has to run after it before it is waited for.
    def copy_in(self, slot: int, src: np.ndarray) -> None:
        self._batch.append((_COPY_IN, slot, src))

    def write32(self, off: int, value: int) -> None:
        self._batch.append((_WRITE, off, value))

    def wait_geq32(self, off: int, value: int) -> None:
        self._batch.append((_WAIT, off, value))

    def copy_out(self, slot: int, dst: np.ndarray) -> None:
        self._batch.append((_COPY_OUT, slot, dst))

    def record(self) -> Event:
        return self._record(deferrable=False)

    def enqueue_reply(self, slot: int, t: int, dst: Any, offs: tuple[int, int, int], wait: bool = True) -> Event:
        """As StreamOps.enqueue_reply; with `inline` the batch is deferred: its waiter runs it (class doc)."""
        _, released, consumed = offs
        if wait:
            self.wait_geq32(released, t)
        self.copy_out(slot, dst)
        self.write32(consumed, t)
        return self._record(deferrable=self.inline)

    def _record(self, deferrable: bool) -> Event:
        ev = _ThreadEvent(self if deferrable else None)
        self._batch.append((_RECORD, ev, None))
        batch, self._batch = self._batch, []
        with self._lock:
            if self._deferred is not None and self._deferred.running:
                self._held.append(batch)  # after the deferred batch a waiter is running now
                return ev
            self._hand_deferred()
            if deferrable:
                self._deferred = _Deferred(batch, ev)
            else:
                self._put(batch)
        return ev

    def host_fn(self, fn: Callable[[], None]) -> None:
        self._batch.append((_HOST, fn, None))

    def _put(self, batch: list) -> None:  # under self._lock
        self._sent += 1
        self._q.put(batch)

    def _hand_deferred(self) -> None:
        """Give the deferred batch (what of it has not run) to the thread. Under self._lock, not running."""
        d = self._deferred
        if d is not None:
            self._deferred = None
            d.event._stream = None  # its waiters wait for the thread now
            self._put(d.ops[d.cursor:])

    def _run_deferred(self, ev: _ThreadEvent, timeout_s: float | None) -> bool:
        """Run ev's deferred batch on the calling thread, its waits bounded by timeout_s (None: until
        released or closed). False when it cannot run here (not deferred any more, another waiter runs
        it, or the thread has batches before it: then it is handed to the thread)."""
        with self._lock:
            d = self._deferred
            if d is None or d.event is not ev or d.running:
                return False
            if self._sent != self._done or self._closing[0]:
                self._hand_deferred()  # the thread has work before it: keep the order
                return False
            d.running = True
            self._exec.acquire()  # free: the thread is idle (it releases before counting _done)
        try:
            d.cursor = self._execute(d.ops, d.cursor, timeout_s)
        finally:
            self._exec.release()
            with self._lock:
                d.running = False
                finished = d.cursor >= len(d.ops)
                if finished or self._held or self._closing[0]:
                    self._deferred = None
                    if not finished:
                        d.event._stream = None
                        self._put(d.ops[d.cursor:])
                    for b in self._held:
                        self._put(b)
                    self._held = []
                if finished:
                    self.inline_runs += 1
        return True

    def drain(self, timeout_s: float) -> bool:
        if not self._thread.is_alive():
            return True
        return self.record().wait(timeout_s)

    def close(self) -> None:
        if self._thread.is_alive():
            self._closing[0] = 1
            if self._waiting_on:  # a blocking wait checks the abort word when woken, not only per slice
                native.wake32(self._waiting_on)
            self._q.put([(_STOP, None, None)])
            self._thread.join(5.0)
            if self._thread.is_alive():
                raise StreamStuck("emulated stream thread did not stop within 5 s")
        self._staging = self._reply = []

    # -- the "device" ----------------------------------------------------------------------------
    def _execute(self, ops: list, start: int, timeout_s: float | None = None) -> int:
        """Run ops[start:] in order; returns the index of the first op not run (len(ops): all ran). A
        wait gives up after timeout_s (None: never, only when closing) and is not counted as run."""
        base = self.region.base
        block = self.wait == "block"
        store = native.store32_wake if block else native.store32
        end = None if timeout_s is None else time.monotonic() + timeout_s
        for i in range(start, len(ops)):
            op, a, b = ops[i]
            try:
                if op == _COPY_IN:
                    n = min(len(b), len(self._staging[a]))
                    self._staging[a][:n] = b[:n]
                elif op == _WRITE:
                    if a == self._gathered_off:
                        native.store64(base + self._stamp_off, native.now_ns())
                    store(base + a, b)
                elif op == _WAIT:
                    self._waiting_on = base + a
                    spin = self.spin_us  # once per wait, not once per poll slice: a 20 ms spin per 50 ms
                    t_wait = time.monotonic()  # slice held 40 % of a core through a long round
                    if block and self.window is not None and not native.geq32(native.load32(base + a), b):
                        spin = self.window.before(base + a, b, self._closing_addr, self.slice_us, end)
                    while True:
                        bound = self.poll_us if end is None else max(0, min(
                            self.poll_us, int((end - time.monotonic()) * 1e6)))
                        if block:
                            rc = native.wait_geq32_block(base + a, b, spin, self.slice_us, bound,
                                                         self._closing_addr)
                        else:
                            rc = native.wait_geq32(base + a, b, spin, self.nap_us, bound,
                                                   self._closing_addr)
                        spin = 0
                        if rc == native.WAIT_OK or self._closing[0]:
                            break
                        if end is not None and time.monotonic() >= end:
                            break
                    self._waiting_on = 0
                    if rc != native.WAIT_OK:
                        return i
                    if self.window is not None:
                        self.window.observe(time.monotonic() - t_wait)
                elif op == _COPY_OUT:
                    b[:] = self._reply[a][:len(b)]
                elif op == _RECORD:
                    a._flag.set()
                elif op == _HOST:
                    a()
            except Exception as exc:  # a broken op must not kill the "device" silently
                self.error = exc
            except BaseException as exc:
                if threading.get_ident() != self._thread.ident:
                    raise  # Ctrl-C / SIGTERM on a waiter running the batch inline: the waiter's to handle
                self.error = exc
        return len(ops)

    def _run(self) -> None:
        native.set_timer_slack_ns(1000)  # a 20 µs nap must not become the default 50 µs slack + 20
        get = self._q.get
        while True:
            batch = get()
            if batch[0][0] == _STOP:
                return
            with self._exec:
                self._execute(batch, 0)
            with self._lock:
                self._done += 1
            if self._closing[0]:
                return
