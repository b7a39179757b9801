"""Which CPUs a process runs on: a drafter and its target on cores of their own.

The product puts the drafter on hardware of its own (another GPU, another host), so it can draft while
the target verifies. On a CPU-only machine the same placement is a set of cores for each: the target's
engine on some, the drafter worker on the others. Left to the scheduler, both processes spread their
threads over every core and each one's forward waits at its parallel regions for threads whose core the
other process holds (engine/threads.py measured a 1.5B step at 1.26 s on two threads under load, 0.45 s
on one), so the speculation cache's branch work, run during the verify, slows the verify instead of
hiding behind it.

Linux sets affinity per thread, and a new thread inherits its creator's mask: `pin` sets every thread the
process has now (the emulated stream, the watchdog, torch's pool), and the threads and processes it
starts later inherit it. Uses only `os`: no torch, no CUDA.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator


def available() -> set[int]:
    """The CPUs this process may run on now."""
    return set(os.sched_getaffinity(0))


def online() -> set[int]:
    """The machine's online CPUs (a process pinned to some may move itself to any of them, cgroups allowing:
    a worker started by a pinned engine inherits the engine's mask and leaves it)."""
    try:
        with open("/sys/devices/system/cpu/online") as f:
            return _numbers(f.read().strip(), "online CPUs")
    except (OSError, ValueError):
        return set(range(os.cpu_count() or 1))


def parse(spec: str, allowed: set[int] | None = None) -> list[int]:
    """'1', '0,2' or '0-3' (ranges and lists combined) as a sorted list of CPU numbers.

    Raises ValueError naming the value when it is not such a list or names a CPU outside `allowed`
    (default: the machine's online CPUs)."""
    cpus = _numbers(spec, "CPU list")
    allowed = online() if allowed is None else allowed
    outside = sorted(cpus - allowed)
    if outside:
        raise ValueError(f"CPU list {spec!r}: CPU {', '.join(map(str, outside))} is not on this machine "
                         f"(online: {format_list(allowed)})")
    return sorted(cpus)


def _numbers(spec: str, what: str) -> set[int]:
    cpus: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"{what} {spec!r}: {part!r} is not a CPU number or a range N-M")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise ValueError(f"{what} {spec!r}: range {part!r} runs backwards")
        cpus.update(range(a, b + 1))
    return cpus


def format_list(cpus: set[int] | list[int]) -> str:
    """The shortest N-M,K form of a set of CPU numbers (the form `parse` reads)."""
    runs = [[c for _, c in g] for _, g in itertools.groupby(enumerate(sorted(cpus)), lambda t: t[1] - t[0])]
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def threads_of_this_process() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: the calling thread alone
        return [0]


def pin(cpus: list[int] | set[int]) -> set[int]:
    """Every thread of this process on `cpus`; returns the calling thread's mask before. ValueError naming
    the CPUs where the kernel refuses them (a cgroup's cpuset without them)."""
    before = available()
    try:
        os.sched_setaffinity(0, set(cpus))  # the calling thread first: a refusal changes nothing
    except OSError as exc:
        raise ValueError(f"CPUs {format_list(set(cpus))}: this process may not run there ({exc.strerror})") from None
    for tid in threads_of_this_process():
        try:
            os.sched_setaffinity(tid, set(cpus))
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    return before


@contextlib.contextmanager
def pinned(cpus: list[int] | set[int]) -> Iterator[None]:
    """`pin` for the body, the mask before put back after (on every thread alive then)."""
    before = pin(cpus)
    try:
        yield
    finally:
        pin(before)
