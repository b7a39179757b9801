"""The CUDA stream backend, as far as it can be tested without a GPU: it refuses cleanly and visibly
(sync fallback with the reason, or AsyncRefused under strict; no fd, mapping or process left), its
driver bindings are imported only when it is chosen, the preload hook runs before any round is armed,
and `draftrelay selftest` works on the emulated stream. The GPU side is tests_gpu/cuda_probe.py."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from draftrelay.handoff import cli as selftest_cli
from draftrelay.handoff import rounds as rounds_mod
from draftrelay.handoff.region import Region, RegionConfig, RoundRequest, Status
from draftrelay.handoff.rounds import AsyncRefused, AsyncRounds, HandoffConfig, SyncRounds, open_rounds
from draftrelay.handoff.stream import StreamStuck


def cuda_usable() -> bool:
    try:
        import cuda.bindings.driver  # noqa: F401
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


needs_no_cuda = pytest.mark.skipif(
    cuda_usable(), reason="CUDA is usable here: refusal on a real driver is tests_gpu/cuda_probe.py --steps refusal")


def memfd_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum("memfd:draftrelay" in line for line in f)


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def children() -> set[int]:
    me, out = os.getpid(), set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == me:
                        out.add(int(pid))
            except OSError:
                pass
    return out


def cfg(**kw) -> HandoffConfig:
    base = dict(vocab_size=5000, max_requests=4, max_tokens=256, max_drafts=8, deadline_ms=20.0, selftest_rounds=4)
    base.update(kw)
    return HandoffConfig(**base)


@needs_no_cuda
def test_cuda_backend_refuses_visibly_and_leaves_nothing_behind():
    fds, maps, kids = fd_count(), memfd_maps(), children()
    r = open_rounds(cfg(backend="cuda"))
    assert isinstance(r, SyncRounds) and r.mode == "sync"
    assert r.refusal.startswith("CudaStreamRefused:"), r.refusal
    assert "cuda-bindings is not installed" in r.refusal or "no CUDA device" in r.refusal \
        or "driver library" in r.refusal, r.refusal
    assert fd_count() == fds and memfd_maps() == maps and children() <= kids
    res = r.result(r.submit([RoundRequest(1, 1, 0, np.array([3, 4], np.int32), 3)]))
    assert res.status == Status.OK and res.counts[0] == 3  # the sync fallback still drafts
    with pytest.raises(AsyncRefused, match="CudaStreamRefused"):
        open_rounds(cfg(backend="cuda", strict=True))
    assert fd_count() == fds and memfd_maps() == maps and children() <= kids


@needs_no_cuda
def test_cuda_stream_constructor_refuses_and_leaves_the_region_usable():
    from draftrelay.handoff.cuda_stream import CudaStream, CudaStreamRefused

    region = Region.create(RegionConfig(4, 256, 8, 5000))
    try:
        with pytest.raises(CudaStreamRefused) as info:
            CudaStream(region)
        assert str(info.value)  # a reason, not an empty error
        region.view(0, 4)[:] = 1  # still mapped and ours to free
    finally:
        region.close()
    assert region.closed


def test_the_driver_bindings_are_imported_only_when_the_backend_is_chosen():
    code = ("import sys; import draftrelay.handoff.rounds, draftrelay.handoff.cuda_stream, draftrelay.handoff.cli\n"
            "print(sorted(m for m in sys.modules if m == 'cuda' or m.startswith('cuda.')))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def test_preload_runs_once_before_any_round_is_armed(monkeypatch):
    order: list[str] = []
    real_submit = AsyncRounds.submit

    def spy_submit(self, *a, **k):
        order.append("submit")
        return real_submit(self, *a, **k)

    monkeypatch.setattr(AsyncRounds, "submit", spy_submit)
    r = open_rounds(cfg(preload=(lambda: order.append("kernel A"), lambda: order.append("kernel B"))))
    try:
        assert r.mode == "async", r.refusal
        assert order[:2] == ["kernel A", "kernel B"] and order.count("kernel A") == 1
        assert order[2:] and set(order[2:]) == {"submit"}  # the self-test's rounds came after
    finally:
        r.close()


def test_a_failing_preload_refuses_async_without_leaks():
    fds, maps, kids = fd_count(), memfd_maps(), children()

    def broken() -> None:
        raise RuntimeError("kernel failed to build")

    r = open_rounds(cfg(preload=(broken,)))
    assert r.mode == "sync" and "kernel failed to build" in r.refusal
    assert fd_count() == fds and memfd_maps() == maps and children() <= kids


def test_a_stuck_stream_at_start_frees_nothing(monkeypatch):
    """A stream that cannot be drained at start-up fails loudly and keeps the region mapped."""
    started: list[AsyncRounds] = []
    real_start = AsyncRounds._start

    def spy_start(self):
        started.append(self)
        return real_start(self)

    def stuck_stream(cfg_, region):
        raise StreamStuck("test: stream parked for good")

    monkeypatch.setattr(AsyncRounds, "_start", spy_start)
    monkeypatch.setattr(rounds_mod, "make_stream", stuck_stream)
    maps = memfd_maps()
    with pytest.raises(StreamStuck):
        open_rounds(cfg())
    r = started[0]
    try:
        assert memfd_maps() == maps + 1 and not r.region.closed  # nothing the GPU may use was freed
        assert r.watchdog is not None  # and the watchdog still releases whatever is parked
    finally:
        r.watchdog.stop()
        r.region.close()


# -- the selftest subcommand ----------------------------------------------------------------------


def selftest(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    selftest_cli.add_arguments(ap)
    return ap.parse_args(argv)


def test_selftest_on_the_emulated_stream_is_exact(capsys):
    rc = selftest_cli.run(selftest(["--rounds", "150"]))
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "mode async" in out and "150 rounds: 150 exact, 0 failed, 0 wrong" in out


def test_selftest_json_and_refusal_reason(capsys):
    assert selftest_cli.run(selftest(["--rounds", "20", "--json"])) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["mode"] == "async" and res["wrong"] == 0 and res["stats"]["ok"] == 20
    if not cuda_usable():
        rc = selftest_cli.run(selftest(["--backend", "cuda", "--rounds", "3"]))
        out = capsys.readouterr().out
        assert rc == 2 and "async refused: CudaStreamRefused" in out and "3 exact" in out
        rc = selftest_cli.run(selftest(["--backend", "cuda", "--strict", "--json"]))
        res = json.loads(capsys.readouterr().out)
        assert rc == 2 and res["mode"] == "refused" and "CudaStreamRefused" in res["refusal"]


def test_selftest_bad_arguments_are_clear_errors(capsys):
    assert selftest_cli.run(selftest(["--rounds", "-5"])) == 3
    assert "--rounds -5" in capsys.readouterr().err
    assert selftest_cli.run(selftest(["--deadline-ms", "0"])) == 3
    with pytest.raises(SystemExit):
        selftest(["--backend", "opencl"])


def test_selftest_through_the_draftrelay_command():
    p = subprocess.run([sys.executable, "-m", "draftrelay.cli", "selftest", "--rounds", "30", "--json"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(p.stdout)
    assert res["backend"] == "emulated" and res["mode"] == "async" and res["wrong"] == 0
