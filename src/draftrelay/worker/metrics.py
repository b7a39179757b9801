"""The worker's counters as Prometheus metrics (`draftrelay worker --metrics-port PORT`).

Read at scrape time from WorkerCore.stats / WorkerServer.stats, the refusal counts by ERROR code and, with
the speculation cache, the prefetcher's tables and where their branch work went (its pieces);
prometheus_client renders them and runs the HTTP server (a daemon thread).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from draftrelay.wire import protocol as P
from draftrelay.worker.prefetch import PIECES


class WorkerCollector:
    def __init__(self, server) -> None:
        self.server = server

    def collect(self):
        core, srv = self.server.core, self.server
        yield GaugeMetricFamily("draftrelay_worker_sessions", "Open sessions", value=len(core.sessions))
        yield GaugeMetricFamily("draftrelay_worker_rows_in_use", "Draft-KV rows reserved by sessions",
                                value=core.rows_in_use())
        yield GaugeMetricFamily("draftrelay_worker_rows", "Draft-KV rows in all", value=core.drafter.n_rows)
        yield GaugeMetricFamily("draftrelay_worker_connections", "Open connections", value=srv.active_connections())
        ref = CounterMetricFamily("draftrelay_worker_refusals", "ERROR frames sent (and refused connections), by code",
                                  labels=["code"])
        for name in sorted(set(srv.refusals) | {P.code_name(c) for c in P.CLOSING_ERRORS}):
            ref.add_metric([name], srv.refusals.get(name, 0))
        yield ref
        for key, doc in (("steps", "STEP frames served"), ("blocks", "Blocks served"),
                         ("refused_blocks", "Blocks answered with a refusal status"),
                         ("drafter_errors", "Frames the drafter failed on"),
                         ("evictions", "Requests evicted from a full session (least recently used)"),
                         ("sessions_opened", "Sessions opened"), ("sessions_closed", "Sessions closed"),
                         ("sessions_reclaimed", "Idle sessions whose rows went to a new session"),
                         ("prefill_slices", "Prefill slices run between other sessions' STEPs")):
            yield CounterMetricFamily(f"draftrelay_worker_{key}", doc, value=core.stats.get(key, 0))
        for key, doc in (("connections", "Connections accepted"),
                         ("rejected_connections", "Connections refused (total or per-peer limit)"),
                         ("bad_frames", "Frames that did not parse"), ("expired", "Sessions expired or reclaimed"),
                         ("auth_failures", "Handshakes with a wrong shared secret")):
            yield CounterMetricFamily(f"draftrelay_worker_{key}", doc, value=srv.stats.get(key, 0))
        pf = getattr(core, "prefetcher", None)
        if pf is not None:  # the speculation cache's branch work (worker/prefetch.py)
            for key, doc in (("tables", "Branch tables built"), ("branches", "Branches drafted into tables"),
                             ("preempted", "Tables cut because the next STEP waited behind them"),
                             ("worker_side_hits", "STEPs answered from a prefetched branch")):
                yield CounterMetricFamily(f"draftrelay_worker_branch_{key}", doc, value=pf.stats.get(key, 0))
            work = CounterMetricFamily("draftrelay_worker_branch_work_seconds",
                                       "Seconds of branch work by piece (device pieces: their wall time)",
                                       labels=["piece"])
            for piece in PIECES:
                work.add_metric([piece], pf.stats.get(f"{piece}_us", 0) / 1e6)
            yield work


def serve(server, port: int, host: str = "127.0.0.1"):
    """Start the endpoint; returns (http server, its thread)."""
    reg = CollectorRegistry()
    reg.register(WorkerCollector(server))
    return start_http_server(port, addr=host, registry=reg)
