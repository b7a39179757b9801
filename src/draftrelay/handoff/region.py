"""The shared memfd region: layout, creation, opening, and the round records inside it.

One region per engine, shared by three parties: the engine's stream (writes staging, gathered and
consumed; reads replies), the proxy process (reads staging, writes replies, claims and releases) and
the engine's native watchdog (claims and releases overdue rounds). Everything is double-buffered by
round parity: round t uses slot t & 1.

    header   magic, version, sizes (one cache line)
    words    each on its own 64-byte line: gathered, released, consumed, heartbeat, proxy state,
             stop, proxy pid, watchdog fires, last release time, proxy counters, round budget
    staging  [2] descriptor header + request table + tokens        (engine -> proxy, proxy only reads)
    reply    [2] claim word (own line) + header + counts + drafts + confidences  (proxy -> engine)

The claim word sits at the start of each reply slot so one copy brings it to the engine together
with the reply: the engine believes a reply only when the claim says the proxy published round t
(claim == 2t); the watchdog claims with 2t + 1, and nobody can claim a round twice.

The round records themselves (RoundRequest, RoundResult, Status) are draftrelay.round's; this module
lays them out in the region. It is numpy-only: the proxy process imports it.
"""

from __future__ import annotations

import gc
import mmap
import os
import struct
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from draftrelay.round import RoundRequest, RoundResult, Status

MAGIC = 0x594C5244  # "DRLY"
VERSION = 2
LINE = 64

_HEADER = struct.Struct("<IIQIIII")  # magic, version, total_size, max_requests, max_tokens, max_drafts, vocab


class W(IntEnum):
    """Hand-off words: index of the 64-byte line each lives on, after the header line."""

    GATHERED = 0
    RELEASED = 1
    CONSUMED = 2
    HEARTBEAT = 3  # u64 CLOCK_MONOTONIC ns, written by the proxy's native heartbeat thread
    PROXY_STATE = 4
    STOP = 5  # engine -> proxy: exit now
    PROXY_PID = 6
    WD_FIRES = 7
    LAST_RELEASE_NS = 8  # u64, the proxy's clock just before its last release (benchmarks)
    COUNTERS = 9  # u32[16] proxy-side counters, see Counter
    ROUND_BUDGET = 10  # u64 (round << 32) | us the watchdog adds to its deadline for that round (proxy)


N_WORDS = 11


class ProxyState(IntEnum):
    NONE = 0
    STARTING = 1
    READY = 2
    STOPPED = 3
    FAILED = 4


class Counter(IntEnum):
    """Proxy-side counters (u32 each, on the COUNTERS line; only the proxy writes them)."""

    ROUNDS = 0  # rounds the proxy picked up
    PUBLISHED = 1  # rounds it claimed and released
    LATE_DISCARDED = 2  # replies built but lost to the watchdog
    TORN_SKIPPED = 3  # staging overwritten while it was being read: dropped
    SKIPPED = 4  # rounds the proxy never saw (released by the watchdog before it got there)
    FAILED = 5  # rounds it published with a failure status
    RECONNECTS = 6  # the round function's reconnects to the worker (its `reconnects` attribute)


# One staging request record: 8 x u32.
REQ_DTYPE = np.dtype(
    [("req_id", "<u4"), ("generation", "<u4"), ("position", "<u4"), ("tok_off", "<u4"),
     ("n_tok", "<u4"), ("n_out", "<u4"), ("flags", "<u4"), ("reserved", "<u4")]
)
DESC_HEADER = struct.Struct("<IIII")  # round, n_req, n_tok, flags
REPLY_HEADER = struct.Struct("<IIII")  # round, status, n_req, bytes of a failed round's detail
DETAIL_MAX = 240  # bytes of a failed round's detail in its reply slot


def detail_room(cfg: RegionConfig) -> int:
    """Bytes a failed round's detail may take: DETAIL_MAX, within the slot's drafts area it is written to."""
    return min(DETAIL_MAX, 4 * cfg.max_requests * cfg.max_drafts)


FLAG_SELFTEST = 1  # staging flag: answer with the built-in deterministic drafter, no network


def shared_memfd(name: str, size: int) -> tuple[int, mmap.mmap]:
    """A new memfd of `size` bytes, mapped shared read-write (close-on-exec; children get it through
    pass_fds). Nothing is left open if the mapping fails."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        return fd, mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise


class RegionError(ValueError):
    """A region that is not ours, or not of the shape we expect."""


def _round_up(n: int) -> int:
    return (n + LINE - 1) // LINE * LINE


@dataclass(frozen=True)
class RegionConfig:
    max_requests: int = 8
    max_tokens: int = 32768  # tokens staged per round, over all requests
    max_drafts: int = 16  # n_out limit per request
    vocab_size: int = 32000  # draft ids must be below this; the engine rejects a reply otherwise

    def validate(self) -> None:
        for name, lo, hi in (("max_requests", 1, 4096), ("max_tokens", 1, 1 << 24),
                             ("max_drafts", 1, 1024), ("vocab_size", 2, 1 << 31)):
            v = getattr(self, name)
            if not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"RegionConfig.{name}={v!r} must be an int in [{lo}, {hi}]")


@dataclass(frozen=True)
class Layout:
    """Byte offsets of everything in the region; both sides derive it from the header's sizes."""

    cfg: RegionConfig

    @property
    def words(self) -> int:
        return LINE

    def word(self, w: W) -> int:
        return LINE + int(w) * LINE

    def counter(self, c: Counter) -> int:
        return self.word(W.COUNTERS) + 4 * int(c)

    @property
    def announce_stamp(self) -> int:
        """u64 on `gathered`'s line: CLOCK_MONOTONIC ns of the last announcement, stored before `gathered`
        by the host writers (the engine thread, the emulated stream; never a GPU): a sleeping watchdog
        takes a round's age from it (native.Watchdog.use_stamps)."""
        return self.word(W.GATHERED) + 8

    @property
    def staging_size(self) -> int:
        c = self.cfg
        return _round_up(DESC_HEADER.size + c.max_requests * REQ_DTYPE.itemsize + 4 * c.max_tokens)

    @property
    def staging_req_off(self) -> int:
        return DESC_HEADER.size

    @property
    def staging_tok_off(self) -> int:
        return DESC_HEADER.size + self.cfg.max_requests * REQ_DTYPE.itemsize

    def staging(self, slot: int) -> int:
        return LINE + N_WORDS * LINE + slot * self.staging_size

    # reply slot: [claim line][header line][counts][drafts][conf]
    @property
    def reply_counts_off(self) -> int:
        return 2 * LINE

    @property
    def reply_drafts_off(self) -> int:
        return self.reply_counts_off + _round_up(4 * self.cfg.max_requests)

    @property
    def reply_conf_off(self) -> int:
        return self.reply_drafts_off + _round_up(4 * self.cfg.max_requests * self.cfg.max_drafts)

    @property
    def reply_size(self) -> int:
        return self.reply_conf_off + _round_up(4 * self.cfg.max_requests * self.cfg.max_drafts)

    def reply(self, slot: int) -> int:
        return self.staging(2) + slot * self.reply_size

    def claim(self, slot: int) -> int:
        return self.reply(slot)

    @property
    def total_size(self) -> int:
        return self.reply(2)


class Region:
    """A mapped region. `create` makes a new memfd (engine side); `open` maps one by fd (proxy)."""

    def __init__(self, fd: int, mm: mmap.mmap, cfg: RegionConfig, owner: bool) -> None:
        self.fd = fd
        self.mm = mm
        self.cfg = cfg
        self.layout = Layout(cfg)
        self.size = self.layout.total_size
        self.owner = owner
        self._u8 = np.frombuffer(mm, dtype=np.uint8)
        self.base = int(self._u8.ctypes.data)

    # -- lifetime ----------------------------------------------------------------------------
    @classmethod
    def create(cls, cfg: RegionConfig | None = None, name: str = "draftrelay") -> Region:
        cfg = cfg or RegionConfig()
        cfg.validate()
        size = Layout(cfg).total_size
        fd, mm = shared_memfd(name, size)
        region = cls(fd, mm, cfg, owner=True)
        _HEADER.pack_into(mm, 0, MAGIC, VERSION, size, cfg.max_requests, cfg.max_tokens,
                          cfg.max_drafts, cfg.vocab_size)
        return region

    @classmethod
    def open(cls, fd: int) -> Region:
        """Map an existing region by fd, checking that it is a draftrelay region of a shape we know."""
        try:
            st = os.fstat(fd)
        except OSError as exc:
            raise RegionError(f"region fd {fd} is not open: {exc}") from None
        if st.st_size < _HEADER.size:
            raise RegionError(f"region fd {fd} is {st.st_size} bytes: too small for a draftrelay header")
        head = os.pread(fd, _HEADER.size, 0)
        magic, version, size, max_req, max_tok, max_drafts, vocab = _HEADER.unpack(head)
        if magic != MAGIC:
            raise RegionError(f"region fd {fd}: magic {magic:#x} is not draftrelay's {MAGIC:#x}")
        if version != VERSION:
            raise RegionError(f"region fd {fd}: layout version {version}, this build speaks {VERSION}")
        cfg = RegionConfig(max_req, max_tok, max_drafts, vocab)
        try:
            cfg.validate()
        except ValueError as exc:
            raise RegionError(f"region fd {fd}: bad sizes in header: {exc}") from None
        expect = Layout(cfg).total_size
        if size != expect or st.st_size != expect:
            raise RegionError(
                f"region fd {fd}: header says {size} bytes, file is {st.st_size}, sizes imply {expect}"
            )
        mm = mmap.mmap(fd, expect, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        return cls(fd, mm, cfg, owner=False)

    def close(self) -> None:
        """Unmap and close the fd. Views handed out must be gone by now (else BufferError)."""
        if self.mm is None:
            return
        self._u8 = None
        try:
            self.mm.close()
        except BufferError:
            gc.collect()
            self.mm.close()
        self.mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    @property
    def closed(self) -> bool:
        return self.mm is None

    # -- addressing --------------------------------------------------------------------------
    def addr(self, off: int) -> int:
        return self.base + off

    def word_addr(self, w: W) -> int:
        return self.base + self.layout.word(w)

    def view(self, off: int, nbytes: int) -> np.ndarray:
        return self._u8[off:off + nbytes]

    def staging_view(self, slot: int) -> np.ndarray:
        return self.view(self.layout.staging(slot), self.layout.staging_size)

    def reply_view(self, slot: int) -> np.ndarray:
        return self.view(self.layout.reply(slot), self.layout.reply_size)

    def counters(self) -> dict[str, int]:
        arr = self._u8[self.layout.word(W.COUNTERS):self.layout.word(W.COUNTERS) + 64].view("<u4")
        return {c.name.lower(): int(arr[c]) for c in Counter}


# ---------------------------------------------------------------------------------------------
# Round records


def pack_staging(layout: Layout, t: int, requests: list[RoundRequest], flags: int = 0,
                 out: np.ndarray | None = None) -> np.ndarray:
    """Lay a round out as staging bytes (what the engine's gather produces on the device)."""
    cfg = layout.cfg
    if len(requests) > cfg.max_requests:
        raise ValueError(f"{len(requests)} requests in one round, the region holds {cfg.max_requests}")
    n_tok = sum(len(r.tokens) for r in requests)
    if n_tok > cfg.max_tokens:
        raise ValueError(f"{n_tok} tokens in one round, the region holds {cfg.max_tokens}")
    buf = np.zeros(layout.staging_size, np.uint8) if out is None else out
    DESC_HEADER.pack_into(buf, 0, t & 0xFFFFFFFF, len(requests), n_tok, flags)
    table = buf[layout.staging_req_off:layout.staging_req_off + cfg.max_requests * REQ_DTYPE.itemsize]
    table = table.view(REQ_DTYPE)
    toks = buf[layout.staging_tok_off:layout.staging_tok_off + 4 * cfg.max_tokens].view("<i4")
    off = 0
    for i, r in enumerate(requests):
        if not 0 <= r.n_out <= cfg.max_drafts:
            raise ValueError(f"request {r.req_id}: n_out={r.n_out} outside [0, {cfg.max_drafts}]")
        k = len(r.tokens)
        table[i] = (r.req_id, r.generation, r.position, off, k, r.n_out, 0, 0)
        toks[off:off + k] = r.tokens
        off += k
    return buf


class DescriptorError(ValueError):
    pass


def unpack_staging(layout: Layout, buf: np.ndarray, expect_round: int) -> tuple[int, list[RoundRequest]]:
    """Parse staging bytes (a private copy) and check every field. Returns (flags, requests)."""
    cfg = layout.cfg
    rnd, n_req, n_tok, flags = DESC_HEADER.unpack_from(buf, 0)
    if rnd != expect_round & 0xFFFFFFFF:
        raise DescriptorError(f"descriptor is for round {rnd}, expected {expect_round}")
    if n_req > cfg.max_requests:
        raise DescriptorError(f"n_req={n_req} > max_requests={cfg.max_requests}")
    if n_tok > cfg.max_tokens:
        raise DescriptorError(f"n_tok={n_tok} > max_tokens={cfg.max_tokens}")
    table = buf[layout.staging_req_off:layout.staging_req_off + n_req * REQ_DTYPE.itemsize].view(REQ_DTYPE)
    toks = buf[layout.staging_tok_off:layout.staging_tok_off + 4 * n_tok].view("<i4")
    out = []
    # the records as Python ints in one call (the proxy parses every round on its critical path)
    for req_id, generation, position, off, k, n_out, *_ in table.tolist():
        if off + k > n_tok:
            raise DescriptorError(f"request {req_id}: tokens [{off}, {off + k}) beyond n_tok={n_tok}")
        if n_out > cfg.max_drafts:
            raise DescriptorError(f"request {req_id}: n_out={n_out} > max_drafts={cfg.max_drafts}")
        out.append(RoundRequest(req_id, generation, position, toks[off:off + k].copy(), n_out))
    return flags, out


def write_reply(layout: Layout, buf: np.ndarray, t: int, status: Status, counts: np.ndarray | None,
                drafts: np.ndarray | None, conf: np.ndarray | None, detail: str = "") -> None:
    """Fill a reply slot's header and body (never its claim line). A failed round (no counts) carries
    `detail` (UTF-8, cut to the drafts area) where its drafts would be, its length in the header."""
    cfg = layout.cfg
    n_req = 0 if counts is None else len(counts)
    said = b""
    if counts is None and detail:
        said = detail.encode("utf-8", "replace")[:detail_room(cfg)]
        buf[layout.reply_drafts_off:layout.reply_drafts_off + len(said)] = np.frombuffer(said, np.uint8)
    REPLY_HEADER.pack_into(buf, LINE, t & 0xFFFFFFFF, int(status), n_req, len(said))
    c = buf[layout.reply_counts_off:layout.reply_counts_off + 4 * cfg.max_requests].view("<i4")
    c[:] = 0
    if counts is not None and n_req:
        c[:n_req] = counts
        d = buf[layout.reply_drafts_off:layout.reply_drafts_off + 4 * cfg.max_requests * cfg.max_drafts]
        d = d.view("<i4").reshape(cfg.max_requests, cfg.max_drafts)
        f = buf[layout.reply_conf_off:layout.reply_conf_off + 4 * cfg.max_requests * cfg.max_drafts]
        f = f.view("<f4").reshape(cfg.max_requests, cfg.max_drafts)
        d[:n_req] = drafts[:n_req]
        f[:n_req] = conf[:n_req]


def decode_reply(layout: Layout, buf: np.ndarray, t: int, n_out: np.ndarray) -> RoundResult:
    """The engine's verdict on a reply slot copied out after released >= t.

    Trusts nothing in the slot: only claim == 2t (the proxy won round t) with a header for round t,
    status OK, the expected request count, counts within each request's n_out and draft ids inside
    the vocabulary yields drafts; anything else is a zero-draft round with the reason.
    """
    cfg = layout.cfg
    n_req = len(n_out)

    def fail(status: Status, detail: str) -> RoundResult:
        return RoundResult(t, status, np.zeros(n_req, np.int32), np.zeros((n_req, cfg.max_drafts), np.int32),
                           np.zeros((n_req, cfg.max_drafts), np.float32), detail)

    claim = int(buf[:4].view("<u4")[0])
    t32 = t & 0xFFFFFFFF
    if claim == (2 * t32 + 1) & 0xFFFFFFFF:
        return fail(Status.WATCHDOG, "claimed by the watchdog")
    if claim != (2 * t32) & 0xFFFFFFFF:
        return fail(Status.STALE, f"claim word {claim} is not round {t}'s")
    rnd, status, got_req, n_said = REPLY_HEADER.unpack_from(buf, LINE)
    if rnd != t32:
        return fail(Status.STALE, f"reply header is for round {rnd}")
    if status != Status.OK:
        try:
            st = Status(status)
        except ValueError:
            return fail(Status.BAD_REPLY, f"unknown status {status}")
        said = "proxy reported failure"
        if 0 < n_said <= detail_room(cfg):  # text for a log, nothing more
            raw = bytes(buf[layout.reply_drafts_off:layout.reply_drafts_off + n_said])
            said = "".join(c if c.isprintable() else "?" for c in raw.decode("utf-8", "replace"))
        return fail(st if st != Status.NONE else Status.BAD_REPLY, said)
    if got_req != n_req:
        return fail(Status.BAD_REPLY, f"reply has {got_req} requests, round had {n_req}")
    # On the engine's critical path after every round, with caches the verify has just flushed: few numpy
    # calls (a handful of requests, compared as Python ints), each check as strict as the one it stands for.
    counts = buf[layout.reply_counts_off:layout.reply_counts_off + 4 * n_req].view("<i4").copy()
    got, cap = counts.tolist(), np.asarray(n_out).tolist()
    if any(k < 0 or k > m for k, m in zip(got, cap, strict=True)):
        return fail(Status.BAD_REPLY, f"draft counts {got} outside [0, n_out={cap}]")
    d = buf[layout.reply_drafts_off:layout.reply_drafts_off + 4 * n_req * cfg.max_drafts]
    drafts = d.view("<i4").reshape(n_req, cfg.max_drafts).copy()
    f = buf[layout.reply_conf_off:layout.reply_conf_off + 4 * n_req * cfg.max_drafts]
    conf = f.view("<f4").reshape(n_req, cfg.max_drafts).copy()
    for i, k in enumerate(got):  # past a request's count nothing is a draft: zeroed, and then in range
        if k < cfg.max_drafts:
            drafts[i, k:] = 0
            conf[i, k:] = 0.0
    if n_req and (int(drafts.min()) < 0 or int(drafts.max()) >= cfg.vocab_size):
        return fail(Status.BAD_REPLY, "draft id outside the vocabulary")
    return RoundResult(t, Status.OK, counts, drafts, conf)
