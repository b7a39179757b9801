"""`draftrelay serve` end to end: live server processes on loopback, the real `openai` client.

Three servers start once for the module (in parallel): async (local worker, API key, batch 16),
sync (against a worker running in this test process, so its sessions can be inspected; batch 2,
queue 1) and off. Greedy outputs must equal `draftrelay generate`'s and each other's, concurrent
streams must equal the same request served alone, a client going away must free its rows on both
sides, a full queue answers 429, bad requests 400 naming the field, and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from draftrelay.engine.loading import printable  # noqa: E402

KEY = "test-key-123"
MODEL = "tiny-target"
SRC = os.path.join(os.path.dirname(__file__), "..", "src")
ENV = {**os.environ, "PYTHONPATH": os.path.abspath(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""),
       "OMP_NUM_THREADS": "1"}
PROMPTS = ["Hello there", "Once upon a time", "The quick brown fox", "draftrelay"]
_LISTEN = re.compile(r"listening on (http://[\d.]+:\d+)")


class Server:
    def __init__(self, *args: str) -> None:
        fd, self.log_path = tempfile.mkstemp(prefix="draftrelay-serve-", suffix=".log")
        with os.fdopen(fd, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "draftrelay", "serve", "--port", "0", *args],
                                         stdout=subprocess.DEVNULL, stderr=log, env=ENV)
        self.url = ""

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def wait_ready(self, timeout: float = 120.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = _LISTEN.search(self.log())
            if m:
                self.url = m.group(1)
                return self.url
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"server did not start:\n{self.log()}")

    def children(self) -> list[int]:
        out = []
        for pid in os.listdir("/proc"):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == self.proc.pid:
                        out.append(int(pid))
            except (OSError, ValueError, IndexError):
                pass
        return out

    def terminate(self) -> None:
        self.kids = self.children()
        self.proc.terminate()

    def stop(self) -> int:
        kids = self.kids
        try:
            rc = self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait(5)
        os.unlink(self.log_path)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{k}") for k in kids):
            time.sleep(0.1)
        self.leftover = [k for k in kids if os.path.exists(f"/proc/{k}")]
        return rc


def tiny_worker(n_rows: int, max_ctx: int):
    """A worker serving the tiny drafter in this process, on loopback: (core, server, host, port)."""
    from draftrelay.worker import drafters
    from draftrelay.worker.core import WorkerCore
    from draftrelay.worker.server import WorkerServer

    core = WorkerCore(drafters.load_drafter("tiny", n_rows=n_rows, max_ctx=max_ctx, n_out_max=8, dtype="float32"),
                      max_requests=16)
    wsrv = WorkerServer(core, "127.0.0.1", 0)
    return (core, wsrv, *wsrv.start())


def generate_reference(*mode_args: str) -> subprocess.Popen:
    """`draftrelay generate` of PROMPTS[0] (32 tokens, CPU) in a child process: the reference output."""
    return subprocess.Popen([sys.executable, "-m", "draftrelay", "generate", PROMPTS[0], *mode_args,
                             "--max-tokens", "32", "--device", "cpu"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=ENV, text=True)


@pytest.fixture(scope="module")
def servers():
    core, wsrv, whost, wport = tiny_worker(16, 4200)
    with tempfile.NamedTemporaryFile("w", suffix=".key", delete=False) as f:
        f.write(KEY + "\n")
    gen_proc = generate_reference("--mode", "off")  # runs while the servers start
    s = {
        # --depth fixed: these tests look at every request's drafts (the policy may choose 0 for some)
        "async": Server("--mode", "async", "--depth", "fixed", "--api-key-file", f.name, "--max-batch", "16",
                        "--max-model-len", "512"),
        "sync": Server("--mode", "sync", "--depth", "fixed", "--worker", f"{whost}:{wport}", "--max-batch", "2",
                       "--max-queue", "1",
                       "--max-model-len", "4096"),
        "off": Server("--mode", "off", "--max-model-len", "512"),
    }
    try:
        for srv in s.values():
            srv.wait_ready()
        # before any test's request: what the server's own start-up requests left in /metrics
        startup = {name: _scrape(srv) for name, srv in s.items()}
        gen_out, _ = gen_proc.communicate(timeout=120)
        yield {**s, "core": core, "generate": gen_out.rstrip("\n"), "startup_metrics": startup}
    finally:
        for srv in s.values():  # all at once: each takes a few seconds to stop its engine and children
            srv.terminate()
        rcs = {name: srv.stop() for name, srv in s.items()}
        wsrv.stop()
        os.unlink(f.name)
        if gen_proc.poll() is None:
            gen_proc.kill()
    assert rcs == {"async": 0, "sync": 0, "off": 0}, rcs
    assert not any(srv.leftover for srv in s.values()), "child processes outlived the server"


def client(srv: Server, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=60)


def complete(srv: Server, prompt: str, max_tokens: int = 32, key: str = KEY, **kw) -> str:
    r = client(srv, key).completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, **kw)
    return r.choices[0].text


def spec(usage) -> dict:
    return usage.model_extra["spec_decode"]


def test_cpu_servers_measure_their_round_budget_over_a_full_batch(servers):
    """On a CPU without --deadline-ms, serve times the worker's round over --max-batch requests of a catch-up
    round's tokens (256 there) and says the budget it took; off has no rounds to time."""
    for name, batch in (("async", 16), ("sync", 2)):
        log = servers[name].log()
        assert re.search(rf"round budget \d+ ms, deadline \d+ ms \({batch} requests a round\) \(measured STEP: "
                         r"k=1 [\d.]+ ms, k=4 [\d.]+ ms; prompt of 256 tokens", log), log
    assert "round budget" not in servers["off"].log()


def test_completion_chat_and_stream_equal_generate(servers):
    srv = servers["async"]
    c = client(srv)
    r = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=32, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(PROMPTS[0].encode()) and r.usage.completion_tokens == 32
    sd = spec(r.usage)
    assert sd["rounds"]["ok"] > 0 and sd["num_draft_tokens"] > 0
    assert 0 <= sd["num_accepted_tokens"] <= sd["num_draft_tokens"]
    assert sum(sd["num_accepted_tokens_per_pos"]) == sd["num_accepted_tokens"]
    # the same tokens as `draftrelay generate` (it prints prompt + output, escaped for a terminal)
    assert printable(PROMPTS[0] + r.choices[0].text) == servers["generate"]

    pieces, last = [], None
    for chunk in c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=32, temperature=0, stream=True):
        pieces.append(chunk.choices[0].text)
        last = chunk
    assert "".join(pieces) == r.choices[0].text and len(pieces) > 2
    assert last.choices[0].finish_reason == "length" and last.usage.completion_tokens == 32

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    ch = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0)
    assert ch.choices[0].message.role == "assistant" and ch.usage.completion_tokens == 16
    # the built-in ChatML layout, encoded as the prompt of a completion, gives the same tokens
    chatml = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    assert ch.usage.prompt_tokens == len(chatml.encode())
    assert complete(srv, chatml, 16) == ch.choices[0].message.content
    streamed = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(streamed)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(x.choices[0].delta.content or "" for x in chunks if x.choices) == ch.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16

    m = c.models.list()
    assert [x.id for x in m.data] == [MODEL]


def test_greedy_identical_across_modes_and_stop(servers):
    outs = {mode: [complete(servers[mode], p, 24) for p in PROMPTS[:3]] for mode in ("off", "sync", "async")}
    assert outs["off"] == outs["sync"] == outs["async"]
    assert all(len(o.encode("utf-8", "surrogatepass")) > 0 for o in outs["off"])
    # a stop string: the text ends before it; a stop token id: before that token
    full = outs["off"][0]
    cut = next(i for i in range(4, len(full) - 1) if "\ufffd" not in full[i:i + 2])
    stop = full[cut:cut + 2]
    c = client(servers["async"])
    r = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[:full.index(stop)]
    assert r.usage.completion_tokens < 24
    ascii_char = next(ch for ch in full[2:] if ord(ch) < 128)  # a byte token never inside a multi-byte char
    r = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                             extra_body={"stop_token_ids": [ord(ascii_char)]})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[:full.index(ascii_char)]


def test_sixteen_concurrent_streams_equal_alone(servers):
    srv = servers["async"]
    prompts = [f"request {i}: " + PROMPTS[i % 4] for i in range(16)]
    alone = [complete(srv, p, 20) for p in prompts]

    async def one(c, p):
        parts = []
        async for chunk in await c.completions.create(model=MODEL, prompt=p, max_tokens=20, temperature=0,
                                                      stream=True):
            parts.append(chunk.choices[0].text)
        return "".join(parts)

    async def all16():
        async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    together = asyncio.run(all16())
    assert together == alone


def _health(srv: Server) -> dict:
    return httpx.get(srv.url + "/health", timeout=10).json()


def _worker_rids(core) -> set[int]:
    with core.lock:
        return {rid for s in core.sessions.values() for rid in s.requests}


def test_disconnect_frees_rows_and_full_queue_429(servers):
    srv, core = servers["sync"], servers["core"]
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 3000, "temperature": 0, "stream": True}
    before = _worker_rids(core)
    streams, opened = [], []
    for _ in range(2):  # fill both KV rows with long requests
        cm = httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60)
        resp = cm.__enter__()
        lines = resp.iter_lines()
        got = [ln for ln in (next(lines) for _ in range(6)) if ln.startswith("data: ")]
        assert len(got) >= 2  # a few steps ran: rounds went to the worker
        streams.append(cm)
        opened.append(lines)  # a dropped line iterator closes its connection: keep it
    h = _health(srv)
    assert h["running"] == 2 and h["kv_rows_free"] == 0
    held = _worker_rids(core) - before
    assert len(held) == 2  # the worker holds draft KV for both

    # one may wait (--max-queue 1); the next is refused at once
    result = {}
    waiter = threading.Thread(target=lambda: result.update(text=complete(srv, PROMPTS[2], 8)))
    waiter.start()
    deadline = time.monotonic() + 20
    while _health(srv)["waiting"] != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    refused = httpx.post(srv.url + "/v1/completions", json={**body, "stream": False}, timeout=30)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"

    for cm in streams:  # the clients go away mid-stream
        cm.__exit__(None, None, None)
    waiter.join(60)
    assert result["text"] == complete(servers["off"], PROMPTS[2], 8)
    deadline = time.monotonic() + 10
    while _health(srv)["kv_rows_free"] != 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    h = _health(srv)
    assert h["kv_rows_free"] == 2 and h["running"] == 0 and h["waiting"] == 0
    # the drafter was told to forget them: later rounds carried their ENDs
    complete(srv, PROMPTS[3], 8)
    assert not held & _worker_rids(core)
    # a client of a non-streamed request that gives up (times out) is cancelled the same way
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/completions", json={**body, "stream": False}, timeout=1.0)
    deadline = time.monotonic() + 10
    while _health(srv)["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _health(srv)["kv_rows_free"] == 2
    m = httpx.get(srv.url + "/metrics", timeout=10).text
    assert re.search(r'draftrelay_request_success_total\{finished_reason="abort",model_name="tiny-target"\} 3\.0', m)
    assert re.search(r'draftrelay_request_rejected_total\{model_name="tiny-target",reason="queue_full"\} 1\.0', m)


BAD = [
    (b'{"prompt": "x", "max_tokens": 4', None, "not valid JSON"),
    (b'[1, 2]', None, "must be a JSON object"),
    ({"prompt": "x", "max_tokens": 600}, "max_tokens", "exceeds the model's context of 512"),
    ({"prompt": [1] * 600, "max_tokens": 1}, "prompt", "no room"),
    (b'{"prompt": "x", "temperature": NaN}', "temperature", "finite"),
    ({"prompt": "x", "temperature": -0.5}, "temperature", ">= 0"),
    ({"prompt": "x", "model": "gpt-4o"}, "model", "not served here"),
    ({"prompt": "x", "n": 2}, "n", "n = 1"),
    ({"prompt": ["a", "b"]}, "prompt", "one prompt per request"),
    ({"prompt": [1, 256]}, "prompt", "outside the vocabulary"),
    ({"max_tokens": 4}, "prompt", "required"),
    ({"prompt": "x", "top_p": 0}, "top_p", "(0, 1]"),
    ({"prompt": "x", "stop": 5.5}, "stop", "string or a list"),
    ({"prompt": "x", "logprobs": 3}, "logprobs", "not supported"),
    ({"prompt": "x", "max_tokens": "ten"}, "max_tokens", "integer"),
]


@pytest.mark.parametrize("body,param,words", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_request_400_names_the_field(servers, body, param, words):
    srv = servers["async"]
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(srv.url + "/v1/completions", content=content, headers=headers, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    if param:
        assert err["message"].startswith(param)
    assert complete(srv, "still serving", 4)  # and the server keeps serving


def test_chat_bad_messages_and_api_key(servers):
    srv = servers["async"]
    with pytest.raises(openai.BadRequestError) as e:
        client(srv).chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}])
    assert "messages[0].role" in str(e.value)
    with pytest.raises(openai.AuthenticationError):
        complete(srv, "x", 4, key="wrong")
    r = httpx.get(srv.url + "/v1/models", timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert _health(srv)["status"] == "ok"  # health and metrics need no key
    assert complete(srv, "still serving", 4)


def _scrape(srv: Server) -> dict:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    out: dict = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                            + "}" if len(s.labels) > ("model_name" in s.labels) else "")
            out[key] = s.value
    return out


def test_startup_requests_are_not_counted(servers):
    # each server sent itself requests through every HTTP path before it announced itself; a client's
    # dashboard starts from zero requests, tokens and drafts all the same
    for name, m in servers["startup_metrics"].items():
        counted = {k: v for k, v in m.items() if v and k.startswith((
            "draftrelay_request_success_total", "draftrelay_prompt_tokens_total",
            "draftrelay_generation_tokens_total", "draftrelay_time_to_first_token_seconds_count",
            "draftrelay_spec_decode_num_drafts_total"))}
        assert counted == {}, (name, counted)
        assert m["draftrelay_kv_rows_free"] > 0, name  # the scrape read the serving metrics


def test_metrics_parse_and_spec_counters_equal_usage(servers):
    srv = servers["async"]
    before = _scrape(srv)
    c = client(srv)
    usages = [c.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0).usage for p in PROMPTS]
    sampled = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0.9, top_p=0.8,
                                   seed=7, extra_body={"top_k": 40})
    usages.append(sampled.usage)
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
    assert d["draftrelay_generation_tokens_total"] == sum(u.completion_tokens for u in usages)
    assert d["draftrelay_prompt_tokens_total"] == sum(u.prompt_tokens for u in usages)
    assert d["draftrelay_time_to_first_token_seconds_count"] == len(usages)
    assert d["draftrelay_e2e_request_latency_seconds_count"] == len(usages)
    assert d["draftrelay_inter_token_latency_seconds_count"] > 0
    assert d["draftrelay_request_success_total{finished_reason=length}"] == len(usages)
    assert after["draftrelay_num_requests_running"] == 0 and after["draftrelay_kv_rows_free"] == 16
    assert after["draftrelay_rounds_total{status=ok}"] > 0 and after["draftrelay_mode{mode=async}"] == 1
    # the same seed gives the same sample, whatever ran in between
    again = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0.9, top_p=0.8,
                                 seed=7, extra_body={"top_k": 40})
    assert again.choices[0].text == sampled.choices[0].text
