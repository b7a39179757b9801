"""GPU probe of draftrelay.p2p on a pair of GPUs (not collected by CI; run it on the GPU machine).

    python tests_gpu/p2p_probe.py [--out DIR] [--quick]       # -> DIR/p2p_probe_pair.json
    python tests_gpu/p2p_probe.py --one-device [--out DIR]    # one GPU: one_device_pair only
                                                              #   -> DIR/p2p_probe_one_device.json
    python3 -m pytest -q tests_gpu/test_probes.py -k p2p      # the same, as tests

Checks (each reported pass/fail with details, the exit code is 1 if any failed):
  pair_random_mixed    randomized sizes/dtypes, mixed all-reduce / argmax exchange bursts, random issue
                       order, delayed streams (up to 50 ms): bit-equal to the oracle and to emulation
  one_device_pair      both ranks on one GPU (two streams) through the same kernels: bit-equal too
  graph_replay         per-rank CUDA graphs of a mixed sequence, thousands of replays with fresh inputs:
                       epochs advance on the device, parity wraps, results bit-equal
  missing_peer         rank 1 never launched: timeout bits on both sides within the bound (short and
                       default 2 s), host refusal, device-side refusal of a graph replay, reset restores
  cancel               a parked collective on a side stream ends with the cancel bit on both ranks
  desync_invalid_id    different sizes on the two ranks / an out-of-vocab id -> invalid-id bit on both
  epoch_exhaustion     the counter's last value fails closed on both ranks; reset restores
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import traceback

import torch

from draftrelay.handoff.procinfo import machine_info
from draftrelay.p2p import (
    ERR_CANCELLED,
    ERR_EPOCH_EXHAUSTED,
    ERR_INVALID_ID,
    ERR_LOCAL_TIMEOUT,
    ERR_PEER_TIMEOUT,
    EmulatedGroup,
    P2PError,
    P2PGroup,
    reference_all_reduce,
    reference_argmax,
    wait_for_error,
)

RESULTS: dict = {"checks": {}}


def bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.float32:
        return t.view(torch.int32)
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b.to(a.device)))


def env_info() -> dict:
    info = machine_info(topology=True)
    info["devices"] = [{"name": p.name, "sms": p.multi_processor_count, "cc": f"{p.major}.{p.minor}"}
                       for p in map(torch.cuda.get_device_properties, range(torch.cuda.device_count()))]
    try:
        info["nvcc"] = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        info["nvcc"] = f"unavailable: {exc}"
    return info


def check(name: str):
    def deco(fn):
        def run(*args, **kwargs):
            t0 = time.monotonic()
            try:
                details = fn(*args, **kwargs) or {}
                RESULTS["checks"][name] = {"ok": True, "s": round(time.monotonic() - t0, 3), **details}
                print(f"PASS {name} ({time.monotonic() - t0:.1f} s) {json.dumps(details)[:300]}", flush=True)
            except Exception as exc:  # noqa: BLE001 - a probe reports every failure and goes on
                RESULTS["checks"][name] = {"ok": False, "error": repr(exc), "trace": traceback.format_exc()[-3000:]}
                print(f"FAIL {name}: {exc!r}\n{traceback.format_exc()[-2000:]}", flush=True)

        return run

    return deco


# --------------------------------------------------------------------------------------------------
# random ops: each op is a closure that launches rank r's half and returns its outputs; checked later


def make_op(rng: random.Random, devs: list[torch.device]):
    n = len(devs)
    if rng.random() < 0.65:
        rows = rng.randint(1, 40)
        hidden = 5120 if rng.random() < 0.5 else rng.randint(1, 6000)
        dtype = rng.choice([torch.float32, torch.bfloat16])
        xs = [(torch.randn(rows, hidden, device=d) * (1 + r)).to(dtype) for r, d in enumerate(devs)]
        inplace = rng.random() < 0.3
        return {"kind": "ar", "xs": xs, "ref": reference_all_reduce(xs), "inplace": inplace,
                "inputs": [x.clone() for x in xs]}
    rows = rng.randint(1, 40)
    shard = rng.randint(1, 3000)
    levels = rng.choice([3, 50, 100000])
    dtype = rng.choice([torch.float32, torch.bfloat16])
    shards = [torch.randint(0, levels, (rows, shard), device=d).to(dtype) for d in devs]
    return {"kind": "am", "shards": shards, "ref": reference_argmax(shards), "shard": shard, "vocab": shard * n,
            "top2": rng.random() < 0.5}


def launch(group, op: dict, r: int, stream=None):
    if op["kind"] == "ar":
        x = op["xs"][r]
        return group.all_reduce(r, x, out=x if op["inplace"] else None, stream=stream)
    sh = op["shards"][r]
    kw = {} if stream is None else {"stream": stream}
    v1, idx, v2 = group.shard_argmax(r, sh, offset=r * op["shard"], top2=op["top2"], **kw)
    return group.argmax_exchange(r, v1, idx, v2, vocab=op["vocab"], **kw)


def verify(op: dict, outs: list, tag: str) -> None:
    if op["kind"] == "ar":
        for r, o in enumerate(outs):
            assert same(o, op["ref"][r]), f"{tag}: all-reduce rank {r} differs from the oracle"
        assert same(outs[0], outs[-1].to(outs[0].device)), f"{tag}: ranks differ"
    else:
        g1, gi, g2 = op["ref"]
        for r, (o1, oi, o2) in enumerate(outs):
            bad_v = (bits(o1) != bits(g1.to(o1.device))).nonzero().flatten().tolist()
            bad_i = (oi != gi.to(oi.device)).nonzero().flatten().tolist()
            assert not bad_v and not bad_i, (
                f"{tag}: argmax rank {r} rows {op['shards'][0].shape} value rows {bad_v[:5]} id rows {bad_i[:5]}: "
                f"got {o1[bad_v[:3]].tolist()} {oi[bad_i[:3]].tolist()} want {g1[bad_v[:3]].tolist()} "
                f"{gi[bad_i[:3]].tolist()}")
            if o2 is not None:
                assert same(o2, g2.to(o2.device)), f"{tag}: top2 rank {r}"


def emulate(op: dict, n: int, dev: torch.device) -> list:
    emu = EmulatedGroup(n)
    outs = []
    for r in range(n):
        if op["kind"] == "ar":
            outs.append(emu.all_reduce(r, op["inputs"][r].to(dev)))
        else:
            sh = op["shards"][r].to(dev)
            v1, idx, v2 = emu.shard_argmax(r, sh, offset=r * op["shard"], top2=op["top2"])
            outs.append(emu.argmax_exchange(r, v1, idx, v2, vocab=op["vocab"]))
    return outs


def same_outputs(a: list, b: list) -> bool:
    for x, y in zip(a, b, strict=True):
        if isinstance(x, tuple):
            for u, v in zip(x, y, strict=True):
                if (u is None) != (v is None) or (u is not None and not same(u, v)):
                    return False
        elif not same(x, y):
            return False
    return True


def _pair_random_mixed(group: P2PGroup, iters: int, seed: int) -> dict:
    rng = random.Random(seed)
    devs = group.devices
    n = len(devs)
    nops = 0
    delays = 0
    ep0 = [h[0] for h in group.headers()]
    for it in range(iters):
        burst = [make_op(rng, devs) for _ in range(rng.randint(1, 4))]
        order = list(range(n))
        rng.shuffle(order)
        outs: list[list] = [[None] * n for _ in burst]
        # delay one rank's stream (long delay once: 50 ms, inside the bound)
        if rng.random() < 0.3 or it == 3:
            group.delay(rng.randrange(n), 50_000 if it == 3 else rng.uniform(1, 300))
            delays += 1
        for k, op in enumerate(burst):  # lockstep: each op for every rank in turn, any rank order
            for r in order:
                outs[k][r] = launch(group, op, r)
        for d in devs:
            torch.cuda.synchronize(d)
        errs = group.errors()
        assert not any(errs), f"iteration {it}: error words {errs}"
        for k, op in enumerate(burst):
            verify(op, outs[k], f"iter {it} op {k}")
            assert same_outputs(outs[k], emulate(op, n, devs[0])), f"iter {it} op {k}: pair != emulation"
            nops += 1
    ep = [h[0] for h in group.headers()]
    assert all(e - e0 == nops for e, e0 in zip(ep, ep0, strict=True)), f"epochs {ep0} -> {ep} after {nops} ops"
    return {"ops": nops, "delays": delays, "epochs": ep}


pair_random_mixed = check("pair_random_mixed")(_pair_random_mixed)
pair_after_faults = check("pair_after_faults")(_pair_random_mixed)


@check("one_device_pair")
def one_device_pair(iters: int, seed: int, mode: int | None) -> dict:
    group = P2PGroup([0, 0], blocks=16, timeout_ms=2000, mode=mode)
    side = torch.cuda.Stream(device=0)
    rng = random.Random(seed)
    try:
        for it in range(iters):
            op = make_op(rng, group.devices)
            side.wait_stream(torch.cuda.current_stream(0))
            outs = [launch(group, op, 0), launch(group, op, 1, stream=side)]  # rank 1 on another stream
            torch.cuda.current_stream(0).wait_stream(side)
            torch.cuda.synchronize(0)
            assert not any(group.errors()), f"iteration {it}: {group.errors()}"
            verify(op, outs, f"one-device iter {it}")
            assert same_outputs(outs, emulate(op, 2, group.devices[0])), f"one-device iter {it}: != emulation"
    finally:
        group.close()
    return {"ops": iters}


class GraphSet:
    """Per-rank CUDA graphs of a mixed sequence: ar fp32 (20x5120) -> ar bf16 (7x777) -> shard argmax +
    exchange with top2 (5 x 4096 per rank) -> ar fp32 of the first result (chained)."""

    def __init__(self, group: P2PGroup) -> None:
        self.group = group
        self.devs = group.devices
        n = len(self.devs)
        self.a = [torch.empty(20, 5120, device=d) for d in self.devs]
        self.b = [torch.empty(7, 777, device=d, dtype=torch.bfloat16) for d in self.devs]
        self.lg = [torch.empty(5, 4096, device=d) for d in self.devs]
        self.vocab = 4096 * n
        self.refill()
        self.outs: list = [None] * n
        self.graphs: list = []

    def refill(self) -> None:
        for r, d in enumerate(self.devs):
            with torch.cuda.device(d):
                self.a[r].copy_(torch.randn(20, 5120, device=d))
                self.b[r].copy_(torch.randn(7, 777, device=d).to(torch.bfloat16))
                self.lg[r].copy_(torch.randint(0, 200, (5, 4096), device=d).float())

    def sequence(self, r: int):
        g = self.group
        y = g.all_reduce(r, self.a[r])
        z = g.all_reduce(r, self.b[r])
        v1, idx, v2 = g.shard_argmax(r, self.lg[r], offset=r * 4096, top2=True)
        am = g.argmax_exchange(r, v1, idx, v2, vocab=self.vocab)
        w = g.all_reduce(r, y)
        return y, z, am, w

    def eager(self):
        outs = [None] * len(self.devs)
        # lockstep: op k for every rank before op k+1 (rank order 1, 0)
        g = self.group
        ys = [g.all_reduce(r, self.a[r]) for r in range(len(self.devs))]
        zs = [g.all_reduce(r, self.b[r]) for r in range(len(self.devs))]
        ams = []
        for r in range(len(self.devs)):
            v1, idx, v2 = g.shard_argmax(r, self.lg[r], offset=r * 4096, top2=True)
            ams.append(g.argmax_exchange(r, v1, idx, v2, vocab=self.vocab))
        ws = [g.all_reduce(r, ys[r]) for r in range(len(self.devs))]
        for r in range(len(self.devs)):
            outs[r] = (ys[r], zs[r], ams[r], ws[r])
        return outs

    def capture(self) -> None:
        for r, d in enumerate(self.devs):
            with torch.cuda.device(d):
                gr = torch.cuda.CUDAGraph()
                s = torch.cuda.Stream(device=d)
                s.wait_stream(torch.cuda.current_stream(d))
                with torch.cuda.graph(gr, stream=s):
                    self.outs[r] = self.sequence(r)  # capture records only: no partner needed
                self.graphs.append(gr)

    def replay(self, order=(1, 0)) -> None:
        for r in order:
            with torch.cuda.device(self.devs[r]):
                self.graphs[r].replay()

    def expected(self):
        ys = reference_all_reduce(self.a)
        zs = reference_all_reduce(self.b)
        am = reference_argmax(self.lg)
        ws = reference_all_reduce(ys)
        return ys, zs, am, ws

    def verify(self, outs, tag: str) -> None:
        ys, zs, am, ws = self.expected()
        for r in range(len(self.devs)):
            y, z, (o1, oi, o2), w = outs[r]
            assert same(y, ys[r]), f"{tag}: ar fp32 rank {r}"
            assert same(z, zs[r]), f"{tag}: ar bf16 rank {r}"
            assert same(o1, am[0]) and torch.equal(oi, am[1].to(oi.device)) and same(o2, am[2]), f"{tag}: argmax {r}"
            assert same(w, ws[r]), f"{tag}: chained ar rank {r}"


@check("graph_replay")
def graph_replay(group: P2PGroup, gs: GraphSet, replays: int) -> dict:
    outs = gs.eager()
    for d in gs.devs:
        torch.cuda.synchronize(d)
    gs.verify(outs, "eager")
    gs.capture()
    ep0 = [h[0] for h in group.headers()]
    checked = 0
    t0 = time.monotonic()
    for i in range(replays):
        gs.refill()
        gs.replay(order=(1, 0) if i % 2 else (0, 1))
        if i % 10 == 0 or i == replays - 1:
            for d in gs.devs:
                torch.cuda.synchronize(d)
            gs.verify(gs.outs, f"replay {i}")
            checked += 1
    for d in gs.devs:
        torch.cuda.synchronize(d)
    errs = group.errors()
    assert not any(errs), f"error words {errs}"
    ep = [h[0] for h in group.headers()]
    assert all(e - e0 == 4 * replays for e, e0 in zip(ep, ep0, strict=True)), f"epochs {ep0} -> {ep}"
    return {"replays": replays, "collectives_per_replay": 4, "verified_replays": checked, "epochs": ep,
            "wall_s": round(time.monotonic() - t0, 2)}


def lone_rank0(group: P2PGroup, stream=None) -> torch.Tensor:
    x = torch.randn(10, 5120, device=group.devices[0])
    return group.all_reduce(0, x, stream=stream)


@check("missing_peer")
def missing_peer(group: P2PGroup, gs: GraphSet) -> dict:
    details = {}
    for timeout_ms in (250.0, 2000.0):
        group.set_timeout(timeout_ms)
        t0 = time.monotonic()
        lone_rank0(group)
        errs, _ = wait_for_error(group, 10.0)
        took = time.monotonic() - t0
        assert errs[0] & ERR_LOCAL_TIMEOUT and errs[1] & ERR_PEER_TIMEOUT, f"errors {errs}"
        assert took < timeout_ms / 1000 + 0.5, f"took {took:.3f} s for a {timeout_ms} ms bound"
        details[f"bound_{int(timeout_ms)}ms"] = {"errors": errs, "seconds_to_both_bits": round(took, 4)}
        errs2 = group.errors()  # latches the host-side refusal
        try:
            group.all_reduce(1, torch.randn(10, 5120, device=group.devices[1]))
            raise AssertionError("a poisoned pair accepted a launch")
        except P2PError:
            pass
        if timeout_ms == 250.0:
            # device-side refusal: rank 1's graph replays, but its kernels do nothing (outputs stay NaN)
            for t in gs.outs[1][:2]:
                t.fill_(float("nan"))
            ep_before = group.headers()[1][0]
            t1 = time.monotonic()
            gs.replay(order=(1,))
            torch.cuda.synchronize(group.devices[1])
            refused_s = time.monotonic() - t1
            assert torch.isnan(gs.outs[1][0].float()).all() and torch.isnan(gs.outs[1][1].float()).all()
            assert group.headers()[1][0] == ep_before, "a refused replay advanced the epoch"
            details["graph_replay_refused_s"] = round(refused_s, 4)
        group.reset()
        assert group.errors() == [0, 0]
        gs.refill()
        gs.replay()
        for d in group.devices:
            torch.cuda.synchronize(d)
        gs.verify(gs.outs, f"after reset ({timeout_ms} ms)")
        details[f"after_{int(timeout_ms)}ms"] = {"errors_before_reset": errs2, "restored": True}
    group.set_timeout(2000.0)
    return details


@check("cancel")
def cancel(group: P2PGroup) -> dict:
    side = torch.cuda.Stream(device=group.devices[0])
    t0 = time.monotonic()
    lone_rank0(group, stream=side)
    time.sleep(0.05)
    group.cancel()
    errs, _ = wait_for_error(group, 5.0)
    took = time.monotonic() - t0
    assert errs[0] & ERR_CANCELLED and errs[1] & ERR_CANCELLED, f"errors {errs}"
    assert took < 1.0, f"cancel took {took:.3f} s"
    group.reset(streams=[side])
    outs = [group.all_reduce(r, torch.ones(4, device=d)) for r, d in enumerate(group.devices)]
    for d in group.devices:
        torch.cuda.synchronize(d)
    assert outs[0].tolist() == [2.0] * 4 and not any(group.errors())
    return {"errors": errs, "seconds": round(took, 4)}


@check("desync_invalid_id")
def desync_invalid_id(group: P2PGroup) -> dict:
    d0, d1 = group.devices[:2]
    group.set_timeout(500.0)
    group.all_reduce(0, torch.ones(1024, device=d0))
    group.all_reduce(1, torch.ones(2048, device=d1))
    errs, took = wait_for_error(group, 5.0)
    assert errs[0] & ERR_INVALID_ID and errs[1] & ERR_INVALID_ID, f"size mismatch: errors {errs}"
    group.reset()
    v = [torch.zeros(3, device=d) for d in (d0, d1)]
    i = [torch.tensor([0, 1, 2], device=d0), torch.tensor([5, 4096 * 9, 6], device=d1)]
    for r in range(2):
        group.argmax_exchange(r, v[r], i[r], vocab=100)
    errs2, _ = wait_for_error(group, 5.0)
    assert errs2[0] & ERR_INVALID_ID and errs2[1] & ERR_INVALID_ID, f"bad id: errors {errs2}"
    group.reset()
    group.set_timeout(2000.0)
    return {"size_mismatch_errors": errs, "bad_id_errors": errs2, "seconds": round(took, 4)}


@check("epoch_exhaustion")
def epoch_exhaustion(group: P2PGroup) -> dict:
    base = 2**32 - 4
    group.reset(epoch_base=base)
    xs = [torch.randn(5, 5120, device=d) for d in group.devices]
    ref = reference_all_reduce(xs)
    for _ in range(3):  # epochs 2**32-3 .. 2**32-1 still run
        outs = [group.all_reduce(r, x) for r, x in enumerate(xs)]
    for d in group.devices:
        torch.cuda.synchronize(d)
    assert all(same(o, rf) for o, rf in zip(outs, ref, strict=True))
    assert [h[0] for h in group.headers()] == [2**32 - 1] * 2
    last = [torch.full_like(x, float("nan")) for x in xs]
    for r, x in enumerate(xs):
        group.all_reduce(r, x, out=last[r])
    for d in group.devices:
        torch.cuda.synchronize(d)
    errs = group.errors()
    assert all(e & ERR_EPOCH_EXHAUSTED for e in errs), f"errors {errs}"
    assert all(torch.isnan(t).all() for t in last), "an exhausted launch wrote output"
    assert [h[0] for h in group.headers()] == [2**32 - 1] * 2, "epoch zero was published"
    group.reset()
    outs = [group.all_reduce(r, x) for r, x in enumerate(xs)]
    for d in group.devices:
        torch.cuda.synchronize(d)
    assert all(same(o, rf) for o, rf in zip(outs, ref, strict=True)) and not any(group.errors())
    return {"errors": errs}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".", help="directory for the result JSON")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--one-device", action="store_true", help="only one_device_pair (both ranks on cuda:0)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--mode", type=int, default=None, help="protocol mode (default: the library's DEFAULT_MODE)")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    RESULTS["env"] = env_info()
    print(json.dumps(RESULTS["env"], indent=1)[:1500], flush=True)
    need = 1 if args.one_device else 2
    if torch.cuda.device_count() < need:
        print(f"needs {need} GPU(s)", flush=True)
        return 2
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "p2p_probe_one_device.json" if args.one_device else "p2p_probe_pair.json")
    if args.one_device:
        one_device_pair(20 if args.quick else 60, args.seed + 1, args.mode)
    else:
        t0 = time.monotonic()
        group = P2PGroup([0, 1], timeout_ms=2000, mode=args.mode)
        RESULTS["build_and_init_s"] = round(time.monotonic() - t0, 2)
        RESULTS["group"] = {"blocks": group.blocks, "threads": group.threads, "max_bytes": group.max_bytes,
                            "mode": group.mode}
        pair_random_mixed(group, 40 if args.quick else 250, args.seed)
        one_device_pair(20 if args.quick else 60, args.seed + 1, args.mode)
        gs = GraphSet(group)
        graph_replay(group, gs, 300 if args.quick else 3000)
        missing_peer(group, gs)
        cancel(group)
        desync_invalid_id(group)
        epoch_exhaustion(group)
        pair_after_faults(group, 20, args.seed + 2)  # still healthy after every fault
    RESULTS["passed"] = sum(c["ok"] for c in RESULTS["checks"].values())
    RESULTS["failed"] = [k for k, c in RESULTS["checks"].items() if not c["ok"]]
    with open(path, "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    print(f"p2p probe: {RESULTS['passed']} passed, failed: {RESULTS['failed']} -> {path}", flush=True)
    return 1 if RESULTS["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
