"""`draftrelay drill` exits non-zero when a drill's claim fails (and 0 when they all hold)."""

from __future__ import annotations

from draftrelay import cli
from draftrelay.handoff import drills


def test_a_failed_claim_fails_the_command(monkeypatch, capsys):
    good = {"losses": 0, "requests_completed": "2/2", "wrong_drafts": 0, "round_status": {}}
    monkeypatch.setitem(drills.DRILLS, "idle", lambda args: dict(good))
    assert cli.main(["drill", "idle"]) == 0
    assert "all hold" in capsys.readouterr().out
    for bad, claim in (({"wrong_drafts": 2}, "no wrong draft"), ({"losses": 1}, "no loss declared"),
                       ({"requests_completed": "1/2"}, "every request completed")):
        monkeypatch.setitem(drills.DRILLS, "idle", lambda args, bad=bad: {**good, **bad})
        assert cli.main(["drill", "idle"]) == 1
        cap = capsys.readouterr()
        assert claim in cap.out and "claims failed in idle" in cap.err


def test_claims_of_every_drill_read_their_own_result_keys():
    kill = {"requests_completed": "3/3", "loss_cause": "exit", "new_proxy_pid_differs": True,
            "stopped_or_zombie_children": 0, "memfds_before": 1, "memfds_after": 1, "wrong_drafts": 0}
    assert drills.failed_claims("kill", kill) == []
    assert drills.failed_claims("kill", {**kill, "loss_cause": None}) == ["the loss was detected"]
    assert drills.failed_claims("soak", {"rounds": 10, "kills": 2, "respawns": 1, "wrong_drafts": 0})
    assert drills.failed_claims("freeze", {"losses": 0, "wrong_drafts": 0}) == []
    assert any("result has no" in m for m in drills.failed_claims("stop", {"wrong_drafts": 0}))


def test_a_real_drill_passes(capsys):
    assert cli.main(["drill", "idle", "--idle-s", "0.2", "--tokens", "20"]) == 0
    assert "all hold" in capsys.readouterr().out
