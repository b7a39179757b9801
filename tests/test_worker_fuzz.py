"""Property-based fuzz of frames against a live worker process: whatever arrives on one connection,
the worker answers only with well-formed frames (or closes), and a well-formed client on its own
connection keeps getting correct drafts throughout. No fd is left behind."""

from __future__ import annotations

import os
import socket
import struct
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from draftrelay.wire import Block, DrafterClient
from draftrelay.wire import protocol as P
from draftrelay.worker.process import start_worker_process

V = 500
ARGS = ["--model", "test", "--test-vocab", str(V), "--rows", "16", "--max-requests", "4", "--max-ctx", "256",
        "--n-out-max", "8", "--max-conns", "32", "--handshake-timeout", "1", "--frame-timeout", "1",
        "--max-frame", "65536"]
VALID_CODES = set(P.CODE_NAMES)


def expect(ctx, n):
    ctx = list(ctx)
    out = []
    for _ in range(n):
        t = (31 * ctx[-1] + 17 * len(ctx) + sum(ctx)) % V
        out.append(t)
        ctx.append(t)
    return out


@pytest.fixture(scope="module")
def worker():
    w = start_worker_process(ARGS, timeout=30)
    good = DrafterClient(w.host, w.port, max_requests=1, n_out_max=4, timeout=3.0)
    state = {"ctx": [7, 8, 9], "good": good, "fds": None}
    r = good.step([Block(1, 0, 0, np.array(state["ctx"], np.int32), 3)])
    assert r[0].drafts.tolist() == expect(state["ctx"], 3)
    time.sleep(0.2)
    state["fds"] = len(os.listdir(f"/proc/{w.pid}/fd"))
    yield w, state
    good.close()
    assert w.stop() == 0, w.log()[-2000:]


def read_all(sock: socket.socket, wait: float = 0.05) -> bytes:
    data = b""
    sock.settimeout(wait)
    try:
        while True:
            got = sock.recv(65536)
            if not got:
                break
            data += got
    except (TimeoutError, ConnectionResetError):
        pass
    return data


def assert_well_formed(data: bytes) -> None:
    """The worker's bytes parse as whole frames of worker-side types with known codes."""
    off = 0
    while len(data) - off >= P.HEADER_SIZE:
        _, ftype, length, _ = P.check_header(data[off:off + 16], 1 << 20)
        assert ftype in (P.HELLO_OK, P.STEP_REPLY, P.ERROR, P.PONG), ftype
        body = data[off + 16:off + 16 + length]
        if len(body) < length:
            return  # cut by our read timeout
        if ftype == P.ERROR:
            assert P.decode_error(body)[0] in VALID_CODES
        elif ftype == P.STEP_REPLY:
            n, _, _, _ = P.REPLY_HEAD.unpack_from(body, 0)
            o = P.REPLY_HEAD.size
            for _ in range(n):
                _, _, status, cnt = P.RBLOCK_HEAD.unpack_from(body, o)
                assert status in VALID_CODES and cnt <= 8
                o += P.RBLOCK_HEAD.size + 8 * cnt
            assert o == len(body)
        off += 16 + length


def good_client_still_served(state) -> None:
    ctx = state["ctx"]
    ctx.append(len(ctx) % V)
    if len(ctx) > 200:
        ctx[:] = [7, 8, 9]
        r = state["good"].step([Block(1, 1 + len(ctx), 0, np.array(ctx, np.int32), 2)])
        state["gen"] = 1 + len(ctx)
    else:
        r = state["good"].step([Block(1, state.get("gen", 0), len(ctx) - 1, np.array(ctx[-1:], np.int32), 2)])
    assert r[0].status == P.OK and r[0].drafts.tolist() == expect(ctx, 2)


blocks_st = st.lists(st.tuples(
    st.integers(0, 2**64 - 1) | st.integers(0, 5),     # request id
    st.integers(0, 2**32 - 1) | st.integers(0, 2),     # generation
    st.integers(0, 2**32 - 1) | st.integers(0, 300),   # position
    st.lists(st.integers(-2**31, 2**31 - 1) | st.integers(0, V + 2), max_size=40),
    st.integers(0, 2**16 - 1) | st.integers(0, 9),     # n_out
    st.integers(0, 2**16 - 1) | st.integers(0, 1),     # flags
), min_size=1, max_size=6)


def step_bytes(blocks) -> bytes:
    return P.encode_step([Block(r, g, p, np.array(t, np.int32), n, f) for r, g, p, t, n, f in blocks])


hello_st = st.builds(
    P.Hello, proto_version=st.integers(0, 3), max_requests=st.integers(0, 20), n_out_max=st.integers(0, 70),
    flags=st.integers(0, 3), vocab_size=st.sampled_from([0, V, 32000]),
    model_id=st.sampled_from(["", "test-drafter-v500", "other"]), tokenizer_hash=st.text(max_size=20),
    client_name=st.text(max_size=30)).map(lambda h: ("hello", P.frame(P.HELLO, h.encode(), 1)))

frame_st = st.one_of(
    hello_st,
    st.binary(min_size=1, max_size=300).map(lambda b: ("raw", b)),
    st.tuples(st.integers(0, 12), st.binary(max_size=200)).map(lambda t: ("frame", P.frame(t[0], t[1], 1))),
    blocks_st.map(lambda b: ("step", P.frame(P.STEP, step_bytes(b), 1))),
    st.tuples(blocks_st, st.integers(1, 60)).map(lambda t: ("cut", P.frame(P.STEP, step_bytes(t[0]), 1)[:-t[1]])),
    st.tuples(blocks_st, st.binary(min_size=1, max_size=8)).map(
        lambda t: ("extra", P.frame(P.STEP, step_bytes(t[0]) + t[1], 1))),
    st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**16 - 1)).map(
        lambda t: ("header", struct.pack("<IHHII", P.MAGIC, 1, P.STEP, t[0], 1) + b"\0" * (t[1] % 64))),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(handshake=st.booleans(), frames=st.lists(frame_st, min_size=1, max_size=3),
       half_close=st.booleans())
def test_fuzz_frames_never_stop_service(worker, handshake, frames, half_close):
    w, state = worker
    s = socket.create_connection((w.host, w.port), timeout=3)
    try:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if handshake:
            s.sendall(P.frame(P.HELLO, P.Hello(max_requests=4, n_out_max=8).encode(), 1))
        for _, data in frames:
            try:
                s.sendall(data)
            except OSError:
                break  # the worker already closed on an earlier frame
        if half_close:
            try:
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the worker already reset the connection
        assert_well_formed(read_all(s))
    finally:
        s.close()
    good_client_still_served(state)


def test_after_fuzz_no_fd_leak(worker):
    w, state = worker
    deadline = time.time() + 5
    while len(os.listdir(f"/proc/{w.pid}/fd")) > state["fds"] and time.time() < deadline:
        time.sleep(0.1)
    assert len(os.listdir(f"/proc/{w.pid}/fd")) <= state["fds"]
    good_client_still_served(state)
