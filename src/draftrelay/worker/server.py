"""The worker's TCP server: one thread per connection, every read bounded by a deadline.

A connection is a session (CONTRACT.md §2). Frames are received into a per-connection buffer
that is reused (the STEP's token arrays are numpy views into it, no copy) and that grows only as
bytes arrive, never to a length a header merely declares. Whatever one client sends, the damage
stays on its connection: bad frames get an ERROR frame and, where the framing is lost, the
connection closes; the drafter itself is shared and serialized by WorkerCore's lock.

Who may connect (CONTRACT.md §8): with a secret, a HELLO is answered by a CHALLENGE and nothing of
the HELLO is looked at (identity, limits, rows) before a correct AUTH; with a TLS context every
connection is wrapped before its first frame. Connections are bounded in total and per peer address.
"""

from __future__ import annotations

import logging
import select
import socket
import ssl
import threading
import time
from collections import Counter

from draftrelay.wire import protocol as P
from draftrelay.wire import security
from draftrelay.worker.core import Refusal, Session, WorkerCore
from draftrelay.worker.prefetch import branches_payload

log = logging.getLogger("draftrelay.worker")

HELLO_MAX_FRAME = 1024  # before the handshake nobody gets a big buffer
BUF_START = 4096  # a connection's buffer starts here and doubles only as bytes arrive
BUF_KEEP = 1 << 20  # a connection's buffer shrinks back after a frame larger than this


class _Closed(Exception):
    """The peer closed, reset, or has to be dropped; nothing more to send."""


class _Idle(Exception):
    """No byte of a new frame arrived within the idle (or handshake) timeout."""


class RateLimitedLog:
    """WARNING lines for what clients do wrong, at most one per `every_s` per kind; the lines in
    between are counted and reported with the next one (a flood cannot flood the log)."""

    def __init__(self, logger: logging.Logger, every_s: float = 5.0) -> None:
        self.logger, self.every_s = logger, every_s
        self._last: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()
        self._mu = threading.Lock()

    def warning(self, kind: str, msg: str, *args) -> bool:
        now = time.monotonic()
        with self._mu:
            if now - self._last.get(kind, -1e18) < self.every_s:
                self._suppressed[kind] += 1
                return False
            self._last[kind] = now
            n = self._suppressed.pop(kind, 0)
        self.logger.warning(msg + (f" (+{n} more {kind} since the last line)" if n else ""), *args)
        return True


class _Conn:
    """One accepted connection: its socket, peer and a send lock (the core may evict the session, and
    say so on the socket, from another connection's thread)."""

    def __init__(self, sock: socket.socket, addr) -> None:
        self.sock, self.addr = sock, addr
        self.peer = addr[0]
        self.send_mu = threading.Lock()

    def __str__(self) -> str:
        return f"{self.addr[0]}:{self.addr[1]}"


def _step_waiting(sock: socket.socket) -> bool:
    """Whether the client's next STEP (or its BYE, or the connection's end) is already waiting on `sock`:
    branch work still running then comes too late to be used (worker/prefetch.py cuts it). A peek: the
    frame stays for _read_frame; a PING does not count (the proxy pings while the engine's verify runs)."""
    try:
        if not select.select([sock], [], [], 0)[0]:  # (a recv would first wait out the socket's timeout)
            return bool(isinstance(sock, ssl.SSLSocket) and sock.pending())
        if isinstance(sock, ssl.SSLSocket):  # no peek through TLS: any bytes waiting count
            return True
        head = sock.recv(P.HEADER_SIZE, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return False
    except (OSError, ValueError):
        return True  # the connection failed: nothing will read the table
    if len(head) < P.HEADER_SIZE:
        return True  # closed (b""), or a frame has begun: a PING is too small to arrive in pieces
    try:
        ftype = P.check_header(head, 1 << 31)[1]
    except P.FrameError:
        return True  # the framing is lost: the table would not be read
    return ftype != P.PING


class WorkerServer:
    def __init__(self, core: WorkerCore, host: str = "127.0.0.1", port: int = 0, max_conns: int = 64,
                 handshake_timeout: float = 5.0, frame_timeout: float = 5.0, *, secret: bytes | None = None,
                 tls: ssl.SSLContext | None = None, max_conns_per_peer: int = 16, log_every_s: float = 5.0):
        self.core = core
        self.max_conns, self.max_conns_per_peer = max_conns, max_conns_per_peer
        self.handshake_timeout, self.frame_timeout = handshake_timeout, frame_timeout
        self.secret, self.tls = secret or None, tls
        self.listener = socket.create_server((host, port), reuse_port=False, backlog=128)
        self.address = self.listener.getsockname()[:2]
        self._conns: dict[_Conn, threading.Thread] = {}
        self._per_peer: Counter[str] = Counter()
        self._mu = threading.Lock()
        self._stopping = threading.Event()
        self._accept_thread: threading.Thread | None = None
        self.warn = RateLimitedLog(log, log_every_s)
        self.stats = {"connections": 0, "rejected_connections": 0, "bad_frames": 0, "expired": 0,
                      "auth_failures": 0}
        self.refusals: Counter[str] = Counter()  # ERROR codes sent, by name (the Prometheus counters)

    # ---- lifecycle -----------------------------------------------------------------------------

    def start(self) -> tuple[str, int]:
        self._accept_thread = threading.Thread(target=self._accept_loop, name="worker-accept", daemon=True)
        self._accept_thread.start()
        return self.address

    def serve_forever(self) -> None:
        if self._accept_thread is None:
            self.start()
        while not self._stopping.wait(0.5):
            pass

    def stop(self) -> None:
        self._stopping.set()
        try:
            self.listener.close()
        except OSError:
            pass
        with self._mu:
            conns = list(self._conns.items())
        for conn, _ in conns:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for _, th in conns:
            th.join(timeout=2.0)
        if self._accept_thread is not None:
            self._accept_thread.join(timeout=2.0)

    def active_connections(self) -> int:
        with self._mu:
            return len(self._conns)

    def _accept_loop(self) -> None:
        self.listener.settimeout(0.2)
        while not self._stopping.is_set():
            try:
                sock, addr = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopping.is_set():
                    return
                time.sleep(0.05)  # e.g. out of fds: back off instead of spinning
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, addr)
            with self._mu:
                why = ""
                if len(self._conns) >= self.max_conns:
                    why = f"connection limit {self.max_conns} reached"
                elif self._per_peer[conn.peer] >= self.max_conns_per_peer:
                    why = f"{conn.peer} already has {self._per_peer[conn.peer]} connections (limit per peer " \
                          f"{self.max_conns_per_peer})"
                else:
                    th = threading.Thread(target=self._serve_conn, args=(conn,), daemon=True,
                                          name=f"worker-conn-{addr[1]}")
                    self._conns[conn] = th
                    self._per_peer[conn.peer] += 1
            if why:
                self.stats["rejected_connections"] += 1
                self.warn.warning("capacity", "refused a connection from %s: %s", conn, why)
                if self.tls is None:  # a TLS peer could not read a plain ERROR frame anyway
                    self._send_error(conn, P.OVER_CAPACITY, why, 0)
                else:
                    self.refusals[P.code_name(P.OVER_CAPACITY)] += 1
                sock.close()
                continue
            self.stats["connections"] += 1
            th.start()

    # ---- one connection ---------------------------------------------------------------------------

    def _send_error(self, conn: _Conn, code: int, msg: str, seq: int) -> None:
        self.refusals[P.code_name(code)] += 1
        try:
            with conn.send_mu:
                conn.sock.settimeout(0.5)
                conn.sock.sendall(P.frame(P.ERROR, P.encode_error(code, msg), seq))
        except OSError:
            pass

    def _send(self, conn: _Conn, ftype: int, payload: bytes, seq: int) -> None:
        try:
            with conn.send_mu:
                conn.sock.settimeout(self.frame_timeout)  # a client that never reads cannot hold us forever
                conn.sock.sendall(P.header(ftype, len(payload), seq) + payload)
        except OSError:
            raise _Closed() from None

    def _recv_exact(self, sock: socket.socket, view: memoryview, deadline: float) -> None:
        got = 0
        while got < len(view):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            sock.settimeout(left)
            n = sock.recv_into(view[got:])
            if n == 0:
                raise _Closed()
            got += n

    def _recv_growing(self, sock: socket.socket, buf: bytearray, need: int, deadline: float) -> bytearray:
        """Receive buf[HEADER_SIZE:need], doubling buf only when what arrived fills it: a peer that declares
        4 MiB and sends 4 bytes costs this connection its small buffer, not 4 MiB."""
        have = P.HEADER_SIZE
        while have < need:
            if have == len(buf):
                grown = bytearray(min(need, 2 * len(buf)))
                grown[:have] = memoryview(buf)[:have]
                buf = grown
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            sock.settimeout(left)
            with memoryview(buf) as view:
                n = sock.recv_into(view[have:min(len(buf), need)])
            if n == 0:
                raise _Closed()
            have += n
        return buf

    def _read_frame(self, sock: socket.socket, buf: bytearray, wait: float, max_frame: int):
        """(buf, type, seq, payload view). _Idle if nothing starts within `wait`; once a frame has
        started, all of it must arrive within frame_timeout (FRAME_TIMEOUT otherwise)."""
        try:
            sock.settimeout(max(wait, 1e-3))
            with memoryview(buf) as view:
                n = sock.recv_into(view[:P.HEADER_SIZE])
        except TimeoutError:
            raise _Idle() from None
        except OSError:
            raise _Closed() from None
        if n == 0:
            raise _Closed()
        deadline = time.monotonic() + self.frame_timeout
        try:
            if n < P.HEADER_SIZE:
                with memoryview(buf) as view:
                    self._recv_exact(sock, view[n:P.HEADER_SIZE], deadline)
            _, ftype, length, seq = P.check_header(buf, max_frame)
            buf = self._recv_growing(sock, buf, P.HEADER_SIZE + length, deadline)
        except TimeoutError:
            raise P.FrameError(P.FRAME_TIMEOUT, f"frame incomplete after {self.frame_timeout:.1f} s") from None
        except OSError:
            raise _Closed() from None
        return buf, ftype, seq, memoryview(buf)[P.HEADER_SIZE:P.HEADER_SIZE + length]

    def _authenticate(self, conn: _Conn, buf: bytearray, hello: bytes, seq: int,
                      deadline: float) -> tuple[bytearray, int]:
        """CHALLENGE, then the AUTH frame must carry the HMAC; Refusal (AUTH_REQUIRED / AUTH_FAILED) if not.
        Returns the buffer and the AUTH's seq (HELLO_OK answers the AUTH)."""
        nonce = security.new_nonce()
        self._send(conn, P.CHALLENGE, nonce, seq)
        try:
            buf, ftype, seq, payload = self._read_frame(conn.sock, buf, deadline - time.monotonic(), HELLO_MAX_FRAME)
        except _Idle:
            raise Refusal(P.AUTH_REQUIRED, "no AUTH answer to the CHALLENGE: this worker requires the shared "
                                           "secret (--secret-file or $DRAFTRELAY_SECRET on the client)") from None
        if ftype != P.AUTH:
            raise Refusal(P.AUTH_REQUIRED, f"frame type {ftype} after the CHALLENGE: this worker requires the "
                                           f"shared secret (AUTH with the HMAC of the nonce)")
        if len(payload) != security.MAC_SIZE or not security.verify_mac(self.secret, nonce, hello, payload):
            self.stats["auth_failures"] += 1
            raise Refusal(P.AUTH_FAILED, "wrong shared secret (the AUTH HMAC does not match)")
        return buf, seq

    def _on_evict(self, conn: _Conn, msg: str) -> None:
        self.stats["expired"] += 1
        self._send_error(conn, P.SESSION_EXPIRED, msg, 0)
        try:
            conn.sock.shutdown(socket.SHUT_RDWR)  # the connection's thread sees the close and ends
        except OSError:
            pass

    def _serve_conn(self, conn: _Conn) -> None:
        session: Session | None = None
        buf = bytearray(BUF_START)
        try:
            if self.tls is not None:
                try:
                    conn.sock.settimeout(self.handshake_timeout)
                    conn.sock = self.tls.wrap_socket(conn.sock, server_side=True)
                except (OSError, ssl.SSLError) as exc:
                    self.refusals["TLS_HANDSHAKE"] += 1
                    self.warn.warning("tls", "TLS handshake with %s failed: %s", conn, exc)
                    return
            sock = conn.sock
            # handshake: HELLO first, small, within handshake_timeout (AUTH included)
            deadline = time.monotonic() + self.handshake_timeout
            try:
                buf, ftype, seq, payload = self._read_frame(sock, buf, self.handshake_timeout, HELLO_MAX_FRAME)
            except _Idle:
                self.warn.warning("timeout", "no HELLO from %s within %.1f s", conn, self.handshake_timeout)
                self._send_error(conn, P.FRAME_TIMEOUT, f"no HELLO within {self.handshake_timeout:.1f} s", 0)
                return
            if ftype != P.HELLO:
                self.stats["bad_frames"] += 1
                self.warn.warning("malformed", "refused %s: first frame of type %d, not HELLO", conn, ftype)
                self._send_error(conn, P.BAD_TYPE, f"first frame must be HELLO, got type {ftype}", seq)
                return
            try:
                hello_bytes = bytes(payload)
                hello = P.Hello.decode(hello_bytes)
                if self.secret is not None:
                    buf, seq = self._authenticate(conn, buf, hello_bytes, seq, deadline)
                session, ok = self.core.open_session(hello)
            except (P.FrameError, Refusal) as exc:
                self.stats["bad_frames"] += isinstance(exc, P.FrameError)
                kind = {P.OVER_CAPACITY: "capacity", P.AUTH_FAILED: "auth", P.AUTH_REQUIRED: "auth"}.get(
                    exc.code, "refusal")
                self.warn.warning(kind, "refused %s: %s: %s", conn, P.code_name(exc.code), exc)
                self._send_error(conn, exc.code, str(exc), seq)
                return
            session.on_evict = lambda msg: self._on_evict(conn, msg)
            self._send(conn, P.HELLO_OK, ok.encode(), seq)
            log.info("session %016x opened for %s (%s)", session.id, conn, hello.client_name)
            idle = self.core.idle_timeout
            while not self._stopping.is_set():
                try:
                    buf, ftype, seq, payload = self._read_frame(sock, buf, idle, self.core.max_frame)
                except _Idle:
                    self.stats["expired"] += 1
                    self.warn.warning("expiry", "session %016x (%s) expired: idle for %.1f s", session.id, conn, idle)
                    self._send_error(conn, P.SESSION_EXPIRED, f"idle for {idle:.1f} s", 0)
                    return
                if ftype == P.STEP:
                    try:
                        blocks = P.decode_step(payload, session.max_requests)
                        fanout = P.step_fanout(payload)  # speculation cache: branches follow the reply
                    except P.FrameError as exc:
                        self.stats["bad_frames"] += 1
                        self.warn.warning("malformed", "malformed STEP from %s: %s", conn, exc)
                        self._send_error(conn, exc.code, str(exc), seq)
                        continue
                    try:
                        r = self.core.step(session, blocks)
                        reply = P.encode_step_reply(session.id, r.worker_us, r.request_ids, r.generations,
                                                    r.status, r.counts, r.drafts, r.confidences)
                    except Refusal as exc:  # the session's rows were reclaimed while it waited
                        self._send_error(conn, exc.code, str(exc), seq)
                        return
                    except Exception as exc:  # a bug on our side: report it, keep serving
                        log.exception("STEP failed in session %016x", session.id)
                        self._send_error(conn, P.INTERNAL, f"{type(exc).__name__}: {exc}", seq)
                        continue
                    self._send(conn, P.STEP_REPLY, reply, seq)
                    if fanout:  # drafted after the reply is out, so it never delays the reply
                        self._send(conn, P.BRANCHES, branches_payload(self.core, session, blocks, r, fanout,
                                                                      lambda: _step_waiting(sock)), seq)
                elif ftype == P.PING:
                    self._send(conn, P.PONG, b"", seq)
                elif ftype == P.BYE:
                    return
                else:
                    self.stats["bad_frames"] += 1
                    self.warn.warning("malformed", "unexpected frame type %d from %s", ftype, conn)
                    self._send_error(conn, P.BAD_TYPE, f"unexpected frame type {ftype} in a session", seq)
                if len(buf) > BUF_KEEP:
                    buf = bytearray(BUF_START)
        except P.FrameError as exc:  # framing lost (magic, version, size, timeout): tell and close
            self.stats["bad_frames"] += 1
            self.warn.warning("malformed", "closing %s: %s: %s", conn, P.code_name(exc.code), exc)
            self._send_error(conn, exc.code, str(exc), 0)
        except _Closed:
            pass
        except Exception:
            log.exception("connection %s failed", conn)
        finally:
            if session is not None:
                self.core.close_session(session)
                log.info("session %016x closed", session.id)
            try:
                conn.sock.close()
            except OSError:
                pass
            with self._mu:
                self._conns.pop(conn, None)
                self._per_peer[conn.peer] -= 1
                if self._per_peer[conn.peer] <= 0:
                    del self._per_peer[conn.peer]
