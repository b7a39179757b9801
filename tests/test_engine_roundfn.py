"""The proxy's worker round function (wire/roundfn.py): drafts from a live worker, END blocks,
per-block refusals as zero drafts, every wire failure as a RoundFailure with its status, no torch."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

from draftrelay.round import RoundFailure, RoundRequest, Status
from draftrelay.wire.roundfn import worker_round_fn
from draftrelay.worker import drafters
from draftrelay.worker.core import WorkerCore
from draftrelay.worker.server import WorkerServer


@pytest.fixture
def worker():
    core = WorkerCore(drafters.TestDrafter(vocab_size=256, n_rows=8, max_ctx=512), max_requests=8)
    server = WorkerServer(core, "127.0.0.1", 0)
    host, port = server.start()
    yield {"kind": "worker", "host": host, "port": port, "vocab_size": 256, "model_id": "test-drafter-v256"}
    server.stop()


def req(rid, pos, toks, n_out=4, gen=1):
    return RoundRequest(rid, gen, pos, np.asarray(toks, np.int32), n_out)


def test_drafts_rollback_and_end(worker):
    fn = worker_round_fn(worker)
    try:
        out = fn(1, [req(1, 0, [5, 6, 7]), req(2, 0, [9], n_out=2)], 1.0)
        assert [len(d) for d, _ in out] == [4, 2]
        assert out[0][0].dtype == np.int32 and out[0][1].dtype == np.float32
        d1 = out[0][0]
        # a continuation that accepts 2 drafts + 1 correction is served from position 3
        out = fn(2, [req(1, 3, [d1[0], d1[1], 0])], 1.0)
        assert len(out[0][0]) == 4
        # the same context sent again from scratch (new generation) gives the same drafts
        again = fn(3, [req(1, 0, [5, 6, 7, d1[0], d1[1], 0], gen=2)], 1.0)
        assert np.array_equal(again[0][0], out[0][0])
        # END (n_out 0, no tokens): the worker forgets request 1; a later block for it is refused,
        # which the round function reports as zero drafts for that request only
        assert [len(d) for d, _ in fn(4, [req(1, 6, [], n_out=0, gen=2)], 1.0)] == [0]
        out = fn(5, [req(1, 6, [3]), req(2, 1, [4], n_out=2)], 1.0)
        assert len(out[0][0]) == 0 and len(out[1][0]) == 2
    finally:
        fn.client.close()


def test_identity_mismatch_fails_the_round(worker):
    fn = worker_round_fn({**worker, "model_id": "another-model"})
    with pytest.raises(RoundFailure) as e:
        fn(1, [req(1, 0, [1])], 1.0)
    assert e.value.status == Status.BAD_REPLY and "IDENTITY_MISMATCH" in str(e.value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_worker_is_disconnect_then_breaker():
    fn = worker_round_fn({"kind": "worker", "host": "127.0.0.1", "port": _free_port(), "breaker_failures": 2,
                          "breaker_cooldown_s": 30})
    statuses = []
    for t in range(4):
        with pytest.raises(RoundFailure) as e:
            fn(t, [req(1, 0, [1])], 0.2)
        statuses.append(e.value.status)
    assert statuses == [Status.DISCONNECT, Status.DISCONNECT, Status.BREAKER, Status.BREAKER]


class _Silent:
    """A listener that accepts and then either says nothing or sends garbage."""

    def __init__(self, garbage: bool):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.garbage, self.conns = garbage, []
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)
            if self.garbage:
                c.sendall(b"\x00" * 64)

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.mark.parametrize("garbage,status", [(False, Status.TIMEOUT), (True, Status.BAD_REPLY)])
def test_silent_or_garbage_worker(garbage, status):
    srv = _Silent(garbage)
    try:
        fn = worker_round_fn({"kind": "worker", "host": "127.0.0.1", "port": srv.port})
        with pytest.raises(RoundFailure) as e:
            fn(1, [req(1, 0, [1])], 0.1)
        assert e.value.status == status
    finally:
        srv.close()


def test_spec_needs_a_port():
    with pytest.raises(ValueError, match="port"):
        worker_round_fn({"kind": "worker", "host": "127.0.0.1"})


def test_round_fn_module_does_not_load_torch():
    code = "import sys, draftrelay.wire.roundfn; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_failures_keep_their_status_through_the_proxy_process():
    """The proxy runs as __main__: a wire failure must still arrive as DISCONNECT / BREAKER, not as
    a generic EXCEPTION (the proxy module is loaded twice there, with two RoundFailure classes)."""
    from draftrelay.handoff.rounds import HandoffConfig, open_rounds

    spec = {"kind": "worker", "host": "127.0.0.1", "port": _free_port(), "breaker_failures": 2,
            "breaker_cooldown_s": 30}
    rounds = open_rounds(HandoffConfig(vocab_size=256, round_spec=spec, strict=True))
    try:
        got = []
        for _ in range(4):
            res = rounds.result(rounds.submit([req(1, 0, [1, 2])]))
            got.append(res.status)
        assert got == [Status.DISCONNECT, Status.DISCONNECT, Status.BREAKER, Status.BREAKER]
    finally:
        rounds.close()
