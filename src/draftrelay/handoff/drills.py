"""Fault drills against live async rounds: `draftrelay drill kill|stop|idle|slow|soak|freeze`.

Each drill starts a hand-off (emulated stream on CPU, or --backend cuda), drives concurrent requests
through it the way an engine does (one round per step carrying every active request, two rounds in
flight), injects its fault from outside (a real signal to the real proxy process) and returns a
result dict; the CLI prints it as a table. Drafts come from the built-in deterministic drafter, so
every OK round is checked bit for bit: a drill also counts wrong drafts (it must be 0).

Each drill's claims (CLAIMS: no wrong draft, every request completed, the loss detected, ...) are
checked on its result; the command exits 1 when one does not hold, 0 when all do.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from draftrelay.round import RoundRequest
from draftrelay.testing import score_round

from . import native
from .procinfo import children_states, memfd_fds, proc_state
from .rounds import AsyncRounds, HandoffConfig, open_rounds


@dataclass
class Drive:
    """Concurrent requests advancing one token per step, whatever the round's outcome."""

    n_requests: int
    tokens_each: int
    seed: int = 0
    steps: int = 0
    done: list[int] = field(default_factory=list)
    wrong: int = 0
    exact: int = 0
    max_submit_s: float = 0.0
    by_status: dict = field(default_factory=dict)

    def run(self, rounds, vocab: int, until=None, on_step=None, step_sleep_s: float = 0.0) -> None:
        rng = np.random.default_rng(self.seed)
        left = {i: self.tokens_each for i in range(self.n_requests)}
        gen = dict.fromkeys(left, 1)
        pos = dict.fromkeys(left, 0)
        inflight: list = []
        while left or inflight:
            stopping = until is not None and until()
            if left and not stopping:
                reqs = [RoundRequest(i, gen[i], pos[i], rng.integers(0, vocab, 2).astype(np.int32), 4) for i in left]
                t0 = time.perf_counter()
                rid = rounds.submit(reqs)
                self.max_submit_s = max(self.max_submit_s, time.perf_counter() - t0)
                inflight.append((rid, reqs))
                for i in list(left):
                    pos[i] += 2
                    left[i] -= 1
                    if left[i] == 0:
                        del left[i]
                        self.done.append(i)
                self.steps += 1
                if on_step:
                    on_step(self.steps)
            if len(inflight) == 2 or (inflight and (not left or stopping)):
                rid, reqs = inflight.pop(0)
                res = rounds.result(rid, timeout_s=30)
                self.by_status[res.status.name] = self.by_status.get(res.status.name, 0) + 1
                exact, wrong = score_round(reqs, res, vocab)
                self.exact += exact
                self.wrong += wrong
            if step_sleep_s:
                time.sleep(step_sleep_s)
            if stopping and not inflight:
                break


def _cfg(args, **kw) -> HandoffConfig:
    base = dict(vocab_size=5000, max_requests=8, max_tokens=256, max_drafts=8, backend=args.backend,
                deadline_ms=args.deadline_ms, strict=True, selftest_rounds=4)
    base.update(kw)
    return HandoffConfig(**base)





def _signal_drill(args, sig: int, n_requests: int, **kw) -> dict:
    rounds = open_rounds(_cfg(args, **kw))
    assert isinstance(rounds, AsyncRounds)
    memfds_before = memfd_fds()
    old_pid = rounds.proxy.pid
    sent: dict = {}

    def on_step(step: int) -> None:
        if step == args.signal_at and not sent:
            sent["ns"] = native.now_ns()
            sent["fires"] = rounds.watchdog.fires
            os.kill(old_pid, sig)

    drive = Drive(n_requests, args.tokens)
    try:
        drive.run(rounds, 5000, on_step=on_step, step_sleep_s=args.step_ms / 1000)
        rounds.wait_settled()
        st = rounds.stats()
        loss = rounds.loss_log[0] if rounds.loss_log else {}
        new_pid = rounds.proxy.pid if rounds.proxy else None
        kids = children_states()
        memfds_after = memfd_fds()
    finally:
        rounds.close()
    ms = lambda key: (loss[key] - sent["ns"]) / 1e6 if key in loss and sent else None  # noqa: E731
    return {
        "requests_completed": f"{len(drive.done)}/{n_requests}", "loss_cause": loss.get("cause"),
        "loss_detail": loss.get("detail"), "detected_after_ms": ms("detected_ns"),
        "respawn_started_after_ms": ms("respawn_ns"), "respawn_ready_after_ms": ms("ready_ns"),
        "old_proxy_state": proc_state(old_pid), "new_proxy_pid_differs": new_pid not in (None, old_pid),
        "stopped_or_zombie_children": sum(s in ("T", "Z", "t") for s in kids.values()),
        "memfds_before": memfds_before, "memfds_after": memfds_after,
        "generation": st["generation"], "respawns_left": st["respawns_left"],
        "parked_rounds_before_loss": loss["fires"] - sent["fires"] if loss and sent else None,
        "target_only_rounds": st["target_only_rounds"], "released_on_loss": st["released_on_loss"],
        "wrong_drafts": drive.wrong, "exact_drafts": drive.exact, "max_submit_ms": drive.max_submit_s * 1e3,
        "round_status": drive.by_status,
    }


def drill_kill(args) -> dict:
    """kill -9 of the proxy during concurrent requests: lost on exit, respawned, all complete."""
    return _signal_drill(args, signal.SIGKILL, 3)


def drill_stop(args) -> dict:
    """SIGSTOP of the proxy: lost by heartbeat (default deadline) or by watchdog fires (short one)."""
    return _signal_drill(args, signal.SIGSTOP, 2)


def drill_idle(args) -> dict:
    """Idle for longer than the loss limit, then requests: no loss may be declared."""
    rounds = open_rounds(_cfg(args))
    try:
        Drive(1, 10).run(rounds, 5000)
        time.sleep(args.idle_s)
        d = Drive(2, args.tokens, seed=1)
        d.run(rounds, 5000)
        st = rounds.stats()
    finally:
        rounds.close()
    return {"idle_s": args.idle_s, "loss_limit_s": rounds.loss_limit_s, "losses": sum(st["proxy_losses"].values()),
            "requests_completed": f"{len(d.done)}/2", "wrong_drafts": d.wrong, "round_status": d.by_status}


def drill_slow(args) -> dict:
    """A slow-but-live proxy (every round late past the deadline) is not declared lost."""
    faults = {"p_delay": 1.0, "delay_ms": args.deadline_ms * 1.5}
    rounds = open_rounds(_cfg(args, round_spec={"kind": "builtin", "faults": faults}))
    try:
        d = Drive(2, args.tokens)
        d.run(rounds, 5000)
        st = rounds.stats()
    finally:
        rounds.close()
    return {"deadline_ms": args.deadline_ms, "delay_ms": faults["delay_ms"], "losses": st["proxy_losses"],
            "watchdog": st["watchdog"], "late_discarded": st["late_discarded"], "wrong_drafts": d.wrong,
            "requests_completed": f"{len(d.done)}/2"}


def drill_soak(args) -> dict:
    """A long run with a SIGKILL of the proxy every `--kill-every` rounds."""
    rounds = open_rounds(_cfg(args))
    kills = []

    def on_step(step: int) -> None:
        if step % args.kill_every == 0:
            rounds.wait_settled()  # the previous respawn is done: every kill hits a live proxy
            if rounds.state == "live":
                kills.append(step)
                os.kill(rounds.proxy.pid, signal.SIGKILL)

    try:
        d = Drive(1, args.rounds)
        d.run(rounds, 5000, on_step=on_step, step_sleep_s=args.step_ms / 4000)
        end = time.monotonic() + 5
        while len(rounds.loss_log) < len(kills) and time.monotonic() < end:
            time.sleep(0.005)  # the last kill may land on the final step
        rounds.wait_settled()
        st = rounds.stats()
    finally:
        rounds.close()
    return {"rounds": d.steps, "kills": len(kills), "respawns": st["respawns_used"], "state": st["state"],
            "wrong_drafts": d.wrong, "exact_drafts": d.exact, "round_status": d.by_status,
            "target_only_rounds": st["target_only_rounds"]}


def drill_freeze(args) -> dict:
    """SIGSTOP/SIGCONT of the engine side (a child process running rounds): no false loss."""
    child = subprocess.Popen([sys.executable, "-m", "draftrelay.handoff.drills", "_freeze_child",
                              "--deadline-ms", str(args.deadline_ms), "--tokens", "1000000"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        for _ in range(args.freezes):
            time.sleep(args.run_ms / 1000)
            child.send_signal(signal.SIGSTOP)
            time.sleep(args.freeze_ms / 1000)
            child.send_signal(signal.SIGCONT)
        time.sleep(0.2)
        child.send_signal(signal.SIGTERM)
        text, _ = child.communicate(timeout=30)
        out = json.loads(text.strip().splitlines()[-1])
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
    out.update(freezes=args.freezes, freeze_ms=args.freeze_ms)
    return out


def _freeze_child(args) -> None:
    try:
        __import__("ctypes").CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never outlive the drill
    except Exception:
        pass
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *a: stop.update(now=True))
    rounds = open_rounds(_cfg(args, round_budget_ms=50.0))
    print("ready", flush=True)
    d = Drive(2, args.tokens)
    try:
        d.run(rounds, 5000, until=lambda: stop["now"], step_sleep_s=0.002)
        st = rounds.stats()
    finally:
        rounds.close()
    print(json.dumps({"losses": sum(st["proxy_losses"].values()), "loss_causes": st["proxy_losses"],
                      "rounds": d.steps, "wrong_drafts": d.wrong, "loss_limit_s": rounds.loss_limit_s}), flush=True)


DRILLS = {"kill": drill_kill, "stop": drill_stop, "idle": drill_idle, "slow": drill_slow, "soak": drill_soak,
          "freeze": drill_freeze}


def _all_done(r: dict) -> bool:
    done, _, total = str(r.get("requests_completed", "")).partition("/")
    return done == total != ""


def _no_losses(r: dict) -> bool:
    losses = r.get("losses", 0)
    return (sum(losses.values()) if isinstance(losses, dict) else losses) == 0


# what each drill claims; `draftrelay drill` exits 1 when one of them does not hold
CLAIMS: dict[str, list[tuple[str, object]]] = {
    "kill": [("every request completed", _all_done), ("the loss was detected", lambda r: bool(r["loss_cause"])),
             ("a new proxy took over", lambda r: r["new_proxy_pid_differs"]),
             ("no stopped or zombie child", lambda r: r["stopped_or_zombie_children"] == 0),
             ("no memfd leaked", lambda r: r["memfds_after"] <= r["memfds_before"])],
    "stop": [("every request completed", _all_done), ("the loss was detected", lambda r: bool(r["loss_cause"])),
             ("a new proxy took over", lambda r: r["new_proxy_pid_differs"]),
             ("no stopped or zombie child", lambda r: r["stopped_or_zombie_children"] == 0)],
    "idle": [("no loss declared while idle", _no_losses), ("every request completed", _all_done)],
    "slow": [("a slow proxy is not declared lost", _no_losses), ("every request completed", _all_done)],
    "soak": [("every kill was followed by a respawn (within the budget of 3)",
              lambda r: r["respawns"] >= min(r["kills"], 3))],
    "freeze": [("no false loss across the freezes", _no_losses)],
}


def failed_claims(name: str, result: dict) -> list[str]:
    """The claims of drill `name` that `result` does not meet (every drill: no wrong draft)."""
    checks = [("no wrong draft", lambda r: r.get("wrong_drafts", 0) == 0), *CLAIMS.get(name, [])]
    bad = []
    for what, ok in checks:
        try:
            if not ok(result):
                bad.append(what)
        except (KeyError, TypeError) as exc:
            bad.append(f"{what} (result has no {exc})")
    return bad


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("drill", choices=[*DRILLS, "all"], help="which drill to run")
    p.add_argument("--backend", default="emulated", choices=["emulated", "cuda"])
    p.add_argument("--deadline-ms", type=float, default=200.0, help="watchdog deadline (default 200)")
    p.add_argument("--tokens", type=int, default=300, help="tokens (steps) per request")
    p.add_argument("--signal-at", type=int, default=50, help="step at which kill/stop sends its signal")
    p.add_argument("--step-ms", type=float, default=2.0, help="host time per engine step (kill/stop)")
    p.add_argument("--idle-s", type=float, default=1.0, help="idle time for the idle drill")
    p.add_argument("--rounds", type=int, default=6000, help="rounds for the soak drill")
    p.add_argument("--kill-every", type=int, default=2000, help="soak: SIGKILL the proxy every N rounds")
    p.add_argument("--freezes", type=int, default=80, help="freeze drill: SIGSTOP/SIGCONT cycles")
    p.add_argument("--freeze-ms", type=float, default=450.0, help="freeze drill: each freeze's length")
    p.add_argument("--run-ms", type=float, default=50.0, help="freeze drill: running time between freezes")
    p.add_argument("--json", default="", help="also write the results to this file")


def run(args) -> int:
    names = list(DRILLS) if args.drill == "all" else [args.drill]
    results = {}
    failed: dict[str, list[str]] = {}
    for name in names:
        print(f"drill {name} ...", file=sys.stderr, flush=True)
        results[name] = DRILLS[name](args)
        print(f"\n== drill {name}")
        for k, v in results[name].items():
            print(f"  {k:28} {v}")
        bad = failed_claims(name, results[name])
        results[name]["failed_claims"] = bad
        print(f"  {'claims':28} " + ("all hold" if not bad else "FAILED: " + "; ".join(bad)))
        if bad:
            failed[name] = bad
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=str)
    if failed:
        print(f"draftrelay drill: claims failed in {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_freeze_child":
        ap = argparse.ArgumentParser()
        ap.add_argument("_freeze_child")
        ap.add_argument("--deadline-ms", type=float, default=20.0)
        ap.add_argument("--tokens", type=int, default=10**6)
        a = ap.parse_args()
        a.backend = "emulated"
        _freeze_child(a)
    else:
        ap = argparse.ArgumentParser(prog="python -m draftrelay.handoff.drills")
        add_arguments(ap)
        sys.exit(run(ap.parse_args()))
