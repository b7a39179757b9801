"""Engine-side rounds: `open_rounds(cfg)` gives the engine async rounds (the hand-off) or, when async
is refused, sync rounds with the reason recorded. Both implement draftrelay.round.Rounds:

    t = rounds.submit(requests)      # async: enqueue the round's stream ops and return at once
    res = rounds.result(t)           # RoundResult: drafts, or zero drafts and why

Async start-up, in order: create the region -> start the native watchdog -> start the stream backend ->
spawn the proxy and wait for READY -> self-test rounds through the real mechanism. Any refusal
undoes everything done so far (no fd, no mapping, no process left) and either raises (strict) or
falls back to sync rounds.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import weakref
from collections import Counter as Tally
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from draftrelay.round import RoundFailure, RoundRequest, RoundResult, Status, check_drafts, zero_result
from draftrelay.testing import deterministic_draft
from draftrelay.wire.roundfn import make_round_fn

from . import native
from .proxy_process import AsyncRefused, ProxyProcess
from .region import (
    FLAG_SELFTEST,
    Layout,
    Region,
    RegionConfig,
    W,
    decode_reply,
    pack_staging,
)
from .stream import EmulatedStream, Event, StreamOps, StreamStuck

log = logging.getLogger("draftrelay")

PARKS = ("stream", "host")


@dataclass
class HandoffConfig:
    max_requests: int = 8
    max_tokens: int = 32768
    max_drafts: int = 16
    vocab_size: int = 32000
    deadline_ms: float = 200.0  # watchdog: a round older than this decodes target-only
    watchdog_poll_us: int = 1000
    spin_us: int = 50  # the proxy's waits spin this long, then nap
    nap_us: int = 20
    stream_spin_us: int = 50  # the emulated stream's wait (a GPU polls; the emulation spins, then naps)
    stream_nap_us: int = 20
    # wait "block": the proxy's wait for the next round and the emulated stream's wait for a release sleep
    # until this long before the moment they expect it (the running average of the last waits), then
    # spin through 2x this window, then sleep again: the writer's store finds its reader awake instead of
    # waking it (on a VM, an idle vCPU), at a bounded spin per round. 0: off (sleep at once)
    spin_window_us: int = 0
    # how the emulated stream and the proxy wait: "poll" (spin, then nap: what a GPU's wait costs the
    # host, nothing) or "block" (sleep on the word, woken by the writer: no CPU while a round is out,
    # which is what a CPU-only machine needs, where every poll takes time from the target's compute).
    # "auto": block on the emulated backend, poll on cuda (the GPU writes `gathered` and cannot wake).
    wait: str = "auto"
    wait_slice_us: int = 2000  # a blocking wait re-checks its word at least this often
    heartbeat_ms: float = 20.0
    round_budget_ms: float = 150.0  # what the proxy allows the network round
    selftest_rounds: int = 8
    proxy_start_timeout_s: float = 20.0
    backend: str = "emulated"  # or "cuda"
    strict: bool = False
    # the worker runs on the engine's GPU (loading.handoff_config): the speculation cache declines there
    worker_shares_gpu: bool = False
    round_spec: dict = field(default_factory=lambda: {"kind": "builtin"})
    proxy_audit: str = ""  # file the proxy writes its loaded modules to (tests)
    proxy_python: str = ""  # the interpreter that runs the proxy ("": this process's, sys.executable)
    # recovery (see AsyncRounds._judge / _recover)
    max_respawns: int = 3
    respawn_reset_s: float = 3600.0  # an hour without a loss restores the respawn budget
    loss_fires: int = 3  # watchdog fires with no round finished by the proxy = lost
    supervise_ms: float = 10.0
    preload: tuple = ()  # callables launching every kernel used while a stream is parked (run before round 1)
    cuda_stream: object = None  # backend "cuda": the torch.cuda.Stream to park (default: the current one)
    # backend "cuda": how the parked stream waits (docs/CUDA_BACKEND.md). "" = $DRAFTRELAY_CUDA_WAIT or
    # "auto" (the round kernel: fastest wake-up, holds one SM). Use "memop" when the drafter worker
    # runs on the engine's own GPU: a kernel spinning in the engine's context makes the GPU time-slice
    # between the two processes' contexts, and the worker's step ran at half speed (H200, 128K).
    cuda_wait: str = ""
    # backend "cuda": driver calls through the ctypes fast path (drops the GIL per call) and the
    # batched [write gathered, wait released] memop; off only to measure what each one is worth
    cuda_fast_calls: bool = True
    cuda_batch_memops: bool = True
    # a round packed on the host (submit(requests)) with no round in flight is written into staging and
    # announced (gathered = t) by the engine thread itself: the proxy starts the network round at once,
    # while the stream's part of the round (wait, reply copy, consumed) is still being enqueued. Off: the
    # stream stages and announces it (what a round gathered on the device always does)
    host_staging: bool = True
    # where a host-staged round waits for its release: "stream" (the stream parks: the GPU releases the
    # verify queued behind it) or "host" (nothing is queued on the stream while the round is out; the
    # engine thread sleeps on `released`, woken by the proxy's release, then enqueues the reply copy and
    # the verify). "stream" is what measured fastest on the H200, the worker on the engine's GPU included
    # (docs/REPLAY.md); "host" keeps the engine's context empty while the round is out
    park: str = "stream"
    park_spin_us: int = 0  # park "host": the engine thread spins this long on `released` before it sleeps
    # the emulated stream with wait "block": the stream's part of a host-staged round (wait `released`, copy
    # the reply, store `consumed`) runs on the engine thread that waits for it, not on the stream thread
    # (EmulatedStream, "inline"); off only to measure what it is worth
    stream_inline: bool = True
    # the worker's shared secret (wire/security.py): sent as the handshake's HMAC, given to the proxy
    # child through its environment (never its command line); "" = $DRAFTRELAY_SECRET or none
    secret: str = field(default="", repr=False)

    @property
    def wait_mode(self) -> str:
        if self.wait == "auto":
            return "block" if self.backend == "emulated" else "poll"
        if self.wait not in native.WAITS:
            raise ValueError(f"HandoffConfig.wait {self.wait!r}: expected 'auto', 'poll' or 'block'")
        return self.wait

    @property
    def park_mode(self) -> str:
        if self.park not in PARKS:
            raise ValueError(f"HandoffConfig.park {self.park!r}: expected one of {PARKS}")
        return self.park

    @property
    def region_config(self) -> RegionConfig:
        return RegionConfig(self.max_requests, self.max_tokens, self.max_drafts, self.vocab_size)

    def proxy_spec(self) -> dict:
        spec = dict(self.round_spec)
        spec.setdefault("vocab_size", self.vocab_size)
        spec.update(spin_us=self.spin_us, nap_us=self.nap_us, heartbeat_us=int(self.heartbeat_ms * 1000),
                    round_budget_s=self.round_budget_ms / 1000, wait=self.wait_mode,
                    wait_slice_us=self.wait_slice_us, wake_release=self.park_mode == "host",
                    spin_window_us=self.spin_window_us)
        if self.secret:
            spec["secret"] = self.secret
        return spec


class _Stats:
    def __init__(self) -> None:
        self.rounds = 0
        self.by_status: Tally = Tally()
        self.drafts = 0
        self.first_detail: dict[str, str] = {}  # per failure reason, what its first round said

    def add(self, res: RoundResult) -> None:
        self.rounds += 1
        reason = res.status.name.lower()
        self.by_status[reason] += 1
        self.drafts += int(res.counts.sum())
        if reason not in ("ok", "watchdog") and res.detail and reason not in self.first_detail:
            self.first_detail[reason] = res.detail[:300]

    def as_dict(self) -> dict:
        failed = {k: v for k, v in self.by_status.items() if k not in ("ok", "watchdog")}
        return {"rounds": self.rounds, "ok": self.by_status.get("ok", 0),
                "watchdog": self.by_status.get("watchdog", 0), "failed": sum(failed.values()),
                "failed_by_reason": dict(sorted(failed.items())), "drafts": self.drafts,
                "first_failure": dict(sorted(self.first_detail.items()))}


class SyncRounds:
    """The baseline: the engine's own thread runs the round function (and waits on the network). A
    worker round function's session is kept alive between rounds by a timer thread (`keepalive`: a
    PING once a third of the worker's idle timeout passed with no frame, wire/client.py), which takes
    the same lock as a round, so the two never share the client's socket."""

    mode = "sync"
    device_replies = False
    reply_layout = None
    KEEPALIVE_POLL_S = 1.0  # how often the timer asks the client whether a PING is due

    def __init__(self, cfg: HandoffConfig, refusal: str = "") -> None:
        self.cfg = cfg
        self.refusal = refusal
        self._fn = make_round_fn(cfg.proxy_spec())
        self._t = 0
        self._results: dict[int, RoundResult] = {}
        self._stats = _Stats()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._keeper = None
        if getattr(self._fn, "keepalive", None) is not None:
            # the thread holds the round function weakly: rounds never closed still get collected (and
            # their timer ends at its next tick)
            self._keeper = threading.Thread(target=SyncRounds._keep, daemon=True, name="draftrelay-keepalive",
                                            args=(weakref.ref(self._fn), self._stop, self._lock,
                                                  self.KEEPALIVE_POLL_S))
            self._keeper.start()

    @staticmethod
    def _keep(fn_ref, stop: threading.Event, lock: threading.Lock, poll_s: float) -> None:
        while not stop.wait(poll_s):
            with lock:
                fn = fn_ref()
                if fn is None or stop.is_set():
                    return
                try:
                    fn.keepalive()
                except Exception:  # a keepalive never fails a round; the next round reconnects if it must
                    log.debug("keepalive failed", exc_info=True)
                del fn

    def submit(self, requests: list[RoundRequest]) -> int:
        self._t += 1
        t = self._t
        cfg = self.cfg
        n = len(requests)
        try:
            with self._lock:
                out = self._fn(t, requests, cfg.round_budget_ms / 1000)
            counts, drafts, conf = check_drafts(out, requests, cfg.vocab_size, cfg.max_drafts)
            res = RoundResult(t, Status.OK, counts, drafts, conf)
        except Exception as exc:
            st = exc.status if isinstance(exc, RoundFailure) else Status.EXCEPTION
            res = zero_result(t, n, cfg.max_drafts, st, str(exc))
        self._results[t] = res
        return t

    @property
    def capacity(self) -> int:
        return self.cfg.max_requests

    def reply_device_buffer(self, t: int) -> None:
        return None  # the round ran on this thread: its drafts are on the host

    def result(self, t: int, timeout_s: float | None = None) -> RoundResult:
        res = self._results.pop(t)
        self._stats.add(res)
        return res

    def stats(self) -> dict:
        return {"mode": self.mode, "refusal": self.refusal, **self._stats.as_dict()}

    def close(self) -> None:
        self._stop.set()
        with self._lock:  # the timer is not mid-PING on the socket BYE goes out on
            close = getattr(self._fn, "close", None)  # a worker client: end its session now, not at GC
            if close is not None:
                close()
        if self._keeper is not None:
            self._keeper.join(timeout=5)


class PendingRound(NamedTuple):
    """A round on the stream, not yet decoded: its reply lands in reply buffer `slot`."""

    rid: int  # the id the engine holds
    t: int  # the stream's round number
    n_out: np.ndarray  # int32 drafts asked per request (what decode_reply checks counts against)
    event: Any  # set once the stream has passed the round (reply copied, consumed written); None while
    # a host-parked round waits for its release (nothing of it is on the stream yet: see AsyncRounds._arm)
    generation: int = 0  # the proxy generation it was submitted to (a recovery in between releases it)


class _Done(Event):
    """The event of a round that never reached the stream (see AsyncRounds._arm)."""

    def query(self) -> bool:
        return True

    def wait(self, timeout_s: float | None = None) -> bool:
        return True


_DONE = _Done()


class AsyncRounds:
    """The hand-off: the stream parks on `released`, the proxy process does the round.

    Round ids handed to the engine (`rid`) only grow; the stream's round numbers (`t`) restart at 1
    after a respawn, when the words are reset. A supervisor thread watches the proxy while the
    engine is active and replaces it when it is lost (see `_judge` and `_recover`); meanwhile, and
    once the respawn budget is spent, submit() returns target-only rounds without touching the stream.
    """

    mode = "async"
    refusal = ""

    def __init__(self, cfg: HandoffConfig) -> None:
        self.cfg = cfg
        self.region: Region | None = None
        self.watchdog: native.Watchdog | None = None
        self.stream: StreamOps | None = None
        self.proxy: ProxyProcess | None = None
        self.state = "starting"  # live | recovering | target_only | closed
        self._lock = threading.Lock()  # submit vs. the supervisor's state changes
        self._rid = 0
        self._t = 0
        self._pending: dict[int, PendingRound] = {}  # by slot
        self._results: dict[int, RoundResult] = {}
        self._stats = _Stats()
        self._dst: list = []
        self.device_replies = False  # set at start: true on the CUDA backend
        self._last_submit_ns = 0
        self._park = cfg.park
        self._announce = native.store32
        self.on_resume = None  # host callback run on the stream right after the wait (benchmarks)
        # recovery
        self.generation = 0
        self.respawns_used = 0
        self.losses: Tally = Tally()
        self.loss_log: list[dict] = []
        self.target_only_rounds = 0
        self.target_only_reason = ""
        self.released_on_loss = 0
        self._last_loss_ns = 0
        self._mark = (0, 0)  # (watchdog fires, proxy rounds done) when the proxy last made progress
        self._supervisor: threading.Thread | None = None
        self._stop = threading.Event()

    # -- start-up ---------------------------------------------------------------------------------
    def _start(self) -> None:
        cfg = self.cfg
        self.region = Region.create(cfg.region_config)
        L = self.region.layout
        self.watchdog = native.Watchdog(self.region.base, L.word(W.GATHERED), L.word(W.RELEASED),
                                        (L.claim(0), L.claim(1)), L.word(W.WD_FIRES),
                                        int(cfg.deadline_ms * 1000), cfg.watchdog_poll_us,
                                        off_budget=L.word(W.ROUND_BUDGET))
        self.stream = make_stream(cfg, self.region)
        if self.stream.name == "emulated" and cfg.wait_mode == "block":
            # every writer of `gathered` stamps the announcement (the emulated stream, the engine thread's
            # host staging: _announce): the watchdog sleeps to each round's deadline instead of waking
            # every poll on the cores the target and the worker share, and nobody wakes it per round
            self.watchdog.use_stamps(L.announce_stamp, max(cfg.wait_slice_us, cfg.watchdog_poll_us))
        self.stream.preload(cfg.preload)  # before any round is armed, the self-test's included
        self._off = (L.word(W.GATHERED), L.word(W.RELEASED), L.word(W.CONSUMED))
        self._dst = [self.stream.new_reply_buffer() for _ in (0, 1)]
        self.device_replies = self.stream.name == "cuda"
        self._park = cfg.park_mode
        # a proxy that sleeps on `gathered` (wait "block") is woken by whoever announces a round; the
        # announcement's time goes first (Layout.announce_stamp: what the watchdog measures a round's age by)
        store, a_stamp = (native.store32_wake if cfg.wait_mode == "block" else native.store32), \
            self.region.base + L.announce_stamp

        def announce(addr: int, t: int) -> None:
            native.store64(a_stamp, native.now_ns())
            store(addr, t)

        self._announce = announce
        self.proxy = self._spawn_proxy()
        self.state = "live"
        self._selftest()
        self._mark = self._progress()
        self._supervisor = threading.Thread(target=self._supervise, name="draftrelay-supervisor", daemon=True)
        self._supervisor.start()

    def _spawn_proxy(self) -> ProxyProcess:
        c = self.cfg
        proxy = ProxyProcess(self.region, c.proxy_spec(), c.proxy_audit, python=c.proxy_python or sys.executable)
        try:
            proxy.wait_ready(c.proxy_start_timeout_s)
        except BaseException:
            proxy.kill()
            raise
        return proxy

    def _selftest(self) -> None:
        """Rounds through the real mechanism, checked bit for bit. A wrong draft refuses async at
        once; a round lost to the watchdog (a slow machine at start) is retried a few times."""
        rng = np.random.default_rng(1234)
        n_out = min(4, self.cfg.max_drafts)
        for i in range(self.cfg.selftest_rounds):
            toks = rng.integers(0, self.cfg.vocab_size, 3 + i % 4).astype(np.int32)
            for attempt in range(4):
                req = RoundRequest(i, 1 + attempt, 10 * i, toks, n_out)
                t = self.submit([req], flags=FLAG_SELFTEST)
                res = self.result(t, timeout_s=5.0 + self.cfg.deadline_ms / 1000)
                if res.status != Status.WATCHDOG:
                    break
            want, _ = deterministic_draft(req, self.cfg.vocab_size)
            if not res.ok or not np.array_equal(res.drafts[0, :res.counts[0]], want) or res.counts[0] != n_out:
                raise AsyncRefused(f"self-test round {t} failed: status {res.status.name} {res.detail}")
        self._stats = _Stats()  # the self-test does not count as serving

    # -- rounds -------------------------------------------------------------------------------------
    def submit(self, requests: list[RoundRequest] | None = None, *, src=None, n_out=None,
               flags: int = 0) -> int:
        """Enqueue a round; returns its id. Either `requests` (packed here) or a prepared staging `src`
        (whose descriptor must carry `self.next_stream_round`) and its n_out."""
        self._rid += 1
        rid = self._rid
        with self._lock:
            if self.state != "live":
                n = len(requests) if requests is not None else len(n_out)
                self._results[rid] = zero_result(rid, n, self.cfg.max_drafts, Status.UNAVAILABLE,
                                                 f"proxy {self.state}")
                self.target_only_rounds += 1
                return rid
            t = self._t + 1
            s = t & 1
            if s in self._pending:  # the slot's previous round must be decoded before its buffer is reused
                self._collect(self._pending[s].rid, None)
            self._t = t
            ev = None
            if src is None:
                n_out = np.array([r.n_out for r in requests], np.int32)
                if self._host_stages():
                    # staging[s] was last read for round t - 2, which was collected (its consumed store
                    # came before its event); no round is in flight, so gathered steps from t - 1 to t
                    # and the proxy, waiting for exactly t, takes it (a round the GPU announces later
                    # cannot overtake it). Written, then announced with a release store (rule 5 holds:
                    # the proxy still never writes staging).
                    pack_staging(self.region.layout, t, requests, flags, out=self.region.staging_view(s))
                    self._announce(self.region.base + self._off[0], t)
                    if self._park == "stream":
                        ev = self.stream.enqueue_reply(s, t, self._dst[s], self._off)
                    self._pending[s] = PendingRound(rid, t, n_out, ev, self.generation)
                    src = None
                else:
                    src = pack_staging(self.region.layout, t, requests, flags)
            if s not in self._pending:
                ev = self.stream.enqueue_round(s, t, src, self._dst[s], self._off, self.on_resume)
                self._pending[s] = PendingRound(rid, t, np.asarray(n_out, np.int32), ev, self.generation)
        # time.monotonic_ns (CLOCK_MONOTONIC, like the native clock) because it keeps the GIL: a ctypes
        # call here would hand the GIL to the just-woken stream thread and bill its work to submit()
        self._last_submit_ns = time.monotonic_ns()
        return rid

    def _host_stages(self) -> bool:
        """Whether this host-packed round is staged and announced by the engine thread: configured, no
        benchmark callback mid-stream, and no round in flight (the other slot's round may still be
        unreleased: announcing t before it would make the proxy skip it)."""
        return self.cfg.host_staging and self.on_resume is None and not self._pending

    @property
    def next_stream_round(self) -> int:
        return self._t + 1

    def _arm(self, slot: int, timeout_s: float | None) -> bool:
        """A host-parked round: wait on the host until it is released (by the proxy or the watchdog),
        then enqueue its reply copy and `consumed`, as the stream would after its own wait. False if
        `timeout_s` passed first (the round stays pending, unarmed). The engine thread sleeps in native
        code (the GIL is free). A recovery (or target-only) meanwhile ends the wait too: then nothing is
        enqueued (see below) and the round decodes with zero drafts."""
        p = self._pending[slot]
        a_rel = self.region.base + self._off[1]
        c = self.cfg
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            step = max(20_000, c.wait_slice_us)  # between looks at the generation (a recovery's reset)
            slice_us = step if end is None else max(1, min(step, int((end - time.monotonic()) * 1e6)))
            # the proxy wakes the word when the engine parks on the host (proxy_spec), the watchdog and a
            # recovery's drain always do: a sleep here ends at the release, a slice is only the belt
            rc = native.wait_geq32_block(a_rel, p.t, c.park_spin_us, c.wait_slice_us, slice_us)
            if rc == native.WAIT_OK or self.generation != p.generation or self.state != "live":
                break
            if end is not None and time.monotonic() >= end:
                return False
        with self._lock:
            if self.stream is None:  # closed meanwhile
                return False
            if self.state != "live" or self.generation != p.generation:
                # a recovery drained the stream and resets (or reset) the words: ops enqueued now could
                # land after the reset (a stale `consumed`, or the round kernel's `gathered`). Nothing
                # goes on the stream; the reply buffer still holds an older round's bytes, which
                # decode_reply refuses (no claim of round t): a zero-draft round
                self._pending[slot] = p._replace(event=_DONE)
                return True
            ev = self.stream.enqueue_reply(slot, p.t, self._dst[slot], self._off, wait=False)
            self._pending[slot] = p._replace(event=ev)
        return True

    def _slot_of(self, rid: int) -> int | None:
        return next((s for s, p in self._pending.items() if p.rid == rid), None)

    def pending(self, rid: int) -> PendingRound | None:
        """Round `rid` while it is on the stream and not yet decoded; None otherwise."""
        slot = self._slot_of(rid)
        return None if slot is None else self._pending[slot]

    def _collect(self, rid: int, timeout_s: float | None) -> None:
        slot = self._slot_of(rid)
        if slot is None:
            raise KeyError(f"round {rid} was never submitted or was already collected")
        p = self._pending[slot]
        t0 = time.monotonic()
        if p.event is None and not self._arm(slot, timeout_s):
            raise TimeoutError(f"round {rid} not released after {timeout_s} s")
        p = self._pending[slot]
        left = None if timeout_s is None else max(0.0, timeout_s - (time.monotonic() - t0))
        if not p.event.wait(left):
            raise TimeoutError(f"round {rid} not finished on the stream after {timeout_s} s")
        del self._pending[slot]
        buf = self.stream.host_bytes(self._dst[slot])
        res = decode_reply(self.region.layout, buf, p.t, p.n_out)
        res.round = rid
        res.stream_round, res.proxy_generation = p.t, self.generation  # StampedRounds
        self._results[rid] = res

    @property
    def capacity(self) -> int:
        return self.cfg.max_requests

    @property
    def reply_layout(self) -> Layout | None:
        return None if self.region is None else self.region.layout

    @property
    def round_spec(self) -> dict:
        return self.cfg.round_spec

    @property
    def deadline_s(self) -> float:
        return self.cfg.deadline_ms / 1000

    def reply_device_buffer(self, rid: int):
        """The engine-side buffer (a device buffer on the CUDA backend) that round `rid`'s reply is
        copied into; None when the round is not on the stream (target-only while recovering). Work
        enqueued after this call reads the round's reply: a host-parked round is waited for here and
        its reply copy enqueued first (see _arm)."""
        slot = self._slot_of(rid)
        if slot is None:
            return None
        if self._pending[slot].event is None:
            self._arm(slot, None)
        return getattr(self._dst[slot], "dev", self._dst[slot])

    def result(self, rid: int, timeout_s: float | None = None) -> RoundResult:
        if rid not in self._results:
            self._collect(rid, timeout_s)
        res = self._results.pop(rid)
        self._stats.add(res)
        return res

    # -- loss detection and respawn ----------------------------------------------------------------
    @property
    def loss_limit_s(self) -> float:
        """A heartbeat older than this is a lost proxy: max(2 x deadline, round budget + 250 ms)."""
        return max(2 * self.cfg.deadline_ms, self.cfg.round_budget_ms + 250) / 1000

    def _progress(self) -> tuple[int, int]:
        c = self.region.counters()
        return self.watchdog.fires, c["published"] + c["late_discarded"]

    def _active(self) -> bool:
        recent = (time.monotonic_ns() - self._last_submit_ns) / 1e9 < 2 * self.loss_limit_s
        return bool(self._pending) or recent

    def _judge(self) -> tuple[str, str] | None:
        """The loss rule. Process exit always counts; the heartbeat and the watchdog-fire rule are
        judged only while the engine is active, so an idle engine never declares a loss."""
        rc = self.proxy.proc.poll()
        if rc is not None:
            return "exit", f"proxy exited with code {rc}"
        if not self._active():
            self._mark = self._progress()
            return None
        a_hb = self.region.word_addr(W.HEARTBEAT)
        limit_ns = int(self.loss_limit_s * 1e9)
        age = native.now_ns() - native.load64(a_hb)
        if age > limit_ns:
            # Read it again after the clock: if this process was frozen between the two reads above
            # (SIGSTOP, a VM pause), a live proxy's heartbeat is fresh now.
            age = native.now_ns() - native.load64(a_hb)
            if age > limit_ns:
                return "heartbeat", f"heartbeat {age / 1e6:.0f} ms old against the {limit_ns / 1e6:.0f} ms limit"
        fires, done = self._progress()
        if done != self._mark[1]:
            self._mark = (fires, done)
        elif fires - self._mark[0] >= self.cfg.loss_fires:
            return "fires", f"{fires - self._mark[0]} watchdog fires with no round finished"
        return None

    def _supervise(self) -> None:
        period = self.cfg.supervise_ms / 1000
        self.stream.bind_thread()  # it records and queries events on the engine's stream when it drains
        while not self._stop.wait(period):
            if self.state != "live":
                continue
            try:
                verdict = self._judge()
                if verdict:
                    self._recover(*verdict)
            except Exception as exc:  # the supervisor must not die silently: go target-only, loudly
                self._go_target_only(f"supervisor error: {type(exc).__name__}: {exc}")

    def _recover(self, cause: str, detail: str) -> None:
        now = native.now_ns()
        event = {"cause": cause, "detail": detail, "detected_ns": now, "generation": self.generation,
                 "fires": self.watchdog.fires}
        self.loss_log.append(event)
        self.losses[cause] += 1
        with self._lock:
            self.state = "recovering"  # from here on submit() does not touch the stream
        log.warning("draftrelay: proxy lost (%s: %s)", cause, detail)
        if self._last_loss_ns and (now - self._last_loss_ns) / 1e9 > self.cfg.respawn_reset_s:
            self.respawns_used = 0  # an hour (by default) without loss restores the budget
        self._last_loss_ns = now
        self.proxy.kill()  # SIGKILL works on a stopped process too; reaped here, not on the engine thread
        if not self._drain_released(5.0 + 2 * self.cfg.deadline_ms / 1000):
            self._go_target_only("the stream did not drain after a proxy loss; region kept mapped")
            return
        if self.respawns_used >= self.cfg.max_respawns:
            self._go_target_only(f"respawn budget spent ({self.cfg.max_respawns}); continuing target-only")
            return
        self.respawns_used += 1
        L = self.region.layout
        self.watchdog.reset_words([L.word(W.GATHERED), L.word(W.RELEASED), L.word(W.CONSUMED), L.claim(0),
                                   L.claim(1), L.word(W.STOP), L.word(W.PROXY_STATE), L.word(W.HEARTBEAT),
                                   L.word(W.HEARTBEAT) + 4, L.word(W.PROXY_PID), L.word(W.ROUND_BUDGET),
                                   L.word(W.ROUND_BUDGET) + 4])
        self._t = 0
        event["respawn_ns"] = native.now_ns()
        try:
            self.proxy = self._spawn_proxy()
        except Exception as exc:
            self._go_target_only(f"respawn failed: {exc}")
            return
        event["ready_ns"] = native.now_ns()
        self.generation += 1
        self._mark = self._progress()
        with self._lock:
            self.state = "live"
        log.warning("draftrelay: proxy respawned (generation %d, %d respawns left)", self.generation,
                    self.cfg.max_respawns - self.respawns_used)

    def _drain_released(self, timeout_s: float) -> bool:
        """Drain the stream after the proxy was killed and reaped. Nobody else can publish now, so
        rounds still parked are claimed and released here as the watchdog would (claim 2t+1: zero
        drafts) instead of waiting a deadline for each of them."""
        L, base = self.region.layout, self.region.base
        done = self.stream.record()
        end = time.monotonic() + timeout_s
        while not done.wait(0.001):
            g = native.load32(base + L.word(W.GATHERED))
            if g and not native.geq32(native.load32(base + L.word(W.RELEASED)), g):
                if native.claim32(base + L.claim(g & 1), 2 * g, 2 * g + 1):
                    self.released_on_loss += 1
                native.store_max32_wake(base + L.word(W.RELEASED), g)
            if time.monotonic() > end:
                return False
        return True

    def _go_target_only(self, reason: str) -> None:
        with self._lock:
            self.state = "target_only"
        self.target_only_reason = reason
        if self.proxy is not None:
            self.proxy.kill()
        log.warning("draftrelay: async rounds off: %s", reason)

    # -- state --------------------------------------------------------------------------------------
    def stats(self) -> dict:
        out = {"mode": self.mode, "refusal": "", "state": self.state, **self._stats.as_dict(),
               "generation": self.generation, "respawns_used": self.respawns_used,
               "respawns_left": max(0, self.cfg.max_respawns - self.respawns_used),
               "proxy_losses": dict(self.losses), "target_only_rounds": self.target_only_rounds,
               "released_on_loss": self.released_on_loss,
               "target_only_reason": self.target_only_reason}
        if self.region is not None and not self.region.closed:
            c = self.region.counters()
            out.update(late_discarded=c["late_discarded"], torn_skipped=c["torn_skipped"],
                       proxy_skipped=c["skipped"], proxy_published=c["published"],
                       worker_reconnects=c["reconnects"])
        if self.watchdog is not None:
            out.update(watchdog_fires=self.watchdog.fires, watchdog_assists=self.watchdog.assists)
        return out

    def wait_settled(self, timeout_s: float = 10.0) -> str:
        """Wait until no recovery is in progress; returns the state (drills and tests)."""
        end = time.monotonic() + timeout_s
        while self.state in ("recovering", "starting") and time.monotonic() < end:
            time.sleep(0.005)
        return self.state

    def close(self) -> None:
        """Stop the supervisor and the proxy, drain the stream (the watchdog releases what is parked),
        free everything. A stream that will not drain raises StreamStuck and frees nothing the device
        may still use."""
        self._stop.set()
        if self._supervisor is not None and self._supervisor is not threading.current_thread():
            self._supervisor.join(10.0)
        with self._lock:
            self.state = "closed"
        if self.proxy is not None:
            self.proxy.stop(timeout_s=0.1)
            self.proxy = None
        if self.stream is not None:
            if not self.stream.drain(5.0 + 2 * self.cfg.deadline_ms / 1000):
                raise StreamStuck("the stream did not drain within its bound; region kept mapped")
            self.stream.close()
            self.stream = None
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        self._pending.clear()
        self._dst = []
        if self.region is not None:
            self.region.close()
            self.region = None


def make_stream(cfg: HandoffConfig, region: Region) -> StreamOps:
    if cfg.backend == "emulated":
        return EmulatedStream(region, cfg.stream_spin_us, cfg.stream_nap_us, wait=cfg.wait_mode,
                              slice_us=cfg.wait_slice_us, inline=None if cfg.stream_inline else False,
                              spin_window_us=cfg.spin_window_us)
    if cfg.backend == "cuda":
        from .cuda_stream import CudaStream  # needs cuda-bindings and a GPU

        return CudaStream(region, cfg.cuda_stream, wait=cfg.cuda_wait or None, fast=cfg.cuda_fast_calls,
                          batch=cfg.cuda_batch_memops)
    raise ValueError(f"unknown stream backend {cfg.backend!r} (expected 'emulated' or 'cuda')")


def open_rounds(cfg: HandoffConfig) -> AsyncRounds | SyncRounds:
    """Async rounds if everything starts and the self-test passes; else sync rounds with the reason
    (or AsyncRefused under cfg.strict). A refusal leaves no fd, mapping or process behind."""
    rounds = AsyncRounds(cfg)
    try:
        rounds._start()
        return rounds
    except BaseException as exc:
        if isinstance(exc, StreamStuck):  # the GPU may still use the region: free nothing, keep the watchdog
            if rounds.proxy is not None:
                rounds.proxy.stop()
            raise
        reason = f"{type(exc).__name__}: {exc}"
        try:
            rounds.close()
        except StreamStuck:
            raise
        except Exception as close_exc:  # keep the first reason; report the cleanup failure too
            reason += f" (cleanup: {close_exc})"
        if not isinstance(exc, Exception):  # Ctrl-C, SystemExit: cleaned up above, then what it was
            raise
        if cfg.strict:
            if isinstance(exc, AsyncRefused):
                raise
            raise AsyncRefused(reason) from exc
        return SyncRounds(cfg, refusal=reason)


__all__ = ["AsyncRefused", "AsyncRounds", "HandoffConfig", "PendingRound", "SyncRounds", "open_rounds"]
