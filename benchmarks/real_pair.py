"""The reference pair on this machine: draftrelay's modes side by side with transformers as the peer.

    python benchmarks/real_pair.py                                  # everything (long: run on a quiet machine)
    python benchmarks/real_pair.py --prompts code0 --max-tokens 16 --dtypes fp32 --modes off,sync:auto,hf

Target Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M), drafter Qwen2.5-Coder-0.5B-Instruct (GGUF), both
dequantized by draftrelay's loader (checkpoint/gguf.py) into fp32 or bf16; greedy, 6 prompts (3 code,
3 prose) x 128 tokens by default, one request at a time (batch 1), each prompt decoded `--repeats` times.
Modes are interleaved: one engine (or transformers pipeline) per mode stays alive for the whole run, and
every prompt of every repeat runs each mode once in an order that rotates, so a change of the machine's
load (it is shared) hits every mode alike; each run records the load average before and after it.
The engine's CPU threads follow its thread policy (`--threads auto`, engine/threads.py); transformers
runs with torch's default thread count.

Modes (`--modes`, comma-separated):
  off                      target only (draftrelay's engine)
  off:full-head            the same with the greedy head read whole in fp32 (greedy_head.py's screen off)
  off:even-probes          target only with the thread policy probing one thread as often as all of them
  off:mkl                  target only with its fp32 products on MKL whatever cpu_linear's probe chose
                           (probe_cost_fewer = probe_cost, engine/threads.py)
  off:whole                target only on every CPU the run started with, under the thread policy, whatever
                           --engine-cpus pins the other modes to (the whole machine for the target alone)
  sync:D / async:D         rounds to a local drafter worker process (loopback), D = auto (the depth
                           policy, engine/depth.py, up to --k-max), autoN (the same up to N) or a fixed k
  sync:D/S / async:D/S     the same with the worker's confidence stop at S (e.g. sync:auto12/0.4): a round's
                           drafts end after the first one the drafter gives a probability below S, so D is a cap
  cache:K/F[/RULE]         async rounds with the speculation cache (engine/spec_cache.py): fixed k = K,
                           F branches per request, wait rule RULE (all, rows or early; default all), with
                           its guard (engine/cache_guard.py: F, F/2 or plain rounds, whichever measures faster)
  cache:autoK/F[/RULE]     the same with the depth policy (up to K) choosing k on the guard's plain steps, as
                           `draftrelay generate --spec-cache` runs it (cache steps draft K)
  cache:...[/dD[.D]]       the guard may also run cache steps at depth D < K, where they measure faster
                           (cache_guard.py's depths; e.g. cache:auto4/4/d2)
  cache:autoK/F/dauto      cache steps at the depth policy's choice with the round hidden (up to K: tokens
                           per verify second, SpecCache(depth="policy"))
  cache-raw:K/F[/RULE]     the same without the guard: every step a cache step
  MODE@QUANT               a sync, async or cache mode with the drafter worker's --quant QUANT (none, int8,
                           int4) instead of --drafter-quant's: one worker per quant, every mode interleaved
  MODE+vocabN              a sync, async or cache mode with the drafter worker's --draft-vocab N (its head
                           restricted to ids 0..N-1, draft_vocab.py; e.g. sync:auto+vocab32768; N at least
                           the drafter's vocabulary: the whole head); combines with @QUANT in either order
                           (cache:auto4/8+vocab32768@int4): one worker per quant and draft vocabulary,
                           every mode interleaved
  hf                       transformers' plain greedy generate
  hf-assisted:K            transformers' assisted generation, constant K drafts (confidence threshold off)
  hf-assisted:heuristic    transformers' assisted generation with its own defaults (heuristic schedule)
  (default: off, sync and async with auto and k = 2, 3, 4, 6, hf, hf-assisted:4, hf-assisted:heuristic)

The transformers models are Qwen2ForCausalLM built in memory from draftrelay's dequantized weights
(the very tensors, not copies): transformers' own GGUF loading needs accelerate, which is not a
dependency. So the peer runs the same numbers through transformers' code; its greedy output is
compared token for token with the engine's.

Placement (`--engine-cpus`, `--worker-cpus`): by default the engine, its proxy and the drafter worker
share every core, as a laptop runs them. `--engine-cpus 0 --worker-cpus 1` gives each side a core of
its own (cpus.py), the CPU form of the product's placement (the drafter off the target's hardware): the
target-only baseline then runs on the target's core alone, and `off:whole` beside it on every core.

Per mode: tokens/s (output tokens over decode wall time, all prompts), the same by prompt kind, step
p50, TTFT, drafts accepted per round and by position, the depth policy's choices, rounds ok/failed,
and whether every output equals target-only's (and transformers plain's). The round budget and the
watchdog deadline follow the worker's measured STEP (engine/calibrate.py), as in `draftrelay generate`.
JSON: benchmarks/results/real_pair.json (or --out).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from draftrelay.worker.quant import QUANTS  # the worker's --quant values
from machine import cpu_name  # benchmarks/ (the script's own folder, or put on sys.path by its importers)

REFPAIR = Path(os.environ.get("DRAFTRELAY_REFPAIR", "/work/refpair"))
TARGET = REFPAIR / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
DRAFTER = REFPAIR / "qwen2.5-coder-0.5b-instruct.gguf"

PROMPTS = {
    "code0": ("code", "def quicksort(arr):\n    \"\"\"Sort a list of integers with quicksort.\"\"\"\n"),
    "code1": ("code", "# Python: read a CSV file and print the average of the 'price' column\nimport csv\n\n"),
    "code2": ("code", "// C: reverse a singly linked list in place\nstruct node { int value; struct node *next; };\n\n"
                      "struct node *reverse(struct node *head) {\n"),
    "prose0": ("prose", "The history of the printing press begins in"),
    "prose1": ("prose", "Write a short letter to a neighbour asking them to water your plants while you are away.\n\n"
                        "Dear"),
    "prose2": ("prose", "Three reasons why regular exercise improves sleep are"),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEFAULT_MODES = ("off,sync:auto,async:auto,sync:2,sync:3,sync:4,sync:6,async:2,async:3,async:4,async:6,"
                 "hf,hf-assisted:4,hf-assisted:heuristic")


def engine_mode(m: str, k_max: int) -> tuple[str, bool, int, float]:
    """(kind, depth policy on, k_max or the fixed k, confidence stop) of an engine mode; ValueError if bad."""
    kind, _, arg = m.partition(":")
    if kind == "off" and not arg:
        return kind, False, 0, 0.0
    if kind not in ("sync", "async"):
        raise ValueError(m)
    depth, _, stop = arg.partition("/")
    s = float(stop) if stop else 0.0
    if not 0.0 <= s <= 1.0:
        raise ValueError(m)
    if depth == "auto":
        return kind, True, k_max, s
    auto = depth.startswith("auto")
    k = depth[4:] if auto else depth
    if not k.isdigit() or not 1 <= int(k) <= 16:
        raise ValueError(m)
    return kind, auto, int(k), s


SPEC_KINDS = ("sync", "async", "cache", "cache-raw")  # the modes that draft (a drafter worker's)
VOCAB_SUFFIX = "+vocab"


def mode_suffixes(m: str) -> tuple[str, str | None, str | None]:
    """MODE[@QUANT][+vocabN] (either order) -> (MODE, QUANT or None, N's text or None); ValueError (naming
    what is wrong) for a suffix given twice or an empty MODE. The values are checked by parse_modes."""
    base, quant, vocab = "", None, None
    rest = m
    while rest:
        cut = min((i for i in (rest.find("@", 1), rest.find(VOCAB_SUFFIX, 1)) if i > 0), default=len(rest))
        part, rest = rest[:cut], rest[cut:]
        if not base and not part.startswith(("@", VOCAB_SUFFIX)):
            base = part
        elif part.startswith("@") and quant is None:
            quant = part[1:]
        elif part.startswith(VOCAB_SUFFIX) and vocab is None:
            vocab = part[len(VOCAB_SUFFIX):]
        else:
            raise ValueError(f"a second {'@QUANT' if part.startswith('@') else VOCAB_SUFFIX + 'N'} ({part!r})"
                             if base else "no mode before its suffix")
    if not base:
        raise ValueError("no mode before its suffix")
    return base, quant, vocab


def mode_worker(m: str, default_quant: str) -> tuple[str, str, int]:
    """(the mode without its suffixes, its drafter worker's quant, its draft vocabulary N: 0 = the whole head)."""
    base, q, v = mode_suffixes(m)
    return base, (q if q is not None else default_quant), int(v) if v else 0


def worker_key(quant: str, vocab: int) -> str:
    """A drafter worker's name in the results (round_timing) and the log: its quant, +vocabN if it has one."""
    return quant + (f"{VOCAB_SUFFIX}{vocab}" if vocab else "")


def parse_modes(s: str, k_max: int = 6) -> list[str]:
    out = []
    for full in (x.strip() for x in s.split(",") if x.strip()):
        try:
            m, q, v = mode_suffixes(full)
        except ValueError as exc:
            raise SystemExit(f"real_pair: --modes: {full!r}: {exc}") from None
        spec = m.partition(":")[0] in SPEC_KINDS
        if q is not None and (q not in QUANTS or not spec):
            raise SystemExit(f"real_pair: --modes: {full!r}: @QUANT ({', '.join(QUANTS)}) follows a sync, async "
                             f"or cache mode")
        if v is not None and not (spec and v.isdigit() and int(v) >= 1):
            raise SystemExit(f"real_pair: --modes: {full!r}: +vocabN (N a whole number of token ids, at least 1: "
                             f"the drafter worker's --draft-vocab N) follows a sync, async or cache mode"
                             + (f"; got N = {v!r}" if spec else f", not {m!r}"))
        kind, _, arg = m.partition(":")
        ok = (kind == "hf" and not arg) or (kind == "off" and arg in ("full-head", "even-probes", "mkl", "whole")) \
            or (kind == "hf-assisted" and (arg == "heuristic" or arg.isdigit() and 1 <= int(arg) <= 16)) \
            or (kind == "cache" and _cache_arg(arg) is not None) \
            or (kind == "cache-raw" and _cache_arg(arg) is not None and _cache_arg_depths(arg)[4] in ([], "auto"))
        if not ok:
            try:
                engine_mode(m, k_max)
                ok = True
            except ValueError:
                pass
        if not ok:
            raise SystemExit(f"real_pair: --modes: {m!r} is not off, off:full-head, off:even-probes, off:mkl, "
                             f"off:whole, hf, "
                             f"sync:D[/S], async:D[/S] "
                             f"(D: auto, autoN or K <= 16; S: a confidence stop in [0, 1]), "
                             f"cache[-raw]:K/F[/all|rows|early][/dD|/dauto], hf-assisted:K|heuristic "
                             f"(a drafting mode may add @QUANT and +vocabN)")
        out.append(full)
    return out


def _cache_arg(arg: str) -> tuple[int, int, str, bool] | None:
    """cache:[auto]K/F[/RULE] -> (K, F, RULE, depth policy on the plain steps), or None if malformed."""
    parsed = _cache_arg_depths(arg)
    return parsed[:4] if parsed else None


def _cache_arg_depths(arg: str) -> tuple[int, int, str, bool, list[int] | str] | None:
    """cache:[auto]K/F[/RULE][/dD[.D...]|/dauto] -> (K, F, RULE, depth policy on the plain steps, the guard's
    other depths for cache steps, each below K: `d2` lets it run cache steps at k = 2 where they measure
    faster; or "auto": `dauto`, cache steps at the depth policy's choice with the round hidden, which needs
    autoK), or None if malformed."""
    parts = arg.split("/")
    extra: list[int] | str = []
    if len(parts) > 2 and parts[-1] == "dauto":
        parts.pop()
        extra = "auto"
        if not parts[0].startswith("auto"):
            return None
    elif len(parts) > 2 and parts[-1].startswith("d"):
        ds = parts.pop()[1:].split(".")
        if not all(x.isdigit() for x in ds):
            return None
        extra = [int(x) for x in ds]
    auto = parts[0].startswith("auto")
    if auto:
        parts[0] = parts[0][4:]
    if len(parts) not in (2, 3) or not all(x.isdigit() for x in parts[:2]):
        return None
    k, f, rule = int(parts[0]), int(parts[1]), parts[2] if len(parts) == 3 else "all"
    if not (1 <= k <= 16 and 1 <= f <= 64 and rule in ("all", "rows", "early")):
        return None
    if extra != "auto" and (any(not 1 <= d < k for d in extra) or len(set(extra)) != len(extra)):
        return None
    return k, f, rule, auto, extra


# -- draftrelay ---------------------------------------------------------------------------------------
def start_worker(drafter: str, n_draft: int, max_ctx: int, threads: int, dtype: str, quant: str, vocab: int,
                 cpus: str = ""):
    """loading.start_local_worker on the CPU (4 rows), with the worker's --draft-vocab N where vocab > 0 and
    its --cpus where given."""
    from draftrelay.engine import loading as L

    return L.start_local_worker(drafter, torch.device("cpu"), n_draft, max_ctx, 4, threads, dtype=dtype,
                                quant=quant, draft_vocab=str(vocab) if vocab else "", cpus=cpus)


def round_settings_for(spec: dict, prompt: list[int], depths: list[int]):
    """calibrate.round_settings with the worker's STEP measured at depth 1 and every mode's k_max."""
    from draftrelay.engine import calibrate as C

    ks = sorted({1, *depths})
    timing = C.measure_rounds(spec, prompt, ks)
    budget = timing.budget_ms(ks[-1])
    deadline = C.deadline_for(budget)
    steady = ", ".join(f"k={k} {1e3 * v:.1f} ms" for k, v in sorted(timing.by_k.items()))
    note = (f"round budget {budget:.0f} ms, deadline {deadline:.0f} ms (measured STEP: {steady}; prompt of "
            f"{timing.prompt_tokens} tokens {1e3 * timing.prefill_s:.1f} ms)")
    return C.RoundSettings(float(budget), float(deadline), timing, note)


def load_pair_target(dtype: torch.dtype):
    from draftrelay.checkpoint import gguf
    from draftrelay.checkpoint.tokenizer import HFTokenizer

    ck = gguf.read_gguf(TARGET)
    tok = HFTokenizer.from_gguf_vocab(ck.vocab, ck.name or TARGET.name, str(TARGET))
    model = gguf.load_gguf(TARGET, device="cpu", dtype=dtype, checkpoint=ck)
    return model, tok


def delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


class EngineRunner:
    """One engine per mode, alive for the whole run (its depth and thread policies learn across prompts,
    as a server's would), decoding one prompt per call."""

    def __init__(self, model, tok, mode: str, ids: dict[str, list[int]], args, spec, rs) -> None:
        from draftrelay.engine import loading as L
        from draftrelay.engine.engine import Engine, EngineConfig, SamplingParams

        kind, _, arg = mode.partition(":")
        self.full_head, self.mkl = arg == "full-head", arg == "mkl"
        even = arg == "even-probes"
        # off:whole: every CPU the run started with, whatever --engine-cpus pins the other modes to
        self.whole = set(args.all_cpus) if arg == "whole" else None
        fanout, options = 0, {}
        if kind in ("cache", "cache-raw"):  # async rounds with the speculation cache at depth k_max
            k_max, fanout, rule, auto, depths = _cache_arg_depths(arg)  # auto: the depth policy on plain steps
            kind, stop, options = "async", 0.0, {"wait_rule": rule, "guard": kind == "cache"}
            if depths == "auto":  # cache steps at the depth policy's choice, the round hidden (spec_cache.py)
                options["depth"] = "policy"
            elif depths:  # the guard also tries cache steps at these depths (cache_guard.py; None: k_max)
                options["guard_options"] = {"depths": [None, *depths]}
        else:
            kind, auto, k_max, stop = engine_mode("off" if self.full_head or even or self.mkl or self.whole else mode,
                                                  args.k_max)
        max_len = max(len(x) for x in ids.values()) + args.max_tokens + 16 + 8
        h = None
        if kind != "off":
            h = L.handoff_config(spec, torch.device("cpu"), rs.deadline_ms, True, round_budget_ms=rs.budget_ms)
        cfg = EngineConfig(mode=kind, n_draft=k_max if kind != "off" else 0, max_batch=1, max_len=max_len,
                           handoff=h, depth="auto" if auto else "fixed", draft_stop=stop,
                           round_costs_s=rs.round_costs_s if h else None,
                           threads="auto" if self.whole else args.threads,
                           spec_fanout=fanout, spec_options=options)
        self.params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, stop_token_ids=tok.stop_ids)
        self.fixed_threads = cfg.threads if isinstance(cfg.threads, int) else 0  # head() sets it before each run
        with self.head():  # off:whole's thread policy counts the CPUs it may use as it starts
            self.eng = Engine(model, cfg)
        if even and self.eng.threads is not None:  # the policy as it probed before the asymmetric costs
            self.eng.threads.probe_cost_fewer = self.eng.threads.probe_cost
        with self.head():  # warm-up (and the policy's start)
            self.eng.generate([next(iter(ids.values()))], SamplingParams(max_tokens=4))

    @contextlib.contextmanager
    def head(self):
        """off:full-head: the screen of greedy_head.py off for this engine's steps; off:mkl: its products on
        MKL (cpu_linear's choice for the others is put back after each call); off:whole: every CPU (the
        --engine-cpus mask put back after)."""
        from draftrelay import cpu_linear, cpus, greedy_head

        saved, library = greedy_head.SCREEN_MIN_BYTES, cpu_linear.chosen()
        if self.full_head:
            greedy_head.SCREEN_MIN_BYTES = 1 << 62
        if self.mkl:
            cpu_linear.choose("mkl")
        whole = cpus.pinned(self.whole) if self.whole else contextlib.nullcontext()
        n = self.fixed_threads
        if n and torch.get_num_threads() != n:  # another mode's thread policy left its count
            torch.set_num_threads(n)
        try:
            with whole:
                yield
        finally:
            greedy_head.SCREEN_MIN_BYTES = saved
            if self.mkl:
                cpu_linear.choose(library)

    def run(self, x: list[int]) -> dict:
        with self.head():
            return self._run(x)

    def _run(self, x: list[int]) -> dict:
        eng = self.eng
        d0 = dict(eng.depth.chosen) if eng.depth is not None else {}
        th0 = dict(eng.threads.chosen) if eng.threads is not None else {}
        eng.reset_metrics()
        (req,) = eng.generate([x], self.params)
        t = eng.metrics([req])["total"]
        return {"output": req.output, "tokens": t["output_tokens"], "wall_s": t["wall_s"],
                "decode_s": t["wall_s"] - t["ttft_s_mean"], "ttft_s": t["ttft_s_mean"],
                "step_p50_ms": t["step_p50_ms"], "step_parts_p50_ms": t["step_parts_p50_ms"],
                "mean_accepted": t["mean_accepted"], "accept_rate_by_pos": t["accept_rate_by_pos"],
                "rounds": t["rounds"], "depth": delta(eng.depth.chosen, d0) if eng.depth is not None else None,
                "depth_view": t.get("depth"),
                "threads": delta(eng.threads.chosen, th0) if eng.threads is not None else None,
                "warning": t.get("speculation_warning", ""),
                "spec_cache": {k: t["spec_cache"][k] for k in ("active", "refusal", "hits", "lookups", "hit_rate",
                                                               "fast_steps", "waited_steps", "bare_rows", "misses",
                                                               "plain_steps", "guard")}
                if "spec_cache" in t else None}

    def close(self) -> dict:
        mode = self.eng.round_mode
        self.eng.close()
        return {"round_mode": mode}


# -- transformers -------------------------------------------------------------------------------------
@contextlib.contextmanager
def plain_pages():
    """Loads inside allocate in torch's own way (DRAFTRELAY_HUGEPAGES=0: 4 KiB pages where THP is 'madvise')."""
    from draftrelay import hugepages

    saved = os.environ.get(hugepages.ENV)
    os.environ[hugepages.ENV] = "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(hugepages.ENV)
        else:
            os.environ[hugepages.ENV] = saved


def plain_copy(model):
    """The model again in torch's own allocations, as a load with DRAFTRELAY_HUGEPAGES=0 gives it and as
    transformers' own loader allocates its weights."""
    from draftrelay.checkpoint.hf import empty_model

    with plain_pages():
        copy = empty_model(model.cfg, "cpu", model.dtype)
    with torch.no_grad():
        for (na, a), (nb, b) in zip(copy.named_parameters(), model.named_parameters(), strict=True):
            if na != nb:
                raise RuntimeError(f"plain_copy: parameter {na} against {nb}")
            a.copy_(b)
    return copy.eval()


def hf_model(ours):
    """A transformers Qwen2ForCausalLM holding our tensors (assign=True: no copy)."""
    import inspect

    import transformers

    from draftrelay.checkpoint.hf import config_to_dict, hf_state_dict

    d = config_to_dict(ours.cfg)
    theta = d.pop("rope_theta")
    d.pop("rope_scaling")
    d.pop("model_type")
    if "rope_parameters" in inspect.signature(transformers.Qwen2Config.__init__).parameters:
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    else:
        d["rope_theta"] = theta
    conf = transformers.Qwen2Config(**d)
    with torch.device("meta"):
        hf = transformers.Qwen2ForCausalLM(conf)
    sd = hf_state_dict(ours)
    if ours.cfg.tie_word_embeddings:
        sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])
    missing, unexpected = hf.load_state_dict(sd, strict=False, assign=True)
    missing = [k for k in missing if not k.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise RuntimeError(f"transformers model from our weights: missing {missing[:3]}, unexpected {unexpected[:3]}")
    for name, buf in list(hf.named_buffers()):  # non-persistent buffers (rotary inv_freq) are still on meta
        if buf.is_meta:
            mod = hf.get_submodule(name.rpartition(".")[0])
            fresh = type(mod)(config=conf)
            for bn, b in fresh.named_buffers():
                setattr(mod, bn, b)
    return hf.eval()


class HFRunner:
    """transformers' generate, plain or assisted, with torch's default thread count (as a user runs it)."""

    def __init__(self, hf, hf_drafter, tok, mode: str, ids: dict[str, list[int]], args, threads: int) -> None:
        self.hf, self.hf_drafter, self.args, self.threads = hf, hf_drafter, args, threads
        self.kind, _, self.arg = mode.partition(":")
        self.stop = list(tok.stop_ids)
        self.gen(next(iter(ids.values())), 4)  # warm-up

    def gen(self, x: list[int], n: int):
        stop = self.stop
        kw = dict(max_new_tokens=n, min_new_tokens=0, do_sample=False, eos_token_id=stop or None,
                  pad_token_id=stop[0] if stop else 0, temperature=None, top_p=None, top_k=None)
        if self.kind == "hf-assisted":
            g = self.hf_drafter.generation_config
            if self.arg == "heuristic":
                g.num_assistant_tokens, g.num_assistant_tokens_schedule = 20, "heuristic"
                g.assistant_confidence_threshold = 0.4
            else:
                g.num_assistant_tokens, g.num_assistant_tokens_schedule = int(self.arg), "constant"
                g.assistant_confidence_threshold = 0.0
            kw["assistant_model"] = self.hf_drafter
        if torch.get_num_threads() != self.threads:  # an engine's thread policy may have left another count
            torch.set_num_threads(self.threads)
        with torch.inference_mode():
            return self.hf.generate(torch.tensor([x]), attention_mask=torch.ones(1, len(x), dtype=torch.long), **kw)

    def run(self, x: list[int]) -> dict:
        t0 = time.perf_counter()
        self.gen(x, 1)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = self.gen(x, self.args.max_tokens)[0, len(x):].tolist()
        wall = time.perf_counter() - t0
        return {"output": out, "tokens": len(out), "wall_s": wall, "decode_s": max(wall - ttft, 1e-9), "ttft_s": ttft}

    def close(self) -> dict:
        return {"round_mode": self.kind}


# -- the table ----------------------------------------------------------------------------------------
def summarize(res: dict, ref: dict | None, hf_ref: dict | None) -> dict:
    """Totals over prompts (median over repeats of each prompt's figures), by prompt kind too."""
    rows = {}
    for scope in ("all", "code", "prose"):
        names = [n for n in res["prompts"] if scope == "all" or PROMPTS[n][0] == scope]
        if not names:
            continue
        tok = dec = 0.0
        p50, ttft, acc = [], [], []
        for n in names:
            runs = res["prompts"][n]["runs"]
            tok += statistics.median(r["tokens"] - 1 for r in runs)
            dec += statistics.median(r["decode_s"] for r in runs)
            ttft.append(statistics.median(r["ttft_s"] for r in runs))
            if "step_p50_ms" in runs[0]:
                p50.append(statistics.median(r["step_p50_ms"] for r in runs))
                acc.append(statistics.median(r["mean_accepted"] for r in runs))
        rates = [(r["tokens"] - 1) / r["decode_s"] for n in names for r in res["prompts"][n]["runs"]]
        rows[scope] = {"tokens_per_s": tok / dec if dec else 0.0, "tokens_per_s_min": min(rates),
                       "tokens_per_s_max": max(rates), "ttft_ms": 1e3 * statistics.median(ttft),
                       "step_p50_ms": statistics.median(p50) if p50 else None,
                       "mean_accepted": statistics.mean(acc) if acc else None}
    first = [res["prompts"][n]["runs"][0] for n in res["prompts"]]
    pos = [r["accept_rate_by_pos"] for r in first if r.get("accept_rate_by_pos")]
    width = max((len(p) for p in pos), default=0)
    by_pos = [statistics.mean(p[j] for p in pos if len(p) > j) for j in range(width)]
    every = [r for n in res["prompts"] for r in res["prompts"][n]["runs"]]
    depth: dict = {}
    threads: dict = {}
    rounds: dict = {}
    for r in every:
        for acc, key in ((depth, "depth"), (threads, "threads"), (rounds, "rounds")):
            for k, v in (r.get(key) or {}).items():
                acc[k] = acc.get(k, 0) + v
    depth_by_kind: dict = {}
    for n in res["prompts"]:
        for r in res["prompts"][n]["runs"]:
            d = depth_by_kind.setdefault(PROMPTS[n][0], {})
            for k, v in (r.get("depth") or {}).items():
                d[k] = d.get(k, 0) + v

    def same(other):
        if other is None:
            return None
        return all(run["output"] == other["prompts"][n]["runs"][0]["output"]
                   for n in res["prompts"] for run in res["prompts"][n]["runs"])

    return {"by_kind": rows, "accept_rate_by_pos": by_pos, "depth_chosen": depth, "depth_by_kind": depth_by_kind,
            "threads_chosen": threads, "rounds": rounds,
            "identical_to_off": same(ref), "identical_to_hf": same(hf_ref),
            "warnings": sorted({r["warning"] for r in first if r.get("warning")})}


def print_table(dtype: str, table: dict[str, dict]) -> None:
    base = table.get("off", {}).get("by_kind", {})
    head = ["mode", "tok/s", "code", "prose", "vs off", "step p50", "TTFT ms", "acc/round", "acc by pos", "depths",
            "same"]
    lines = [head]
    for mode, s in table.items():
        a = s["by_kind"].get("all", {})
        rel = a.get("tokens_per_s", 0) / base["all"]["tokens_per_s"] if base.get("all") else float("nan")
        lines.append([mode, f"{a.get('tokens_per_s', 0):.2f}",
                      f"{s['by_kind'].get('code', {}).get('tokens_per_s', 0):.2f}",
                      f"{s['by_kind'].get('prose', {}).get('tokens_per_s', 0):.2f}", f"{rel:.2f}x",
                      f"{a['step_p50_ms']:.0f}" if a.get("step_p50_ms") is not None else "-",
                      f"{a.get('ttft_ms', 0):.0f}",
                      f"{a['mean_accepted']:.2f}" if a.get("mean_accepted") is not None else "-",
                      " ".join(f"{x:.2f}" for x in s["accept_rate_by_pos"]) or "-",
                      " ".join(f"{k}:{v}" for k, v in sorted(s["depth_chosen"].items())) or "-",
                      {True: "yes", False: "NO", None: "-"}[s["identical_to_off"]]
                      + ("/" + {True: "yes", False: "NO", None: "-"}[s["identical_to_hf"]])])
    w = [max(len(r[i]) for r in lines) for i in range(len(head))]
    print(f"\n[{dtype}]")
    for i, r in enumerate(lines):
        print("  ".join(c.ljust(w[j]) if j in (0, 8, 9) else c.rjust(w[j]) for j, c in enumerate(r)))
        if i == 0:
            print("-" * (sum(w) + 2 * len(w)))
    for mode, s in table.items():
        for msg in s["warnings"]:
            print(f"  WARNING [{mode}]: {msg}")


def main(argv: list[str] | None = None) -> int:
    modes_doc = __doc__[__doc__.index("Modes (`--modes`"):__doc__.index("The transformers models")].rstrip()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=modes_doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default=",".join(PROMPTS), help=f"subset of {','.join(PROMPTS)} (or 'code'/'prose')")
    ap.add_argument("--modes", default=DEFAULT_MODES,
                    help="comma-separated modes (listed below); a sync, async or cache mode may add @QUANT (the "
                         "drafter worker's --quant) and +vocabN (its --draft-vocab N: the head restricted to ids "
                         "0..N-1), e.g. sync:auto+vocab32768,cache:auto4/8+vocab32768@int4")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--k-max", type=int, default=6, help="deepest draft of the depth policy (sync:auto, async:auto)")
    ap.add_argument("--worker-threads", type=int, default=0, help="the drafter worker's CPU threads (0: all cores)")
    ap.add_argument("--drafter-dtype", default="same", choices=["same", *DTYPES],
                    help="the drafter's dtype (the worker's, and transformers' assistant's): same as the target "
                         "(default), or fp32 / bf16 whatever the target's (a greedy verify keeps the target's "
                         "output; a bf16 drafter reads half the bytes a draft)")
    ap.add_argument("--drafter-quant", default="none", choices=list(QUANTS),
                    help="the worker's --quant: int8 / int4 run the drafter's layer products on int8 / int4 weights "
                         "(worker/quant.py; transformers' assistant stays as loaded). A mode's own @QUANT suffix "
                         "(sync:auto@int4) overrides it: each quant gets its own worker, all modes interleaved")
    ap.add_argument("--threads", default="auto",
                    help="the engine's CPU threads: auto (engine/threads.py) or N (default with --engine-cpus: one a "
                         "CPU there)")
    ap.add_argument("--engine-cpus", default="", metavar="LIST",
                    help="the engine and its proxy on these CPUs only (e.g. 0); default: every CPU (cpus.py)")
    ap.add_argument("--worker-cpus", default="", metavar="LIST",
                    help="the drafter worker on these CPUs only (its --cpus, e.g. 1); default: every CPU")
    ap.add_argument("--hf-weights", default="shared", choices=["shared", "own"],
                    help="transformers' weights: our tensors (shared: in our huge pages, hugepages.py), or its own "
                         "copy in torch's plain allocations, as its own loader gives it (own: the target's size "
                         "again in memory; the assisted drafter is loaded without huge pages)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "real_pair.json"))
    args = ap.parse_args(argv)
    names = []
    for p in (x.strip() for x in args.prompts.split(",") if x.strip()):
        group = [n for n, (kind, _) in PROMPTS.items() if kind == p]
        if not group and p not in PROMPTS:
            raise SystemExit(f"real_pair: --prompts: unknown prompt {p!r} (known: {', '.join(PROMPTS)}, code, prose)")
        names += [n for n in group or [p] if n not in names]
    try:
        modes = parse_modes(args.modes, args.k_max)
    except SystemExit as exc:  # argparse's error (usage, exit status 2), the message naming the value
        ap.error(str(exc).removeprefix("real_pair: "))
    from draftrelay import cpus

    args.all_cpus = sorted(cpus.available())
    for name in ("engine_cpus", "worker_cpus"):
        if getattr(args, name):
            try:
                setattr(args, name, cpus.format_list(cpus.parse(getattr(args, name))))
            except ValueError as exc:
                ap.error(f"--{name.replace('_', '-')}: {exc}")
    if args.engine_cpus:
        engine_cpus = cpus.parse(args.engine_cpus)
        cpus.pin(engine_cpus)  # the proxy and threads started later inherit it
        if args.threads == "auto":
            args.threads = str(len(engine_cpus))
        # now, before cpu_linear's probe: OpenMP threads beyond the pinned CPUs would share them (a blocked
        # 4-row MKL product then took 235 ms against 4.6 on one thread)
        torch.set_num_threads(int(args.threads) if args.threads.isdigit() else len(engine_cpus))
    if args.threads != "auto":
        if not args.threads.isdigit():
            raise SystemExit(f"real_pair: --threads: 'auto' or a count, got {args.threads!r}")
        args.threads = int(args.threads)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not dtypes or any(d not in DTYPES for d in dtypes):
        raise SystemExit(f"real_pair: --dtypes: each must be one of {', '.join(DTYPES)}")
    if args.max_tokens < 2 or args.repeats < 1:
        raise SystemExit("real_pair: need --max-tokens >= 2 and --repeats >= 1")
    for f in (TARGET, DRAFTER):
        if not f.is_file():
            raise SystemExit(f"real_pair: {f} is missing (set DRAFTRELAY_REFPAIR to the folder holding the pair)")
    if any(m.startswith("hf") for m in modes):
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise SystemExit("real_pair: the hf modes need transformers: pip install -e '.[bench]'") from None

    from draftrelay import cpu_linear
    from draftrelay.engine import loading as L

    out = {"machine": {"platform": platform.platform(), "cpu": cpu_name(), "cpus": L.default_threads(),
                       "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                       "python": sys.version.split()[0], "cpu_linear": cpu_linear.chosen(),
                       "cpu_linear_probe_ms": cpu_linear.probe_times()},
           "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
           "target": TARGET.name, "drafter": DRAFTER.name, "drafter_dtype": args.drafter_dtype,
           "drafter_quant": args.drafter_quant,
           "placement": {"engine_cpus": args.engine_cpus or cpus.format_list(args.all_cpus),
                         "worker_cpus": args.worker_cpus or cpus.format_list(args.all_cpus),
                         "engine_threads": args.threads},
           "max_tokens": args.max_tokens, "repeats": args.repeats,
           "prompts": {n: PROMPTS[n] for n in names}, "results": {}}
    from draftrelay import hugepages

    out["huge_pages"] = {"enabled": hugepages.enabled()[0], "why": hugepages.enabled()[1],
                         "hf_weights": args.hf_weights}
    for dname in dtypes:
        dtype = DTYPES[dname]
        ddtype = dtype if args.drafter_dtype == "same" else DTYPES[args.drafter_dtype]
        t0 = time.perf_counter()
        model, tok = load_pair_target(dtype)
        print(f"[{dname}] target loaded in {time.perf_counter() - t0:.1f} s", flush=True)
        if cpu_linear.chosen() == "auto":  # decide once, on the target's own weights, before any mode runs
            cpu_linear.prepare(model)  # (off:mkl switches around its calls)
            print(f"CPU fp32 products: {cpu_linear.chosen()} {cpu_linear.probe_times() or '(fixed)'}", flush=True)
            out["machine"].update(cpu_linear=cpu_linear.chosen(), cpu_linear_probe_ms=cpu_linear.probe_times())
        ids = {n: tok.encode(PROMPTS[n][1]) for n in names}
        res: dict[str, dict] = {m: {"prompts": {n: {"runs": []} for n in ids}} for m in modes}
        timing = None
        workers: dict[str, object] = {}
        runners: dict[str, object] = {}
        hf_threads = torch.get_num_threads()
        try:
            spec_modes = [mode_worker(m, args.drafter_quant) for m in modes
                          if m.split(":")[0] in SPEC_KINDS]
            specs: dict[tuple, tuple] = {}  # (quant, draft vocab) -> (worker spec, round settings)
            if spec_modes:
                max_ctx = max(len(x) for x in ids.values()) + args.max_tokens + 64
                k_all = max([args.k_max] + [engine_mode(m, args.k_max)[2] for m, _, _ in spec_modes
                                            if m.startswith(("sync", "async"))]
                            + [_cache_arg(m.partition(":")[2])[0] for m, _, _ in spec_modes
                               if m.startswith(("cache:", "cache-raw:"))])
                timing = {}
                # one worker per drafter quant and draft vocabulary
                for quant, vocab in dict.fromkeys((q, v) for _, q, v in spec_modes):
                    key = worker_key(quant, vocab)
                    workers[key] = w = start_worker(
                        str(DRAFTER), k_all, max_ctx, args.worker_threads,
                        "float32" if ddtype == torch.float32 else "bfloat16", quant, vocab, args.worker_cpus)
                    spec = L.worker_spec(w.host, w.port, L.drafter_model_id(str(DRAFTER)), tok.vocab_hash, k_all, 8)
                    # the round budget follows the deepest mode; each mode's policy starts from the round costs
                    # measured at its own k_max (calibrate.py measures every depth asked)
                    depths = [engine_mode(m, args.k_max)[2] for m, q, v in spec_modes
                              if (q, v) == (quant, vocab) and m.startswith(("sync", "async"))]
                    rs = round_settings_for(spec, max(ids.values(), key=len), depths)
                    specs[quant, vocab] = (spec, rs)
                    timing[key] = rs.timing.as_dict() if rs.timing else None
                    print(f"[{dname}] drafter quant {quant}"
                          f"{f', draft vocabulary {vocab}' if vocab else ''}: {rs.note}", flush=True)
                if len(timing) == 1:
                    timing = next(iter(timing.values()))
            hf_modes = [m for m in modes if m.startswith("hf")]
            if hf_modes:
                from draftrelay.checkpoint import gguf

                own = args.hf_weights == "own"
                hf = hf_model(plain_copy(model) if own else model)
                drafter = None
                if any("assisted" in m for m in hf_modes):
                    with plain_pages() if own else contextlib.nullcontext():
                        drafter = gguf.load_gguf(DRAFTER, device="cpu", dtype=ddtype)
                hf_drafter = hf_model(drafter) if drafter is not None else None
            for mode in modes:
                runners[mode] = HFRunner(hf, hf_drafter, tok, mode, ids, args, hf_threads) if mode.startswith("hf") \
                    else EngineRunner(model, tok, mode_worker(mode, "")[0], ids, args,
                                      *specs.get(mode_worker(mode, args.drafter_quant)[1:], (None, None)))
            # interleaved: every prompt of every repeat runs each mode once, the order rotating, so a change of
            # the machine's load hits every mode alike
            t_all = time.perf_counter()
            turn = 0
            for rep in range(args.repeats):
                for name, x in ids.items():
                    order = modes[turn % len(modes):] + modes[:turn % len(modes)]
                    turn += 1
                    for mode in order:
                        load0 = os.getloadavg()[0]
                        run = runners[mode].run(x)
                        run["load"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
                        res[mode]["prompts"][name]["runs"].append(run)
                        with open(args.out + ".partial", "w") as f:  # what a stopped run leaves behind
                            json.dump({**out, "partial": {dname: res}}, f)
                        print(f"[{dname}] rep {rep} {name} {mode}: {(run['tokens'] - 1) / run['decode_s']:.2f} tok/s "
                              f"(load {load0:.1f}, {time.perf_counter() - t_all:.0f} s)", flush=True)
        finally:
            for mode, r in runners.items():
                res[mode].update(r.close())
            for w in workers.values():
                w.stop()
        loads = [v for m in res.values() for p in m["prompts"].values() for r in p["runs"] for v in r["load"]]
        out.setdefault("load_average", {})[dname] = {"min": min(loads), "max": max(loads),
                                                     "median": statistics.median(loads)}
        # transformers' output: plain greedy's, else (a run without it) its assisted generation's
        hf_name = "hf" if "hf" in res else next((m for m in res if m.startswith("hf-assisted")), None)
        ref, hf_ref = res.get("off"), res.get(hf_name) if hf_name else None
        table = {m: summarize(r, ref if m != "off" else None, hf_ref if m != hf_name else None)
                 for m, r in res.items()}
        print_table(dname, table)
        out["results"][dname] = {"round_timing": timing, "summary": table, "raw": res}
        del model, runners
        gc.collect()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    Path(args.out + ".partial").unlink(missing_ok=True)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
