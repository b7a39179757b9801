"""docs/CONTRACT.md against a real worker process on loopback (the deterministic test drafter).

Every status and error code, the handshake checks, sessions (ids, expiry, capacity), rollback and
rewind, partial windows, END, and bad input that must not stop the worker serving others.
"""

from __future__ import annotations

import os
import socket
import time

import numpy as np
import pytest

from draftrelay.wire import Block, DrafterClient, WireRefused, WireRemoteError
from draftrelay.wire import protocol as P
from draftrelay.worker.process import start_worker_process

V, CTX, NOUT, MAXREQ, ROWS = 1000, 64, 6, 4, 8
SLOW, FAIL = 999, 998
WORKER_ARGS = ["--model", "test", "--test-vocab", str(V), "--rows", str(ROWS), "--max-requests", str(MAXREQ),
               "--max-ctx", str(CTX), "--n-out-max", str(NOUT), "--idle-timeout", "30", "--max-conns", "12",
               "--handshake-timeout", "1", "--frame-timeout", "1", "--max-frame", "65536",
               "--test-slow-token", str(SLOW), "--test-delay-ms", "300", "--test-fail-token", str(FAIL)]


def expect(ctx, n):
    """The test drafter's drafts for a context, computed here from its published rule."""
    ctx = [int(t) for t in ctx]
    toks, confs = [], []
    for _ in range(n):
        t = (31 * ctx[-1] + 17 * len(ctx) + sum(ctx)) % V
        confs.append(np.float32(((t * 2654435761 + len(ctx)) % 1000 + 1) / 1001.0))
        toks.append(t)
        ctx.append(t)
    return toks, confs


@pytest.fixture(scope="module")
def worker():
    w = start_worker_process(WORKER_ARGS, timeout=30)
    yield w
    rc = w.stop()
    assert rc == 0, w.log()[-2000:]  # SIGTERM -> clean exit, no crash behind the scenes


def client(w, **kw) -> DrafterClient:
    kw.setdefault("max_requests", MAXREQ)
    kw.setdefault("n_out_max", NOUT)
    return DrafterClient(w.host, w.port, timeout=2.0, **kw)


def B(rid, pos, toks, n_out, gen=0, flags=0):
    return Block(rid, gen, pos, np.asarray(toks, np.int32), n_out, flags)


class Raw:
    """A raw socket speaking frames by hand (for what the client would never send)."""

    def __init__(self, w):
        self.s = socket.create_connection((w.host, w.port), timeout=3)

    def send(self, ftype, payload=b"", seq=1, version=P.VERSION):
        self.s.sendall(P.header(ftype, len(payload), seq, version) + payload)

    def hello(self, **kw):
        h = P.Hello(max_requests=kw.pop("max_requests", 1), n_out_max=kw.pop("n_out_max", NOUT), **kw)
        self.send(P.HELLO, h.encode())
        return self.recv()

    def recv(self, timeout=3.0):
        """(type, seq, payload), or None when the worker closed the connection."""
        self.s.settimeout(timeout)
        data = b""
        try:
            while len(data) < 16:
                got = self.s.recv(16 - len(data))
                if not got:
                    return None
                data += got
            _, _, ftype, length, seq = P.HEADER.unpack(data)
            body = b""
            while len(body) < length:
                got = self.s.recv(length - len(body))
                if not got:
                    return None
                body += got
        except ConnectionResetError:
            return None
        return ftype, seq, body

    def error(self, timeout=3.0):
        r = self.recv(timeout)
        assert r is not None and r[0] == P.ERROR, r
        return P.decode_error(r[2])

    def closed(self, timeout=3.0) -> bool:
        return self.recv(timeout) is None

    def close(self):
        self.s.close()


# ---- handshake and sessions ---------------------------------------------------------------------------


def test_handshake_fields_and_session_ids(worker):
    a, b = client(worker, vocab_size=V, model_id="test-drafter-v1000", tokenizer_hash="test-tokenizer"), client(worker)
    ia, ib = a.connect(), b.connect()
    assert ia.session_id != ib.session_id and ia.session_id != 0
    assert (ia.proto_version, ia.max_requests, ia.n_out_max, ia.vocab_size, ia.max_ctx) == (1, MAXREQ, NOUT, V, CTX)
    assert ia.max_frame == 65536 and ia.idle_timeout_ms == 30000
    assert ia.model_id == "test-drafter-v1000" and ia.tokenizer_hash == "test-tokenizer" and "test" in ia.info
    a.close()
    assert a.step([B(1, 0, [1], 1)])[0].status == P.OK and a.session_id not in (0, ia.session_id)  # reconnect
    a.close()
    b.close()


@pytest.mark.parametrize("kw,code,words", [
    (dict(model_id="other"), P.IDENTITY_MISMATCH, "model_id"),
    (dict(vocab_size=32000), P.IDENTITY_MISMATCH, "vocab_size"),
    (dict(tokenizer_hash="beef"), P.IDENTITY_MISMATCH, "tokenizer_hash"),
    (dict(n_out_max=NOUT + 1), P.OVER_LIMITS, "n_out_max"),
    (dict(max_requests=MAXREQ + 1), P.OVER_LIMITS, "max_requests"),
])
def test_handshake_refusals(worker, kw, code, words):
    c = client(worker, **kw)
    with pytest.raises(WireRefused) as e:
        c.connect()
    assert e.value.code == code and words in e.value.message
    assert not c.connected


def test_handshake_refusals_raw(worker):
    r = Raw(worker)
    assert r.hello(proto_version=2)[0] == P.ERROR
    assert r.closed()
    r = Raw(worker)
    res = r.hello(flags=4)
    assert P.decode_error(res[2])[0] == P.OVER_LIMITS and r.closed()
    r = Raw(worker)
    r.send(P.HELLO, P.Hello().encode(), version=2)
    assert r.error()[0] == P.BAD_VERSION and r.closed()
    r = Raw(worker)
    r.send(P.STEP, P.encode_step([B(1, 0, [1], 1)]))
    code, msg = r.error()
    assert code == P.BAD_TYPE and "HELLO" in msg and r.closed()
    r = Raw(worker)
    r.send(P.HELLO, b"\x01\x00" * 3)
    assert r.error()[0] == P.MALFORMED and r.closed()
    r = Raw(worker)
    r.send(P.HELLO, b"\0" * 2000)  # bigger than any HELLO may be
    assert r.error()[0] == P.FRAME_TOO_LARGE and r.closed()
    r = Raw(worker)  # says nothing: handshake timeout (1 s here)
    code, _ = r.error(timeout=3)
    assert code == P.FRAME_TIMEOUT and r.closed()


def test_row_capacity_is_reserved_per_session(worker):
    a, b = client(worker), client(worker)
    a.connect()
    b.connect()  # 2 x 4 rows = all 8
    c = client(worker, max_requests=1)
    with pytest.raises(WireRefused) as e:
        c.connect()
    assert e.value.code == P.OVER_CAPACITY and "rows" in e.value.message
    a.close()
    time.sleep(0.2)
    assert c.connect().max_requests == 1  # the closed session's rows are back
    b.close()
    c.close()


def test_idle_session_expires():
    with start_worker_process(["--model", "test", "--idle-timeout", "0.5"], timeout=30) as w:
        c = DrafterClient(w.host, w.port, timeout=2.0)
        sid = c.connect().session_id
        time.sleep(0.9)
        with pytest.raises(WireRemoteError) as e:  # the expiry notice is what the next read finds
            c.step([B(1, 0, [1, 2], 2)])
        assert e.value.code == P.SESSION_EXPIRED and not c.connected
        r = c.step([B(1, 0, [1, 2], 2)])  # reconnects: a new session
        assert r.session_id != sid and r[0].status == P.OK
        for _ in range(3):  # a PING keeps it alive
            time.sleep(0.3)
            c.ping()
        assert c.step([B(1, 2, [5], 1)])[0].status == P.OK
        c.close()


# ---- STEP semantics ------------------------------------------------------------------------------------


def test_ok_rollback_rewind_and_confidences(worker):
    with client(worker) as c:
        prompt = [5, 6, 7, 8]
        r = c.step([B(1, 0, prompt, 4), B(2, 0, [9], 2, gen=7)])
        assert [x.status for x in r] == [P.OK, P.OK]
        assert r.session_id == c.session_id and r.worker_us > 0 and r.generations.tolist() == [0, 7]
        want, conf = expect(prompt, 4)
        assert r[0].drafts.tolist() == want and r[0].confidences.tolist() == conf
        assert r[1].drafts.tolist() == expect([9], 2)[0]
        assert r.drafts.shape == (2, 4) and r.drafts[1, 2:].tolist() == [0, 0]  # zero padded past n
        # the engine accepted 2 drafts and added a bonus token: the rejected drafts must be rolled back
        acc = want[:2] + [123]
        r2 = c.step([B(1, 4, acc, 5)])
        ctx = prompt + acc
        assert r2[0].status == P.OK and r2[0].drafts.tolist() == expect(ctx, 5)[0]
        # nothing accepted, a different token
        r3 = c.step([B(1, len(ctx), [77], 3)])
        ctx += [77]
        assert r3[0].drafts.tolist() == expect(ctx, 3)[0]
        # rewind: position < L resends from an earlier point
        r4 = c.step([B(1, 2, [1, 2, 3], 2)])
        assert r4[0].drafts.tolist() == expect(prompt[:2] + [1, 2, 3], 2)[0]
        # n_out 0: the context still advances, no drafts
        r5 = c.step([B(1, 5, [4], 0)])
        assert r5[0].status == P.OK and r5[0].drafts.size == 0
        assert c.step([B(1, 6, [8], 1)])[0].drafts.tolist() == expect(prompt[:2] + [1, 2, 3, 4, 8], 1)[0]


def test_refusal_codes_leave_other_blocks_served(worker):
    with client(worker) as c:
        c.step([B(1, 0, [1, 2, 3], 2, gen=2)])
        r = c.step([
            B(1, 3, [4], 2, gen=1),        # older generation
            B(2, 5, [4], 2),               # unknown request, position != 0
            B(3, 0, [V], 2),               # token outside the vocabulary
            B(4, 0, [-1], 2),              # negative token
            ])
        assert [x.status for x in r] == [P.STALE_GENERATION, P.UNKNOWN_REQUEST, P.BAD_ENTRY, P.BAD_ENTRY]
        assert all(x.drafts.size == 0 for x in r)
        r = c.step([B(1, 3, [4], 2, gen=2), B(5, 0, [], 2), B(6, 0, [1], 2, flags=2), B(1, 0, [1], 1, gen=2)])
        assert [x.status for x in r] == [P.OK, P.BAD_ENTRY, P.BAD_ENTRY, P.BAD_ENTRY]  # empty, flags, duplicate
        assert r[0].drafts.tolist() == expect([1, 2, 3, 4], 2)[0]
        r = c.step([B(1, 9, [4], 2, gen=2), B(7, 0, [1], NOUT + 1), B(8, 0, list(range(CTX + 1)), 1),
                    B(9, 0, [3, 3], 1)])
        assert [x.status for x in r] == [P.POSITION_GAP, P.OVER_LIMITS, P.OVER_LIMITS, P.OK]
        # the refused gap changed nothing: position 4 still continues request 1
        assert c.step([B(1, 4, [6], 1, gen=2)])[0].drafts.tolist() == expect([1, 2, 3, 4, 6], 1)[0]
        # a newer generation restarts the request: position must be 0
        assert c.step([B(1, 5, [6], 1, gen=3)])[0].status == P.UNKNOWN_REQUEST
        assert c.step([B(1, 5, [6], 1, gen=2)])[0].status == P.UNKNOWN_REQUEST  # the old state is gone
        assert c.step([B(1, 0, [6], 1, gen=3)])[0].drafts.tolist() == expect([6], 1)[0]


def test_partial_window_at_end_of_context(worker):
    with client(worker) as c:
        ctx = list(range(1, CTX - 2))  # 61 tokens: 3 positions left
        r = c.step([B(1, 0, ctx, 5), B(2, 0, [1, 2], 5)])
        assert r[0].status == P.PARTIAL and r[0].drafts.tolist() == expect(ctx, 3)[0]
        assert r[1].status == P.OK and len(r[1].drafts) == 5
        r = c.step([B(1, len(ctx), [7, 7, 7], 4)])  # context exactly full: 0 drafts, still PARTIAL
        assert r[0].status == P.PARTIAL and r[0].drafts.size == 0
        assert c.step([B(1, CTX, [1], 1)])[0].status == P.OVER_LIMITS


def test_end_flag_and_release_only(worker):
    with client(worker) as c:
        r = c.step([B(1, 0, [1, 2], 2, flags=P.FLAG_END), B(2, 0, [3], 1)])
        assert r[0].status == P.OK and len(r[0].drafts) == 2
        assert c.step([B(1, 2, [3], 1)])[0].status == P.UNKNOWN_REQUEST
        r = c.step([B(2, 0, [], 0, flags=P.FLAG_END)])
        assert r[0].status == P.OK and r[0].drafts.size == 0
        assert c.step([B(2, 1, [3], 1)])[0].status == P.UNKNOWN_REQUEST


def test_lru_eviction_when_slots_run_out(worker):
    with client(worker) as c:
        c.step([B(i, 0, [i], 1) for i in range(1, MAXREQ + 1)])
        c.step([B(i, 1, [i], 1) for i in range(2, MAXREQ + 1)])  # request 1 is now the least recent
        assert c.step([B(50, 0, [1], 1)])[0].status == P.OK  # takes request 1's slot
        r = c.step([B(1, 1, [1], 1), B(2, 2, [1], 1)])
        assert [x.status for x in r] == [P.UNKNOWN_REQUEST, P.OK]


def test_drafter_error_drops_the_frames_requests(worker):
    with client(worker) as c:
        c.step([B(1, 0, [1, 2], 1), B(2, 0, [3], 1)])
        r = c.step([B(1, 2, [FAIL], 1), B(2, 1, [4], 1), B(3, 7, [1], 1)])
        assert [x.status for x in r] == [P.DRAFTER_ERROR, P.DRAFTER_ERROR, P.UNKNOWN_REQUEST]
        assert c.step([B(2, 2, [4], 1)])[0].status == P.UNKNOWN_REQUEST
        assert c.step([B(2, 0, [3, 4], 1)])[0].drafts.tolist() == expect([3, 4], 1)[0]


def test_stale_reply_after_timeout_is_skipped(worker):
    with client(worker) as c:
        c.step([B(1, 0, [1], 1)])
        with pytest.raises(Exception) as e:
            c.step([B(1, 1, [SLOW], 2)], timeout=0.1)
        assert type(e.value).__name__ == "WireTimeout" and c.connected
        # the worker did serve the slow round (L = 2): the engine resends from its last known point
        r = c.step([B(1, 1, [SLOW, 5], 2)], timeout=3.0)
        assert r[0].status == P.OK and r[0].drafts.tolist() == expect([1, SLOW, 5], 2)[0]
        assert c.stats["skipped_late_replies"] == 1


# ---- frame errors and bad input -------------------------------------------------------------------------


def test_frame_errors_after_handshake(worker):
    r = Raw(worker)
    assert r.hello()[0] == P.HELLO_OK
    r.send(P.STEP, b"\x01\x00", seq=5)
    code, msg = r.error()
    assert code == P.MALFORMED  # framing intact: the session stays
    r.send(99, b"abc", seq=6)
    f = r.recv()
    assert f[0] == P.ERROR and f[1] == 6 and P.decode_error(f[2])[0] == P.BAD_TYPE
    r.send(P.STEP, P.encode_step([B(1, 0, [1], 1), B(2, 0, [1], 1)]), seq=7)  # 2 blocks > max_requests 1
    assert r.error()[0] == P.MALFORMED
    r.send(P.PING, seq=8)
    assert r.recv()[:2] == (P.PONG, 8)
    r.send(P.STEP, P.encode_step([B(1, 0, [1], 1)]), seq=9)
    f = r.recv()
    assert f[:2] == (P.STEP_REPLY, 9)
    r.send(P.STEP, b"", seq=10, version=3)
    assert r.error()[0] == P.BAD_VERSION and r.closed()
    r = Raw(worker)
    r.hello()
    r.s.sendall(P.header(P.STEP, 1 << 20, 1))  # above max_frame (64 KiB here)
    assert r.error()[0] == P.FRAME_TOO_LARGE and r.closed()
    r = Raw(worker)
    r.hello()
    r.s.sendall(b"GET / HTTP/1.1\r\n\r\n")
    assert r.error()[0] == P.BAD_MAGIC and r.closed()
    r = Raw(worker)
    r.hello()
    r.s.sendall(P.header(P.STEP, 100, 1) + b"\0" * 10)  # a frame that never completes (slowloris)
    assert r.error(timeout=4)[0] == P.FRAME_TIMEOUT and r.closed()
    r = Raw(worker)
    r.hello()
    r.send(P.BYE)
    assert r.closed()


def _fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_flood_half_closed_and_garbage_do_not_stop_service(worker):
    good = client(worker, max_requests=1)
    good.step([B(1, 0, [1], 1)])
    time.sleep(0.2)
    base_fds = _fds(worker.pid)
    socks, bad = [], []
    try:
        _flood(worker, good, base_fds, socks, bad)
    finally:  # a failure above must not leave 60 connections holding the module's worker at its limit
        for s in socks + bad:
            s.close()
        good.close()


def _flood(worker, good, base_fds: int, socks: list, bad: list) -> None:
    for _ in range(40):  # silent connections, more than --max-conns 12
        socks.append(socket.create_connection((worker.host, worker.port), timeout=3))
    for i in range(20):  # garbage, and sockets half-closed in the middle of a header
        s = socket.create_connection((worker.host, worker.port), timeout=3)
        bad.append(s)
        try:
            if i % 2:
                s.sendall(os.urandom(100))
            else:
                s.sendall(P.header(P.HELLO, 50, 1)[:7])
                s.shutdown(socket.SHUT_WR)
        except OSError:  # at its limit the worker answers OVER_CAPACITY and closes: it may have done so already
            pass
    ctx = [1]
    for k in range(5):  # the well-formed client keeps being answered throughout
        r = good.step([B(1, len(ctx), [k + 2], 2)], timeout=3.0)
        ctx.append(k + 2)
        assert r[0].drafts.tolist() == expect(ctx, 2)[0]
    codes = []
    for s in socks + bad:
        s.settimeout(4)
        try:
            data = s.recv(64)
        except (ConnectionResetError, TimeoutError):
            data = b""
        codes.append(P.decode_error(data[16:])[0] if len(data) >= 22 else None)
        s.close()  # (again in the caller's finally: closing twice is harmless)
    # the excess was told OVER_CAPACITY, the admitted silent ones timed out their handshake
    assert codes[:40].count(P.OVER_CAPACITY) >= 40 - 12
    assert set(codes[:40]) <= {P.OVER_CAPACITY, P.FRAME_TIMEOUT}
    assert set(codes[40:]) <= {P.OVER_CAPACITY, P.BAD_MAGIC, P.FRAME_TIMEOUT, None}
    deadline = time.time() + 5
    while _fds(worker.pid) > base_fds and time.time() < deadline:
        time.sleep(0.1)
    assert _fds(worker.pid) <= base_fds  # every flood connection's fd was released
    assert good.step([B(1, len(ctx), [3], 1)])[0].status == P.OK


def test_internal_error_keeps_the_session():
    """INTERNAL (a bug outside the drafter) needs a broken core: an in-process server on loopback."""
    from draftrelay.worker.core import WorkerCore
    from draftrelay.worker.drafters import TestDrafter
    from draftrelay.worker.server import WorkerServer

    core = WorkerCore(TestDrafter(n_rows=2), max_requests=2)
    real = core.step
    calls = []

    def flaky(s, blocks):
        calls.append(1)
        if len(calls) == 1:
            raise KeyError("boom")
        return real(s, blocks)

    core.step = flaky
    srv = WorkerServer(core, "127.0.0.1", 0)
    host, port = srv.start()
    try:
        c = DrafterClient(host, port, max_requests=2, timeout=2.0)
        with pytest.raises(WireRemoteError) as e:
            c.step([B(1, 0, [1], 1)])
        assert e.value.code == P.INTERNAL and "boom" in e.value.message and c.connected
        assert c.step([B(1, 0, [1], 1)])[0].status == P.OK
        c.close()
    finally:
        srv.stop()
    assert srv.active_connections() == 0 and core.sessions == {} and len(core.free_rows) == 2


def test_concurrent_sessions_stay_isolated(worker):
    """Four clients on four threads, same request ids, interleaved STEPs: each sees only its own contexts."""
    import threading

    errors = []

    def play(k):
        try:
            with DrafterClient(worker.host, worker.port, max_requests=2, n_out_max=NOUT, timeout=5.0) as c:
                ctx = {1: [k + 1, k + 2], 2: [k + 3]}
                sent = {1: 0, 2: 0}
                for rnd in range(25):
                    blocks = [B(r, sent[r], ctx[r][sent[r]:], 3) for r in (1, 2)]
                    rep = c.step(blocks)
                    for i, r in enumerate((1, 2)):
                        sent[r] = len(ctx[r])
                        want = expect(ctx[r], 3)[0]
                        assert rep[i].drafts.tolist() == want, (k, rnd, r)
                        ctx[r] += want[:rnd % 3] + [(k * 7 + rnd) % V]
        except Exception as exc:  # surfaced below, with the thread's id
            errors.append((k, repr(exc)))

    threads = [threading.Thread(target=play, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


def test_every_code_of_the_contract_is_exercised_here():
    src = open(__file__).read()
    for name in P.CODE_NAMES.values():
        assert f"P.{name}" in src, name


def _threads(pid):
    with open(f"/proc/{pid}/status") as f:
        return int(next(ln.split()[1] for ln in f if ln.startswith("Threads:")))


def test_many_sessions_leave_no_fds_threads_or_rows(worker):
    with client(worker, max_requests=1) as c:
        c.step([B(1, 0, [1], 1)])
    time.sleep(0.3)
    fds, threads = _fds(worker.pid), _threads(worker.pid)
    for k in range(60):
        c = client(worker, max_requests=MAXREQ)
        c.step([B(i, 0, [k, i], 2) for i in range(MAXREQ)])  # every row of the session in use
        if k % 2:
            c.close()  # BYE
        else:
            c.sock.close()  # vanish without BYE
            c.sock = None
    deadline = time.time() + 5
    while (_fds(worker.pid) > fds or _threads(worker.pid) > threads) and time.time() < deadline:
        time.sleep(0.1)
    assert _fds(worker.pid) <= fds and _threads(worker.pid) <= threads
    a, b = client(worker), client(worker)  # all 8 rows are free again
    a.connect()
    b.connect()
    a.close()
    b.close()


# ---- §8: the shared secret ------------------------------------------------------------------------

SECRET = b"a-shared-secret-of-32-bytes-long"


@pytest.fixture
def secret_worker():
    """An in-process worker that requires SECRET (the test drafter, 4 rows, 2 per session)."""
    from draftrelay.worker.core import WorkerCore
    from draftrelay.worker.drafters import TestDrafter
    from draftrelay.worker.server import WorkerServer

    core = WorkerCore(TestDrafter(vocab_size=V, n_rows=4), max_requests=2)
    srv = WorkerServer(core, "127.0.0.1", 0, secret=SECRET, handshake_timeout=1.0)
    srv.start()
    yield srv
    srv.stop()


def test_secret_worker_refuses_missing_and_wrong_secrets_before_holding_a_row(secret_worker):
    srv = secret_worker
    host, port = srv.address
    with pytest.raises(WireRefused) as e:  # the client has no secret: it knows at once, from the CHALLENGE
        DrafterClient(host, port, max_requests=1, timeout=2.0).connect()
    assert e.value.code == P.AUTH_REQUIRED and "shared secret" in e.value.message
    with pytest.raises(WireRefused) as e:
        DrafterClient(host, port, max_requests=1, timeout=2.0, secret=b"x" * 32).connect()
    assert e.value.code == P.AUTH_FAILED and "wrong shared secret" in e.value.message
    assert srv.core.sessions == {} and len(srv.core.free_rows) == 4  # no row was ever reserved
    # a raw peer that answers the CHALLENGE with a STEP (or not at all) is refused AUTH_REQUIRED
    r = Raw(type("W", (), {"host": host, "port": port}))
    ftype, _, nonce = r.hello(model_id="anything")  # identity is not even looked at before AUTH
    assert ftype == P.CHALLENGE and len(bytes(nonce)) == 32
    r.send(P.STEP, P.encode_step([B(1, 0, [1], 1)]))
    assert r.error()[0] == P.AUTH_REQUIRED and r.closed()
    good = DrafterClient(host, port, max_requests=2, n_out_max=NOUT, timeout=2.0, secret=SECRET)
    assert good.step([B(1, 0, [3, 4], 2)])[0].drafts.tolist() == expect([3, 4], 2)[0]
    good.close()
    assert srv.stats["auth_failures"] == 1 and srv.refusals["AUTH_REQUIRED"] == 1  # the first client just left


def test_a_replayed_auth_does_not_open_a_session(secret_worker):
    """The MAC covers a fresh nonce: an AUTH recorded on one connection is refused on the next."""
    from draftrelay.wire import security

    host, port = secret_worker.address
    w = type("W", (), {"host": host, "port": port})
    hello = P.Hello(max_requests=1, n_out_max=NOUT).encode()
    r1 = Raw(w)
    r1.send(P.HELLO, hello)
    _, _, nonce1 = r1.recv()
    mac = security.auth_mac(SECRET, bytes(nonce1), hello)
    r1.send(P.AUTH, mac)
    assert r1.recv()[0] == P.HELLO_OK
    r2 = Raw(w)
    r2.send(P.HELLO, hello)
    _, _, nonce2 = r2.recv()
    assert bytes(nonce2) != bytes(nonce1)
    r2.send(P.AUTH, mac)
    assert r2.error()[0] == P.AUTH_FAILED and r2.closed()
