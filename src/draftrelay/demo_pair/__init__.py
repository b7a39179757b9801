"""The demo pair shipped in the package: a small Python code model (`target/`) and a much smaller
drafter for it (`drafter/`), trained by `scripts/train_demo_pair.py` on CPython's standard-library
sources with their own byte-level BPE tokenizer (the same `tokenizer.json` in both directories).

Both are ordinary HF directories (config.json, model.safetensors in bf16, tokenizer.json) of the
project's Llama-family `Transformer`: the target loader and the worker read them like any other
checkpoint. `TRAINING.json` beside them records the corpus, shapes, losses and estimated acceptance.
"""

from __future__ import annotations

import os

from draftrelay.model import ModelError

NAME = "demo"  # what `--model` / `--drafter` say to mean this pair
HERE = os.path.dirname(os.path.abspath(__file__))
TARGET_DIR = os.path.join(HERE, "target")
DRAFTER_DIR = os.path.join(HERE, "drafter")
FILES = ("config.json", "model.safetensors", "tokenizer.json")
MAX_WEIGHT_BYTES = 16_000_000  # both weight files together: small enough to ship in the wheel


def paths() -> tuple[str, str]:
    """(target directory, drafter directory); ModelError naming the missing file if either is incomplete."""
    for d in (TARGET_DIR, DRAFTER_DIR):
        for fn in FILES:
            if not os.path.isfile(os.path.join(d, fn)):
                raise ModelError(f"the demo pair is incomplete: {os.path.join(d, fn)} is missing "
                                 "(train it with scripts/train_demo_pair.py --out src/draftrelay/demo_pair)")
    return TARGET_DIR, DRAFTER_DIR
