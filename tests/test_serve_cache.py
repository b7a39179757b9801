"""`draftrelay serve --mode async --spec-cache`: the speculation cache through the server, end to end.

One server with the cache (async rounds, against a worker running in this test process, so its
sessions and its branch state can be inspected; batch 16), the real `openai` client on loopback.
Greedy outputs must equal target-only decoding of the same prompts and `draftrelay generate` with the
cache; concurrent streams must equal the same requests served alone; clients going away mid-stream
(their rounds in flight) must leave no row behind on either side, branch state included; /metrics
must parse, its spec-decode counters equal the sums of the usage and its cache counters the sums of
each request's cache figures.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

from draftrelay.engine.loading import printable  # noqa: E402
from test_serve import (  # noqa: E402
    ENV,
    MODEL,
    PROMPTS,
    Server,
    _health,
    _scrape,
    _worker_rids,
    generate_reference,
    spec,
    tiny_worker,
)


@pytest.fixture(scope="module")
def cached():
    core, wsrv, whost, wport = tiny_worker(20, 600)
    # `draftrelay generate` with the cache (its own local worker), while the server starts
    gen = generate_reference("--mode", "async", "--spec-cache", "--k", "4")
    # the guard off: every step a cache step (on 2 cores it would run plain rounds, hiding the paths tested here)
    srv = Server("--mode", "async", "--spec-cache", "--cache-guard", "off", "--k", "4", "--worker", f"{whost}:{wport}",
                 "--max-batch", "16", "--max-model-len", "512", "--device", "cpu")
    try:
        srv.wait_ready()
        gen_out, gen_err = gen.communicate(timeout=120)
        yield {"srv": srv, "core": core, "generate": gen_out.rstrip("\n"), "generate_log": gen_err,
               "log": srv.log()}
    finally:
        srv.terminate()
        rc = srv.stop()
        wsrv.stop()
        if gen.poll() is None:
            gen.kill()
    assert rc == 0 and not srv.leftover


def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def complete(srv: Server, prompt: str, max_tokens: int = 32):
    return client(srv).completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)


def target_only(prompts: list[str], max_tokens: int) -> list[str]:
    """The same prompts decoded target-only in this process: the text the server must produce."""
    import torch

    from draftrelay.engine import loading as L
    from draftrelay.engine.engine import Engine, EngineConfig
    from draftrelay.engine.request import SamplingParams

    target = L.load_target("tiny", torch.device("cpu"))
    with Engine(target.model, EngineConfig(mode="off", max_batch=1, max_len=600)) as eng:
        reqs = [eng.generate([target.tokenizer.encode(p)], SamplingParams(max_tokens=max_tokens))[0] for p in prompts]
    return [target.tokenizer.decode(r.output) for r in reqs]


def test_startup_says_cache_on_and_warm_up_covered_its_paths(cached):
    log = cached["log"]
    assert "mode async + speculation cache F=8" in log, log
    warm = log[log.index("speculation cache:"):]
    hits, lookups = (int(x) for x in warm.split()[2].split("/"))
    fast = int(warm.split(",")[1].split()[0])
    cancelled = int(warm.split(",")[3].split()[0])
    assert 0 < hits <= lookups and fast > 0 and cancelled >= 1, warm


def test_greedy_with_cache_equals_target_only_and_generate(cached):
    srv = cached["srv"]
    outs = [complete(srv, p, 32) for p in PROMPTS]
    assert [o.choices[0].text for o in outs] == target_only(PROMPTS, 32)
    # `draftrelay generate --spec-cache` prints prompt + output, escaped for a terminal
    assert printable(PROMPTS[0] + outs[0].choices[0].text) == cached["generate"]
    assert "[spec-cache F=8] hits" in cached["generate_log"], cached["generate_log"][-2000:]
    sc = [spec(o.usage)["spec_cache"] for o in outs]
    assert sum(s["hits"] for s in sc) > 0  # the drafts of some steps came from branches
    assert all(0 <= s["hits"] <= s["lookups"] for s in sc)


def test_concurrent_streams_with_cache_equal_alone(cached):
    srv = cached["srv"]
    prompts = [f"request {i}: " + PROMPTS[i % 4] for i in range(16)]
    alone = [complete(srv, p, 20).choices[0].text for p in prompts]

    async def one(c, p):
        parts = []
        async for chunk in await c.completions.create(model=MODEL, prompt=p, max_tokens=20, temperature=0,
                                                      stream=True):
            parts.append(chunk.choices[0].text)
        return "".join(parts)

    async def all16():
        async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    assert asyncio.run(all16()) == alone


def _branch_state(core) -> tuple[set[int], set[int]]:
    """The worker's speculation-cache state: request ids with last drafts kept for the next table, and
    the request rows holding branch records."""
    pf = core.prefetcher
    with core.lock:
        return {rid for _, rid in pf._last}, set(pf.records)


def test_disconnect_mid_stream_with_cache_frees_rows_both_sides(cached):
    srv, core = cached["srv"], cached["core"]
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 400, "temperature": 0, "stream": True}
    before = _worker_rids(core)
    m0 = _scrape(srv)
    streams, opened = [], []
    try:
        for _ in range(3):
            cm = httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60)
            resp = cm.__enter__()
            streams.append(cm)
            lines = resp.iter_lines()
            got = [ln for ln in (next(lines) for _ in range(8)) if ln.startswith("data: ")]
            assert len(got) >= 3  # steps ran: rounds and tables went to the worker
            opened.append(lines)
        held = _worker_rids(core) - before
        assert len(held) == 3  # the worker holds draft KV for the three
        last, _ = _branch_state(core)
        assert held & last  # and branch state (the drafts its next table branches from)
        m1 = _scrape(srv)
        # the cache's lookups grew while the streams ran. On a loaded host (the whole suite on two cores) a
        # slow round can open the round breaker, and the steps of that second run without rounds or lookups:
        # read on (each stream has 400 tokens) until a cache step is counted
        deadline = time.monotonic() + 30
        while (m1["draftrelay_spec_cache_lookups_total"] <= m0["draftrelay_spec_cache_lookups_total"]
               and time.monotonic() < deadline):
            for lines in opened:
                next(lines, None)
            m1 = _scrape(srv)
        assert m1["draftrelay_spec_cache_lookups_total"] > m0["draftrelay_spec_cache_lookups_total"]
    except BaseException:  # a failure here leaves no stream running on into the next test's metrics
        for cm in streams:
            cm.__exit__(None, None, None)
        raise
    # the clients go away mid-stream (some of their rounds in flight: the engine does not wait for them)
    done = threading.Event()

    def leave():
        for cm in streams:
            cm.__exit__(None, None, None)
        done.set()

    threading.Thread(target=leave).start()
    assert done.wait(30)
    deadline = time.monotonic() + 15
    while _health(srv)["kv_rows_free"] != 16 and time.monotonic() < deadline:
        time.sleep(0.05)
    h = _health(srv)
    assert h["kv_rows_free"] == 16 and h["running"] == 0 and h["waiting"] == 0
    # the next request's rounds carry their ENDs: the worker frees their rows and their branch state
    r = complete(srv, PROMPTS[3], 16)
    assert r.choices[0].text == target_only([PROMPTS[3]], 16)[0]
    assert not held & _worker_rids(core)
    last, rows = _branch_state(core)
    assert not held & last
    with core.lock:
        live_rows = {st.row for s in core.sessions.values() for st in s.requests.values()}
    assert rows <= live_rows  # branch records only for rows a live request holds
    m = _scrape(srv)
    assert m["draftrelay_request_success_total{finished_reason=abort}"] \
        - m0.get("draftrelay_request_success_total{finished_reason=abort}", 0.0) == 3
    assert m["draftrelay_kv_rows_free"] == 16 and m["draftrelay_num_requests_running"] == 0


def test_metrics_with_cache_parse_and_equal_usage(cached):
    srv = cached["srv"]
    before = _scrape(srv)
    c = client(srv)
    usages = [c.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0).usage for p in PROMPTS]
    sampled = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0.9, top_p=0.8,
                                   seed=7, extra_body={"top_k": 40})
    usages.append(sampled.usage)
    deadline = time.monotonic() + 5
    while _health(srv)["running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    after = _scrape(srv)
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    sds = [spec(u) for u in usages]
    assert d["draftrelay_spec_decode_num_drafts_total"] == sum(s["num_drafts"] for s in sds) > 0
    assert d["draftrelay_spec_decode_num_draft_tokens_total"] == sum(s["num_draft_tokens"] for s in sds)
    assert d["draftrelay_spec_decode_num_accepted_tokens_total"] == sum(s["num_accepted_tokens"] for s in sds)
    for j in range(4):
        key = f"draftrelay_spec_decode_num_accepted_tokens_per_pos_total{{position={j}}}"
        assert d.get(key, 0.0) == sum(s["num_accepted_tokens_per_pos"][j] for s in sds
                                      if j < len(s["num_accepted_tokens_per_pos"]))
    # the cache's counters: its lookups and hits are the sums of each request's
    assert d["draftrelay_spec_cache_lookups_total"] == sum(s["spec_cache"]["lookups"] for s in sds) > 0
    assert d["draftrelay_spec_cache_hits_total"] == sum(s["spec_cache"]["hits"] for s in sds) > 0
    assert after["draftrelay_spec_cache_hit_rate"] == pytest.approx(
        after["draftrelay_spec_cache_hits_total"] / after["draftrelay_spec_cache_lookups_total"])
    assert d["draftrelay_spec_cache_fast_steps_total"] > 0
    assert after["draftrelay_spec_cache_active"] == 1 and after["draftrelay_spec_cache_branches_per_round"] > 0
    misses = sum(v for k, v in d.items() if k.startswith("draftrelay_spec_cache_misses_total"))
    assert misses == d["draftrelay_spec_cache_lookups_total"] - d["draftrelay_spec_cache_hits_total"]
    assert d["draftrelay_generation_tokens_total"] == sum(u.completion_tokens for u in usages)
    assert after["draftrelay_mode{mode=async}"] == 1
    # a sampled request with a seed gives the same text again with the cache
    again = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0.9, top_p=0.8,
                                 seed=7, extra_body={"top_k": 40})
    assert again.choices[0].text == sampled.choices[0].text


@pytest.mark.parametrize("argv,words", [
    (["--mode", "sync", "--spec-cache"], "--spec-cache needs --mode async (got --mode sync)"),
    (["--mode", "off", "--spec-cache", "4"], "--spec-cache needs --mode async (got --mode off)"),
    (["--spec-cache", "65"], "--spec-cache must be 0-64"),
    (["--spec-cache", "--k", "0"], "--spec-cache needs --k >= 1"),
])
def test_spec_cache_flag_refused_by_name(argv, words):
    cp = subprocess.run([sys.executable, "-m", "draftrelay", "serve", "--port", "0", *argv], env=ENV,
                        capture_output=True, text=True, timeout=60)
    assert cp.returncode == 2 and words in cp.stderr, cp.stderr


def test_serve_replay_cache_mode_cpu_dry_run(tmp_path):
    # the H200 load test's cache mode, on the CPU at tiny shapes over a synthetic trace, with the drafter
    # on an emulated second device (its costs measured first): it runs end to end, every output equals
    # the trace, and the cache ran (its figures are for a GPU)
    out = tmp_path / "replay.json"
    cmd = [sys.executable, "benchmarks/serve_replay.py", "--device", "cpu", "--target", "tiny", "--drafter", "tiny",
           "--trace", "synthetic", "--modes", "sync,cache", "--placement", "emulated", "--concurrency", "2",
           "--requests", "4", "--max-tokens", "24", "--ttft-repeats", "1", "--long-len", "64", "--cost-iters", "2",
           "--cache-guard", "off", "--out", str(out)]  # every step a cache step (the guard would run plain ones here)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**ENV, "OMP_NUM_THREADS": "1",
                                                                                      "DRAFTRELAY_BRANCH_CUT": "off"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["cost_table_ms"] and res["prefetch_cost_ms"]
    for mode in ("sync", "cache"):
        row = res["modes"][mode]
        assert "error" not in row and "client_error" not in row, row
        assert row["trace_check"]["outputs_equal_trace"] == row["trace_check"]["requests"] == 8
        assert row["placement"] == "emulated" and row["levels"][0]["output_tokens"] == 4 * 24
    cache = res["modes"]["cache"]
    assert cache["round_mode"] == "async" and cache["spec_cache"]["active"] and not cache["spec_cache_refusal"]
    assert cache["spec_cache"]["hits"] > 0 and "cache_hit_rate" in cache["levels"][0]


def test_the_cache_wait_times_a_server_keeps_are_bounded():
    # one wait time per step, medians taken at every /metrics snapshot: a server running for days keeps
    # only the recent ones (serve.scheduler.WAIT_WINDOW per kind), the newest
    import types

    from draftrelay import model as M
    from draftrelay.engine.engine import Engine, EngineConfig
    from draftrelay.serve.metrics import ServeMetrics
    from draftrelay.serve.scheduler import WAIT_WINDOW, Scheduler

    target, _ = M.tiny_pair(M.TINY_SEED)
    with Engine(target, EngineConfig(mode="off", max_batch=1, max_len=64)) as eng:
        sched = Scheduler(eng, ServeMetrics("m", lambda: {"mode": "off"}), max_queue=1)
        hit, miss = [float(i) for i in range(3 * WAIT_WINDOW)], [-1.0] * 10
        eng.spec_cache = types.SimpleNamespace(wait_hit_s=hit, wait_miss_s=miss)
        try:
            sched._harvest()
        finally:
            eng.spec_cache = None
    assert hit == [float(i) for i in range(2 * WAIT_WINDOW, 3 * WAIT_WINDOW)] and miss == [-1.0] * 10
