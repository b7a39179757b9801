"""Hand-off and recovery counters as Prometheus metrics, and `draftrelay stats`.

`rounds.stats()` (AsyncRounds or SyncRounds) is the one source; this module only renders it, either
as text (`render`) or behind an HTTP endpoint (`serve`) that a serving process starts with the
port of its choice. prometheus_client does the exposition format and the HTTP server.
"""

from __future__ import annotations

import argparse
import sys
import urllib.request
from collections.abc import Callable

from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

STATES = ("starting", "live", "recovering", "target_only", "closed")


class _StatsCollector:
    def __init__(self, stats_fn: Callable[[], dict]) -> None:
        self.stats_fn = stats_fn

    def collect(self):
        st = self.stats_fn()
        rounds = CounterMetricFamily("draftrelay_rounds", "Rounds finished, by outcome", labels=["status"])
        rounds.add_metric(["ok"], st.get("ok", 0))
        rounds.add_metric(["watchdog"], st.get("watchdog", 0))
        for reason, n in st.get("failed_by_reason", {}).items():
            rounds.add_metric([reason], n)
        yield rounds
        yield CounterMetricFamily("draftrelay_drafts", "Draft tokens delivered to the engine",
                                  value=st.get("drafts", 0))
        simple = [
            ("watchdog_fires", "Rounds claimed and released by the native watchdog"),
            ("watchdog_assists", "Rounds the watchdog released after the proxy had claimed them"),
            ("late_discarded", "Replies a late proxy built but lost to the watchdog"),
            ("target_only_rounds", "Rounds decoded target-only because no proxy was serving"),
            ("released_on_loss", "Parked rounds released by the engine after a proxy loss"),
            ("worker_reconnects", "Reconnects of the proxy's worker client"),
        ]
        for key, doc in simple:
            if key in st:
                yield CounterMetricFamily(f"draftrelay_{key}", doc, value=st[key])
        if "proxy_losses" in st:
            losses = CounterMetricFamily("draftrelay_proxy_losses", "Proxy losses, by cause", labels=["cause"])
            for cause in ("exit", "heartbeat", "fires"):
                losses.add_metric([cause], st["proxy_losses"].get(cause, 0))
            yield losses
        for key, doc in (("generation", "Proxy generation (respawns so far)"),
                         ("respawns_used", "Respawns used in the current budget window"),
                         ("respawns_left", "Respawns left before the engine stays target-only")):
            if key in st:
                yield GaugeMetricFamily(f"draftrelay_{key}", doc, value=st[key])
        mode = GaugeMetricFamily("draftrelay_mode", "Round mode in use (1 for the active one)", labels=["mode"])
        for m in ("async", "sync", "off"):
            mode.add_metric([m], 1.0 if st.get("mode") == m else 0.0)
        yield mode
        if "state" in st:
            state = GaugeMetricFamily("draftrelay_async_state", "Async hand-off state", labels=["state"])
            for s in STATES:
                state.add_metric([s], 1.0 if st["state"] == s else 0.0)
            yield state
        yield from _spec_cache_metrics(st.get("spec_cache"))


def _spec_cache_metrics(sc: dict | None):
    """The speculation cache's counters (Engine.spec_cache.stats(), passed in as stats['spec_cache'])."""
    if not sc:
        return
    yield CounterMetricFamily("draftrelay_spec_cache_lookups", "Request-rounds that looked for a branch",
                              value=sc["request_rounds"])
    yield CounterMetricFamily("draftrelay_spec_cache_hits", "Request-rounds whose outcome was a pre-drafted branch",
                              value=sc["hits"])
    misses = CounterMetricFamily("draftrelay_spec_cache_misses", "Request-rounds without a usable branch, by reason",
                                 labels=["reason"])
    for reason, n in sc["misses"].items():
        misses.add_metric([reason], n)
    yield misses
    yield CounterMetricFamily("draftrelay_spec_cache_fast_steps", "Verifies that started without waiting for a round",
                              value=sc["fast_steps"])
    yield CounterMetricFamily("draftrelay_spec_cache_waited_steps", "Verifies that waited for their round",
                              value=sc["waited_steps"])
    for key, doc in (("hit_rate", "Hits per lookup"), ("branches_per_round", "Branches per request per table"),
                     ("wait_ms_mean", "Mean time a verify waited for its drafts, ms"),
                     ("active", "1 while the cache is in use")):
        yield GaugeMetricFamily(f"draftrelay_spec_cache_{key}", doc, value=float(sc[key]))


def registry_for(stats_fn: Callable[[], dict]) -> CollectorRegistry:
    reg = CollectorRegistry()
    reg.register(_StatsCollector(stats_fn))
    return reg


def render(stats: dict) -> str:
    return generate_latest(registry_for(lambda: stats)).decode()


def serve(port: int, stats_fn: Callable[[], dict], addr: str = "127.0.0.1"):
    """Start the HTTP metrics endpoint in a daemon thread; returns (server, thread)."""
    return start_http_server(port, addr=addr, registry=registry_for(stats_fn))


# -- `draftrelay stats` ---------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="", help="read a serving process's metrics endpoint (e.g. http://127.0.0.1:9400/)")
    p.add_argument("--rounds", type=int, default=200,
                   help="without --url: run this many hand-off rounds (emulated stream, built-in drafter) "
                        "and print their counters")
    p.add_argument("--backend", default="emulated", choices=["emulated", "cuda"])


def run(args) -> int:
    if args.url:
        try:
            with urllib.request.urlopen(args.url, timeout=5) as resp:
                text = resp.read().decode()
        except OSError as exc:
            print(f"draftrelay stats: cannot read {args.url}: {exc}", file=sys.stderr)
            return 1
        print("\n".join(line for line in text.splitlines() if line.startswith("draftrelay_")))
        return 0
    if args.rounds < 0:
        print("draftrelay stats: --rounds must be >= 0", file=sys.stderr)
        return 2
    import numpy as np

    from draftrelay.round import RoundRequest

    from .rounds import HandoffConfig, open_rounds

    rounds = open_rounds(HandoffConfig(vocab_size=32000, max_requests=4, max_tokens=256, backend=args.backend))
    try:
        rng = np.random.default_rng(0)
        for i in range(args.rounds):
            reqs = [RoundRequest(j, 1, i, rng.integers(0, 32000, 3).astype(np.int32), 4) for j in range(2)]
            rounds.result(rounds.submit(reqs), timeout_s=10)
        print(render(rounds.stats()), end="")
    finally:
        rounds.close()
    return 0
