"""The drafter worker client: numpy + the standard library only (the proxy process imports it).

One round is one call: `reply = client.step(blocks, timeout=0.05)`. It either returns a
`StepReply` (per-block status, drafts, confidences) or raises one of the `WireError` classes
below; it never blocks past its timeout. Not thread-safe: one client per proxy thread.

Failure handling, in one place:
- timeout: the connection stays open; the late reply, when it comes, is skipped by its seq.
- disconnect / bad reply: the connection is closed; the next call reconnects (a new session: the
  worker then answers UNKNOWN_REQUEST until requests are resent from position 0).
- circuit breaker: after `breaker_failures` failures in a row, calls raise WireBreakerOpen at once
  for `breaker_cooldown` seconds; then one call goes through (success closes the breaker).
- idle sessions: the worker expires a session that sent no frame for its idle timeout (HELLO_OK's
  idle_timeout_ms, 60 s by default), and the first round after such a pause would then fail and reach
  a new session that knows none of the requests. `keepalive()`, called by whoever holds the client while
  no round runs (the proxy between rounds, SyncRounds' timer), PINGs once a third of that timeout has
  passed without a frame, so a pause between requests costs no round.
"""

from __future__ import annotations

import socket
import ssl
import struct
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from draftrelay.wire import protocol as P
from draftrelay.wire import security
from draftrelay.wire.protocol import Block, Hello, HelloOk

__all__ = ["Block", "BlockResult", "DrafterClient", "StepReply", "WireBadReply", "WireBreakerOpen",
           "WireDisconnected", "WireError", "WireRefused", "WireRemoteError", "WireTimeout"]

CLIENT_MAX_FRAME = 1 << 20  # replies are small: 16 + blocks * (16 + 8 * n_out)
KEEPALIVE_WITHIN = 1 / 3  # keepalive() PINGs once this fraction of the worker's idle timeout has passed


class WireError(Exception):
    """Base class: the round failed; decode target-only."""


class WireTimeout(WireError):
    """No complete reply within the call's timeout."""


class WireDisconnected(WireError):
    """Could not connect, or the connection was closed or reset."""


class WireBadReply(WireError):
    """The worker's bytes do not follow the contract (framing, counts, ids)."""


class WireRemoteError(WireError):
    """The worker answered with an ERROR frame."""

    def __init__(self, code: int, message: str):
        super().__init__(f"{P.code_name(code)} ({code}): {message}")
        self.code, self.message = code, message


class WireRefused(WireRemoteError):
    """The worker refused the handshake (identity, version, limits or capacity)."""


class WireBreakerOpen(WireError):
    """Too many failures in a row: failing fast until the cool-down ends."""


class BlockResult(NamedTuple):
    request_id: int
    status: int  # P.OK, P.PARTIAL, or a refusal code (CONTRACT.md §4)
    drafts: np.ndarray  # int32 [n]
    confidences: np.ndarray  # float32 [n]


class StepReply(Sequence):
    """Per-block results in request order, plus array views for copying into shared memory."""

    def __init__(self, session_id: int, worker_us: int, request_ids: np.ndarray, generations: np.ndarray,
                 status: np.ndarray, counts: np.ndarray, drafts: np.ndarray, confidences: np.ndarray):
        self.session_id, self.worker_us = session_id, worker_us
        self.request_ids, self.generations = request_ids, generations  # uint64 [B], uint32 [B]
        self.status, self.counts = status, counts  # uint16 [B], uint16 [B]
        self.drafts, self.confidences = drafts, confidences  # int32 [B, n_out_max], float32 (zero padded)

    def __len__(self) -> int:
        return len(self.status)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = int(self.counts[i])
        return BlockResult(int(self.request_ids[i]), int(self.status[i]), self.drafts[i, :n],
                           self.confidences[i, :n])


class DrafterClient:
    def __init__(self, host: str, port: int, *, model_id: str = "", vocab_size: int = 0, tokenizer_hash: str = "",
                 n_out_max: int = 8, max_requests: int = 4, client_name: str = "draftrelay",
                 connect_timeout: float = 1.0, timeout: float = 0.5, breaker_failures: int = 3,
                 breaker_cooldown: float = 1.0, secret: bytes | None = None, tls: ssl.SSLContext | None = None,
                 tls_server_name: str = ""):
        self.addr = (host, int(port))
        # the shared secret answers the worker's CHALLENGE (wire/security.py); TLS wraps the socket
        self._secret = secret or None
        self.tls, self.tls_server_name = tls, tls_server_name or host
        self.hello = Hello(P.VERSION, max_requests, n_out_max, 0, vocab_size, model_id, tokenizer_hash, client_name)
        self.hello.encode()  # validates the strings now, not at the first round
        self.connect_timeout, self.timeout = connect_timeout, timeout
        self.breaker_failures, self.breaker_cooldown = breaker_failures, breaker_cooldown
        self.sock: socket.socket | None = None
        self.info: HelloOk | None = None  # the worker's HELLO_OK of the current session
        self._rx = bytearray(64 * 1024)  # receive buffer, grows up to CLIENT_MAX_FRAME
        self._have = 0  # bytes in _rx not yet consumed (a reply may arrive across calls after a timeout)
        self._seq = 0
        self._fails = 0
        self._open_until = 0.0
        self._last_sent = 0.0  # monotonic time of the last frame sent (the worker's idle clock restarts)
        self.stats = {"steps": 0, "timeouts": 0, "disconnects": 0, "bad_replies": 0, "remote_errors": 0,
                      "breaker_rejects": 0, "connects": 0, "skipped_late_replies": 0, "keepalives": 0,
                      "keepalive_failures": 0, "late_branches": 0}
        # the speculation cache (handoff/branch_push.py): called with (seq, payload) for a BRANCHES frame
        # that arrives while a later frame's reply is awaited, instead of skipping it (its table may still
        # be in time: the engine waits for it until the next round is answered)
        self.on_late_branches: Callable[[int, memoryview], None] | None = None

    # ---- public -----------------------------------------------------------------------------------

    @property
    def last_seq(self) -> int:
        """The sequence number of the last frame sent (a STEP's BRANCHES frame carries it)."""
        return self._seq

    @property
    def session_id(self) -> int:
        return self.info.session_id if self.info else 0

    @property
    def connected(self) -> bool:
        return self.sock is not None

    def connect(self, timeout: float | None = None) -> HelloOk:
        """Open a connection and handshake (a new session). Counts toward the breaker."""
        deadline = time.monotonic() + (self.connect_timeout if timeout is None else timeout)
        return self._guarded(lambda: self._connect(deadline))

    def step(self, blocks: Sequence[Block], timeout: float | None = None, fanout: int = 0) -> StepReply:
        """One STEP round: send every block, return the worker's per-block results. fanout > 0 also
        asks for a branch table (the speculation cache), read afterwards with `recv_branches`."""
        t0 = time.monotonic()
        deadline = t0 + (self.timeout if timeout is None else timeout)
        if not blocks:
            raise ValueError("step needs at least one block")
        payload = P.encode_step(blocks, fanout)  # encoding errors are the caller's bug, not a wire failure
        return self._guarded(lambda: self._step(payload, blocks, deadline, t0))

    def recv_branches(self, timeout: float) -> memoryview:
        """The payload of the BRANCHES frame answering the last STEP (raw bytes, parsed by
        draftrelay.speculation.table). A timeout leaves the connection open: the late frame is then
        skipped like a late reply. It does not count toward the breaker: a missing table costs a hit only."""
        deadline = time.monotonic() + timeout
        if self.sock is None:
            raise WireDisconnected("not connected")
        return self._recv_reply(self._seq, P.BRANCHES, deadline)

    def ping(self, timeout: float | None = None) -> float:
        """Round trip of an empty frame, in seconds (also keeps an idle session alive)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)

        def go():
            t0 = time.perf_counter()
            self._ensure(deadline)
            seq = self._send(P.PING, b"", deadline)
            self._recv_reply(seq, P.PONG, deadline)
            return time.perf_counter() - t0

        return self._guarded(go)

    def keepalive(self) -> bool:
        """PING the worker if this session has sent nothing for KEEPALIVE_WITHIN of its idle timeout; True
        if it did and the PONG came back. Not connected, or no timeout announced: nothing to keep. A failed
        PING drops the connection (the next round reconnects, as after any disconnect) but does not
        count toward the breaker: no round failed."""
        if self.sock is None or self.info is None or not self.info.idle_timeout_ms:
            return False
        if time.monotonic() - self._last_sent < KEEPALIVE_WITHIN * self.info.idle_timeout_ms / 1000:
            return False
        deadline = time.monotonic() + self.timeout
        try:
            seq = self._send(P.PING, b"", deadline)
            self._recv_reply(seq, P.PONG, deadline)
        except WireError:
            self.stats["keepalive_failures"] += 1
            self._drop()
            return False
        self.stats["keepalives"] += 1
        return True

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.settimeout(0.05)
                self.sock.sendall(P.frame(P.BYE, b"", 0))
            except OSError:
                pass
            self._drop()

    def __enter__(self) -> DrafterClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def breaker_open(self) -> bool:
        return self._fails >= self.breaker_failures and time.monotonic() < self._open_until

    # ---- internals ------------------------------------------------------------------------------------

    def _guarded(self, fn):
        if self._fails >= self.breaker_failures and time.monotonic() < self._open_until:
            self.stats["breaker_rejects"] += 1
            raise WireBreakerOpen(f"{self._fails} failures in a row; retrying in "
                                  f"{self._open_until - time.monotonic():.3f} s")
        try:
            out = fn()
        except WireError as exc:
            if isinstance(exc, WireTimeout):
                self.stats["timeouts"] += 1
            elif isinstance(exc, WireDisconnected):
                self.stats["disconnects"] += 1
            elif isinstance(exc, WireBadReply):
                self.stats["bad_replies"] += 1
            elif isinstance(exc, WireRemoteError):
                self.stats["remote_errors"] += 1
            self._fails += 1
            if self._fails >= self.breaker_failures:
                self._open_until = time.monotonic() + self.breaker_cooldown
            raise
        self._fails = 0
        return out

    def _drop(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
        self.sock, self.info, self._have = None, None, 0

    def _ensure(self, deadline: float) -> None:
        if self.sock is None:
            self._connect(deadline)

    def _connect(self, deadline: float) -> HelloOk:
        self._drop()
        left = deadline - time.monotonic()
        if left <= 0:
            raise WireTimeout("no time left to connect")
        try:
            sock = socket.create_connection(self.addr, timeout=left)
        except TimeoutError:
            raise WireTimeout(f"connect to {self.addr[0]}:{self.addr[1]} timed out") from None
        except OSError as exc:
            raise WireDisconnected(f"cannot connect to {self.addr[0]}:{self.addr[1]}: {exc}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.tls is not None:
            try:
                sock.settimeout(max(1e-3, deadline - time.monotonic()))
                sock = self.tls.wrap_socket(sock, server_hostname=self.tls_server_name)
            except TimeoutError:
                sock.close()
                raise WireTimeout(f"TLS handshake with {self.addr[0]}:{self.addr[1]} timed out") from None
            except (ssl.SSLError, ssl.CertificateError) as exc:
                sock.close()
                raise WireRefused(P.AUTH_FAILED, f"TLS with {self.addr[0]}:{self.addr[1]}: {exc}") from None
            except OSError as exc:
                sock.close()
                raise WireDisconnected(f"TLS with {self.addr[0]}:{self.addr[1]}: {exc}") from None
        self.sock = sock
        self.stats["connects"] += 1
        try:
            hello = self.hello.encode()
            seq = self._send(P.HELLO, hello, deadline)
            ftype, payload = self._recv_any(seq, (P.HELLO_OK, P.CHALLENGE), deadline, refusal=True)
            if ftype == P.CHALLENGE:
                if self._secret is None:
                    raise WireRefused(P.AUTH_REQUIRED, f"the worker at {self.addr[0]}:{self.addr[1]} requires the "
                                                       f"shared secret (--secret-file or ${security.SECRET_ENV})")
                if len(payload) != security.NONCE_SIZE:
                    raise WireBadReply(f"CHALLENGE of {len(payload)} bytes (expected {security.NONCE_SIZE})")
                seq = self._send(P.AUTH, security.auth_mac(self._secret, payload, hello), deadline)
                payload = self._recv_reply(seq, P.HELLO_OK, deadline, refusal=True)
            try:
                info = HelloOk.decode(payload)
            except P.FrameError as exc:
                raise WireBadReply(str(exc)) from None
            if info.n_out_max < self.hello.n_out_max or info.max_requests < self.hello.max_requests:
                raise WireBadReply(f"HELLO_OK grants less than asked: {info}")
        except WireTimeout:
            self._drop()  # a half-done handshake is not worth keeping
            raise
        except WireError:
            self._drop()
            raise
        self.info = info
        return info

    def _send(self, ftype: int, payload: bytes, deadline: float) -> int:
        self._seq = (self._seq + 1) & 0xFFFFFFFF or 1
        data = P.header(ftype, len(payload), self._seq) + payload
        left = deadline - time.monotonic()
        if left <= 0:
            raise WireTimeout("no time left to send")
        try:
            self.sock.settimeout(left)
            self.sock.sendall(data)
            self._last_sent = time.monotonic()
        except TimeoutError:
            self._drop()  # a partly sent frame breaks the framing: this connection is done
            raise WireTimeout("send timed out") from None
        except OSError as exc:
            self._drop()
            raise WireDisconnected(f"send failed: {exc}") from None
        return self._seq

    def _read_frame(self, deadline: float) -> tuple[int, int, memoryview]:
        """(type, seq, payload view) of the next whole frame; keeps partial bytes across timeouts."""
        while True:
            if self._have >= P.HEADER_SIZE:
                try:
                    _, ftype, length, seq = P.check_header(self._rx, CLIENT_MAX_FRAME)
                except P.FrameError as exc:
                    self._drop()
                    raise WireBadReply(f"reply header: {exc}") from None
                need = P.HEADER_SIZE + length
                if need > len(self._rx):
                    self._rx.extend(bytes(need - len(self._rx)))
                if self._have >= need:
                    payload = bytes(self._rx[P.HEADER_SIZE:need])
                    rest = self._have - need
                    if rest:
                        self._rx[:rest] = self._rx[need:self._have]
                    self._have = rest
                    return ftype, seq, memoryview(payload)
            left = deadline - time.monotonic()
            if left <= 0:
                raise WireTimeout("no reply within the timeout")
            try:
                self.sock.settimeout(left)
                got = self.sock.recv_into(memoryview(self._rx)[self._have:])
            except TimeoutError:
                raise WireTimeout("no reply within the timeout") from None
            except OSError as exc:
                self._drop()
                raise WireDisconnected(f"receive failed: {exc}") from None
            if got == 0:
                self._drop()
                raise WireDisconnected("the worker closed the connection")
            self._have += got

    def _recv_reply(self, seq: int, want: int, deadline: float, refusal: bool = False) -> memoryview:
        return self._recv_any(seq, (want,), deadline, refusal)[1]

    def _recv_any(self, seq: int, wants: tuple[int, ...], deadline: float,
                  refusal: bool = False) -> tuple[int, memoryview]:
        while True:
            ftype, rseq, payload = self._read_frame(deadline)
            if ftype == P.ERROR:
                try:
                    code, msg = P.decode_error(payload)
                except P.FrameError as exc:
                    self._drop()
                    raise WireBadReply(str(exc)) from None
                if rseq != seq and rseq != 0 and code not in P.CLOSING_ERRORS:
                    self.stats["skipped_late_replies"] += 1
                    continue  # an error about an older, timed-out frame
                if code in P.CLOSING_ERRORS:
                    self._drop()
                raise (WireRefused if refusal else WireRemoteError)(code, msg)
            if rseq != seq:
                if rseq < seq and ftype == P.BRANCHES and self.on_late_branches is not None:
                    self.stats["late_branches"] += 1
                    self.on_late_branches(rseq, payload)  # (the callback keeps no view: payload is a copy)
                    continue
                if rseq < seq and ftype in (P.STEP_REPLY, P.PONG, P.HELLO_OK, P.BRANCHES):
                    self.stats["skipped_late_replies"] += 1
                    continue  # the late answer to a round that already timed out
                self._drop()
                raise WireBadReply(f"reply seq {rseq} does not match request seq {seq}")
            if ftype not in wants:
                self._drop()
                raise WireBadReply(f"expected {' or '.join(P.FRAME_NAMES[w] for w in wants)}, got frame type {ftype}")
            return ftype, payload

    def _step(self, payload: bytes, blocks: Sequence[Block], deadline: float, t0: float) -> StepReply:
        phase = "connecting and the handshake" if self.sock is None else "sending the STEP"
        try:
            self._ensure(deadline)
            phase = "sending the STEP"
            seq = self._send(P.STEP, payload, deadline)
            phase = "waiting for the STEP's reply"
            reply = self._recv_reply(seq, P.STEP_REPLY, deadline)
        except WireTimeout as exc:  # which part of the round ran out of time, and how much it had
            raise WireTimeout(f"{exc} ({phase}; {(time.monotonic() - t0) * 1e3:.1f} ms of "
                              f"{(deadline - t0) * 1e3:.1f} ms)") from None
        self.stats["steps"] += 1
        try:
            return self._decode_reply(reply, blocks)
        except (P.FrameError, struct.error, ValueError) as exc:
            self._drop()
            raise WireBadReply(f"STEP_REPLY: {exc}") from None

    def _decode_reply(self, buf: memoryview, blocks: Sequence[Block]) -> StepReply:
        n_blocks, _, worker_us, session_id = P.REPLY_HEAD.unpack_from(buf, 0)
        if n_blocks != len(blocks):
            raise ValueError(f"{n_blocks} blocks in the reply for {len(blocks)} sent")
        width = max(1, max(int(b.n_out) for b in blocks))
        B = n_blocks
        rids = np.zeros(B, np.uint64)
        gens = np.zeros(B, np.uint32)
        status = np.zeros(B, np.uint16)
        counts = np.zeros(B, np.uint16)
        drafts = np.zeros((B, width), np.int32)
        confs = np.zeros((B, width), np.float32)
        off = P.REPLY_HEAD.size
        for i, blk in enumerate(blocks):
            rid, gen, st, n = P.RBLOCK_HEAD.unpack_from(buf, off)
            off += P.RBLOCK_HEAD.size
            if rid != blk.request_id:
                raise ValueError(f"block {i}: request id {rid} where {blk.request_id} was sent")
            if n > blk.n_out or (st not in (P.OK, P.PARTIAL) and n) or (st == P.OK and n != blk.n_out):
                raise ValueError(f"block {i}: {n} drafts with status {P.code_name(st)} for n_out {blk.n_out}")
            if off + 8 * n > len(buf):
                raise ValueError(f"block {i}: truncated drafts")
            drafts[i, :n] = np.frombuffer(buf, "<i4", n, off)
            confs[i, :n] = np.frombuffer(buf, "<f4", n, off + 4 * n)
            off += 8 * n
            rids[i], gens[i], status[i], counts[i] = rid, gen, st, n
        if off != len(buf):
            raise ValueError(f"{len(buf) - off} trailing bytes")
        return StepReply(session_id, worker_us, rids, gens, status, counts, drafts, confs)


def security_from_spec(spec: dict) -> dict:
    """DrafterClient keyword arguments for the secret and TLS a round spec names: keys `secret` (only in
    a process's memory: the engine hands it to its proxy through the environment, never argv),
    `secret_file`, else $DRAFTRELAY_SECRET; `tls` (bool), `tls_ca` (PEM file), `tls_verify` (default
    true), `tls_server_name`. security.SecretError / ValueError for what cannot be loaded."""
    secret = spec.get("secret") or ""
    key = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not key:
        key = security.load_secret(str(spec.get("secret_file", ""))) or b""
    tls = None
    if spec.get("tls") or spec.get("tls_ca"):
        tls = security.client_tls_context(str(spec.get("tls_ca", "")), bool(spec.get("tls_verify", True)))
    return {"secret": key or None, "tls": tls, "tls_server_name": str(spec.get("tls_server_name", ""))}
