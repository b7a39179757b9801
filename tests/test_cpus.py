"""cpus.py: CPU lists read and refused by name, a process pinned on every thread (and put back), and the
worker's --cpus: a real worker process whose threads all run where it was told."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from draftrelay import cpus
from draftrelay.engine import loading as L


@pytest.mark.parametrize("spec, want", [
    ("0", [0]), ("1", [1]), ("0-1", [0, 1]), ("1,0", [0, 1]), (" 0 , 1 ", [0, 1]), ("0-0,1", [0, 1]),
])
def test_parse_reads_lists_and_ranges(spec, want):
    assert cpus.parse(spec, allowed={0, 1}) == want


@pytest.mark.parametrize("spec, says", [
    ("", "'' is not a CPU number"),
    ("x", "'x' is not a CPU number"),
    ("1-", "'1-' is not a CPU number"),
    ("-1", "'-1' is not a CPU number"),
    ("3-1", "range '3-1' runs backwards"),
    ("0,,1", "'' is not a CPU number"),
    ("0,7", "CPU 7 is not on this machine (online: 0-1)"),
    ("5-6", "CPU 5, 6 is not on this machine"),
])
def test_parse_names_what_is_wrong(spec, says):
    with pytest.raises(ValueError) as exc:
        cpus.parse(spec, allowed={0, 1})
    assert f"CPU list {spec!r}" in str(exc.value) and says in str(exc.value)


def test_format_list_is_what_parse_reads():
    for s in ({0}, {0, 1, 2}, {0, 2, 3, 7}, {1, 3, 5}):
        text = cpus.format_list(s)
        assert cpus.parse(text, allowed=set(range(8))) == sorted(s)
    assert cpus.format_list({0, 2, 3, 7}) == "0,2-3,7"


def test_online_holds_this_process_cpus():
    assert cpus.available() <= cpus.online()


def _mask_of(tid: int) -> set[int]:
    return set(os.sched_getaffinity(tid))


def test_pinned_sets_every_thread_and_puts_the_mask_back():
    before = cpus.available()
    one = min(before)
    started, stop = threading.Event(), threading.Event()
    tid: list[int] = []

    def other():
        tid.append(threading.get_native_id())
        started.set()
        stop.wait(10)

    t = threading.Thread(target=other)
    t.start()
    started.wait(5)
    try:
        with cpus.pinned([one]):
            assert cpus.available() == {one}
            assert _mask_of(tid[0]) == {one}  # a thread that was running before the pin
        assert cpus.available() == before and _mask_of(tid[0]) == before
    finally:
        stop.set()
        t.join()


def test_pin_refused_by_the_kernel_names_the_cpus_and_changes_nothing():
    before = cpus.available()
    bogus = max(cpus.online()) + 1000  # no such CPU: sched_setaffinity refuses it
    with pytest.raises(ValueError) as exc:
        cpus.pin([bogus])
    assert f"CPUs {bogus}" in str(exc.value) and "may not run there" in str(exc.value)
    assert cpus.available() == before


def run_worker(*args, timeout=60):
    return subprocess.run([sys.executable, "-m", "draftrelay.cli", "worker", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("value, says", [
    ("x", "--cpus: CPU list 'x': 'x' is not a CPU number"),
    ("4096", "--cpus: CPU list '4096': CPU 4096 is not on this machine"),
])
def test_worker_bad_cpus_is_named(value, says):
    out = run_worker("--cpus", value)
    assert out.returncode == 2 and says in out.stderr, out.stderr


def _threads_masks(pid: int) -> dict[int, set[int]]:
    return {int(t): _mask_of(int(t)) for t in os.listdir(f"/proc/{pid}/task")}


def test_local_worker_runs_every_thread_on_its_cpus_and_drafts():
    """start_local_worker(cpus=...) -> --cpus and one thread a CPU there; every thread of the worker
    (torch's pool included, after a draft made it start) runs on that CPU only, and its drafts are the
    tiny drafter's own."""
    from draftrelay.wire import Block
    from draftrelay.wire.roundfn import client_from_spec

    last = max(cpus.available())
    w = L.start_local_worker("tiny", torch.device("cpu"), 4, 256, 1, cpus=str(last))
    try:
        spec = L.worker_spec(w.host, w.port, L.drafter_model_id("tiny"), "", 4, 1)
        c = client_from_spec(spec)
        c.connect(timeout=10)
        r = c.step([Block(1, 0, 0, np.arange(1, 9, dtype=np.int32), 4)])[0]
        assert len(r.drafts) == 4
        c.close()
        masks = _threads_masks(w.proc.pid)
        assert masks and all(m == {last} for m in masks.values()), masks
    finally:
        w.stop()


def test_start_local_worker_passes_cpus_and_one_thread_a_cpu(monkeypatch):
    seen = {}

    def fake(args, env=None):
        seen["args"], seen["env"] = args, env

    import draftrelay.worker.process as wp

    monkeypatch.setattr(wp, "start_worker_process", fake)
    L.start_local_worker("some/dir", torch.device("cpu"), 4, 256, 1, cpus="0")
    assert seen["args"][-4:] == ["--threads", "1", "--cpus", "0"] and seen["env"]["OMP_NUM_THREADS"] == "1"
    with pytest.raises(ValueError, match="CPU list 'z'"):
        L.start_local_worker("some/dir", torch.device("cpu"), 4, 256, 1, cpus="z")


def test_nothing_here_calls_cuda():
    """cpus.py pins processes that must never touch CUDA (a worker before its device is chosen): it imports
    os alone."""
    code = ("import sys; import draftrelay.cpus as c; c.pin(c.available()); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'cuda')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_generate_and_serve_name_bad_placements(capsys):
    import argparse

    from draftrelay import cli
    from draftrelay.serve import cli as serve_cli

    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    for flags, words in [(["--cpus", "0-"], "--cpus: CPU list '0-': '0-' is not a CPU number"),
                         (["--drafter-cpus", "4096"], "--drafter-cpus: CPU list '4096': CPU 4096 is not on"),
                         (["--drafter-cpus", "0", "--worker", "h:1"], "--drafter-cpus 0: the local worker's")]:
        assert serve_cli._check(p.parse_args(flags)).startswith(words)
    assert serve_cli._check(p.parse_args(["--cpus", "0", "--drafter-cpus", "0"])) == ""
    assert cli.main(["generate", "x", "--cpus", "a"]) == 2
    assert "--cpus: CPU list 'a': 'a' is not a CPU number" in capsys.readouterr().err


def test_generate_with_target_and_drafter_on_their_own_cpus_is_the_target_only_output():
    """The placement changes where the work runs, never the tokens: greedy sync and speculation-cache decoding
    with the target on the first CPU and the drafter on the last equal target-only decoding. In a child
    process: a pin would otherwise hold this test process to one CPU."""
    from draftrelay import demo_pair

    target, drafter = demo_pair.paths()
    one, last = min(cpus.available()), max(cpus.available())
    base = [sys.executable, "-m", "draftrelay.cli", "generate", "def add(a, b):", "--model", target, "--drafter",
            drafter, "--device", "cpu", "--max-tokens", "24", "--k", "4"]
    outs = []
    for extra in (["--mode", "off"], ["--mode", "sync", "--cpus", str(one), "--drafter-cpus", str(last)],
                  ["--mode", "async", "--spec-cache", "4", "--cpus", str(one), "--drafter-cpus", str(last)]):
        out = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "DRAFTRELAY_BRANCH_CUT": "off"})
        assert out.returncode == 0, out.stderr
        outs.append(out.stdout.split("\n")[0])
    assert outs[0] and outs[1] == outs[0] and outs[2] == outs[0]


def test_generate_cache_guard_auto_is_off_where_the_drafter_has_cpus_of_its_own():
    """--cache-guard auto: no guard where --drafter-cpus gives the drafter cores of its own (its branch work
    takes nothing from the target's), the guard otherwise; on / off as said. The depth policy's cache steps
    on a CPU with the depth not fixed, not on a GPU or with --k."""
    import argparse

    from draftrelay.engine import cli_generate as G
    from draftrelay.engine.spec_cache import SpecCache

    p = argparse.ArgumentParser()
    G.add_arguments(p)

    def opts(*flags: str, dev: str = "cpu") -> dict:
        return G.spec_options(p.parse_args(["x", "--spec-cache", "4", *flags]), dev)

    assert opts("--cpus", "0", "--drafter-cpus", "1") == {"depth": "policy", "guard": False}
    assert opts() == {"depth": "policy"}
    assert opts("--drafter-cpus", "1", "--cache-guard", "on") == {"depth": "policy"}
    assert opts("--cache-guard", "off", "--k", "4") == {"guard": False}
    assert opts(dev="cuda") == {}
    with pytest.raises(SystemExit):
        p.parse_args(["x", "--cache-guard", "maybe"])
    guarded, bare = (SpecCache(4, **opts(*f)) for f in ((), ("--drafter-cpus", "1")))
    try:
        assert guarded.guard is not None and bare.guard is None
    finally:
        guarded.shm.close()
        bare.shm.close()
