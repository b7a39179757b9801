#!/usr/bin/env python3
"""Rank the Qwen2 tokenizer's vocabulary by frequency over a text corpus: a ranking file for a drafter's
draft vocabulary (`draftrelay worker --draft-vocab FILE.npy:N`, src/draftrelay/draft_vocab.py).

A drafter that restricts its LM head to N token ids (FR-Spec, EAGLE-3's draft vocabulary) reads N rows of
the head per drafted token instead of all 151,936; a draft outside the subset cannot be proposed, so
acceptance drops by the share of the target's tokens that fall outside it. This script measures that
share on the recorded trace of the reference pair, for its ranking and for plain id order (the worker's
default, ids 0..N-1: BPE merge order). On this machine's default corpus the id order covered more of the
trace (96.6 % against 92.7 % at 32,768: the corpus has little prose), so a ranking is worth building from
text like the workload's own.

The tokenizer is the project's own, built from a GGUF file's vocabulary (every Qwen2.5 model shares it).
Token ids are counted over the corpus (by default the running Python's standard library *.py files,
then the plain-text files of /usr/share/doc, no markup, duplicate files once, up to --max-bytes), ranked
by count, ties and unseen ids by lower id first, and the first --keep ids are written as a uint32 .npy
with a JSON sidecar of the same stem (tokenizer digest, corpus, corpus coverage and trace coverage by the
top 8K/16K/32K/64K).

    python3 scripts/build_draft_vocab.py --out ranking.npy
    python3 scripts/build_draft_vocab.py --corpus ~/src:*.py ~/notes --max-bytes 128M --out ranking.npy
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
REFPAIR = Path(os.environ.get("DRAFTRELAY_REFPAIR", "/work/refpair"))
DEFAULT_GGUF = REFPAIR / "qwen2.5-coder-0.5b-instruct.gguf"
DEFAULT_OUT = Path("draft_vocab_ranking.npy")
DEFAULT_TRACE = ROOT / "benchmarks" / "data" / "trace_qwen2.5-coder-0.5b-1.5b.json"
FORMAT = "draftrelay-draft-vocab-1"
SIZES = (8192, 16384, 32768, 65536)
# directories never walked into: installed packages are not the standard library, caches are bytecode
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", ".git"})
# suffixes of compressed, binary and markup files, skipped without reading them (markup: HTML pages'
# tags would rank span / href / class above the words of the text)
SKIP_SUFFIXES = frozenset({".gz", ".bz2", ".xz", ".zst", ".zip", ".tgz", ".png", ".gif", ".jpg", ".jpeg",
                           ".ico", ".pdf", ".so", ".a", ".o", ".pyc", ".whl", ".exe", ".dll", ".woff",
                           ".woff2", ".ttf", ".otf", ".wav", ".mp3", ".db", ".sqlite", ".npy",
                           ".html", ".htm", ".xhtml", ".xml", ".svg", ".css", ".xsl", ".xslt", ".devhelp2"})
BATCH_BYTES = 4 << 20  # texts handed to one encode_batch call


def default_corpus() -> list[str]:
    specs = [sysconfig.get_paths()["stdlib"] + ":*.py"]
    if os.path.isdir("/usr/share/doc"):
        specs.append("/usr/share/doc")
    return specs


def parse_bytes(s: str) -> int:
    """'64M', '1.5G', '65536' -> bytes (K/M/G are powers of 1024)."""
    t = s.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        n = float(t[:-1] if mult > 1 else t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte count: {s!r} (e.g. 64M)") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {s!r}")
    return int(n)


def split_spec(spec: str) -> tuple[str, str]:
    """'DIR' -> (DIR, '*'); 'DIR:*.py' -> (DIR, '*.py') where DIR is an existing path."""
    if os.path.exists(spec):
        return spec, "*"
    path, sep, pattern = spec.rpartition(":")
    if sep and pattern and "/" not in pattern and os.path.exists(path):
        return path, pattern
    raise SystemExit(f"--corpus {spec!r}: no such file or directory")


def walk(path: str, pattern: str) -> Iterator[str]:
    """Files under path whose names match pattern, in sorted order (deterministic)."""
    if os.path.isfile(path):
        yield path
        return
    for d, dirs, files in os.walk(path):
        dirs[:] = sorted(x for x in dirs if x not in SKIP_DIRS)
        for f in sorted(files):
            if fnmatch.fnmatch(f, pattern):
                yield os.path.join(d, f)


def read_text(path: str) -> bytes | None:
    """The file's bytes if it is plain UTF-8 text (no NUL byte), else None."""
    if os.path.splitext(path)[1].lower() in SKIP_SUFFIXES or os.path.islink(path) or not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError:
        return None
    if not raw or b"\x00" in raw:
        return None
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return raw


@dataclass
class Corpus:
    specs: list[str]
    files: int = 0
    skipped: int = 0  # binary, markup, non-UTF-8, empty or unreadable
    duplicates: int = 0  # the same bytes as a file already counted (e.g. one license text in many packages)
    bytes: int = 0
    tokens: int = 0
    truncated: bool = False  # the byte cap cut the corpus short
    per_spec: list[dict] = field(default_factory=list)


def count_tokens(tok, specs: list[str], max_bytes: int, progress_every: int) -> tuple[np.ndarray, Corpus]:
    """Counts of each token id over the corpus' files (tokenized file by file, in batches); a file whose
    bytes equal an earlier file's is counted once."""
    vocab_size = tok.get_vocab_size()
    counts = np.zeros(vocab_size, dtype=np.int64)
    corpus = Corpus(specs)
    batch: list[str] = []
    batch_bytes = 0
    next_report = progress_every
    seen: set[bytes] = set()
    t0 = time.perf_counter()

    def flush() -> None:
        nonlocal batch, batch_bytes
        if batch:
            ids = np.concatenate([np.asarray(e.ids, dtype=np.int64)
                                  for e in tok.encode_batch(batch, add_special_tokens=False)])
            counts[:] += np.bincount(ids, minlength=vocab_size)
            corpus.tokens += len(ids)
        batch, batch_bytes = [], 0

    for spec in specs:
        path, pattern = split_spec(spec)
        files0, bytes0 = corpus.files, corpus.bytes
        for fn in walk(path, pattern):
            raw = read_text(fn)
            if raw is None:
                corpus.skipped += 1
                continue
            digest = hashlib.blake2b(raw, digest_size=16).digest()
            if digest in seen:
                corpus.duplicates += 1
                continue
            seen.add(digest)
            if corpus.bytes + len(raw) > max_bytes:  # the last file is cut at a line end below the cap
                raw = raw[:raw.rfind(b"\n", 0, max_bytes - corpus.bytes) + 1]
                corpus.truncated = True
            text, size = raw.decode("utf-8"), len(raw)
            if text:
                batch.append(text)
                batch_bytes += size
                corpus.files += 1
                corpus.bytes += size
            if batch_bytes >= BATCH_BYTES or corpus.truncated:
                flush()
            if corpus.bytes >= next_report:
                dt = time.perf_counter() - t0
                print(f"  {corpus.bytes / 2**20:7.1f} MiB, {corpus.files} files, {corpus.tokens:,} tokens "
                      f"({corpus.bytes / 2**20 / max(dt, 1e-9):.1f} MiB/s)", file=sys.stderr, flush=True)
                next_report += progress_every
            if corpus.truncated:
                break
        flush()
        corpus.per_spec.append({"spec": spec, "files": corpus.files - files0, "bytes": corpus.bytes - bytes0})
        if corpus.truncated:
            break
    return counts, corpus


def rank(counts: np.ndarray) -> np.ndarray:
    """Ids by count descending; equal counts (unseen ids included) by lower id first."""
    return np.argsort(-counts, kind="stable")


def trace_coverage(trace_path: Path, order: np.ndarray, sizes: tuple[int, ...]) -> dict:
    """Share of the trace's target tokens inside the ranking's top N and inside ids < N, overall and by
    the entries' group (the name before ':', e.g. code / prose)."""
    with open(trace_path) as f:
        trace = json.load(f)
    groups: dict[str, list[int]] = {}
    for e in trace["entries"]:
        groups.setdefault(str(e.get("name", "")).partition(":")[0] or "all", []).extend(e["target"])
    everything = [t for ids in groups.values() for t in ids]
    rank_of = np.empty(len(order), dtype=np.int64)
    rank_of[order] = np.arange(len(order))

    def cover(ids: list[int]) -> dict:
        a = np.asarray(ids, dtype=np.int64)
        return {"tokens": len(a),
                "ranking": {str(n): round(float(np.mean(rank_of[a] < n)), 6) for n in sizes},
                "id_order": {str(n): round(float(np.mean(a < n)), 6) for n in sizes}}

    out = {"trace": trace_path.name, **cover(everything)}
    if len(groups) > 1:
        out["by_group"] = {g: cover(ids) for g, ids in sorted(groups.items())}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Rank the Qwen2 vocabulary by token frequency over a corpus and write the top --keep ids "
                    "(a drafter's restricted LM-head vocabulary) as a uint32 .npy with a JSON sidecar.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=DEFAULT_GGUF,
                    help="GGUF file whose vocabulary builds the tokenizer (any Qwen2.5 model; $DRAFTRELAY_REFPAIR "
                         "sets the default's folder)")
    ap.add_argument("--corpus", nargs="+", metavar="DIR[:GLOB]", default=default_corpus(),
                    help="files or directories to count over, in order; ':GLOB' keeps only file names matching it "
                         "(e.g. /usr/lib/python3.11:*.py). Only plain UTF-8 text files are read (compressed, "
                         "binary and markup files such as HTML are skipped, a file equal to an earlier one is "
                         f"counted once), and the folders {', '.join(sorted(SKIP_DIRS))} are not walked")
    ap.add_argument("--max-bytes", type=parse_bytes, default="64M", metavar="N[K|M|G]",
                    help="stop after this much text (the last file is cut at a line end)")
    ap.add_argument("--progress-every", type=parse_bytes, default="8M", metavar="N[K|M|G]",
                    help="print progress to stderr after every this much text")
    ap.add_argument("--keep", type=int, default=65536, help="ids written (the top of the ranking)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help="the .npy to write; the sidecar is the same path with .json")
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                    help="recorded trace (draftrelay-trace-1) whose target tokens measure the coverage; "
                         "'none' skips it")
    args = ap.parse_args(argv)

    from draftrelay.checkpoint.gguf import read_gguf
    from draftrelay.checkpoint.tokenizer import HFTokenizer

    t_start = time.perf_counter()
    print(f"reading {args.gguf} ...", file=sys.stderr, flush=True)
    ck = read_gguf(args.gguf)
    tok = HFTokenizer.from_gguf_vocab(ck.vocab, ck.name or args.gguf.name, str(args.gguf)).tok
    vocab_size = len(ck.vocab.tokens)
    if tok.get_vocab_size() != vocab_size:
        raise SystemExit(f"{args.gguf}: tokenizer has {tok.get_vocab_size()} ids for {vocab_size} tokens")
    if not 0 < args.keep <= vocab_size:
        raise SystemExit(f"--keep {args.keep}: must be in 1..{vocab_size}")
    print(f"tokenizer {ck.vocab.digest()} ({ck.vocab.pre}, {vocab_size} ids) in "
          f"{time.perf_counter() - t_start:.1f} s; counting over {', '.join(args.corpus)}", file=sys.stderr)

    t_count = time.perf_counter()
    counts, corpus = count_tokens(tok, args.corpus, args.max_bytes, args.progress_every)
    t_count = time.perf_counter() - t_count
    if corpus.tokens == 0:
        raise SystemExit("the corpus holds no readable text")
    order = rank(counts)
    cum = np.cumsum(counts[order])
    sizes = tuple(n for n in SIZES if n <= vocab_size)
    coverage = {str(n): round(float(cum[n - 1] / corpus.tokens), 6) for n in sizes}
    seen = int(np.count_nonzero(counts))

    sidecar = {
        "format": FORMAT,
        "about": "token ids of the tokenizer by descending frequency over the corpus (ties and unseen ids by "
                 "lower id first); the first `keep` of them, uint32, in the .npy of the same stem",
        "tokenizer": {"gguf": args.gguf.name, "digest": ck.vocab.digest(), "pre": ck.vocab.pre,
                      "model": ck.vocab.model},
        "vocab_size": vocab_size,
        "keep": args.keep,
        "corpus": {"specs": corpus.specs, "per_spec": corpus.per_spec, "files": corpus.files,
                   "skipped_files": corpus.skipped,
                   "duplicate_files": corpus.duplicates, "bytes": corpus.bytes, "tokens": corpus.tokens,
                   "max_bytes": args.max_bytes, "truncated": corpus.truncated, "distinct_ids_seen": seen,
                   "python": sys.version.split()[0]},
        "coverage": coverage,
    }
    if str(args.trace).lower() != "none":
        sidecar["trace_coverage"] = trace_coverage(args.trace, order, sizes)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.save(args.out, order[:args.keep].astype(np.uint32))
    side = args.out.with_suffix(".json")
    with open(side, "w") as f:
        json.dump(sidecar, f, indent=1)
        f.write("\n")

    total = time.perf_counter() - t_start
    print(f"corpus: {corpus.files} files ({corpus.skipped} skipped, {corpus.duplicates} duplicates), "
          f"{corpus.bytes / 2**20:.1f} MiB, {corpus.tokens:,} tokens, {seen:,} distinct ids; "
          f"counted in {t_count:.1f} s")
    print(f"{'N':>6} {'corpus':>8}" + (f" {'trace: ranked':>14} {'ids < N':>8}" if "trace_coverage" in sidecar else ""))
    for n in sizes:
        row = f"{n:>6} {coverage[str(n)]:>8.4f}"
        if "trace_coverage" in sidecar:
            tc = sidecar["trace_coverage"]
            row += f" {tc['ranking'][str(n)]:>14.4f} {tc['id_order'][str(n)]:>8.4f}"
        print(row)
    for g, c in sidecar.get("trace_coverage", {}).get("by_group", {}).items():
        print(f"  {g} ({c['tokens']} target tokens): ranked "
              + ", ".join(f"{n // 1024}K {c['ranking'][str(n)]:.4f}" for n in sizes)
              + "; ids < N " + ", ".join(f"{n // 1024}K {c['id_order'][str(n)]:.4f}" for n in sizes))
    print(f"wrote {args.out} ({args.out.stat().st_size:,} bytes) and {side} ({side.stat().st_size:,} bytes) "
          f"in {total:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
