"""Interleaved timing of CPU benchmark variants: each repeat runs every variant once, the order rotated
by one per repeat, so a load change on this shared machine lands on every variant alike."""

from __future__ import annotations

import os
import time


def interleaved(variants: dict, steps: int, loads: list[float]) -> dict[str, list[float]]:
    """Seconds of each variant's step() over `steps` rotated repeats; the load average after each repeat
    is appended to `loads`."""
    times: dict[str, list[float]] = {k: [] for k in variants}
    for i in range(steps):
        order = list(variants.items())
        for name, var in order[i % len(order):] + order[:i % len(order)]:
            t0 = time.perf_counter()
            var.step()
            times[name].append(time.perf_counter() - t0)
        loads.append(os.getloadavg()[0])
    return times
