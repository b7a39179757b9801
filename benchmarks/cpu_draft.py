"""Where a CPU draft's time goes: the reference drafter (Qwen2.5-Coder 0.5B, fp32) drafting in-process with
the worker's own loop (LlamaDrafter, lean mode) against transformers' forward of the same model on the same
tensors, threads and prompt, and the same STEP through a worker process over loopback.

    python benchmarks/cpu_draft.py                  # the reference drafter (about 2 minutes on 2 cores)
    python benchmarks/cpu_draft.py --drafter tiny   # a smoke run

A draft of a greedy drafter is one decode forward (24 layers, then the head: 151,936 x 896, 544 MB of fp32,
read in full for the logits) plus its argmax and confidence (the softmax probability of the drafted token).
The STEP variants run `LlamaDrafter.run` with n_steps 1 and N (one job at the same position each time, its
row rolled back after): the cost of one draft is the slope (t_N - t_1) / (N - 1); the extension forward that
gives the first draft is in t_1. "full head" variants turn the lean loop's screened head off;
--other-thread adds the same STEP from a second thread of this process (as a worker's connection thread
ran it without worker/mainthread.py): with two threads running torch CPU ops the process has two
OpenMP teams on its cores, and every in-process variant is slower from then on.
"transformers draft" is one decode forward of Qwen2ForCausalLM
(logits_to_keep=1, the cache cropped back each time) plus the argmax and the softmax its assisted
generation takes for its confidence threshold. "layers only" runs the 24 layers without the head; "head
full" / "head screened" the head alone on one row: the fp32 product, and the int8 screen of greedy_head.py
with its fp32 rows. "worker STEP" sends the same STEP over loopback to a worker process started as the
engine starts a local one (its own copy of the drafter); its slope is the per-draft cost a round pays. Variants are
interleaved step by step in one process so a change of the (shared) machine's load hits each alike.
JSON: benchmarks/results/cpu_draft.json (or --out).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))

from interleave import interleaved  # noqa: E402
from machine import write_json  # noqa: E402

PROBE_ID = (1 << 62) + 11  # the benchmark's request id at the worker


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", default="pair", help="pair (the reference drafter, fp32) or tiny")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--n", type=int, default=5, help="drafts of the long STEP (the slope's other end)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: every core, as the local worker)")
    ap.add_argument("--no-hf", action="store_true", help="leave transformers out")
    ap.add_argument("--no-worker", action="store_true", help="leave the worker process out")
    ap.add_argument("--quant", default="",
                    help="comma-separated int8,int4: also the STEP of a drafter on the same weights with its layer "
                         "products quantized so (draftrelay worker --quant, worker/quant.py), interleaved")
    ap.add_argument("--int8", action="store_true", help="the same as --quant int8")
    ap.add_argument("--other-thread", action="store_true",
                    help="also the STEP from a second thread of this process (its second OpenMP team slows every "
                         "in-process variant, which is what it shows)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_draft.json"))
    args = ap.parse_args(argv)

    from draftrelay import greedy_head, hugepages
    from draftrelay.engine import loading as L
    from draftrelay.worker import quant as Q
    from draftrelay.worker.drafters import Job, LlamaDrafter

    threads = args.threads or L.default_threads()
    torch.set_num_threads(threads)
    load0 = os.getloadavg()[0]
    if args.drafter == "pair":
        import real_pair as RP
        from draftrelay.checkpoint import gguf
        from draftrelay.checkpoint.tokenizer import HFTokenizer

        ck = gguf.read_gguf(RP.DRAFTER)
        net = gguf.load_gguf(RP.DRAFTER, device="cpu", dtype=torch.float32, checkpoint=ck)
        tok = HFTokenizer.from_gguf_vocab(ck.vocab, ck.name, str(RP.DRAFTER))
        ids = tok.encode(RP.PROMPTS["code0"][1])
        spec_model = str(RP.DRAFTER)
        vocab_hash = tok.vocab_hash
    elif args.drafter == "tiny":
        from draftrelay.model import tiny_pair

        net = tiny_pair()[1]
        ids = list(b"def quicksort(arr):\n")
        spec_model, vocab_hash = "tiny", None
    else:
        raise SystemExit(f"cpu_draft: --drafter must be 'pair' or 'tiny', got {args.drafter!r}")
    head = net.embed_tokens.weight if net.lm_head is None else net.lm_head.weight
    n = args.n
    worker = None
    if not args.no_worker:  # a worker process holding its own copy of the drafter, as the engine starts one
        worker = L.start_local_worker(spec_model, torch.device("cpu"), n, len(ids) + 64, 4, 0,
                                      dtype="float32" if args.drafter == "pair" else "")
    drafter = LlamaDrafter(net, 1, len(ids) + n + 32, max(8, n), "bench", "", mode="lean")
    prompt = np.asarray(ids, np.int32)
    drafter.run([Job(0, 0, prompt[:-1])], 0)  # the prompt but its last token in the cache: every STEP below
    base = len(ids) - 1                       # extends it by that token and drafts from there
    quants = [q for q in args.quant.split(",") if q] + (["int8"] if args.int8 and "int8" not in args.quant else [])
    kinds = [q for q in Q.QUANTS if q != "none"]
    bad = [q for q in quants if q not in kinds]
    if bad:
        raise SystemExit(f"cpu_draft: --quant takes {' and/or '.join(kinds)}, got {','.join(bad)}")
    quantized = {}  # the same weights, the layers' products on a quantized copy of them
    for q in quants:
        quantized[q] = LlamaDrafter(net, 1, len(ids) + n + 32, max(8, n), "bench", "", mode="lean", quant=q)
        quantized[q].run([Job(0, 0, prompt[:-1])], 0)

    def step(n_steps: int, d=drafter):
        return d.run([Job(0, base, prompt[-1:])], n_steps)

    class Step:
        def __init__(self, n_steps: int, screen: bool = True, d=drafter) -> None:
            self.n_steps, self.screen, self.out, self.d = n_steps, screen, None, d

        def step(self) -> None:
            self.d._lean.screen = self.screen
            try:
                self.out = step(self.n_steps, self.d)
            finally:
                self.d._lean.screen = True

    h = torch.randn(1, net.cfg.hidden_size) * 0.05  # any hidden state: the head's reads do not depend on it

    class Head:
        def __init__(self, screened: bool) -> None:
            self.screened = screened

        def step(self) -> None:
            with torch.inference_mode():
                if self.screened:
                    greedy_head.head_argmax(h, head)
                else:
                    F.linear(h, head).argmax(-1)

    class Layers:
        """The decoder's layers and final norm for one token (the lean forward returns the head's input)."""

        def __init__(self) -> None:
            self.lean = drafter._lean
            self.pos = torch.tensor([[base]])
            self.tables = self.lean.tables(self.pos, base + 1)

        def step(self) -> None:
            with torch.inference_mode():
                self.lean.forward(torch.tensor([ids[-1:]]), self.pos, self.tables, [0], base + 1)
            drafter.cache.lengths[0] = base

    class HF:
        def __init__(self) -> None:
            from transformers import DynamicCache

            import real_pair as RP

            self.hf = RP.hf_model(net)
            with torch.inference_mode():
                self.cache = DynamicCache()
                self.hf(torch.tensor([ids[:-1]]), cache=self.cache, use_cache=True)

        def step(self) -> None:
            with torch.inference_mode():
                o = self.hf(torch.tensor([ids[-1:]]), cache=self.cache, use_cache=True, logits_to_keep=1,
                            position_ids=torch.tensor([[base]]))
                self.cache.crop(-1)
                lg = o.logits[0, -1]
                t = lg.argmax()
                torch.softmax(lg.float(), -1)[t].item()

    class ThreadStep:
        """The STEP of `Step` run by another thread of this process (one kept for the whole run), as a
        worker's connection thread would run it without worker/mainthread.py."""

        def __init__(self, n_steps: int) -> None:
            import queue
            import threading

            self.n_steps, self.q, self.done = n_steps, queue.SimpleQueue(), queue.SimpleQueue()
            threading.Thread(target=self.loop, daemon=True).start()

        def loop(self) -> None:
            while self.q.get():
                self.done.put(step(self.n_steps))

        def step(self) -> None:
            self.q.put(True)
            self.done.get()

    class WorkerStep:
        """One STEP over loopback: the same block (the prompt's last token at the same position) each time."""

        def __init__(self, client, n_steps: int) -> None:
            self.client, self.n_steps = client, n_steps

        def step(self) -> None:
            from draftrelay.wire import protocol as P

            self.client.step([P.Block(PROBE_ID, 1, base, prompt[-1:], self.n_steps, 0)], timeout=120)

    client = None
    if worker is not None:
        from draftrelay.model import TINY_TOKENIZER_ID
        from draftrelay.wire import protocol as P
        from draftrelay.wire.roundfn import client_from_spec

        spec = L.worker_spec(worker.host, worker.port, L.drafter_model_id(spec_model),
                             vocab_hash or TINY_TOKENIZER_ID, n, 1)
        client = client_from_spec({**spec, "client_name": "cpu-draft"})
        client.connect(timeout=120)
        client.step([P.Block(PROBE_ID, 1, 0, prompt[:-1], 0, 0)], timeout=120)  # the prompt but its last token

    variants: dict[str, object] = {"STEP 1 draft (extension forward)": Step(1), f"STEP {n} drafts": Step(n),
                                   "STEP 1 draft, full head": Step(1, False),
                                   f"STEP {n} drafts, full head": Step(n, False),
                                   "layers only": Layers(), "head full": Head(False), "head screened": Head(True)}
    for q, dq in quantized.items():
        variants[f"STEP 1 draft, {q} products"] = Step(1, d=dq)
        variants[f"STEP {n} drafts, {q} products"] = Step(n, d=dq)
    if args.other_thread:
        variants["STEP 1 draft, another thread"] = ThreadStep(1)
        variants[f"STEP {n} drafts, another thread"] = ThreadStep(n)
    if not args.no_hf and args.drafter == "pair":
        variants["transformers draft"] = HF()
    if client is not None:
        variants["worker STEP 1 draft"] = WorkerStep(client, 1)
        variants[f"worker STEP {n} drafts"] = WorkerStep(client, n)
    for v in variants.values():  # warm-up (and the screen's int8 copy)
        v.step()
    loads = [load0]
    times = interleaved(variants, args.steps, loads)
    rows = {k: {"p50_ms": 1e3 * statistics.median(t), "min_ms": 1e3 * min(t)} for k, t in times.items()}
    one, many = rows["STEP 1 draft (extension forward)"], rows[f"STEP {n} drafts"]
    per_draft = {q: (many[q] - one[q]) / (n - 1) for q in ("p50_ms", "min_ms")}
    one_f, many_f = rows["STEP 1 draft, full head"], rows[f"STEP {n} drafts, full head"]
    per_draft_full = {q: (many_f[q] - one_f[q]) / (n - 1) for q in ("p50_ms", "min_ms")}
    same = all(np.array_equal(a, b) for a, b in zip(variants[f"STEP {n} drafts"].out[:1],
                                                    variants[f"STEP {n} drafts, full head"].out[:1], strict=True))
    screened = {"screened_steps": drafter._lean.screened, "full_steps": drafter._lean.full}
    per_draft_thread = None
    per_draft_q, same_q = {}, {}
    for q in quantized:
        i1, i_n = rows[f"STEP 1 draft, {q} products"], rows[f"STEP {n} drafts, {q} products"]
        per_draft_q[q] = {s: (i_n[s] - i1[s]) / (n - 1) for s in ("p50_ms", "min_ms")}
        out_q = variants[f"STEP {n} drafts, {q} products"].out[0][0]
        same_q[q] = int((out_q == variants[f"STEP {n} drafts"].out[0][0]).sum())
    if args.other_thread:
        t1, tn = rows["STEP 1 draft, another thread"], rows[f"STEP {n} drafts, another thread"]
        per_draft_thread = {q: (tn[q] - t1[q]) / (n - 1) for q in ("p50_ms", "min_ms")}
    if worker is not None:
        client.close()
        worker.stop()
        w1, wn = rows["worker STEP 1 draft"], rows[f"worker STEP {n} drafts"]
        worker = {q: (wn[q] - w1[q]) / (n - 1) for q in ("p50_ms", "min_ms")}

    print(f"load average {min(loads):.2f}-{max(loads):.2f}; {net.cfg.name or args.drafter}, {threads} threads, "
          f"huge pages {'on' if hugepages.enabled()[0] else 'off'} ({hugepages.enabled()[1]}), "
          f"head {head.numel() * head.element_size() / 1e6:.0f} MB")
    for name, r in rows.items():
        print(f"  {name:34s} p50 {r['p50_ms']:7.1f} ms  min {r['min_ms']:7.1f} ms")
    print(f"  per draft in the worker's loop (slope 1 -> {n}): p50 {per_draft['p50_ms']:.1f} ms, "
          f"min {per_draft['min_ms']:.1f} ms; with the full head p50 {per_draft_full['p50_ms']:.1f} ms, "
          f"min {per_draft_full['min_ms']:.1f} ms; drafts equal: {same}; {screened}")
    for q, pq in per_draft_q.items():
        print(f"  per draft with {q} products: p50 {pq['p50_ms']:.1f} ms, "
              f"min {pq['min_ms']:.1f} ms ({per_draft['p50_ms'] / pq['p50_ms']:.2f} x "
              f"faster at the p50; {same_q[q]} of {n} drafts equal to fp32's)")
    if per_draft_thread:
        print(f"  per draft from another thread of this process: p50 {per_draft_thread['p50_ms']:.1f} ms, "
              f"min {per_draft_thread['min_ms']:.1f} ms")
    if worker:
        print(f"  per draft through the worker process (slope 1 -> {n}): p50 {worker['p50_ms']:.1f} ms, "
              f"min {worker['min_ms']:.1f} ms")
    out = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
           "threads": threads, "drafter": net.cfg.name or args.drafter, "steps": args.steps,
           "huge_pages": hugepages.enabled()[0], "load_average": {"min": min(loads), "max": max(loads)},
           "variants": rows, "per_draft_ms": per_draft, "per_draft_full_head_ms": per_draft_full,
           "per_draft_other_thread_ms": per_draft_thread, "per_draft_int8_ms": per_draft_q.get("int8"),
           "int8_drafts_equal_fp32": same_q.get("int8"), "per_draft_int4_ms": per_draft_q.get("int4"),
           "int4_drafts_equal_fp32": same_q.get("int4"),
           "drafts_equal_full_head": same, "steps_picked": screened, "per_draft_worker_ms": worker}
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
