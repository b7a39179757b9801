"""Start a worker as a child process on a free loopback port (tests, benchmarks, the demo).

    with start_worker_process(["--model", "tiny"]) as w:
        client = DrafterClient(w.host, w.port)

The child is `python -m draftrelay.worker --port 0 ...`; its first stdout line names the port.
`stop()` terminates it (SIGTERM, then SIGKILL after a grace period) and always reaps it.
Torch-free: the proxy side may use it too.
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time

_LISTEN = re.compile(r"listening on (\S+):(\d+)")


class WorkerProcess:
    def __init__(self, proc: subprocess.Popen, host: str, port: int, banner: str, log_path: str):
        self.proc, self.host, self.port, self.banner, self.log_path = proc, host, port, banner, log_path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def stop(self, grace: float = 10.0) -> int | None:  # generous: a loaded host is slow to exit cleanly
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5.0)
        if self.proc.stdout:
            self.proc.stdout.close()
        try:
            os.unlink(self.log_path)
        except OSError:
            pass
        return self.proc.returncode

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_worker_process(args: list[str], host: str = "127.0.0.1", timeout: float = 180.0,
                         env: dict | None = None, die_with_us: bool = True) -> WorkerProcess:
    """timeout: seconds without the banner and without a new line in the child's log (_wait_banner).
    die_with_us: the child exits when this process dies (SIGTERM by PR_SET_PDEATHSIG, which fires
    when the *thread* that started it ends: start it from a long-lived thread)."""
    fd, log_path = tempfile.mkstemp(prefix="draftrelay-worker-", suffix=".log")
    cmd = [sys.executable, "-m", "draftrelay.worker", "--host", host, "--port", "0", *args]
    if die_with_us:
        cmd += ["--parent-pid", str(os.getpid()), "--parent-log", log_path]
    with os.fdopen(fd, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log_file, text=True,
                                env={**os.environ, **(env or {})})
    try:
        return _wait_banner(proc, cmd, host, timeout, log_path)
    except BaseException:  # SIGTERM / Ctrl-C while the child starts: it must not outlive us
        if proc.poll() is None:
            proc.kill()
            proc.wait(5.0)
        raise


MAX_START_TIMEOUTS = 10  # the longest start, in banner timeouts (30 minutes for the default 180 s)


def _log_size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _wait_banner(proc: subprocess.Popen, cmd: list[str], host: str, timeout: float, log_path: str) -> WorkerProcess:
    """Wait for the child's banner for `timeout` seconds of silence: each time its log (stderr) grows, the
    wait starts again, so a worker that says its warm-up's progress (a GPU worker capturing hundreds of
    draft-step graphs says where it is every 10 s, minutes in all) is waited for, and a silent one is not.
    A child that keeps logging without ever listening is given up on after MAX_START_TIMEOUTS timeouts."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    t0 = time.monotonic()
    deadline, cap = t0 + timeout, MAX_START_TIMEOUTS * timeout
    seen = _log_size(log_path)
    try:
        while True:
            size = _log_size(log_path)
            if size != seen:
                seen, deadline = size, min(time.monotonic() + timeout, t0 + cap)
            left = deadline - time.monotonic()
            if left <= 0 or proc.poll() is not None:
                break
            if sel.select(min(left, 0.2)):
                line = proc.stdout.readline()
                m = _LISTEN.search(line)
                if m:
                    return WorkerProcess(proc, m.group(1), int(m.group(2)), line.strip(), log_path)
                if not line:
                    break
    finally:
        sel.close()
    w = WorkerProcess(proc, host, 0, "", log_path)
    err = w.log()
    code = proc.poll()
    why = (f"exit {code}" if code is not None else f"no banner in {cap:g} s" if time.monotonic() - t0 >= cap
           else f"no banner and no new log line in {timeout:g} s")
    w.stop()
    raise RuntimeError(f"worker did not start ({' '.join(cmd)}): {why}\n{err[-2000:]}")


PR_SET_PDEATHSIG = 1


def die_with_parent(expected_ppid: int, sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel for `sig` when our parent dies (PR_SET_PDEATHSIG), then check the parent is still
    `expected_ppid`: a parent that died before the prctl sends nothing (we were already reparented).
    False when it is gone. A no-op check only where prctl is unavailable (not Linux)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))
    except (OSError, AttributeError):
        pass
    return os.getppid() == expected_ppid
