"""Large CPU weights in transparent huge pages.

A batch-1 decode step on a CPU streams every weight from memory once, and the hardware prefetchers
stop at page boundaries: with 4 KiB pages a product's read restarts its prefetch stream 256 times per
MiB. Where the kernel's transparent huge pages are in `madvise` mode (a common default), torch's CPU
tensors get 4 KiB pages; memory advised MADV_HUGEPAGE *before its first write* is faulted in 2 MiB
pages instead (docs/ENGINE.md, "Huge pages": what it buys the decode step).
Advising memory that is already written only lets khugepaged collapse it later, slowly, so the place
to do it is the allocation, before the loader fills it.

So a model's CPU parameters are allocated together in one *arena*: a fresh anonymous mapping, advised
MADV_HUGEPAGE, its start rounded up to 2 MiB, wrapped as a torch tensor (torch.frombuffer keeps the
mapping alive while any view of it lives; the last view's release unmaps it), and each parameter a
64-byte-aligned view into it. The model's bytes are allocated once, as before (no peak above the model's
size: the loader writes into the views), and only the arena's two ends can miss a huge page.

Off (plain torch allocations) where THP is `never` or absent (not Linux), for arenas below MIN_BYTES,
and with DRAFTRELAY_HUGEPAGES=0; the first decision is logged in one line.
"""

from __future__ import annotations

import logging
import mmap
import os
import sys

import torch
from torch import nn

ENV = "DRAFTRELAY_HUGEPAGES"  # "0" (or off/false/no): plain torch allocations
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"
HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor's start in the arena (vector loads, as torch's own allocator aligns)
MIN_BYTES = 4 << 20  # smaller arenas (the tiny test models) are plain allocations: nothing to gain

log = logging.getLogger(__name__)
_logged: set[str] = set()


def thp_mode(path: str = THP_ENABLED) -> str | None:
    """The kernel's THP mode (`always`, `madvise`, `never`), or None where there is none (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def enabled() -> tuple[bool, str]:
    """(whether arenas are advised, why): off by the environment, by the kernel's mode or without THP."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "off", "false", "no"):
        return False, f"{ENV}={os.environ[ENV]}"
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False, "no MADV_HUGEPAGE on this platform"
    mode = thp_mode()
    if mode is None:
        return False, "no transparent huge pages here"
    if mode == "never":
        return False, "transparent huge pages are 'never' on this kernel"
    return True, f"transparent huge pages '{mode}'"


def _log_once(on: bool, why: str) -> None:
    if why not in _logged:
        _logged.add(why)
        log.info("huge pages for CPU weights: %s (%s)", "on" if on else "off", why)


def arena(nbytes: int) -> torch.Tensor | None:
    """nbytes of uint8 in a fresh anonymous mapping advised MADV_HUGEPAGE, its start 2 MiB-aligned, not
    yet touched; None where huge pages are off (`enabled`) or nbytes is below MIN_BYTES."""
    on, why = enabled()
    _log_once(on, why)
    if not on or nbytes < MIN_BYTES:
        return None
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except OSError as exc:  # a kernel built without THP refuses the advice: plain pages, nothing lost
        mm.close()
        _log_once(False, f"madvise(MADV_HUGEPAGE) refused: {exc}")
        return None
    whole = torch.frombuffer(mm, dtype=torch.uint8)  # holds mm; unmapped when its last view goes
    del mm
    skip = (-whole.data_ptr()) % HUGE_PAGE
    return whole[skip:skip + nbytes]


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """torch.empty(shape, dtype) on the CPU, in huge pages where `arena` gives them."""
    n = 1
    for s in shape:
        n *= int(s)
    buf = arena(n * dtype.itemsize)
    if buf is None:
        return torch.empty(shape, dtype=dtype)
    return buf.view(dtype).view(shape)


def materialize(module: nn.Module, dtype: torch.dtype) -> bool:
    """Give every parameter and buffer of `module` (on the meta device, any dtype: floating ones are cast
    to `dtype`) uninitialised CPU storage in one arena. False (nothing changed) where `arena` declines:
    the caller allocates as usual."""
    slots = []  # (owner, name, is_param, shape, dtype, requires_grad)
    total = 0
    seen: dict[int, int] = {}  # shared tensors (tied weights) get one slot
    for mod in module.modules():
        for table, is_param in ((mod._parameters, True), (mod._buffers, False)):
            for name, t in table.items():
                if t is None:
                    continue
                if not t.is_meta:
                    raise ValueError(f"hugepages.materialize: {name} is on {t.device}, expected meta")
                dt = dtype if t.is_floating_point() else t.dtype
                key = id(t)
                if key not in seen:
                    seen[key] = total
                    total += -(-t.numel() * dt.itemsize // ALIGN) * ALIGN
                slots.append((mod, name, is_param, t, dt, seen[key]))
    buf = arena(total)
    if buf is None:
        return False
    made: dict[int, torch.Tensor] = {}
    for mod, name, is_param, t, dt, off in slots:
        view = made.get(off)
        if view is None:
            view = buf[off:off + t.numel() * dt.itemsize].view(dt).view(t.shape)
            made[off] = view
        if is_param:
            mod._parameters[name] = nn.Parameter(view, requires_grad=t.requires_grad)
        else:
            mod._buffers[name] = view
    return True


def huge_bytes(t: torch.Tensor) -> int:
    """Bytes of AnonHugePages in the mappings /proc/self/smaps lists under t's storage (0 where there is
    no smaps: not Linux). For tests and benchmarks."""
    lo = t.untyped_storage().data_ptr()
    hi = lo + t.untyped_storage().nbytes()
    total, inside = 0, False
    try:
        f = open("/proc/self/smaps")
    except OSError:
        return 0
    with f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                a, b = (int(x, 16) for x in head.split("-"))
                inside = a < hi and b > lo
            elif inside and head == "AnonHugePages:":
                total += int(line.split()[1]) * 1024
    return total
