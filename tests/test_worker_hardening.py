"""Who may connect to a worker and how its capacity is shared (docs/CONTRACT.md §2, §8): TLS, the
non-loopback guard, the secret's way to the proxy, row quotas and reclaim, per-peer connection limits,
the receive buffer, compute fairness, the GPU lock, WARNING logs and the Prometheus counters."""

from __future__ import annotations

import datetime
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
import urllib.request

import numpy as np
import pytest

from draftrelay.wire import Block, DrafterClient, WireDisconnected, WireRefused, WireRemoteError, security
from draftrelay.wire import protocol as P
from draftrelay.worker import drafters
from draftrelay.worker.core import WorkerCore
from draftrelay.worker.drafters import Job
from draftrelay.worker.server import WorkerServer

SECRET = "0123456789abcdef-the-test-secret"


def serve(core: WorkerCore, **kw) -> WorkerServer:
    srv = WorkerServer(core, "127.0.0.1", 0, **kw)
    srv.start()
    return srv


def blk(rid, pos, toks, n_out=2, gen=0):
    return Block(rid, gen, pos, np.asarray(toks, np.int32), n_out)


def worker_cli(*args, env=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "draftrelay.worker", "--model", "test", *args],
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


# ---- TLS --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 / localhost (cryptography), as PEM files."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "draftrelay-test-worker")])
    now = datetime.datetime.now(datetime.timezone.utc)
    crt = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
           .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
           .not_valid_after(now + datetime.timedelta(days=1))
           .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                       x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                          critical=False)
           .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
           .sign(key, hashes.SHA256()))
    d = tmp_path_factory.mktemp("tls")
    (d / "cert.pem").write_bytes(crt.public_bytes(serialization.Encoding.PEM))
    (d / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    return str(d / "cert.pem"), str(d / "key.pem")


def test_tls_link_with_secret(cert):
    crt, key = cert
    core = WorkerCore(drafters.TestDrafter(n_rows=4))
    srv = serve(core, tls=security.server_tls_context(crt, key), secret=SECRET.encode())
    host, port = srv.address
    try:
        c = DrafterClient(host, port, max_requests=2, timeout=3.0, secret=SECRET.encode(),
                          tls=security.client_tls_context(crt))
        assert c.step([blk(1, 0, [1, 2])])[0].status == P.OK
        c.close()
        plain = DrafterClient(host, port, max_requests=1, timeout=2.0, secret=SECRET.encode())
        with pytest.raises((WireDisconnected, WireRemoteError, WireRefused)) as e:  # no TLS: no session
            plain.connect()
        assert not isinstance(e.value, WireRefused) or e.value.code != P.OK
        # a client that checks the certificate refuses a worker it cannot verify
        other = DrafterClient(host, port, max_requests=1, timeout=3.0, secret=SECRET.encode(),
                              tls=security.client_tls_context())  # system CAs only
        with pytest.raises(WireRefused) as e:
            other.connect()
        assert "certificate" in str(e.value).lower()
    finally:
        srv.stop()
    assert core.sessions == {} and len(core.free_rows) == 4


# ---- binding and the secret's way -------------------------------------------------------------------


def test_non_loopback_bind_needs_a_secret_or_the_insecure_flag(tmp_path):
    out = worker_cli("--host", "0.0.0.0", "--port", "0", env={"DRAFTRELAY_SECRET": ""})
    assert out.returncode == 2 and "no shared secret" in out.stderr and "--insecure-no-auth" in out.stderr
    weak = tmp_path / "weak"
    weak.write_text("short\n")
    weak.chmod(0o600)
    out = worker_cli("--host", "0.0.0.0", "--secret-file", str(weak))
    assert out.returncode == 2 and "at least 16" in out.stderr
    open_file = tmp_path / "readable"
    open_file.write_text(SECRET)
    open_file.chmod(0o644)
    out = worker_cli("--host", "0.0.0.0", "--secret-file", str(open_file))
    assert out.returncode == 2 and "chmod 600" in out.stderr
    out = subprocess.run([sys.executable, "-m", "draftrelay.worker", "--secret", SECRET], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2  # there is no flag that puts the secret on a command line


def test_secret_file_worker_and_an_engine_round_trip(tmp_path):
    """A non-loopback worker with a secret file; the proxy (a real child process) sends the secret it was
    given through HandoffConfig, which never appears on its command line."""
    from draftrelay.handoff.region import RoundRequest
    from draftrelay.handoff.rounds import HandoffConfig, open_rounds
    from draftrelay.worker.process import start_worker_process

    f = tmp_path / "secret"
    f.write_text(SECRET + "\n")
    f.chmod(0o600)
    with start_worker_process(["--model", "test", "--test-vocab", "500", "--secret-file", str(f)],
                              host="0.0.0.0", timeout=60) as w:
        assert "auth=secret" in w.banner
        spec = {"kind": "worker", "host": "127.0.0.1", "port": w.port, "n_out_max": 4, "max_requests": 2}
        for secret, ok in (("", False), (SECRET, True)):
            cfg = HandoffConfig(vocab_size=500, max_requests=2, max_drafts=4, round_spec=spec, secret=secret,
                                selftest_rounds=0, strict=False)
            rounds = open_rounds(cfg)
            try:
                if rounds.mode == "async":
                    with open(f"/proc/{rounds.proxy.pid}/cmdline", "rb") as fh:
                        assert SECRET.encode() not in fh.read()
                res = rounds.result(rounds.submit([RoundRequest(1, 1, 0, np.array([1, 2], np.int32), 3)]), 10.0)
                assert res.ok == ok and (int(res.counts[0]) == 3) == ok, res
            finally:
                rounds.close()
        assert "HandoffConfig" in repr(cfg) and SECRET not in repr(cfg)


# ---- rows, connections ---------------------------------------------------------------------------------


def test_default_quota_leaves_rows_for_a_second_client():
    out = worker_cli("--help")
    assert "half of --rows" in " ".join(out.stdout.split())
    core = WorkerCore(drafters.TestDrafter(n_rows=16))  # the CLI default: 16 rows
    assert core.max_requests == 8
    srv = serve(core)
    host, port = srv.address
    try:
        with pytest.raises(WireRefused) as e:
            DrafterClient(host, port, max_requests=16, timeout=2.0).connect()
        assert e.value.code == P.OVER_LIMITS
        a = DrafterClient(host, port, max_requests=8, timeout=2.0)
        b = DrafterClient(host, port, max_requests=8, timeout=2.0)
        a.connect()
        b.connect()  # the second engine gets its share
        a.close()
        b.close()
    finally:
        srv.stop()


def test_idle_sessions_lose_their_rows_to_a_new_session_ping_does_not_keep_them():
    core = WorkerCore(drafters.TestDrafter(n_rows=4), max_requests=2, row_lease=0.6, capacity_wait=0.1)
    srv = serve(core)
    host, port = srv.address
    try:
        a = DrafterClient(host, port, max_requests=2, timeout=2.0)
        b = DrafterClient(host, port, max_requests=2, timeout=2.0)
        a.step([blk(1, 0, [1])])
        b.step([blk(1, 0, [1])])
        c = DrafterClient(host, port, max_requests=2, timeout=2.0)
        with pytest.raises(WireRefused) as e:  # both hold their rows and stepped just now
            c.connect()
        assert e.value.code == P.OVER_CAPACITY and "row lease" in e.value.message
        end = time.monotonic() + 0.8
        while time.monotonic() < end:  # a only pings; b keeps stepping
            a.ping()
            b.step([blk(1, 0, [1])])  # a rewind to position 0: a STEP all the same
            time.sleep(0.05)
        c.connect()  # a's rows went to c
        assert core.stats["sessions_reclaimed"] == 1
        with pytest.raises((WireRemoteError, WireDisconnected)) as e:
            a.ping()
        assert not isinstance(e.value, WireRemoteError) or e.value.code == P.SESSION_EXPIRED
        assert b.step([blk(1, 0, [1])])[0].status == P.OK  # b was active: untouched
        for x in (a, b, c):
            x.close()
    finally:
        srv.stop()
    assert len(core.free_rows) == 4


def test_a_reconnect_right_after_close_finds_its_rows():
    """BYE and a new HELLO race (the old session's thread frees its rows once it reads the BYE): the new
    HELLO waits up to capacity_wait for them instead of being refused OVER_CAPACITY."""
    core = WorkerCore(drafters.TestDrafter(n_rows=2), max_requests=2)
    srv = serve(core)
    host, port = srv.address
    try:
        for _ in range(30):
            c = DrafterClient(host, port, max_requests=2, timeout=3.0)
            c.connect()
            c.close()
        assert core.stats["sessions_opened"] == 30
    finally:
        srv.stop()


def test_connections_per_peer_are_bounded():
    core = WorkerCore(drafters.TestDrafter(n_rows=8))
    srv = serve(core, max_conns=20, max_conns_per_peer=3)
    host, port = srv.address
    socks = []
    try:
        for _ in range(3):
            socks.append(socket.create_connection((host, port), timeout=3))
        time.sleep(0.2)
        extra = socket.create_connection((host, port), timeout=3)
        extra.settimeout(3)
        data = extra.recv(4096)
        code, msg = P.decode_error(data[16:])
        assert code == P.OVER_CAPACITY and "per peer 3" in msg
        extra.close()
    finally:
        for s in socks:
            s.close()
        srv.stop()


# ---- receive buffer -----------------------------------------------------------------------------------


def test_declared_frame_length_does_not_allocate_before_the_bytes_arrive():
    """60 sessions each declaring a 4 MiB STEP and sending 4 bytes of it: the worker's buffers stay small
    (before, each allocated 16 + 4 MiB at once: 250 MB in all)."""
    core = WorkerCore(drafters.TestDrafter(n_rows=64), max_requests=1)
    srv = serve(core, max_conns=80, max_conns_per_peer=80, frame_timeout=5.0)
    host, port = srv.address
    socks = []
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(60):
            s = socket.create_connection((host, port), timeout=3)
            s.sendall(P.frame(P.HELLO, P.Hello(max_requests=1, n_out_max=2).encode(), 1))
            socks.append(s)
        for s in socks:
            s.settimeout(3)
            assert s.recv(16 + 4096)[:16]  # HELLO_OK
            s.sendall(P.header(P.STEP, 4 << 20, 2) + b"\0\0\0\0")
        time.sleep(0.5)
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
        for s in socks:
            s.close()
        srv.stop()
    assert grown < 20 << 20, f"{grown / 2**20:.1f} MiB for 60 half-sent frames"


# ---- compute fairness ---------------------------------------------------------------------------------


class _Timed(drafters.TestDrafter):
    """The test drafter, plus a log of every run: (session tag by row, tokens, n_steps)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.log: list[tuple[int, int, int]] = []

    def run(self, jobs, n_steps):
        self.log.append((jobs[0].row, sum(len(j.tokens) for j in jobs), n_steps))
        time.sleep(0.0005 + 0.00002 * sum(len(j.tokens) for j in jobs))  # cost grows with the tokens
        return super().run(jobs, n_steps)


def test_a_long_prefill_yields_to_another_sessions_step_between_slices():
    d = _Timed(n_rows=6, max_ctx=8192)
    core = WorkerCore(d, max_requests=4, prefill_slice_ms=1.0)
    from draftrelay.wire.protocol import Hello

    victim, _ = core.open_session(Hello(max_requests=1, n_out_max=2))
    flood, _ = core.open_session(Hello(max_requests=4, n_out_max=2))
    victim_row = victim.free_rows[-1]
    core.step(victim, [blk(1, 0, [1, 2, 3])])
    rng = np.random.default_rng(0)
    frame = [blk(10 + i, 0, rng.integers(0, 900, 4000), 2) for i in range(4)]
    done = threading.Event()
    result = {}

    def go():
        result["r"] = core.step(flood, frame)
        done.set()

    th = threading.Thread(target=go)
    th.start()
    time.sleep(0.05)  # the flood frame is slicing now
    pos = 3
    waits = []
    while not done.is_set():
        n0 = len(d.log)
        r = core.step(victim, [blk(1, pos, [5], 2)])
        assert r.status[0] == P.OK
        pos += 1
        mine = next(i for i in range(n0, len(d.log)) if d.log[i][0] == victim_row)
        waits.append(mine - n0)  # flood slices that ran between the victim's arrival and its step
    th.join()
    assert len(waits) >= 10 and max(waits) <= 1, waits  # at most the slice already running
    assert core.stats["prefill_slices"] > 50
    # the flood's drafts are the ones an unsliced worker gives (slicing changes only the schedule)
    ref_core = WorkerCore(drafters.TestDrafter(n_rows=6, max_ctx=8192), max_requests=4)
    ref, _ = ref_core.open_session(Hello(max_requests=4, n_out_max=2))
    want = ref_core.step(ref, frame)
    assert np.array_equal(result["r"].drafts, want.drafts) and np.array_equal(result["r"].status, want.status)


def test_other_sessions_step_p99_within_twice_the_median_under_a_prompt_flood():
    """8 x 4,000-token first-round prompts per frame from one session (the tiny drafter on this CPU), a
    second session's steady STEPs: their p99 stays within 2x their median. (benchmarks/worker_fairness.py
    measures it with slicing off and on side by side.) A host busy with other work stalls threads for
    milliseconds: the claim gets three tries, and is not judged where the victim's STEPs alone already
    spread past 1.5x (the host's noise, not the worker's scheduling)."""
    pytest.importorskip("torch")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    try:
        import worker_fairness
    finally:
        sys.path.pop(0)
    base = ["--model", "tiny", "--device", "cpu", "--rows", "10", "--max-requests", "8", "--max-ctx", "4096",
            "--n-out-max", "4", "--frame-timeout", "60"]
    tries = []
    for _ in range(3):
        m = worker_fairness.measure(base, prompts=8, prompt_len=4000, victim_steps=100, n_out=4, vocab=256)
        tries.append(m)
        if m["alone_p99_over_p50"] <= 1.5 and m["p99_over_p50"] <= 2.0:
            break
    judged = [m for m in tries if m["alone_p99_over_p50"] <= 1.5]
    if not judged:
        pytest.skip(f"host too noisy to judge: the victim alone spreads p99/p50 "
                    f"{[round(m['alone_p99_over_p50'], 2) for m in tries]}")
    assert any(m["p99_over_p50"] <= 2.0 for m in judged), tries


# ---- GPU ownership ------------------------------------------------------------------------------------


def test_gpu_lock_names_the_holder_and_probes_without_blocking(tmp_path, monkeypatch):
    from draftrelay.worker import gpulock

    monkeypatch.setenv(gpulock.LOCK_DIR_ENV, str(tmp_path))
    uuid = "GPU-00000000-fake-uuid-for-cpu-tests"
    assert gpulock.holder(uuid) is None
    held = gpulock.GpuLock(uuid).acquire()
    try:
        t0 = time.monotonic()
        assert gpulock.holder(uuid) == os.getpid() and time.monotonic() - t0 < 0.5
        with pytest.raises(gpulock.GpuBusy) as e:
            gpulock.GpuLock(uuid).acquire()
        assert f"PID {os.getpid()}" in str(e.value) and "--share-gpu" in str(e.value)
        locks, notes = gpulock.acquire_all([uuid], share=True)
        assert locks == [] and "sharing" in notes[0]
        # another worker process on the same (fake) GPU is refused, naming us; --share-gpu lets it run
        env = {gpulock.LOCK_DIR_ENV: str(tmp_path)}
        out = worker_cli("--port", "0", "--test-gpu-uuid", uuid, env=env)
        assert out.returncode == 2 and f"PID {os.getpid()}" in out.stderr
    finally:
        held.release()
    assert gpulock.holder(uuid) is None


def test_second_worker_on_a_held_gpu_is_refused(tmp_path, monkeypatch):
    from draftrelay.worker import gpulock
    from draftrelay.worker.process import start_worker_process

    monkeypatch.setenv(gpulock.LOCK_DIR_ENV, str(tmp_path))
    uuid = "GPU-11111111-fake"
    with start_worker_process(["--model", "test", "--test-gpu-uuid", uuid], timeout=60) as first:
        assert gpulock.holder(uuid) == first.pid
        out = worker_cli("--port", "0", "--test-gpu-uuid", uuid)
        assert out.returncode == 2 and f"PID {first.pid}" in out.stderr
        out = worker_cli("--gpu-status", "--test-gpu-uuid", uuid, timeout=20)  # inspecting never blocks
        assert out.returncode == 0 and f"{uuid}: held by PID {first.pid}" in out.stdout
        with start_worker_process(["--model", "test", "--test-gpu-uuid", uuid, "--share-gpu"],
                                  timeout=60) as second:
            assert second.alive() and gpulock.holder(uuid) == first.pid
        first.proc.kill()  # however the holder dies, the kernel drops its lock
        first.proc.wait(10)
        assert gpulock.holder(uuid) is None
        with start_worker_process(["--model", "test", "--test-gpu-uuid", uuid], timeout=60) as third:
            assert gpulock.holder(uuid) == third.pid


# ---- logs and metrics ---------------------------------------------------------------------------------


def test_refusals_are_logged_at_warning_rate_limited(caplog):
    core = WorkerCore(drafters.TestDrafter(n_rows=2), max_requests=1)
    srv = serve(core, log_every_s=60.0, max_conns_per_peer=64, max_conns=64)
    host, port = srv.address
    try:
        with caplog.at_level(logging.WARNING, logger="draftrelay.worker"):
            for _ in range(30):  # garbage: BAD_MAGIC each time
                s = socket.create_connection((host, port), timeout=3)
                s.sendall(b"\xff" * 16)
                s.settimeout(3)
                s.recv(256)
                s.close()
            with pytest.raises(WireRefused):
                DrafterClient(host, port, max_requests=2, timeout=2.0).connect()  # OVER_LIMITS
            a = DrafterClient(host, port, max_requests=1, timeout=2.0)
            a.connect()
            b = DrafterClient(host, port, max_requests=1, timeout=2.0)
            b.connect()
            with pytest.raises(WireRefused):
                DrafterClient(host, port, max_requests=1, timeout=2.0).connect()  # OVER_CAPACITY
            time.sleep(0.1)
    finally:
        srv.stop()
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    malformed = [m for m in lines if "BAD_MAGIC" in m]
    assert len(malformed) == 1  # 30 attempts, one line (the rest are counted into the next line of the kind)
    assert any("OVER_LIMITS" in m for m in lines) and any("OVER_CAPACITY" in m for m in lines)
    assert srv.refusals["BAD_MAGIC"] == 30


def test_prometheus_endpoint_counts_sessions_rows_and_refusals():
    from draftrelay.worker import metrics

    core = WorkerCore(drafters.TestDrafter(n_rows=4), max_requests=2)
    srv = serve(core, secret=SECRET.encode())
    host, port = srv.address
    http, _ = metrics.serve(srv, 0)
    try:
        c = DrafterClient(host, port, max_requests=2, timeout=2.0, secret=SECRET.encode())
        c.connect()
        with pytest.raises(WireRefused):
            DrafterClient(host, port, max_requests=1, timeout=2.0, secret=b"y" * 20).connect()
        text = urllib.request.urlopen(f"http://127.0.0.1:{http.server_port}/metrics", timeout=5).read().decode()
        c.close()
    finally:
        http.shutdown()
        srv.stop()
    assert "draftrelay_worker_sessions 1.0" in text
    assert "draftrelay_worker_rows_in_use 2.0" in text
    assert 'draftrelay_worker_refusals_total{code="AUTH_FAILED"} 1.0' in text
    assert "draftrelay_worker_auth_failures_total 1.0" in text


def test_worker_cli_serves_metrics_port():
    from draftrelay.worker.process import start_worker_process

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    mport = s.getsockname()[1]
    s.close()
    with start_worker_process(["--model", "test", "--metrics-port", str(mport)], timeout=60):
        text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5).read().decode()
    assert "draftrelay_worker_rows 16.0" in text


def test_drafter_run_with_zero_steps_only_extends():
    """The slicing relies on run(jobs, 0): extend the row, draft nothing."""
    d = drafters.TestDrafter(n_rows=2)
    d.run([Job(0, 0, np.arange(10, dtype=np.int32))], 0)
    a = d.run([Job(0, 10, np.arange(10, 15, dtype=np.int32))], 3)
    b = drafters.TestDrafter(n_rows=2).run([Job(0, 0, np.arange(15, dtype=np.int32))], 3)
    assert np.array_equal(a[0], b[0])


def test_a_negative_warm_bound_is_refused_by_name():
    for flag in ("--warm-min-kv", "--warm-max-kv"):
        out = worker_cli("--port", "0", flag, "-1")
        assert out.returncode == 2 and f"{flag} -1: must be >= 0" in out.stderr, out.stderr
