"""The thread policy of the target's CPU forward: it runs the faster count, probes the other, follows a
change of load, and the engine keeps torch's setting as it found it."""

from __future__ import annotations

import pytest
import torch

from draftrelay.engine.engine import Engine, EngineConfig, SamplingParams
from draftrelay.engine.threads import ThreadPolicy
from draftrelay.model import tiny_pair


def drive(pol: ThreadPolicy, cost, steps: int, width=lambda i: 1) -> list[int]:
    """Run `steps` choices against cost(n, width) seconds; the counts chosen."""
    out = []
    for i in range(steps):
        w = width(i)
        n = pol.choose(w)
        pol.observe(w, cost(n, w))
        out.append(n)
    return out


def test_picks_the_faster_count_and_probes_the_other_rarely():
    pol = ThreadPolicy(2, probe_every=10)
    loaded = drive(pol, lambda n, w: 0.45 if n == 1 else 1.26, 200)  # a loaded machine: one thread wins
    assert loaded[:2] == [1, 2]  # both measured first
    assert pol.probing == (loaded[-1] != pol.best)
    assert loaded[-50:].count(1) >= 48
    # the other count is 2.8x slower: probes at most every ceil(1.8 / 0.05) = 36 steps
    assert 3 <= loaded[2:].count(2) <= 200 // 36 + 1
    pol = ThreadPolicy(2, probe_every=10)
    idle = drive(pol, lambda n, w: 0.42 if n == 1 else 0.23, 400)  # idle: two threads win
    # one thread 1.83x slower, probed from two threads: every ceil(0.83 / 0.01) = 83 steps (1 % of the
    # time), not every 17 (5 %: what probing the other way costs)
    assert pol.interval(1) == 83 and 3 <= idle[2:].count(1) <= 400 // 83 + 1
    assert pol.summary()["chosen"]["2"] > 390


def test_follows_a_change_of_load():
    pol = ThreadPolicy(2, probe_every=8)
    drive(pol, lambda n, w: 0.42 if n == 1 else 0.23, 60)
    assert pol.best == 2
    after = drive(pol, lambda n, w: 0.45 if n == 1 else 1.26, 60)  # other work starts
    # no probe needed: the loaded two-thread steps pass one thread's average within a few steps
    assert pol.best == 1 and after.index(1) <= 3 and after[-20:].count(1) >= 19
    back = drive(pol, lambda n, w: 0.42 if n == 1 else 0.23, 120)  # the other work ends
    assert pol.best == 2 and back.index(2) <= 60 and back[-20:].count(2) >= 19


def test_one_slow_probe_under_a_passing_load_does_not_keep_a_count_off():
    # two threads measured once during a load spike (1.2 s against one thread's 0.4 s), then the load goes
    # and two threads take 0.22 s: the policy must come back to them within two probes
    def back_at(**kw) -> int:
        pol = ThreadPolicy(2, probe_every=12, **kw)
        picks = []
        for i in range(200):
            n = pol.choose(1)
            pol.observe(1, 0.4 if n == 1 else (1.2 if i < 4 else 0.22))
            picks.append(n)
        return next(i for i in range(4, 200) if picks[i:i + 10] == [2] * 10)

    assert back_at() <= 60  # first probe after ceil((3 - 1) / 0.05) = 40 steps, the second 12 later
    assert back_at(probe_alpha=0.3) > 60  # a probe weighed as an ordinary step: more probes, later


def test_a_width_seen_with_one_count_only_follows_the_other_widths():
    pol = ThreadPolicy(2, probe_every=1000)
    drive(pol, lambda n, w: (0.45 if n == 1 else 1.26) * w, 4)  # width 1, both counts
    assert pol.faster(5) == 1  # width 5 never measured: the ratio at width 1 decides
    assert pol.choose(5) == 1


def test_new_widths_before_a_ratio_do_not_all_run_on_the_other_count():
    # the depth policy's first steps verify widths 7, 1, 2, 3, 3, ...: each new to the thread policy; one
    # probe of the other count, then the first width seen twice completes a pair, not one probe per width
    pol = ThreadPolicy(2, probe_every=12)
    widths = [7, 1, 2, 3, 3, 3, 2, 3, 1, 3, 3]
    picks = drive(pol, lambda n, w: (0.45 if n == 1 else 0.25) * (1 + (w - 1) / 6), len(widths),
                  width=lambda i: widths[i])
    assert picks[:5].count(1) <= 2 and pol._ratio() is not None
    assert picks[5:] == [2] * 6


def test_near_ties_keep_the_current_count():
    pol = ThreadPolicy(2, probe_every=1000, margin=0.05)
    drive(pol, lambda n, w: 0.30 if n == 1 else 0.31, 10)
    assert pol.best == 2  # 3 % apart, within the margin: no switch


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="at least 2 threads"):
        ThreadPolicy(1)
    with pytest.raises(ValueError, match="probe_every"):
        ThreadPolicy(2, probe_every=1)
    with pytest.raises(ValueError, match="probe_cost_fewer"):
        ThreadPolicy(2, probe_cost_fewer=0.2)
    with pytest.raises(ValueError, match="threads must be"):
        EngineConfig(threads="many").validate()


def test_engine_restores_torch_threads_and_reports_choices(monkeypatch):
    import draftrelay.engine.loading as L

    monkeypatch.setattr(L, "default_threads", lambda: 2)
    before = torch.get_num_threads()
    target, _ = tiny_pair()
    off = Engine(target, EngineConfig(mode="off", max_batch=1, max_len=128, threads=0))
    (ref,) = off.generate([[1, 2, 3]], SamplingParams(max_tokens=20))
    with Engine(target, EngineConfig(mode="off", max_batch=1, max_len=128, threads="auto")) as eng:
        (req,) = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=20))
        th = eng.metrics()["total"]["threads"]
    assert req.output == ref.output  # the tiny model's logits do not depend on the count
    assert sum(th["chosen"].values()) == 19 and th["chosen"]["1"] >= 1 and th["chosen"]["2"] >= 1
    assert torch.get_num_threads() == before
    assert "threads" not in off.metrics()["total"]  # 0, the default: torch's setting, no policy
