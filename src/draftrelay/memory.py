"""How much memory a KV cache may take: the device's free memory, read before the cache is allocated.

On a CPU, `torch.zeros` of a cache larger than the free memory succeeds (Linux overcommits), and the
zero fill then drives the host into swap or the OOM killer. `draftrelay serve` with the 1.5B reference
target at its whole 32K context and 8 rows (15 GB of fp32 K/V) beside its local worker's 16 rows (13 GB)
took every one of a 24 GB host's pages before it listened. So a large cache is checked first and the
refusal names its size, the memory available and the settings that size it. On a GPU torch would raise
its own out-of-memory error; the same check names the settings there too.

No torch import here: the CPU figure comes from /proc/meminfo, the GPU one from the caller's torch.
"""

from __future__ import annotations

import os

# of the memory available, what the caches may take: the rest for activations, the allocator's slack and
# what the other processes of the host touch meanwhile
HEADROOM = 0.9
# of the memory available, what a server sizing its context itself (serve --max-model-len 0) lets the KV
# caches take: a long prompt's prefill activations, the worker's working set and the pages of the files its
# models were read from need the rest. At 0.9 the 1.5B reference target beside its worker (8 rows, F = 4)
# left the 24 GB host 1.4 GB free during its warm-up, and it stalled in I/O wait on the evicted file pages
FIT_SHARE = 0.6
# caches below this are not checked (tests and small models make many; none of them matters)
CHECK_FROM_BYTES = 256 << 20


class KVMemoryError(ValueError):
    """A KV cache that does not fit the memory available; the message names both and what sizes it."""


def size(n: float) -> str:
    """Bytes for a person: GiB from 1 GiB up, MiB below."""
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def available_bytes(device) -> int | None:
    """Bytes a new allocation on `device` (a torch.device or its name) can take now: on a CPU the kernel's
    MemAvailable, on a GPU the driver's free memory; None where it cannot be read."""
    kind = getattr(device, "type", str(device).split(":")[0])
    if kind == "cuda":
        import torch

        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except (RuntimeError, AssertionError):
            return None
    if kind != "cpu":
        return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:  # not Linux: free pages, a lower bound of what may be allocated
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(nbytes: int, device, what: str, hint: str = "", avail: int | None = None) -> None:
    """Raise KVMemoryError when `nbytes` exceed HEADROOM of the memory available on `device` (`avail`, or
    read now). `what` names the cache and its shape; `hint` the settings that size it."""
    if nbytes < CHECK_FROM_BYTES:
        return
    avail = available_bytes(device) if avail is None else avail
    if avail is None or nbytes <= HEADROOM * avail:
        return
    raise KVMemoryError(f"{what} needs {size(nbytes)}, more than the {size(HEADROOM * avail)} it may take of "
                        f"the {size(avail)} available on {device}" + (f"; {hint}" if hint else ""))


def fit_positions(bytes_per_position: int, rows: int, budget: float, limit: int, multiple: int = 256) -> int:
    """The most positions per row, at most `limit`, whose cache of `rows` rows stays within `budget` bytes;
    below `limit`, a multiple of `multiple`. 0 where not even `multiple` positions fit."""
    if bytes_per_position <= 0 or rows <= 0:
        raise ValueError(f"fit_positions needs positive sizes, got {bytes_per_position} bytes x {rows} rows")
    n = int(budget // (bytes_per_position * rows))
    if n >= limit:
        return limit
    return n // multiple * multiple
