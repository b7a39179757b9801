"""The worker's TCP server: one thread per connection, every read bounded by a deadline.

A connection is a session (CONTRACT.md §2). Frames are received into a per-connection buffer
that is reused (the STEP's token arrays are numpy views into it, no copy). Whatever one client
sends, the damage stays on its connection: bad frames get an ERROR frame and, where the framing
is lost, the connection closes; the drafter itself is shared and serialized by WorkerCore's lock.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

from draftrelay.wire import protocol as P
from draftrelay.worker.core import Refusal, Session, WorkerCore

log = logging.getLogger("draftrelay.worker")

HELLO_MAX_FRAME = 1024  # before the handshake nobody gets a big buffer
BUF_KEEP = 1 << 20  # a connection's buffer shrinks back after a frame larger than this


class _Closed(Exception):
    """The peer closed, reset, or has to be dropped; nothing more to send."""


class _Idle(Exception):
    """No byte of a new frame arrived within the idle (or handshake) timeout."""


class WorkerServer:
    def __init__(self, core: WorkerCore, host: str = "127.0.0.1", port: int = 0, max_conns: int = 64,
                 handshake_timeout: float = 5.0, frame_timeout: float = 5.0):
        self.core = core
        self.max_conns = max_conns
        self.handshake_timeout, self.frame_timeout = handshake_timeout, frame_timeout
        self.listener = socket.create_server((host, port), reuse_port=False, backlog=128)
        self.address = self.listener.getsockname()[:2]
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._mu = threading.Lock()
        self._stopping = threading.Event()
        self._accept_thread: threading.Thread | None = None
        self.stats = {"connections": 0, "rejected_connections": 0, "bad_frames": 0, "expired": 0}

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
        for sock, _ in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
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
            with self._mu:
                full = len(self._conns) >= self.max_conns
                if not full:
                    th = threading.Thread(target=self._serve_conn, args=(sock, addr), daemon=True,
                                          name=f"worker-conn-{addr[1]}")
                    self._conns[sock] = th
            if full:
                self.stats["rejected_connections"] += 1
                self._send_error(sock, P.OVER_CAPACITY, f"connection limit {self.max_conns} reached", 0)
                sock.close()
                continue
            self.stats["connections"] += 1
            th.start()

    # ---- one connection ---------------------------------------------------------------------------

    def _send_error(self, sock: socket.socket, code: int, msg: str, seq: int) -> None:
        try:
            sock.settimeout(0.5)
            sock.sendall(P.frame(P.ERROR, P.encode_error(code, msg), seq))
        except OSError:
            pass

    def _send(self, sock: socket.socket, ftype: int, payload: bytes, seq: int) -> None:
        try:
            sock.settimeout(self.frame_timeout)  # a client that never reads cannot hold us forever
            sock.sendall(P.header(ftype, len(payload), seq) + payload)
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

    def _read_frame(self, sock: socket.socket, buf: bytearray, wait: float, max_frame: int):
        """(buf, type, seq, payload view). _Idle if nothing starts within `wait`; once a frame has
        started, all of it must arrive within frame_timeout (FRAME_TIMEOUT otherwise)."""
        view = memoryview(buf)
        try:
            sock.settimeout(wait)
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
                self._recv_exact(sock, view[n:P.HEADER_SIZE], deadline)
            _, ftype, length, seq = P.check_header(buf, max_frame)
            if P.HEADER_SIZE + length > len(buf):
                buf = bytearray(P.HEADER_SIZE + length)
                buf[:P.HEADER_SIZE] = view[:P.HEADER_SIZE]
                view = memoryview(buf)
            self._recv_exact(sock, view[P.HEADER_SIZE:P.HEADER_SIZE + length], deadline)
        except TimeoutError:
            raise P.FrameError(P.FRAME_TIMEOUT, f"frame incomplete after {self.frame_timeout:.1f} s") from None
        except OSError:
            raise _Closed() from None
        return buf, ftype, seq, view[P.HEADER_SIZE:P.HEADER_SIZE + length]

    def _serve_conn(self, sock: socket.socket, addr) -> None:
        session: Session | None = None
        buf = bytearray(64 * 1024)
        try:
            # handshake: HELLO first, small, within handshake_timeout
            try:
                buf, ftype, seq, payload = self._read_frame(sock, buf, self.handshake_timeout, HELLO_MAX_FRAME)
            except _Idle:
                self._send_error(sock, P.FRAME_TIMEOUT, f"no HELLO within {self.handshake_timeout:.1f} s", 0)
                return
            if ftype != P.HELLO:
                self.stats["bad_frames"] += 1
                self._send_error(sock, P.BAD_TYPE, f"first frame must be HELLO, got type {ftype}", seq)
                return
            try:
                hello = P.Hello.decode(payload)
                session, ok = self.core.open_session(hello)
            except (P.FrameError, Refusal) as exc:
                self.stats["bad_frames"] += isinstance(exc, P.FrameError)
                log.info("refused %s:%s: %s", addr[0], addr[1], exc)
                self._send_error(sock, exc.code, str(exc), seq)
                return
            self._send(sock, P.HELLO_OK, ok.encode(), seq)
            log.info("session %016x opened for %s:%s (%s)", session.id, addr[0], addr[1], hello.client_name)
            idle = self.core.idle_timeout
            while not self._stopping.is_set():
                try:
                    buf, ftype, seq, payload = self._read_frame(sock, buf, idle, self.core.max_frame)
                except _Idle:
                    self.stats["expired"] += 1
                    self._send_error(sock, P.SESSION_EXPIRED, f"idle for {idle:.1f} s", 0)
                    return
                if ftype == P.STEP:
                    try:
                        blocks = P.decode_step(payload, session.max_requests)
                    except P.FrameError as exc:
                        self.stats["bad_frames"] += 1
                        self._send_error(sock, exc.code, str(exc), seq)
                        continue
                    try:
                        r = self.core.step(session, blocks)
                        reply = P.encode_step_reply(session.id, r.worker_us, r.request_ids, r.generations,
                                                    r.status, r.counts, r.drafts, r.confidences)
                    except Exception as exc:  # a bug on our side: report it, keep serving
                        log.exception("STEP failed in session %016x", session.id)
                        self._send_error(sock, P.INTERNAL, f"{type(exc).__name__}: {exc}", seq)
                        continue
                    self._send(sock, P.STEP_REPLY, reply, seq)
                elif ftype == P.PING:
                    self._send(sock, P.PONG, b"", seq)
                elif ftype == P.BYE:
                    return
                else:
                    self.stats["bad_frames"] += 1
                    self._send_error(sock, P.BAD_TYPE, f"unexpected frame type {ftype} in a session", seq)
                if len(buf) > BUF_KEEP:
                    buf = bytearray(64 * 1024)
        except P.FrameError as exc:  # framing lost (magic, version, size, timeout): tell and close
            self.stats["bad_frames"] += 1
            log.info("closing %s:%s: %s", addr[0], addr[1], exc)
            self._send_error(sock, exc.code, str(exc), 0)
        except _Closed:
            pass
        except Exception:
            log.exception("connection %s:%s failed", addr[0], addr[1])
        finally:
            if session is not None:
                self.core.close_session(session)
                log.info("session %016x closed", session.id)
            try:
                sock.close()
            except OSError:
                pass
            with self._mu:
                self._conns.pop(sock, None)
