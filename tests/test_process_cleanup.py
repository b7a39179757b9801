"""No process outlives `draftrelay generate`: SIGTERM or SIGKILL at start-up (the worker child is
starting), while the proxy starts, and in the middle of generating; after a bounded time no
descendant of the killed command is alive. Also the proxy's own check of its expected parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest


def _ppids() -> dict[int, int]:
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    out[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return out


def _descendants(root: int) -> set[int]:
    kids: dict[int, list[int]] = {}
    for pid, ppid in _ppids().items():
        kids.setdefault(ppid, []).append(pid)
    out, todo = set(), [root]
    while todo:
        for k in kids.get(todo.pop(), []):
            if k not in out:
                out.add(k)
                todo.append(k)
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except OSError:
        return False


@pytest.mark.parametrize("when", ["start-up", "proxy start", "mid-generation"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_no_descendant_outlives_generate(sig, when, tmp_path):
    err = open(tmp_path / "stderr", "w")
    cmd = [sys.executable, "-m", "draftrelay.cli", "generate", "Once upon a time", "--mode", "async",
           "--device", "cpu", "--max-tokens", "4000", "--progress", "on"]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    seen: set[int] = set()
    t_proxy = None
    deadline = time.monotonic() + 120
    try:
        while p.poll() is None and time.monotonic() < deadline:
            seen |= _descendants(p.pid)
            lines = {pid: _cmdline(pid) for pid in seen}
            has_worker = any("draftrelay.worker" in c for c in lines.values())
            has_proxy = any("draftrelay.handoff.proxy" in c for c in lines.values())
            if has_proxy and t_proxy is None:
                t_proxy = time.monotonic()
            if (when == "start-up" and has_worker) or (when == "proxy start" and has_proxy) or \
                    (when == "mid-generation" and t_proxy is not None and time.monotonic() - t_proxy > 2.0):
                break
            time.sleep(0.005)
        assert p.poll() is None, f"generate ended before the {when} point: {(tmp_path / 'stderr').read_text()}"
        seen |= _descendants(p.pid)
        os.kill(p.pid, sig)
        p.wait(60)
        end = time.monotonic() + 20  # a worker stopping cleanly takes a moment; nothing may take longer
        while any(_alive(pid) for pid in seen) and time.monotonic() < end:
            time.sleep(0.05)
        left = {pid: _cmdline(pid) for pid in seen if _alive(pid)}
        assert not left, f"alive after {sig.name} at {when}: {left}"
        if sig == signal.SIGTERM:
            assert p.returncode == 143, (tmp_path / "stderr").read_text()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        for pid in seen:
            if _alive(pid) and "draftrelay" in _cmdline(pid):
                os.kill(pid, signal.SIGKILL)
        err.close()


def test_proxy_exits_when_its_engine_died_before_the_prctl():
    """The proxy is told its engine's PID; started by someone else (its parent is not that PID, as when the
    engine died before PR_SET_PDEATHSIG took effect), it exits at once instead of polling forever."""
    from draftrelay.handoff.region import Region, RegionConfig

    region = Region.create(RegionConfig(2, 64, 4, 100))
    try:
        p = subprocess.run([sys.executable, "-m", "draftrelay.handoff.proxy", "--fd", str(region.fd), "--spec",
                            '{"kind": "builtin", "vocab_size": 100}', "--parent-pid", "1"],
                           pass_fds=(region.fd,), capture_output=True, text=True, timeout=30)
    finally:
        region.close()
    assert p.returncode == 5 and "is gone" in p.stderr


def test_worker_exits_when_its_parent_is_already_gone():
    p = subprocess.run([sys.executable, "-m", "draftrelay.worker", "--model", "test", "--port", "0",
                        "--parent-pid", "1"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 1 and "is gone" in p.stderr


def test_worker_parent_gone_before_prctl_deletes_the_log_file_it_was_given(tmp_path):
    log = tmp_path / "worker.log"
    log.write_text("")
    p = subprocess.run([sys.executable, "-m", "draftrelay.worker", "--model", "test", "--port", "0",
                        "--parent-pid", "1", "--parent-log", str(log)], capture_output=True, text=True, timeout=30)
    assert p.returncode == 1 and not log.exists()


SLOW = 999


def _slow_worker(tmp_path, delay_ms: float):
    """A worker whose step on token SLOW sleeps delay_ms, started with this test as its parent."""
    from draftrelay.worker.process import start_worker_process

    return start_worker_process(["--model", "test", "--test-vocab", "1000", "--test-slow-token", str(SLOW),
                                 "--test-delay-ms", str(delay_ms)], timeout=60)


def test_worker_sigterm_mid_step_exits_at_once_and_says_a_step_was_running(tmp_path):
    """SIGTERM while a connection's step outlasts the stop's wait for it: the worker still ends (rc 0) in
    bounded time, without tearing the interpreter down around the busy thread, and its log says so."""
    import numpy as np

    from draftrelay.wire import Block, DrafterClient

    w = _slow_worker(tmp_path, 20_000)
    try:
        c = DrafterClient(w.host, w.port, timeout=30.0, max_requests=1, n_out_max=2)
        c.connect()
        blocks = [Block(1, 0, 0, np.asarray([SLOW], np.int32), 2)]  # request 1, generation 0, position 0
        t = threading.Thread(target=_ignore, args=(c.step, blocks), daemon=True)
        t.start()
        time.sleep(1.0)  # the step is asleep inside the worker
        t0 = time.monotonic()
        w.proc.terminate()
        rc = w.proc.wait(15)
        took = time.monotonic() - t0
        log = w.log()
        assert rc == 0, log[-2000:]
        assert took < 10, f"{took:.1f} s to stop"  # the step alone would hold it 19 s more
        assert "still in a step; exiting without interpreter teardown" in log, log[-2000:]
        c.close()
    finally:
        w.stop()


def test_worker_killed_parent_leaves_no_log_file(tmp_path):
    """The parent (a process that started the worker) is SIGKILLed: the worker ends by PR_SET_PDEATHSIG and
    deletes the log file the dead parent can no longer delete."""
    script = ("import sys, time\n"
              "from draftrelay.worker.process import start_worker_process\n"
              "w = start_worker_process(['--model', 'test'], timeout=60)\n"
              "print(w.pid, w.log_path, flush=True)\n"
              "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pid, log = parent.stdout.readline().split()
        assert os.path.exists(log)
        parent.kill()
        parent.wait(10)
        end = time.monotonic() + 20
        while (_alive(int(pid)) or os.path.exists(log)) and time.monotonic() < end:
            time.sleep(0.05)
        assert not _alive(int(pid)) and not os.path.exists(log)
    finally:
        if parent.poll() is None:
            parent.kill()


def _ignore(fn, *a):
    try:
        fn(*a)
    except Exception:
        pass


def test_the_banner_wait_is_a_bound_on_silence_not_on_a_warm_up_that_says_its_progress(tmp_path):
    """start_worker_process waits `timeout` seconds of silence: a child that writes a line to its log every
    0.2 s for 1.5 s before its banner is waited for under a 0.6 s timeout (a GPU worker's warm-up says its
    progress every 10 s for minutes); a silent one is stopped after the timeout with the reason named, and
    is not left running."""
    from draftrelay.worker import process as WP

    def child(code: str, log):
        return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=log, text=True)

    talk = ("import sys, time\n"
            "for i in range(8):\n"
            "    print('warming', i, file=sys.stderr, flush=True); time.sleep(0.2)\n"
            "print('worker listening on 127.0.0.1:4242', flush=True); time.sleep(30)\n")
    log_path = str(tmp_path / "talk.log")
    with open(log_path, "w") as log:
        proc = child(talk, log)
    w = WP._wait_banner(proc, ["talk"], "127.0.0.1", 0.6, log_path)
    try:
        assert (w.host, w.port) == ("127.0.0.1", 4242) and "warming 7" in w.log()
    finally:
        w.stop()
    log_path = str(tmp_path / "silent.log")
    with open(log_path, "w") as log:
        proc = child("import time; time.sleep(30)", log)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="no banner and no new log line in 0.6 s"):
        WP._wait_banner(proc, ["silent"], "127.0.0.1", 0.6, log_path)
    assert time.monotonic() - t0 < 10 and proc.poll() is not None


def test_a_child_that_logs_without_ever_listening_is_given_up_on(tmp_path, monkeypatch):
    """The silence bound restarts on every log line, but not forever: MAX_START_TIMEOUTS timeouts after the
    start, a child that keeps logging and never prints its banner is stopped."""
    from draftrelay.worker import process as WP

    monkeypatch.setattr(WP, "MAX_START_TIMEOUTS", 4)
    log_path = str(tmp_path / "chatty.log")
    code = "import sys, time\nwhile True:\n    print('still busy', file=sys.stderr, flush=True); time.sleep(0.1)\n"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=log, text=True)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="no banner in 2 s"):
        WP._wait_banner(proc, ["chatty"], "127.0.0.1", 0.5, log_path)
    assert 1.5 < time.monotonic() - t0 < 10 and proc.poll() is not None
