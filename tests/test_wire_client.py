"""The numpy-only client against scripted fake workers: timeouts, late replies, disconnects, bad
replies, refusals and the circuit breaker. (The real worker is tested in test_worker_*.py.)"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from draftrelay.wire import (
    Block,
    DrafterClient,
    WireBadReply,
    WireBreakerOpen,
    WireDisconnected,
    WireRefused,
    WireRemoteError,
    WireTimeout,
)
from draftrelay.wire import protocol as P


def read_frame(conn: socket.socket):
    def exact(n):
        b = b""
        while len(b) < n:
            got = conn.recv(n - len(b))
            if not got:
                raise ConnectionError
            b += got
        return b

    _, _, ftype, length, seq = P.HEADER.unpack(exact(16))
    return ftype, seq, exact(length)


def hello_ok(sid=1):
    return P.HelloOk(sid, 1, 4, 8, 100, 4096, 1 << 20, 60000, "fake", "", "fake").encode()


def reply_for(payload: bytes, sid=1, draft=7, status=P.OK):
    blocks = P.decode_step(payload, 64)
    w = max(1, max(b.n_out for b in blocks))
    d = np.full((len(blocks), w), draft, np.int32)
    c = np.full((len(blocks), w), 0.5, np.float32)
    counts = [b.n_out if status == P.OK else 0 for b in blocks]
    return P.encode_step_reply(sid, 10, [b.request_id for b in blocks], [b.generation for b in blocks],
                               [status] * len(blocks), counts, d, c)


class FakeWorker:
    """Accepts connections; `script(conn, n_conn)` plays one connection."""

    def __init__(self, script):
        self.script = script
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.n = 0
        self.threads = []
        self.stop = False
        t = threading.Thread(target=self._loop, daemon=True)
        t.start()
        self.threads.append(t)

    def _loop(self):
        self.sock.settimeout(0.1)
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            self.n += 1
            t = threading.Thread(target=self._run, args=(conn, self.n), daemon=True)
            t.start()
            self.threads.append(t)

    def _run(self, conn, n):
        try:
            self.script(conn, n)
        except (ConnectionError, OSError, P.FrameError):
            pass  # the client went away, or sent BYE/PING where the script expected a STEP
        finally:
            conn.close()

    def close(self):
        self.stop = True
        self.sock.close()
        for t in self.threads:
            t.join(2)


@pytest.fixture
def fake():
    made = []

    def make(script):
        f = FakeWorker(script)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


def blk(rid=1, n_out=3):
    return Block(rid, 0, 0, np.array([1, 2, 3], np.int32), n_out)


def handshake(conn, sid=1):
    ftype, seq, payload = read_frame(conn)
    assert ftype == P.HELLO
    conn.sendall(P.frame(P.HELLO_OK, hello_ok(sid), seq))


def test_step_ok_and_reply_shape(fake):
    def script(conn, n):
        handshake(conn, sid=42)
        while True:
            ftype, seq, payload = read_frame(conn)
            conn.sendall(P.frame(P.STEP_REPLY, reply_for(payload, sid=42), seq))

    f = fake(script)
    c = DrafterClient("127.0.0.1", f.port, vocab_size=100)
    r = c.step([blk(1, 3), blk(2, 0)], timeout=1.0)
    assert c.session_id == 42 and r.session_id == 42 and r.worker_us == 10
    assert len(r) == 2 and r[0].request_id == 1 and r[0].status == P.OK
    assert r[0].drafts.dtype == np.int32 and r[0].drafts.tolist() == [7, 7, 7]
    assert r[0].confidences.dtype == np.float32 and r[1].drafts.size == 0
    assert r.drafts.shape == (2, 3) and r.counts.tolist() == [3, 0]
    c.close()


def test_timeout_keeps_connection_and_skips_the_late_reply(fake):
    def script(conn, n):
        handshake(conn)
        ftype, seq, payload = read_frame(conn)
        time.sleep(0.3)  # too late for the first call
        conn.sendall(P.frame(P.STEP_REPLY, reply_for(payload, draft=1), seq))
        while True:
            ftype, seq, payload = read_frame(conn)
            conn.sendall(P.frame(P.STEP_REPLY, reply_for(payload, draft=2), seq))

    f = fake(script)
    c = DrafterClient("127.0.0.1", f.port)
    c.connect()
    t0 = time.monotonic()
    with pytest.raises(WireTimeout, match=r"waiting for the STEP's reply; 1\d\d\.\d ms of 100\.0 ms"):
        c.step([blk(1)], timeout=0.1)  # the message names the part of the round that ran out of time
    assert time.monotonic() - t0 < 0.25  # the call respects its deadline
    assert c.connected
    r = c.step([blk(5)], timeout=2.0)
    assert r[0].request_id == 5 and r[0].drafts.tolist() == [2, 2, 2]
    assert c.stats["skipped_late_replies"] == 1 and c.stats["connects"] == 1 and f.n == 1
    c.close()


def test_disconnect_then_reconnect_is_a_new_session(fake):
    def script(conn, n):
        handshake(conn, sid=n)
        ftype, seq, payload = read_frame(conn)
        if n == 1:
            return  # close mid-round
        conn.sendall(P.frame(P.STEP_REPLY, reply_for(payload, sid=n), seq))

    f = fake(script)
    c = DrafterClient("127.0.0.1", f.port)
    with pytest.raises(WireDisconnected):
        c.step([blk()], timeout=1.0)
    assert not c.connected
    r = c.step([blk()], timeout=1.0)
    assert r.session_id == 2 and c.stats["connects"] == 2
    c.close()


@pytest.mark.parametrize("mode", ["garbage", "wrong_id", "too_many", "wrong_type", "bad_version", "huge"])
def test_bad_replies(fake, mode):
    def script(conn, n):
        handshake(conn)
        ftype, seq, payload = read_frame(conn)
        if mode == "garbage":
            conn.sendall(b"\x13" * 64)
        elif mode == "wrong_id":
            p = bytearray(reply_for(payload))
            p[16] ^= 1
            conn.sendall(P.frame(P.STEP_REPLY, bytes(p), seq))
        elif mode == "too_many":
            conn.sendall(P.frame(P.STEP_REPLY, reply_for(P.encode_step([blk(1, 5)])), seq))
        elif mode == "wrong_type":
            conn.sendall(P.frame(P.HELLO_OK, hello_ok(), seq))
        elif mode == "bad_version":
            conn.sendall(P.header(P.STEP_REPLY, 0, seq, version=9))
        elif mode == "huge":
            conn.sendall(P.header(P.STEP_REPLY, 1 << 30, seq))
        time.sleep(0.5)

    f = fake(script)
    c = DrafterClient("127.0.0.1", f.port)
    with pytest.raises(WireBadReply):
        c.step([blk(1, 3)], timeout=1.0)
    assert not c.connected  # framing can no longer be trusted
    c.close()


def test_refusal_and_remote_error(fake):
    def script(conn, n):
        ftype, seq, payload = read_frame(conn)
        if n == 1:
            conn.sendall(P.frame(P.ERROR, P.encode_error(P.IDENTITY_MISMATCH, "vocab_size: 5 vs 6"), seq))
            return
        conn.sendall(P.frame(P.HELLO_OK, hello_ok(), seq))
        ftype, seq, payload = read_frame(conn)
        conn.sendall(P.frame(P.ERROR, P.encode_error(P.MALFORMED, "whatever"), seq))
        ftype, seq, payload = read_frame(conn)
        conn.sendall(P.frame(P.STEP_REPLY, reply_for(payload), seq))

    f = fake(script)
    c = DrafterClient("127.0.0.1", f.port)
    with pytest.raises(WireRefused) as e:
        c.connect()
    assert e.value.code == P.IDENTITY_MISMATCH and "vocab_size" in str(e.value)
    assert not c.connected
    with pytest.raises(WireRemoteError) as e2:
        c.step([blk()], timeout=1.0)
    assert e2.value.code == P.MALFORMED and not isinstance(e2.value, WireRefused)
    assert c.connected  # MALFORMED keeps the session (CONTRACT §5)
    assert c.step([blk()], timeout=1.0)[0].status == P.OK
    c.close()


def test_breaker_opens_fails_fast_and_recovers(fake):
    answer = threading.Event()

    def script(conn, n):
        handshake(conn)
        while True:
            ftype, seq, payload = read_frame(conn)
            if answer.is_set():
                conn.sendall(P.frame(P.STEP_REPLY, reply_for(payload), seq))

    f = fake(script)
    c = DrafterClient("127.0.0.1", f.port, breaker_failures=3, breaker_cooldown=0.3)
    for _ in range(3):
        with pytest.raises(WireTimeout):
            c.step([blk()], timeout=0.05)
    t0 = time.monotonic()
    with pytest.raises(WireBreakerOpen):
        c.step([blk()], timeout=1.0)
    assert time.monotonic() - t0 < 0.01 and c.breaker_open and c.stats["breaker_rejects"] == 1
    time.sleep(0.35)
    answer.set()
    r = c.step([blk(9)], timeout=1.0)  # half-open: this one goes through, skipping the 3 late... none came
    assert r[0].request_id == 9 and not c.breaker_open
    c.close()


def test_breaker_on_refused_connections():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    c = DrafterClient("127.0.0.1", port, breaker_failures=2, breaker_cooldown=10.0)
    for _ in range(2):
        with pytest.raises(WireDisconnected):
            c.step([blk()], timeout=0.5)
    with pytest.raises(WireBreakerOpen):
        c.step([blk()], timeout=0.5)


def test_connect_timeout_when_worker_never_answers_hello(fake):
    f = fake(lambda conn, n: time.sleep(1.0))
    c = DrafterClient("127.0.0.1", f.port)
    t0 = time.monotonic()
    with pytest.raises(WireTimeout):
        c.step([blk()], timeout=0.15)
    assert time.monotonic() - t0 < 0.3 and not c.connected


def test_step_needs_blocks_and_valid_strings():
    with pytest.raises(ValueError):
        DrafterClient("127.0.0.1", 1, model_id="x" * 400)
    with pytest.raises(ValueError):
        DrafterClient("127.0.0.1", 1).step([])
