"""A dead CUDA graph in a reference cycle, while another graph is captured (not collected by CI):
`pytest -q tests_gpu/test_capture_gc_gpu.py`.

torch no longer collects garbage before a capture, so a dead graph held only by a cycle (an engine dropped
earlier) can be freed by an automatic collection inside the next capture; CUDA refuses to destroy an
executable graph while a stream captures, and the capture in progress is invalidated. That happened to a
replay_headline.py engine's decode graphs on an H100. capture.GraphCapture pauses the collector for its
captures (capture.gc_paused); here a collection is made due inside the capture (threshold 1 and fresh
allocations). The control, in a child process, does the same through a bare torch.cuda.graph and shows the
failure (skipped where this torch collects safely).
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch

from draftrelay.capture import GraphCapture

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEV = torch.device("cuda")


class Cycle:
    """Holds a graph in a reference cycle: freed only by the cyclic collector."""

    def __init__(self, graph) -> None:
        self.graph, self.me = graph, self


def test_a_dead_graph_is_not_collected_inside_a_capture():
    old, was = gc.get_threshold(), gc.isenabled()
    gc.enable()
    gc.set_threshold(1_000_000)  # no automatic collection before the capture below begins
    try:
        cap = GraphCapture(DEV)
        x = torch.zeros(4, device=DEV)
        cap.warm(lambda: x.add_(1))
        dead, _ = cap.capture(lambda: x.add_(1))
        holder = Cycle(dead)
        ref = weakref.ref(holder)
        del dead, holder
        seen = {}
        y = torch.ones(4, device=DEV)
        cap.warm(lambda: y.mul_(2))
        y.fill_(1)

        def fn():
            gc.set_threshold(1)  # any allocation now makes a collection due: the dead cycle would go here
            junk = [[i] for i in range(1000)]
            seen["dead graph alive inside the capture"] = ref() is not None
            del junk
            return y.mul_(2)

        g, out = cap.capture(fn)
        assert seen == {"dead graph alive inside the capture": True}
        g.replay()
        g.replay()
        torch.cuda.synchronize()
        assert out.tolist() == [4.0] * 4  # two replays of the doubling captured after a dead graph was left
        gc.set_threshold(*old)
        gc.collect()
        assert ref() is None  # collected once the capture is over
    finally:
        gc.set_threshold(*old)
        (gc.enable if was else gc.disable)()


CONTROL = textwrap.dedent("""
    import gc, torch

    class Cycle:
        def __init__(self, graph):
            self.graph, self.me = graph, self

    gc.enable()
    gc.set_threshold(1_000_000)
    x = torch.zeros(4, device="cuda")
    s = torch.cuda.Stream()
    g0 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g0, stream=s, capture_error_mode="thread_local"):
        x.add_(1)
    Cycle(g0)
    del g0
    g1 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g1, stream=s, capture_error_mode="thread_local"):
        gc.set_threshold(1)
        junk = [[i] for i in range(1000)]
        x.mul_(2)
    print("captured")
""")


def test_control_without_the_pause_the_capture_is_invalidated():
    """What the pause prevents: the same steps through a bare torch.cuda.graph, in a child process (a
    failed capture can leave a process's CUDA state behind)."""
    r = subprocess.run([sys.executable, "-c", CONTROL], capture_output=True, text=True, timeout=120)
    if r.returncode == 0 and "captured" in r.stdout:
        pytest.skip("this torch destroys a dead graph safely inside a capture: the pause is not needed here")
    assert "capture" in r.stderr, r.stderr[-2000:]
