"""The split attention's tiles at long contexts on a GPU, side by side: each candidate (keys per tile, warps)
of a split's programs (triton_ops.SPLIT_TILE) and the warps of the forked rows' shared programs
(fork_triton.SHARED_WARPS), at the 0.5B drafter's shapes (plain rows and forked rows, F a request) and the
7B's verify.

A program's registers bound how many an SM holds (benchmarks/kernel_registers.py: as launched at 32K the split
attention holds 64 a thread, eight programs an SM, the forked rows' kernel with 64-row shared programs 216 at
4 warps, two), and at 32K keys with several rows the attention reads 0.9-2.1 TB/s of the copy's 3.3
(docs/SPEC_CACHE.md). Each candidate is checked against
the plain-torch definition (bf16 bounds), then 20 launches are captured in one CUDA graph and the replays
timed, each launch on its own layer's caches (read from HBM, as in a forward); the figure is a launch's p50
and the KV bytes it reads over that time.

    python benchmarks/attention_tiles.py      # writes benchmarks/results/attention_tiles.json
    python benchmarks/attention_tiles.py --contexts 8192,32768 --tiles 64x4,64x8,32x4
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from machine import positive_ints, write_json  # noqa: E402

PER_GRAPH = 20  # launches a captured graph holds (one replay's time / PER_GRAPH is a launch's)


def parse_tiles(text: str) -> list[tuple[int, int]]:
    """'64x4,32x8' -> [(64, 4), (32, 8)]: keys per tile (16..256, a power of two) x warps (1, 2, 4 or 8)."""
    out = []
    for item in text.split(","):
        try:
            tile, warps = (int(x) for x in item.strip().split("x"))
        except ValueError:
            raise SystemExit(f"--tiles: '{item}' is not KEYSxWARPS, such as 64x4") from None
        if tile not in (16, 32, 64, 128, 256) or warps not in (1, 2, 4, 8):
            raise SystemExit(f"--tiles: '{item}': keys per tile 16..256 (a power of two), warps 1, 2, 4 or 8")
        out.append((tile, warps))
    return out


def timed(fn, iters: int) -> dict:
    """p50 / p10 / p90 microseconds of one call, fn(i) for i < PER_GRAPH captured in a graph and replayed:
    each i reads its own caches (a layer's), so the keys come from HBM as in a forward, not from an L2 that
    the same 17 MB filled a launch before."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn(0)  # compile and allocate outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(PER_GRAPH):
            fn(i)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / PER_GRAPH)
    times.sort()
    return {"p50_us": times[len(times) // 2], "p10_us": times[len(times) // 10], "p90_us": times[-1 - len(times) // 10]}


def cases(ctx: int, rows: int, g: torch.Generator, dev: torch.device, bf: torch.dtype = torch.bfloat16,
          layers: int = PER_GRAPH) -> list[dict]:
    """The attention launches measured at `ctx` keys: the 0.5B's plain rows and forked rows (F = 8 a request,
    `rows` requests), the 7B's 5-token verify of one row. Each: a label, the call fn(layer) (each layer its own
    caches: what the launch reads from HBM), its reference ref(layer), the bytes of KV it reads, and the
    (head dim, padded query rows) of its split programs."""
    from draftrelay.kernels import reference as R
    from draftrelay.kernels import triton_ops as TO
    from draftrelay.worker import fork
    from draftrelay.worker import fork_triton as FT

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=dev, dtype=bf)

    out = []
    q, ck, cv = rnd(rows, 1, 14, 64), rnd(layers, rows + 1, 2, ctx + 8, 64), rnd(layers, rows + 1, 2, ctx + 8, 64)
    r_idx, st = torch.arange(rows, device=dev) + 1, torch.full((rows,), ctx - 1, device=dev)
    out.append({"label": f"0.5B plain, {rows} row(s)", "key": (64, 16), "bytes": rows * 2 * 2 * ctx * 64 * 2,
                "fn": lambda i: TO.decode_attention(q, ck[i], cv[i], r_idx, st, ctx),
                "ref": lambda i: R.decode_attention(q, ck[i], cv[i], r_idx, st, ctx)})
    F = 8
    B = rows * F
    # the forked rows' own caches hold a few positions each (one set serves every layer: little is read);
    # the parents' prefixes, what the launch reads, are a layer's each
    fq, fk, fv = rnd(B, 1, 14, 64), rnd(B + 1, 2, ctx + 8, 64), rnd(B + 1, 2, ctx + 8, 64)
    pk, pv = rnd(layers, rows, 2, ctx + 8, 64), rnd(layers, rows, 2, ctx + 8, 64)
    f_rows = torch.arange(B, device=dev) + 1
    parent = torch.arange(B, device=dev) // F
    pivot = ctx - 6 + torch.arange(B, device=dev) % 5  # the branches' own few positions above the pivots
    f_st = pivot + 1
    out.append({"label": f"0.5B forked, {rows} request(s) x F = {F}", "key": (64, 16),
                "bytes": rows * 2 * 2 * ctx * 64 * 2,  # each request's prefix once (its branches share it)
                "fn": lambda i: FT.fork_attention(fq, fk, fv, f_rows, f_st, ctx, pk[i], pv[i], parent, pivot),
                "ref": lambda i: fork.fork_attention_reference(fq, fk, fv, f_rows, f_st, ctx, pk[i], pv[i], parent,
                                                               pivot)})
    if rows == 1:
        vq, vk, vv = rnd(1, 5, 28, 128), rnd(layers, 2, 4, ctx + 8, 128), rnd(layers, 2, 4, ctx + 8, 128)
        v_idx, v_st = torch.tensor([1], device=dev), torch.tensor([ctx - 5], device=dev)
        out.append({"label": "7B verify, 5 tokens", "key": (128, 64), "bytes": 4 * 2 * ctx * 128 * 2,
                    "fn": lambda i: TO.decode_attention(vq, vk[i], vv[i], v_idx, v_st, ctx),
                    "ref": lambda i: R.decode_attention(vq, vk[i], vv[i], v_idx, v_st, ctx)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="32768", help="comma-separated keys a row holds")
    ap.add_argument("--rows", default="1,4", help="comma-separated rows (requests) of each case")
    ap.add_argument("--tiles", default="64x4,64x8,32x4,32x8,128x8",
                    help="comma-separated KEYSxWARPS of a split's programs (the first is the present default "
                         "at head dim 64)")
    ap.add_argument("--shared-warps", default="4,8", help="comma-separated warps of the forked rows' shared launch")
    ap.add_argument("--share", default="on,off",
                    help="comma-separated: the forked rows reading a parent's prefix once (on) or each row its own "
                         "(off, fork_triton.SHARE; GB/s still counts each prefix once)")
    ap.add_argument("--iters", type=int, default=30, help="graph replays timed per candidate")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "attention_tiles.json"),
                    help="the JSON written")
    args = ap.parse_args()

    def ints(name: str, text: str) -> list[int]:
        try:
            return positive_ints(text)
        except ValueError as e:
            ap.error(f"--{name} takes {e}")

    contexts, rows_l = ints("contexts", args.contexts), ints("rows", args.rows)
    tiles, shared_w = parse_tiles(args.tiles), ints("shared-warps", args.shared_warps)
    shares = [x.strip() for x in args.share.split(",")]
    if not shares or any(x not in ("on", "off") for x in shares):
        ap.error(f"--share takes on and / or off, comma-separated, not {args.share!r}")
    if not torch.cuda.is_available():
        raise SystemExit("attention_tiles.py times CUDA kernels: no CUDA device here")
    from draftrelay.handoff.procinfo import machine_info
    from draftrelay.kernels import triton_ops as TO
    from draftrelay.worker import fork_triton as FT

    g = torch.Generator(device="cuda").manual_seed(0)
    results = []
    for ctx in contexts:
        for rows in rows_l:
            with torch.inference_mode():
                for case in cases(ctx, rows, g, torch.device("cuda")):
                    want = case["ref"](0).float()
                    forked = "forked" in case["label"]
                    variants = [(tile, sw, sh) for tile in tiles for sh in (shares if forked else ["on"])
                                for sw in (shared_w if forked and sh == "on" else [0])]
                    for tile, sw, sh in variants:
                        TO.SPLIT_TILE[case["key"]] = tile
                        FT.SHARED_WARPS = sw
                        FT.SHARE = sh == "on"
                        err = (case["fn"](0).float() - want).abs().max().item()
                        t = timed(case["fn"], args.iters)
                        row = {"context": ctx, "rows": rows, "case": case["label"], "tile": tile[0],
                               "warps": tile[1], "shared_warps": sw or None,
                               "share": sh if forked else None, "max_abs_err": err, **t,
                               "GBps": case["bytes"] / (t["p50_us"] * 1e3)}
                        results.append(row)
                        print(f"ctx {ctx:6d} {case['label']:34s} tile {tile[0]:3d} x {tile[1]} warps"
                              f"{f', shared {sw} warps' if sw else ', not shared' if forked else '':18s} "
                              f"{t['p50_us']:8.1f} us "
                              f"({t['p10_us']:.1f}-{t['p90_us']:.1f}) {row['GBps']:7.0f} GB/s  err {err:.3g}",
                              flush=True)
                        if err > 2e-2:
                            print(f"  ^ outside the bf16 bound (2e-2): {case['label']} at tile {tile}",
                                  flush=True)
                    TO.SPLIT_TILE.clear()
                    FT.SHARED_WARPS, FT.SHARE = 0, True
    write_json(args.out, {"benchmark": "attention_tiles", "machine": machine_info(), "argv": sys.argv[1:],
                          "per_graph": PER_GRAPH, "rows": results})


if __name__ == "__main__":
    main()
