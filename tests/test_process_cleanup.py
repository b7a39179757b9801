"""No process outlives `draftrelay generate`: SIGTERM or SIGKILL at start-up (the worker child is
starting), while the proxy starts, and in the middle of generating; after a bounded time no
descendant of the killed command is alive. Also the proxy's own check of its expected parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
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
