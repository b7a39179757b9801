"""What a CPU benchmark records about where it ran, how it writes its JSON, and how it reads a list option."""

from __future__ import annotations

import json
import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_json(path: str | Path, out: dict) -> None:
    """Write a result file (its folder made if needed) and say where."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1))
    print(f"wrote {path}")


def positive_ints(text: str) -> list[int]:
    """'1,4' -> [1, 4]: a comma-separated option of positive integers (ValueError saying what it is not)."""
    try:
        vals = [int(x) for x in text.split(",")]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise ValueError(f"comma-separated positive integers, not {text!r}")
    return vals
