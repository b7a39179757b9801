"""The server's parts without a server: request checks, chat templates, text deltas and stop
strings, the engine's cancel (row and drafter END), the scheduler's continuous batching."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest

from draftrelay.engine.loading import ByteTokenizer
from draftrelay.serve.chat import CHATML, TemplateError, compile_template, find_template
from draftrelay.serve.protocol import ApiError, Limits, parse_json, parse_request
from draftrelay.serve.textstream import TextStream

TOK = ByteTokenizer()


def lim(**kw) -> Limits:
    return Limits("m", 64, 256, (0,), TOK.encode, **kw)


def test_parse_request_defaults_and_fields():
    g = parse_request({"prompt": "hi", "max_tokens": 5, "temperature": 0, "stop": "x", "seed": 3,
                       "stop_token_ids": [7]}, "completion", lim())
    assert g.prompt_ids == [104, 105] and g.params.max_tokens == 5 and g.params.temperature == 0
    assert g.stop == ("x",) and g.params.stop_token_ids == (0, 7) and g.seeded and g.params.seed == 3
    g = parse_request({"prompt": [[1, 2, 3]]}, "completion", lim())  # a batch of one
    assert g.prompt_ids == [1, 2, 3] and g.params.max_tokens == 16 and g.params.temperature == 1.0
    assert not g.seeded
    g = parse_request({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}, "chat",
                      lim(render_chat=lambda m: TOK.encode(m[0]["content"] * 10)))
    assert g.prompt_ids == [97] * 10 and g.params.max_tokens == 54  # chat: the rest of the context


@pytest.mark.parametrize("body,kind,param", [
    ({"prompt": "x", "max_tokens": 64}, "completion", "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, "completion", "max_tokens"),
    ({"prompt": "x", "temperature": float("inf")}, "completion", "temperature"),
    ({"prompt": "x", "temperature": True}, "completion", "temperature"),
    ({"prompt": "x", "top_k": -2}, "completion", "top_k"),
    ({"prompt": "x", "stop": [""]}, "completion", "stop"),
    ({"prompt": "x", "stop": [300]}, "completion", "stop"),
    ({"prompt": "x", "stop_token_ids": [-1]}, "completion", "stop_token_ids"),
    ({"prompt": "x", "stream": "yes"}, "completion", "stream"),
    ({"prompt": "x", "best_of": 2}, "completion", "best_of"),
    ({"prompt": "x", "presence_penalty": 0.5}, "completion", "presence_penalty"),
    ({"prompt": ""}, "completion", "prompt"),
    ({"messages": []}, "chat", "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "chat", "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 100}, "chat", "max_completion_tokens"),
])
def test_parse_request_refusals_name_the_field(body, kind, param):
    with pytest.raises(ApiError) as e:
        parse_request(body, kind, lim(render_chat=lambda m: [1]))
    assert e.value.status == 400 and e.value.param == param and e.value.message.startswith(param)


def test_parse_json_refusals():
    for raw in (b"{", b"\xff\xfe", b'"a string"'):
        with pytest.raises(ApiError) as e:
            parse_json(raw)
        assert e.value.status == 400 and "JSON" in e.value.message
    assert parse_json(b'{"a": 1}') == {"a": 1}


def test_chat_template_sources_and_rendering(tmp_path):
    class Target:
        chat_template = "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
        bos_token = "<s>"

    src, where, bos, eos = find_template(Target(), None)
    assert where == "the model file" and bos == "<s>"
    assert compile_template(src, bos, eos)([{"role": "user", "content": "hi"}]) == "<s>[user]hi"
    # tokenizer_config.json: a list of named templates, the default one used, token dicts accepted
    cfg = {"chat_template": [{"name": "tool_use", "template": "T"},
                             {"name": "default", "template": "D{{ eos_token }}"}],
           "eos_token": {"content": "</s>"}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    src, where, bos, eos = find_template(object(), str(tmp_path))
    assert src == "D{{ eos_token }}" and eos == "</s>" and where.endswith("tokenizer_config.json")
    assert compile_template(src, bos, eos)([]) == "D</s>"
    src, where, _, _ = find_template(object(), None)
    assert src == CHATML and "ChatML" in where
    r = compile_template(CHATML)
    assert r([{"role": "user", "content": "x"}]) == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(TemplateError, match="no system"):
        compile_template("{{ raise_exception('no system') }}")([])
    with pytest.raises(TemplateError, match="compile"):
        compile_template("{% for %}")


def test_textstream_holds_partial_characters_and_finds_stops():
    ids = list("héllo wörld".encode())
    ts, out = TextStream(TOK.decode), []
    for t in ids:  # one byte at a time: a half character is never sent
        out.append(ts.add([t]))
    out.append(ts.add([], final=True))
    assert "".join(out) == "héllo wörld" and all("\ufffd" not in x for x in out)
    # a stop string spanning two deltas: nothing of it (or after it) is sent
    ts, out = TextStream(TOK.decode, ("lo w",)), []
    for chunk in (b"hel", b"l", b"o ", b"wor", b"ld"):
        out.append(ts.add(list(chunk)))
    assert "".join(out) == "hel" and ts.stopped and ts.add(list(b"more"), final=True) == ""
    # invalid bytes stay replacement characters, the same as decoding everything at once
    raw = [0xE6, 0xAF, 65, 0x80, 66, 0xE6]
    ts = TextStream(TOK.decode)
    got = "".join(ts.add([t]) for t in raw) + ts.add([], final=True)
    assert got == TOK.decode(raw)


def test_engine_cancel_frees_the_row_and_ends_the_drafter():
    from draftrelay import model as M
    from draftrelay.engine.engine import Engine, EngineConfig, LocalRounds, SamplingParams

    blocks = []

    def fn(t, reqs, budget):
        blocks.append([(r.req_id, len(r.tokens), r.n_out) for r in reqs])
        return [(np.full(r.n_out, 7, np.int32), np.ones(r.n_out, np.float32)) for r in reqs]

    target, _ = M.tiny_pair(M.TINY_SEED)
    eng = Engine(target, EngineConfig(mode="sync", max_batch=2, max_len=64), rounds=LocalRounds(fn))
    a, b, w = (eng.add_request(p, SamplingParams(max_tokens=20)) for p in ([1, 2, 3], [4, 5], [6]))
    eng.step()  # a and b are prefilled and decoded (their first round); w waits for a row
    assert eng.free_rows == [] and eng.waiting[0] is w
    eng.cancel(w)  # a waiting request holds no row: it only leaves the queue
    assert not eng.waiting and w.done and w.finish_reason == "cancelled"
    row = a.row
    eng.cancel(a)
    assert eng.free_rows == [row] and eng.running == [b] and a.finish_reason == "cancelled"
    eng.step()
    assert (a.id, 0, 0) in blocks[-1]  # the next round told the drafter to forget a (END)
    assert all(rid != w.id for blk in blocks for rid, _, _ in blk)  # w never reached the drafter
    while eng.has_work():
        eng.step()
    assert b.done and b.finish_reason == "length" and eng.free_rows == [0, 1]


def test_scheduler_batches_cancels_and_bounds_the_queue():
    from draftrelay import model as M
    from draftrelay.engine.engine import Engine, EngineConfig, SamplingParams
    from draftrelay.serve.metrics import ServeMetrics
    from draftrelay.serve.protocol import GenRequest
    from draftrelay.serve.scheduler import Job, Scheduler

    target, _ = M.tiny_pair(M.TINY_SEED)
    eng = Engine(target, EngineConfig(mode="off", max_batch=2, max_len=128))
    sched = Scheduler(eng, ServeMetrics("m", lambda: {"mode": "off"}), max_queue=1)

    async def main():
        loop = asyncio.get_running_loop()

        def job(n, prompt):
            g = GenRequest("completion", prompt, SamplingParams(max_tokens=n, temperature=0), False)
            return Job(g, loop, TextStream(TOK.decode))

        async def drain(j):
            text = []
            while True:
                ev = await asyncio.wait_for(j.events.get(), 30)
                if ev.kind == "text":
                    text.append(ev.text)
                elif ev.kind == "done":
                    return "".join(text), ev.finish_reason, ev.usage

        alone = job(12, [1, 2, 3])
        sched.submit(alone)
        ref = await drain(alone)
        long1, long2, short, extra = job(100, [9]), job(100, [8]), job(12, [1, 2, 3]), job(5, [4])
        for j in (long1, long2):
            sched.submit(j)
        await asyncio.wait_for(long1.events.get(), 30)
        await asyncio.wait_for(long2.events.get(), 30)
        sched.submit(short)  # both rows busy: it waits, and the queue (1) is now full
        with pytest.raises(ApiError) as e:
            sched.submit(extra)
        assert e.value.status == 429
        sched.cancel(long1)
        got = await drain(short)  # joins the batch in long1's row, beside long2
        assert got[:2] == ref[:2] and got[2]["completion_tokens"] == 12
        assert (await drain(long1))[1] == "abort"
        sched.cancel(long2)
        await drain(long2)

    sched.start()
    try:
        asyncio.run(main())
        deadline = time.monotonic() + 10  # the thread publishes its counts after the step it is in
        while sched.status()["running"] and time.monotonic() < deadline:
            time.sleep(0.01)
        st = sched.status()
        assert st["running"] == 0 and st["waiting"] == 0 and st["kv_rows_free"] == 2
    finally:
        sched.stop()
    assert eng.free_rows == [0, 1]


def test_serve_flags_refused_by_name(tmp_path):
    import argparse
    import subprocess
    import sys

    from draftrelay.serve import cli

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    for flags, words in [(["--max-batch", "0"], "--max-batch"), (["--max-queue", "-1"], "--max-queue"),
                         (["--port", "70000"], "--port"), (["--k", "17"], "--k"),
                         (["--deadline-ms", "0"], "--deadline-ms"),
                         (["--max-round-tokens", "0"], "--max-round-tokens"),
                         (["--worker-warm-max-kv", "-1"], "--worker-warm-max-kv"),
                         (["--drafter-quant", "int4", "--device", "cuda"], "--drafter-quant int4: for a CPU"),
                         (["--drafter-quant", "int8", "--worker", "h:1"], "--drafter-quant int8: the local")]:
        assert cli._check(p.parse_args(flags)).startswith(words)
    assert cli._check(p.parse_args([])) == ""
    empty, spaced, good = tmp_path / "e", tmp_path / "s", tmp_path / "g"
    empty.write_text("\n")
    spaced.write_text("a b\n")
    good.write_text(" k3y \n")
    for f, words in [(empty, "holds nothing"), (spaced, "whitespace"), (tmp_path / "missing", "No such file")]:
        with pytest.raises(ValueError, match=words):
            cli.read_api_key(str(f))
    assert cli.read_api_key(str(good)) == "k3y"
    # through the command: a context beyond the model's is refused with both numbers, exit 2
    r = subprocess.run([sys.executable, "-m", "draftrelay", "serve", "--mode", "off", "--max-model-len", "99999",
                        "--port", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--max-model-len 99999 exceeds the model's context of 4096" in r.stderr


@pytest.mark.parametrize("sized", [True, False])
def test_a_round_of_every_row_catching_up_fits_the_region(sized):
    """Every row catching up on its prompt in the same async round (max_round_tokens each): the
    hand-off region `draftrelay serve` sizes (round_tokens) carries it; with a little less staging
    the round cannot even be packed, and the step fails (the server would end every running request
    with an error)."""
    from draftrelay import model as M
    from draftrelay.engine.engine import Engine, EngineConfig, SamplingParams
    from draftrelay.handoff.rounds import HandoffConfig
    from draftrelay.serve.cli import round_tokens

    n, chunk, k = 4, 200, 2
    target, _ = M.tiny_pair(M.TINY_SEED)
    h = HandoffConfig(backend="emulated", strict=True,
                      max_tokens=round_tokens(n, chunk, k) - (0 if sized else n * (k + 1) + 1))
    cfg = EngineConfig(mode="async", n_draft=k, max_batch=n, max_len=512, max_round_tokens=chunk, handoff=h)
    prompts = [[(i * 31 + j) % 256 for j in range(2 * chunk + 5)] for i in range(n)]
    with Engine(target, cfg) as eng:
        if sized:
            reqs = eng.generate(prompts, SamplingParams(max_tokens=6))
            assert all(r.rounds.get("ok", 0) > 0 and not r.rounds.get("failed") for r in reqs), [r.rounds for r in reqs]
        else:
            with pytest.raises(ValueError, match=f"{n * chunk} tokens in one round, the region holds"):
                eng.generate(prompts, SamplingParams(max_tokens=6))


def test_warm_up_runs_on_the_engine_thread_up_to_the_longest_prompt(monkeypatch):
    """Scheduler.start(warm) runs the warm-up on the thread that serves and hands back its result (or
    its exception); the warm-up's long prompt is the longest the context leaves room for; where the
    Triton kernels planned products its result carries what the planning cost."""
    import sys
    import threading
    import types

    from draftrelay import model as M
    from draftrelay.engine.engine import Engine, EngineConfig
    from draftrelay.kernels import plan as P
    from draftrelay.serve.metrics import ServeMetrics
    from draftrelay.serve.scheduler import Scheduler, warm_up

    target, _ = M.tiny_pair(M.TINY_SEED)
    with Engine(target, EngineConfig(mode="off", max_batch=5, max_len=512 + 5)) as eng:
        seen, sizes = [], set()
        step = eng.step

        def counted_step():
            sizes.add(len(eng.running))
            return step()

        eng.step = counted_step

        def warm():
            seen.append(threading.current_thread())
            return warm_up(eng, 512)

        sched = Scheduler(eng, ServeMetrics("m", lambda: {"mode": "off"}), max_queue=1)
        try:
            w = sched.start(warm)
        finally:
            sched.stop()
        assert seen == [sched._thread] and seen[0] is not threading.current_thread()
        assert {1, 2, 3, 4, 5} <= sizes  # decode steps at every batch size up to max_batch
        assert w["long_prompt"] == 511 and 512 - 16 <= w["long_decoded"] < 511 and w["rounds_healthy"]
        lines: list[str] = []
        assert warm_up(eng, 512, long_prompt=100, progress=lines.append)["long_prompt"] == 100
        assert [x.split()[0] for x in lines] == ["1/5", "2/5", "3/5", "4/5", "5/5"]
        assert "a prefill of 100 tokens" in lines[2] and "every batch size from 5 to 1" in lines[4]
        assert "kernel_plan" not in w  # a CPU: the Triton kernels never loaded, nothing planned
        stats = P.PlanStats(measured=35, candidates=170, seconds=41.5, from_cache=2)
        monkeypatch.setitem(sys.modules, "draftrelay.kernels.triton_ops",
                            types.SimpleNamespace(PLANNER=types.SimpleNamespace(stats=stats)))
        assert warm_up(eng, 512, long_prompt=100)["kernel_plan"] == stats.summary()

        def broken():
            raise RuntimeError("warm-up failed")

        sched = Scheduler(eng, ServeMetrics("m2", lambda: {"mode": "off"}), max_queue=1)
        try:
            with pytest.raises(RuntimeError, match="warm-up failed"):
                sched.start(broken)
        finally:
            sched.stop()
        assert not sched._thread.is_alive()


def test_gc_pauses_are_counted_and_the_startup_heap_is_frozen():
    import gc

    from prometheus_client.parser import text_string_to_metric_families

    from draftrelay.serve.metrics import ServeMetrics, freeze_startup_objects

    m = ServeMetrics("m", lambda: {"mode": "off"})

    def full_collections() -> float:
        fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
        return next(s.value for s in fams["draftrelay_gc_collections"].samples
                    if s.labels["generation"] == "2" and s.name.endswith("_total"))

    assert full_collections() == 0
    m.gc.start()
    try:
        gc.collect()
        gc.collect()
        assert full_collections() == 2 and m.gc.seconds[2] > 0
    finally:
        m.gc.stop()
    gc.collect()
    assert full_collections() == 2  # stopped: no longer counted
    try:
        freeze_startup_objects()
        assert gc.get_freeze_count() > 1000  # this test process's modules and objects
    finally:
        gc.unfreeze()  # the other tests' garbage must stay collectable


def test_the_local_worker_on_a_gpu_captures_its_draft_graphs_at_start(monkeypatch):
    """serve's local worker gets --warm-graphs k --warm-batch max_batch on a GPU (its draft-step graphs
    for every batch size and context are captured before it listens); a CPU drafter runs eagerly."""
    import torch

    import draftrelay.worker.process as wp
    from draftrelay.engine import loading as L

    seen = {}
    monkeypatch.setattr(wp, "start_worker_process", lambda args, env=None: seen.update(args=args))
    L.start_local_worker("some/dir", torch.device("cuda"), 4, 256, 8, warm_batch=8)
    a = seen["args"]
    assert a[a.index("--warm-graphs") + 1] == "4" and a[a.index("--warm-batch") + 1] == "8"
    L.start_local_worker("some/dir", torch.device("cpu"), 4, 256, 8, warm_batch=8)
    assert "--warm-graphs" not in seen["args"]
    L.start_local_worker("some/dir", torch.device("cuda"), 4, 256, 8)
    assert "--warm-graphs" not in seen["args"]  # demo and generate at a fixed k: captured on first use
    L.start_local_worker("some/dir", torch.device("cuda"), 6, 256, 1, warm_batch=1, warm_depths=True)
    a = seen["args"]  # demo and generate with the depth policy: a step for every depth it may ask
    assert a[a.index("--warm-graphs") + 1] == "1,2,3,4,5,6" and a[a.index("--warm-batch") + 1] == "1"
    assert "--warm-min-kv" not in a
    L.start_local_worker("some/dir", torch.device("cuda"), 6, 4096, 1, warm_batch=1, warm_depths=True,
                         warm_min_kv=3000)  # generate: no bucket below its prompt's
    a = seen["args"]
    assert a[a.index("--warm-min-kv") + 1] == "3000"
