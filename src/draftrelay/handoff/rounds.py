"""Engine-side rounds: `open_rounds(cfg)` gives the engine async rounds (the hand-off) or, when async
is refused, sync rounds with the reason recorded. Both have the same interface:

    t = rounds.submit(requests)      # async: enqueue the round's stream ops and return at once
    res = rounds.result(t)           # RoundResult: drafts, or zero drafts and why

Async start-up, in order: create the region -> start the native watchdog -> start the stream backend ->
spawn the proxy and wait for READY -> self-test rounds through the real mechanism. Any refusal
undoes everything done so far (no fd, no mapping, no process left) and either raises (strict) or
falls back to sync rounds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter as Tally
from dataclasses import dataclass, field

import numpy as np

from . import native
from .proxy import RoundFailure, check_drafts, deterministic_draft, make_round_fn
from .region import (
    FLAG_SELFTEST,
    ProxyState,
    Region,
    RegionConfig,
    RoundRequest,
    RoundResult,
    Status,
    W,
    decode_reply,
    pack_staging,
)
from .stream import EmulatedStream, StreamOps, StreamStuck


class AsyncRefused(RuntimeError):
    """Async rounds could not start (raised only with strict=True; otherwise recorded)."""


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
    heartbeat_ms: float = 20.0
    round_budget_ms: float = 150.0  # what the proxy allows the network round
    selftest_rounds: int = 8
    proxy_start_timeout_s: float = 20.0
    backend: str = "emulated"  # or "cuda"
    strict: bool = False
    round_spec: dict = field(default_factory=lambda: {"kind": "builtin"})
    proxy_audit: str = ""  # file the proxy writes its loaded modules to (tests)
    preload: tuple = ()  # callables launching every kernel used while a stream is parked (run before round 1)
    cuda_stream: object = None  # backend "cuda": the torch.cuda.Stream to park (default: the current one)

    @property
    def region_config(self) -> RegionConfig:
        return RegionConfig(self.max_requests, self.max_tokens, self.max_drafts, self.vocab_size)

    def proxy_spec(self) -> dict:
        spec = dict(self.round_spec)
        spec.setdefault("vocab_size", self.vocab_size)
        spec.update(spin_us=self.spin_us, nap_us=self.nap_us, heartbeat_us=int(self.heartbeat_ms * 1000),
                    round_budget_s=self.round_budget_ms / 1000)
        return spec


class _Stats:
    def __init__(self) -> None:
        self.rounds = 0
        self.by_status: Tally = Tally()
        self.drafts = 0

    def add(self, res: RoundResult) -> None:
        self.rounds += 1
        self.by_status[res.status.name.lower()] += 1
        self.drafts += int(res.counts.sum())

    def as_dict(self) -> dict:
        failed = {k: v for k, v in self.by_status.items() if k not in ("ok", "watchdog")}
        return {"rounds": self.rounds, "ok": self.by_status.get("ok", 0),
                "watchdog": self.by_status.get("watchdog", 0), "failed": sum(failed.values()),
                "failed_by_reason": dict(sorted(failed.items())), "drafts": self.drafts}


class SyncRounds:
    """The baseline: the engine's own thread runs the round function (and waits on the network)."""

    mode = "sync"

    def __init__(self, cfg: HandoffConfig, refusal: str = "") -> None:
        self.cfg = cfg
        self.refusal = refusal
        self._fn = make_round_fn(cfg.proxy_spec())
        self._t = 0
        self._results: dict[int, RoundResult] = {}
        self._stats = _Stats()

    def submit(self, requests: list[RoundRequest]) -> int:
        self._t += 1
        t = self._t
        cfg = self.cfg
        n = len(requests)
        try:
            out = self._fn(t, requests, cfg.round_budget_ms / 1000)
            counts, drafts, conf = check_drafts(out, requests, cfg.vocab_size, cfg.max_drafts)
            res = RoundResult(t, Status.OK, counts, drafts, conf)
        except Exception as exc:
            st = exc.status if isinstance(exc, RoundFailure) else Status.EXCEPTION
            res = RoundResult(t, st, np.zeros(n, np.int32), np.zeros((n, cfg.max_drafts), np.int32),
                              np.zeros((n, cfg.max_drafts), np.float32), str(exc))
        self._results[t] = res
        return t

    def result(self, t: int, timeout_s: float | None = None) -> RoundResult:
        res = self._results.pop(t)
        self._stats.add(res)
        return res

    def stats(self) -> dict:
        return {"mode": self.mode, "refusal": self.refusal, **self._stats.as_dict()}

    def close(self) -> None:
        pass


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class ProxyProcess:
    """The proxy child: spawn with the region's fd, stop with a word, kill if it won't."""

    def __init__(self, region: Region, spec: dict, audit: str = "") -> None:
        self.region = region
        self._err = tempfile.TemporaryFile(prefix="draftrelay-proxy-")
        cmd = [sys.executable, "-m", "draftrelay.handoff.proxy", "--fd", str(region.fd), "--spec",
               json.dumps(spec)]
        if audit:
            cmd += ["--audit", audit]
        env = dict(os.environ)
        env.pop("PYTHONSTARTUP", None)
        try:
            self.proc = subprocess.Popen(cmd, pass_fds=(region.fd,), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=self._err, env=env)
        except BaseException:
            self._err.close()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr_tail(self, n: int = 800) -> str:
        try:
            self._err.seek(0)
            return self._err.read().decode(errors="replace")[-n:].strip()
        except (OSError, ValueError):
            return ""

    def wait_ready(self, timeout_s: float) -> None:
        a_state = self.region.word_addr(W.PROXY_STATE)
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            state = native.load32(a_state)
            if state == ProxyState.READY:
                return
            rc = self.proc.poll()
            if rc is not None or state == ProxyState.FAILED:
                raise AsyncRefused(f"proxy exited during start (code {rc}): {self.stderr_tail()}")
            time.sleep(0.005)
        raise AsyncRefused(f"proxy not ready after {timeout_s:.1f} s")

    def stop(self, timeout_s: float = 1.0) -> None:
        """Ask politely through the STOP word, then SIGKILL; always reaps."""
        if self.proc.poll() is None and not self.region.closed:
            native.store32(self.region.word_addr(W.STOP), 1)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self._err.close()


class AsyncRounds:
    """The hand-off: the stream parks on `released`, the proxy process does the round."""

    mode = "async"
    refusal = ""

    def __init__(self, cfg: HandoffConfig) -> None:
        self.cfg = cfg
        self.region: Region | None = None
        self.watchdog: native.Watchdog | None = None
        self.stream: StreamOps | None = None
        self.proxy: ProxyProcess | None = None
        self._t = 0
        self._pending: dict[int, tuple] = {}  # slot -> (t, n_out, event)
        self._results: dict[int, RoundResult] = {}
        self._stats = _Stats()
        self._dst: list = []
        self.enqueue_ns: list[int] = []  # engine-side submit cost, when enabled (benchmarks)
        self.record_enqueue = False
        self.on_resume = None  # host callback run on the stream right after the wait (benchmarks)

    # -- start-up ---------------------------------------------------------------------------------
    def _start(self) -> None:
        cfg = self.cfg
        self.region = Region.create(cfg.region_config)
        L = self.region.layout
        self.watchdog = native.Watchdog(self.region.base, L.word(W.GATHERED), L.word(W.RELEASED),
                                        (L.claim(0), L.claim(1)), L.word(W.WD_FIRES),
                                        int(cfg.deadline_ms * 1000), cfg.watchdog_poll_us)
        self.stream = make_stream(cfg, self.region)
        self.stream.preload(cfg.preload)  # before any round is armed, the self-test's included
        self._off = (L.word(W.GATHERED), L.word(W.RELEASED), L.word(W.CONSUMED))
        self._dst = [self.stream.new_reply_buffer() for _ in (0, 1)]
        self.proxy = ProxyProcess(self.region, cfg.proxy_spec(), cfg.proxy_audit)
        self.proxy.wait_ready(cfg.proxy_start_timeout_s)
        self._selftest()

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
        """Enqueue round t. Either `requests` (packed here) or a prepared staging `src` and its n_out."""
        t0 = native.now_ns() if self.record_enqueue else 0
        self._t += 1
        t = self._t
        s = t & 1
        if s in self._pending:  # the slot's previous round must be decoded before its buffer is reused
            self._collect(self._pending[s][0], None)
        if src is None:
            src = pack_staging(self.region.layout, t, requests, flags)
            n_out = np.array([r.n_out for r in requests], np.int32)
        gathered, released, consumed = self._off
        st = self.stream
        st.copy_in(s, src)
        st.write32(gathered, t)
        st.wait_geq32(released, t)
        if self.on_resume is not None:
            st.host_fn(self.on_resume)
        st.copy_out(s, self._dst[s])
        st.write32(consumed, t)
        self._pending[s] = (t, np.asarray(n_out, np.int32), st.record())
        if t0:
            self.enqueue_ns.append(native.now_ns() - t0)
        return t

    def _collect(self, t: int, timeout_s: float | None) -> None:
        s = t & 1
        pt, n_out, ev = self._pending[s]
        assert pt == t
        if not ev.wait(timeout_s):
            raise TimeoutError(f"round {t} not finished on the stream after {timeout_s} s")
        del self._pending[s]
        buf = self.stream.host_bytes(self._dst[s])
        self._results[t] = decode_reply(self.region.layout, buf, t, n_out)

    def result(self, t: int, timeout_s: float | None = None) -> RoundResult:
        if t not in self._results:
            self._collect(t, timeout_s)
        res = self._results.pop(t)
        self._stats.add(res)
        return res

    # -- state --------------------------------------------------------------------------------------
    def stats(self) -> dict:
        out = {"mode": self.mode, "refusal": "", **self._stats.as_dict()}
        if self.region is not None and not self.region.closed:
            c = self.region.counters()
            out.update(late_discarded=c["late_discarded"], torn_skipped=c["torn_skipped"],
                       proxy_skipped=c["skipped"], proxy_published=c["published"])
        if self.watchdog is not None:
            out.update(watchdog_fires=self.watchdog.fires, watchdog_assists=self.watchdog.assists)
        return out

    def heartbeat_age_s(self) -> float:
        hb = native.load64(self.region.word_addr(W.HEARTBEAT))
        return (native.now_ns() - hb) / 1e9 if hb else float("inf")

    def close(self) -> None:
        """Stop the proxy, drain the stream (the watchdog releases what is parked), free everything.

        A stream that will not drain raises StreamStuck and frees nothing the device may still use."""
        if self.proxy is not None:
            self.proxy.stop()
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
        return EmulatedStream(region, cfg.stream_spin_us, cfg.stream_nap_us)
    if cfg.backend == "cuda":
        from .cuda_stream import CudaStream  # needs cuda-bindings and a GPU

        return CudaStream(region, cfg.cuda_stream)
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
        if cfg.strict or not isinstance(exc, Exception):
            if isinstance(exc, AsyncRefused):
                raise
            raise AsyncRefused(reason) from exc
        return SyncRounds(cfg, refusal=reason)


__all__ = ["AsyncRefused", "AsyncRounds", "HandoffConfig", "SyncRounds", "open_rounds"]
