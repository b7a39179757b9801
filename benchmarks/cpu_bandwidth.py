"""The CPU decode step's roofline: this machine's memory read bandwidth through torch on 1 and all threads,
the bytes one decode step of the target must read, and where draftrelay's and transformers' steps stand
against bytes / bandwidth.

    python benchmarks/cpu_bandwidth.py                       # the reference target (about 3 minutes on 2 cores)
    python benchmarks/cpu_bandwidth.py --target tiny --no-hf --steps 4 --buffer-mb 64   # a smoke run
    python benchmarks/cpu_bandwidth.py --pages both          # also a 4 KiB-page copy: huge pages on / off side by side

A batch-1 decode step reads every weight of every layer once (q|k|v with its bias, o, gate|up, down, the
two norms), the final norm, the LM head and the KV cache of the context; of the embedding table it reads
one row. Bandwidth is measured on a buffer far larger than the caches, as a weight product reads it (one
GEMV of a [N, hidden] fp32 matrix, the shape of the step's products) and as a plain reduction (sum); the
faster of the two is the roofline. "ours argmax only" is the step a greedy verify runs (the argmax of the
logits only: the head screened through its int8 copy, draftrelay/greedy_head.py). Steps are interleaved
variant by variant in one process so a change of the machine's load (it is shared) hits every variant
alike; the load average is recorded.
JSON: benchmarks/results/cpu_bandwidth.json (or --out).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))

from interleave import interleaved  # noqa: E402
from machine import write_json  # noqa: E402


def decode_read_bytes(model, context: int) -> dict[str, int]:
    """Bytes a batch-1 decode step at `context` cached positions reads, by part."""
    cfg = model.cfg
    el = model.dtype.itemsize
    layers = sum(p.numel() * p.element_size() for p in model.layers.parameters())
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * (context + 1) * el
    return {"layers": layers, "final_norm": model.norm.weight.numel() * el,
            "lm_head": head.numel() * head.element_size(), "embedding_row": cfg.hidden_size * el, "kv_cache": kv}


def bandwidth(threads: int, buffer_mb: int, hidden: int, repeats: int, huge: bool = False) -> dict[str, float]:
    """Read GB/s (best of `repeats`) of one GEMV over a [N, hidden] fp32 buffer and of its sum; the buffer
    in 4 KiB pages (torch's own allocation) or, with huge, in an arena of huge pages (hugepages.py)."""
    from draftrelay import hugepages

    torch.set_num_threads(threads)
    n = max(1, buffer_mb * (1 << 20) // (4 * hidden))
    w = (hugepages.empty((n, hidden), torch.float32) if huge else torch.empty(n, hidden)).fill_(0.5)
    x = torch.ones(1, hidden)
    out = {}
    for name, f in (("gemv", lambda: F.linear(x, w)), ("sum", lambda: w.sum())):
        f()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            f()
            best = min(best, time.perf_counter() - t0)
        out[name] = w.numel() * 4 / best / 1e9
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="pair", help="pair (the reference target, fp32) or tiny")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--buffer-mb", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--no-hf", action="store_true", help="leave transformers' step out")
    ap.add_argument("--pages", default="loaded", choices=["loaded", "both"],
                    help="both: also a copy of the target in 4 KiB pages (torch's own allocation, as "
                         "DRAFTRELAY_HUGEPAGES=0 loads it), ours and transformers on it, and the bandwidth in "
                         "both page sizes (the copy takes the model's size again in memory)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_bandwidth.json"))
    args = ap.parse_args(argv)
    n_all = torch.get_num_threads()
    counts = sorted({1, n_all})
    load0 = os.getloadavg()[0]

    if args.target == "pair":
        import real_pair as RP

        model, tok = RP.load_pair_target(torch.float32)
        ids = tok.encode(RP.PROMPTS["code0"][1])
    elif args.target == "tiny":
        from draftrelay.model import tiny_pair

        model = tiny_pair()[0]
        ids = list(b"def quicksort(arr):\n")
    else:
        raise SystemExit(f"cpu_bandwidth: --target must be 'pair' or 'tiny', got {args.target!r}")
    hidden = model.cfg.hidden_size
    context = len(ids) + args.steps // 2
    parts = decode_read_bytes(model, context)
    total = sum(parts.values())
    from draftrelay import hugepages

    hp_on, hp_why = hugepages.enabled()
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    pages = {"enabled": hp_on, "why": hp_why, "thp_mode": hugepages.thp_mode(),
             "model_anon_huge_bytes": hugepages.huge_bytes(head)}
    print(f"huge pages: {'on' if hp_on else 'off'} ({hp_why}); AnonHugePages under the model's weights: "
          f"{pages['model_anon_huge_bytes'] / 1e6:.0f} MB", flush=True)
    small = None
    if args.pages == "both":
        import real_pair as RP

        small = RP.plain_copy(model)
    bw = {n: bandwidth(n, args.buffer_mb, hidden, args.repeats) for n in counts}
    bw_huge = {n: bandwidth(n, args.buffer_mb, hidden, args.repeats, huge=True) for n in counts} \
        if args.pages == "both" and hp_on else None

    class Ours:
        def __init__(self, threads: int, screened: bool = False, net=None) -> None:
            self.threads, self.screened = threads, screened
            self.model = model if net is None else net
            self.cache = self.model.new_cache(1, len(ids) + 8)
            with torch.inference_mode():
                lg = self.model(torch.tensor([ids]), torch.tensor([0]), self.cache, torch.tensor([0]), last_only=True)
            self.nxt, self.out = int(lg[0, -1].argmax()), []

        def step(self) -> None:
            torch.set_num_threads(self.threads)
            with torch.inference_mode():  # every step at the same position: the same bytes each time
                lg = self.model(torch.tensor([[self.nxt]]), torch.tensor([len(ids)]), self.cache, torch.tensor([0]),
                                argmax_only=self.screened)
            self.nxt = int(lg[0, 0]) if self.screened else int(lg[0, 0].argmax())
            self.out.append(self.nxt)
            self.cache.truncate(0, len(ids))

    class HF:
        def __init__(self, net=None) -> None:
            from transformers import DynamicCache

            import real_pair as RP

            self.hf, self.DynamicCache = RP.hf_model(model if net is None else net), DynamicCache
            self.nxt, self.out = None, []

        def step(self) -> None:
            torch.set_num_threads(n_all)
            with torch.inference_mode():  # a fresh cache each step would cost a prefill: keep one, crop it
                if self.nxt is None:
                    self.cache = self.DynamicCache()
                    o = self.hf(torch.tensor([ids]), cache=self.cache, use_cache=True)
                    self.nxt = int(o.logits[0, -1].argmax())
                    return self.step()
                o = self.hf(torch.tensor([[self.nxt]]), cache=self.cache, use_cache=True, logits_to_keep=1,
                            position_ids=torch.tensor([[len(ids)]]))
                self.cache.crop(-1)  # back to the prompt (transformers 5: a negative count removes)
            self.nxt = int(o.logits[0, -1].argmax())
            self.out.append(self.nxt)

    class Head:
        def __init__(self, threads: int) -> None:
            self.threads, self.x = threads, torch.ones(1, hidden)

        def step(self) -> None:
            torch.set_num_threads(self.threads)
            F.linear(self.x, head)

    variants: dict[str, object] = {}
    for n in counts:
        variants[f"ours, {n} thread{'s' * (n > 1)}"] = Ours(n)
        variants[f"ours argmax only, {n} thread{'s' * (n > 1)}"] = Ours(n, screened=True)
    if small is not None:
        for n in counts:
            variants[f"ours, 4 KiB pages, {n} thread{'s' * (n > 1)}"] = Ours(n, net=small)
            variants[f"ours argmax only, 4 KiB pages, {n} thread{'s' * (n > 1)}"] = Ours(n, screened=True, net=small)
    if not args.no_hf:
        variants[f"transformers, {n_all} thread{'s' * (n_all > 1)}"] = HF()
        if small is not None:
            variants[f"transformers, 4 KiB pages, {n_all} thread{'s' * (n_all > 1)}"] = HF(small)
    variants.update({f"LM head alone, {n} thread{'s' * (n > 1)}": Head(n) for n in counts})
    for v in variants.values():  # warm-up
        v.step()
    loads = [load0]
    times = interleaved(variants, args.steps, loads)
    torch.set_num_threads(n_all)

    roof = {n: max(bw[n].values()) for n in counts}
    ideal_ms = {n: 1e3 * total / (roof[n] * 1e9) for n in counts}
    head_ideal = {n: 1e3 * parts["lm_head"] / (roof[n] * 1e9) for n in counts}
    rows = {}
    print(f"load average {min(loads):.2f}-{max(loads):.2f}; {model.cfg.name or args.target}: "
          f"{total / 1e9:.3f} GB per decode step at {context} positions "
          + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in parts.items()))
    for n in counts:
        print(f"  read bandwidth, {n} thread{'s' * (n > 1)}: gemv {bw[n]['gemv']:.1f} GB/s, sum {bw[n]['sum']:.1f} GB/s"
              f" -> ideal step {ideal_ms[n]:.1f} ms (LM head {head_ideal[n]:.1f} ms)")
        if bw_huge:
            print(f"  read bandwidth in huge pages, {n} thread{'s' * (n > 1)}: gemv {bw_huge[n]['gemv']:.1f} GB/s, "
                  f"sum {bw_huge[n]['sum']:.1f} GB/s ({max(bw_huge[n].values()) / roof[n]:.3f} x 4 KiB pages)")
    for name, t in times.items():
        n = int(name.rsplit(", ", 1)[1].split()[0])
        ideal = head_ideal[n] if name.startswith("LM head") else ideal_ms[n]
        p50, best = 1e3 * statistics.median(t), 1e3 * min(t)
        rows[name] = {"threads": n, "p50_ms": p50, "min_ms": best, "ideal_ms": ideal,
                      "ideal_over_p50": ideal / p50, "ideal_over_min": ideal / best}
        print(f"  {name:44s} p50 {p50:7.1f} ms  min {best:7.1f} ms   ideal/p50 {ideal / p50:5.2f}  "
              f"ideal/min {ideal / best:5.2f}")
    ours = [v for k, v in variants.items() if k.startswith("ours")]
    same = None
    if "transformers" in " ".join(variants):
        hf = next(v for k, v in variants.items() if k.startswith("transformers"))
        same = all(o.out == hf.out for o in ours)
        print(f"  greedy tokens equal to transformers': {same}")
    out = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
           "cpus": n_all, "target": model.cfg.name or args.target, "context": context, "steps": args.steps,
           "load_average": {"min": min(loads), "max": max(loads)}, "bytes_per_step": parts,
           "bytes_per_step_total": total, "bandwidth_gb_s": {str(n): bw[n] for n in counts},
           "bandwidth_huge_pages_gb_s": {str(n): bw_huge[n] for n in counts} if bw_huge else None, "pages": pages,
           "ideal_step_ms": {str(n): ideal_ms[n] for n in counts}, "variants": rows, "greedy_equal_to_hf": same}
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
