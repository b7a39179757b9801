"""The server's Prometheus metrics.

Named as vLLM names them (`vllm:spec_decode_num_drafts` ... ) with this project's prefix instead of
`vllm:`, so a vLLM dashboard works after a prefix rename. Counters count as the engine steps (a
step's drafts are counted when its tokens are), so at any quiet moment the spec-decode counters
equal the sums of the `usage` figures of every request served. The hand-off's own counters
(rounds by outcome, watchdog, proxy losses, ...) are appended from `rounds.stats()` through the
collector `draftrelay stats` renders.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

from draftrelay.handoff import metrics as handoff_metrics

P = "draftrelay_"
# seconds; the low buckets resolve a GPU's per-token latency, the high ones a loaded CPU's
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0)


class _Delegate:
    """Exposes another registry's metrics (the hand-off collector) inside this one."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self):
        yield from self.registry.collect()


class GcWatch:
    """Python garbage-collector pauses: each one holds the interpreter lock, so the engine thread
    and the event loop stand still meanwhile (a full collection walks every tracked object). The
    callback only adds to plain numbers: it may run inside any allocation, also one made while a
    metric's lock is held, so it must take no lock; the collector reads the numbers at a scrape."""

    def __init__(self, model_name: str) -> None:
        self.model = model_name
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._t0 = 0.0
        self._on = False

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            g = info.get("generation", 0)
            if 0 <= g < 3:
                self.count[g] += 1
                self.seconds[g] += time.perf_counter() - self._t0

    def start(self) -> None:
        if not self._on:
            gc.callbacks.append(self._callback)
            self._on = True

    def stop(self) -> None:
        if self._on:
            gc.callbacks.remove(self._callback)
            self._on = False

    def collect(self):
        n = CounterMetricFamily(P + "gc_collections", "Python garbage collections, by generation",
                                labels=["model_name", "generation"])
        t = CounterMetricFamily(P + "gc_pause_seconds", "Time Python garbage collections held the interpreter",
                                labels=["model_name", "generation"])
        for g in range(3):
            n.add_metric([self.model, str(g)], self.count[g])
            t.add_metric([self.model, str(g)], self.seconds[g])
        yield n
        yield t


def freeze_startup_objects() -> None:
    """Collect once, then move every object alive now (modules, the model's and the engine's Python
    objects, captured graphs) into the permanent generation, which no later collection walks: a
    full collection then costs what was allocated since, not the whole start-up heap (130 ms for
    the ~330,000 objects of a CPU server with the tiny pair; more where more is loaded)."""
    gc.collect()
    gc.freeze()


class _NotCounted:
    """What labels() hands out for counters and histograms while the metrics are quiet."""

    def inc(self, *a, **kw) -> None:
        pass

    observe = inc


_NOT_COUNTED = _NotCounted()


class ServeMetrics:
    def __init__(self, model_name: str, handoff_stats: Callable[[], dict]) -> None:
        self.registry = r = CollectorRegistry()
        lab = ["model_name"]
        self.model = model_name
        self.request_success = Counter(P + "request_success", "Requests finished, by reason",
                                       lab + ["finished_reason"], registry=r)
        self.request_rejected = Counter(P + "request_rejected", "Requests refused before running, by reason",
                                        lab + ["reason"], registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens prefilled", lab, registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated", lab, registry=r)
        self.running = Gauge(P + "num_requests_running", "Requests in the running batch", lab, registry=r)
        self.waiting = Gauge(P + "num_requests_waiting", "Requests waiting for a KV row", lab, registry=r)
        self.rows_free = Gauge(P + "kv_rows_free", "Target KV rows free", lab, registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Arrival to first token", lab,
                              buckets=TTFT_BUCKETS, registry=r)
        # TTFT = queue time + prefill time: where a slow first token went (the HTTP side before the
        # arrival, the wait for the engine thread, or the prefill and the hand-over of its token)
        self.queue_time = Histogram(P + "request_queue_time_seconds",
                                    "Arrival (request checked) to the engine thread taking it", lab,
                                    buckets=TTFT_BUCKETS, registry=r)
        self.prefill_time = Histogram(P + "request_prefill_time_seconds",
                                      "Engine thread taking the request to its first token out (a wait for a "
                                      "free KV row included)", lab,
                                      buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds",
                             "Time between a request's successive engine steps that produced tokens", lab,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to last token", lab,
                             buckets=E2E_BUCKETS, registry=r)
        self.num_drafts = Counter(P + "spec_decode_num_drafts", "Speculative steps that verified drafts", lab,
                                  registry=r)
        self.num_draft_tokens = Counter(P + "spec_decode_num_draft_tokens", "Draft tokens verified", lab,
                                        registry=r)
        self.num_accepted = Counter(P + "spec_decode_num_accepted_tokens", "Draft tokens accepted", lab,
                                    registry=r)
        self.accepted_per_pos = Counter(P + "spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted, by position in the draft", lab + ["position"],
                                        registry=r)
        r.register(_Delegate(handoff_metrics.registry_for(handoff_stats)))
        self.gc = GcWatch(model_name)
        r.register(self.gc)

    # the server's own start-up requests (cli.self_request) run with this set: a client's dashboard
    # starts from zero requests, tokens and drafts, not from the start-up's (gauges still follow the
    # state: rows free, running, waiting)
    quiet = False

    def labels(self, m, *values):
        if self.quiet and not isinstance(m, Gauge):
            return _NOT_COUNTED
        return m.labels(self.model, *values)

    def render(self) -> bytes:
        return generate_latest(self.registry)
