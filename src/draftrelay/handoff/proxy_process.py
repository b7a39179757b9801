"""The proxy child process, seen from the engine: spawn it with the region's fd, wait for READY,
stop it through the STOP word, SIGKILL it if it will not stop; it is always reaped here."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

from . import native
from .region import ProxyState, Region, W


class AsyncRefused(RuntimeError):
    """Async rounds could not start (raised only with strict=True; otherwise recorded)."""


class ProxyProcess:
    """The proxy child: spawn with the region's fd, stop with a word, kill if it won't."""

    def __init__(self, region: Region, spec: dict, audit: str = "", python: str = "") -> None:
        self.region = region
        self._err = tempfile.TemporaryFile(prefix="draftrelay-proxy-")
        spec = dict(spec)
        secret = spec.pop("secret", "")  # argv is world-readable (/proc/PID/cmdline), the environment is not
        cmd = [python or sys.executable, "-m", "draftrelay.handoff.proxy", "--fd", str(region.fd), "--spec",
               json.dumps(spec), "--parent-pid", str(os.getpid())]
        if audit:
            cmd += ["--audit", audit]
        env = dict(os.environ)
        env.pop("PYTHONSTARTUP", None)
        if secret:
            env["DRAFTRELAY_SECRET"] = secret
        try:
            extra = tuple(int(fd) for fd in spec.get("pass_fds", ()))  # e.g. the speculation cache's table memfd
            self.proc = subprocess.Popen(cmd, pass_fds=(region.fd, *extra), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=self._err, env=env)
        except BaseException:
            self._err.close()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr_tail(self, n: int = 800) -> str:
        try:
            self._err.seek(0)
            return self._err.read().decode(errors="replace")[-n:].strip()
        except (OSError, ValueError):
            return ""

    def wait_ready(self, timeout_s: float) -> None:
        a_state = self.region.word_addr(W.PROXY_STATE)
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            state = native.load32(a_state)
            if state == ProxyState.READY:
                return
            rc = self.proc.poll()
            if rc is not None or state == ProxyState.FAILED:
                raise AsyncRefused(f"proxy exited during start (code {rc}): {self.stderr_tail()}")
            time.sleep(0.005)
        raise AsyncRefused(f"proxy not ready after {timeout_s:.1f} s")

    def stop(self, timeout_s: float = 1.0) -> None:
        """Ask politely through the STOP word, then SIGKILL; always reaps."""
        if self.proc.poll() is None and not self.region.closed:
            native.store32(self.region.word_addr(W.STOP), 1)
            native.wake32(self.region.word_addr(W.GATHERED))  # a proxy asleep on `gathered` sees STOP now
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self._err.close()
