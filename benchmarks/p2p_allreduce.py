"""Per-op latency of draftrelay.p2p's all-reduce and argmax exchange against NCCL and torch symmetric memory.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        python benchmarks/p2p_allreduce.py [--out benchmarks/results]   # -> DIR/p2p_allreduce.json

Everything is graph-captured: each graph holds K back-to-back collectives, the per-op figure is the
median over trials of (elapsed of R replays) / (R * K) on rank 0's CUDA events. Ours runs from one
controller process (rank 1's graph replayed, then rank 0's); the baselines run in the usual one process
per GPU (spawned here, same sizes, same K and R) so the numbers come from one run, side by side.
Shapes: 5/10/20/40 rows x 5120, fp32 and bf16 (the drafter's activations); argmax exchange of 1-40 rows.
Floors: an empty kernel node (launch), our all-reduce of 0 elements (launch + flag round trip).
Modes with bit 32 (e.g. 51) run the measurement build benchmarks/p2p_unfenced.cu (flags without the
release fence: unsafe, only to price the fence); the package's own kernels refuse that bit.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from draftrelay.handoff.procinfo import machine_info

HIDDEN = 5120
ROWS = (5, 10, 20, 40)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
K = 20
R = 50
TRIALS = 7


def _median_per_op(elapsed_ms: list[float]) -> float:
    return statistics.median(elapsed_ms) * 1000.0 / (R * K)


# --------------------------------------------------------------------------------------------------
# ours: one controller, per-rank graphs


def time_pair(group, make_op) -> float:
    """make_op(rank) -> a callable launching rank's op on the current stream; returns per-op µs."""
    n = group.world_size
    graphs = []
    for r, d in enumerate(group.devices):
        with torch.cuda.device(d):
            op = make_op(r)
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream(device=d)
            s.wait_stream(torch.cuda.current_stream(d))
            with torch.cuda.graph(g, stream=s):
                for _ in range(K):
                    op()
            graphs.append(g)
    order = list(range(n - 1, -1, -1))

    def replay_all() -> None:
        for r in order:
            with torch.cuda.device(group.devices[r]):
                graphs[r].replay()

    for _ in range(5):
        replay_all()
    for d in group.devices:
        torch.cuda.synchronize(d)
    times = []
    for _ in range(TRIALS):
        with torch.cuda.device(group.devices[0]):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        for _ in range(R):
            replay_all()
        with torch.cuda.device(group.devices[0]):
            end.record()
        for d in group.devices:
            torch.cuda.synchronize(d)
        times.append(start.elapsed_time(end))
    errs = group.errors()
    if any(errs):
        raise RuntimeError(f"collective errors during the benchmark: {errs}")
    return _median_per_op(times)


def _bench_group(group, key: str, out: dict, with_extras: bool) -> None:
    for dname, dtype in DTYPES.items():
        for rows in ROWS:
            xs = [torch.randn(rows, HIDDEN, device=d).to(dtype) for d in group.devices]
            ys = [torch.empty_like(x) for x in xs]

            def make(r, xs=xs, ys=ys):
                return lambda: group.all_reduce(r, xs[r], out=ys[r])

            us = time_pair(group, make)
            out["all_reduce"].setdefault(f"{dname}_{rows}", {})[key] = round(us, 2)
            print(f"ours {key} {dname} rows={rows}: {us:.2f} us", flush=True)
    zs = [torch.empty(0, device=d) for d in group.devices]
    out["floors"][f"allreduce_0B_{key}"] = round(
        time_pair(group, lambda r: (lambda: group.all_reduce(r, zs[r], out=zs[r]))), 2)
    if not with_extras:
        return
    out["floors"]["empty_kernel_node"] = round(time_pair(group, lambda r: (lambda: group.delay(r, 0))), 2)
    for rows in (1, 4, 5, 16, 40):
        for top2 in (False, True):
            v = [torch.randn(rows, device=d) for d in group.devices]
            i = [torch.randint(0, 1000, (rows,), device=d) + 1000 * r for r, d in enumerate(group.devices)]
            v2 = [torch.randn(rows, device=d) - 5 if top2 else None for d in group.devices]

            def make_am(r, v=v, i=i, v2=v2):
                o = (torch.empty_like(v[r]), torch.empty_like(i[r]), None if v2[r] is None else torch.empty_like(v[r]))
                return lambda: group.argmax_exchange(r, v[r], i[r], v2[r], vocab=2000, out=o)

            us = time_pair(group, make_am)
            out["argmax"][f"{key}_rows{rows}{'_top2' if top2 else ''}"] = round(us, 2)
            print(f"ours argmax rows={rows} top2={top2}: {us:.2f} us", flush=True)


M_FLAG_RELAXED = 32  # only in benchmarks/p2p_unfenced.cu


def bench_ours(blocks_list: list[int], modes: list[int]) -> dict:
    from pathlib import Path

    from draftrelay.p2p import P2PGroup

    class UnfencedGroup(P2PGroup):
        kernels = Path(__file__).resolve().parent / "p2p_unfenced.cu"

    out: dict = {"all_reduce": {}, "argmax": {}, "floors": {}}
    for n, (mode, blocks) in enumerate((m, b) for m in modes for b in blocks_list):
        cls = UnfencedGroup if mode & M_FLAG_RELAXED else P2PGroup
        group = cls([0, 1], blocks=blocks, timeout_ms=2000, mode=mode)
        _bench_group(group, f"m{mode}_b{blocks}", out, with_extras=n == 0)
        group.close()
    return out


# --------------------------------------------------------------------------------------------------
# baselines: NCCL and torch symmetric memory, one process per GPU


def _graph_time(op, dist) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            op()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(K):
            op()
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(TRIALS):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(R):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return _median_per_op(times)


def _baseline_worker(rank: int, world: int, port: int, path: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev)
    group_name = dist.group.WORLD.group_name
    res: dict = {"nccl": {}, "symm_one_shot": {}, "symm_two_shot": {}, "errors": {}}
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except Exception as exc:  # noqa: BLE001
        symm_mem = None
        res["errors"]["symm_import"] = repr(exc)
    for dname, dtype in DTYPES.items():
        for rows in ROWS:
            key = f"{dname}_{rows}"
            x = torch.randn(rows * HIDDEN, device=dev).to(dtype)
            res["nccl"][key] = round(_graph_time(lambda x=x: dist.all_reduce(x), dist), 2)
            if symm_mem is None:
                continue
            try:
                if hasattr(symm_mem, "enable_symm_mem_for_group") and not symm_mem.is_symm_mem_enabled_for_group(
                    group_name
                ):
                    symm_mem.enable_symm_mem_for_group(group_name)  # needed by older torch, a no-op later
                t = symm_mem.empty(rows * HIDDEN, dtype=dtype, device=dev)
                symm_mem.rendezvous(t, group_name)
                t.copy_(x)
                res["symm_one_shot"][key] = round(
                    _graph_time(lambda t=t: torch.ops.symm_mem.one_shot_all_reduce(t, "sum", group_name), dist), 2)
                res["symm_two_shot"][key] = round(
                    _graph_time(lambda t=t: torch.ops.symm_mem.two_shot_all_reduce_(t, "sum", group_name), dist), 2)
            except Exception as exc:  # noqa: BLE001 - report and go on
                res["errors"][f"symm_{key}"] = repr(exc)[:500]
    if rank == 0:
        with open(path, "w") as f:
            json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


def bench_baselines(timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "baselines.json")
        cmd = [sys.executable, __file__, "--baseline-child", path]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"error": f"baselines timed out after {timeout_s} s"}
        if proc.returncode != 0 or not os.path.exists(path):
            return {"error": f"baselines failed (rc {proc.returncode}): {proc.stderr[-3000:]}"}
        with open(path) as f:
            return json.load(f)


def env_info() -> dict:
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    return {**machine_info(topology=True), "nccl": nccl}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results", help="directory for p2p_allreduce.json")
    ap.add_argument("--blocks", default="64", help="grid sizes of ours to sweep (comma list; first = extras)")
    ap.add_argument("--modes", default="", help="protocol modes of ours to sweep (comma list; default: DEFAULT_MODE)")
    ap.add_argument("--no-baselines", action="store_true")
    ap.add_argument("--baseline-timeout", type=float, default=240.0)
    ap.add_argument("--baseline-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ[k] = "0" if k == "NCCL_NVLS_ENABLE" else "1"  # never multicast (shared host)
    if args.baseline_child:
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        mp.spawn(_baseline_worker, args=(2, port, args.baseline_child), nprocs=2, join=True)
        return 0
    if torch.cuda.device_count() < 2:
        print("needs 2 GPUs")
        return 2
    t0 = time.monotonic()
    result = {"env": env_info(), "K": K, "R": R, "trials": TRIALS, "hidden": HIDDEN}
    from draftrelay.p2p import DEFAULT_MODE

    modes = [int(m) for m in args.modes.split(",")] if args.modes else [DEFAULT_MODE]
    result["ours"] = bench_ours([int(b) for b in args.blocks.split(",")], modes)
    result["baselines"] = {} if args.no_baselines else bench_baselines(args.baseline_timeout)
    result["wall_s"] = round(time.monotonic() - t0, 1)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "p2p_allreduce.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    base = result["baselines"]
    keys = [f"{d}_{r}" for d in DTYPES for r in ROWS]
    print(f"\nper-op us, graph-captured, K={K} per graph, median of {TRIALS}x{R} replays (rank 0 events)")
    print(f"{'':>14} " + " ".join(f"{k:>8}" for k in keys))
    print(f"{'KB':>14} " + " ".join(
        f"{r * HIDDEN * (4 if d == 'fp32' else 2) / 1000:>8.0f}" for d in DTYPES for r in ROWS))
    for variant in result["ours"]["all_reduce"]["fp32_5"]:
        print(f"{variant:>14} " + " ".join(f"{result['ours']['all_reduce'][k][variant]:>8.2f}" for k in keys))
    for name in ("nccl", "symm_one_shot", "symm_two_shot"):
        vals = [base.get(name, {}).get(k) for k in keys]
        print(f"{name:>14} " + " ".join(f"{v:>8.2f}" if v is not None else f"{'-':>8}" for v in vals))
    print("argmax exchange:", result["ours"]["argmax"])
    print("floors:", result["ours"]["floors"])
    if base.get("error") or base.get("errors"):
        print("baseline errors:", base.get("error") or base.get("errors"))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
