"""The FastAPI application: OpenAI's completions, chat completions and models endpoints, health,
metrics, the API key.

Bodies are read and checked by `protocol` (not by FastAPI's model validation), so every refusal is
a 400 in OpenAI's error shape with the field named in `param` and in the message. Streaming is
server-sent events: one chunk per engine step that produced text, the finish reason in the last
chunk (which also carries `usage`), then `data: [DONE]`. A client that goes away, streaming or
not, has its request cancelled at the next step boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from .metrics import ServeMetrics
from .protocol import ApiError, GenRequest, Limits, parse_json, parse_request
from .scheduler import Event, Job, Scheduler
from .textstream import TextStream


def _error(e: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status in (429, 503) else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(sched: Scheduler, lim: Limits, metrics: ServeMetrics, decode: Callable[[list[int]], str],
              api_key: str = "", on_ready: Callable[[], None] | None = None) -> FastAPI:
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if on_ready is not None:
            on_ready()
        yield

    app = FastAPI(title="draftrelay", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return _error(e)

    def _check_key(request: Request) -> None:
        if api_key:
            got = request.headers.get("authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {api_key}".encode()):
                metrics.labels(metrics.request_rejected, "unauthorized").inc()
                raise ApiError(401, "missing or wrong API key (send 'Authorization: Bearer KEY')",
                               code="invalid_api_key")

    @app.get("/health")
    async def health():
        return {"status": "ok", **sched.status()}

    @app.get("/metrics")
    async def prom():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        _check_key(request)
        return {"object": "list", "data": [{"id": lim.model_name, "object": "model", "created": created,
                                             "owned_by": "draftrelay", "max_model_len": lim.max_model_len}]}

    async def _parse(request: Request, kind: str) -> GenRequest:
        try:
            body = parse_json(await request.body())
            # tokenizing or rendering a long prompt should not hold up the event loop
            return await run_in_threadpool(parse_request, body, kind, lim)
        except ApiError:
            metrics.labels(metrics.request_rejected, "invalid").inc()
            raise

    async def _generate(request: Request, kind: str):
        _check_key(request)
        gen = await _parse(request, kind)
        job = Job(gen, asyncio.get_running_loop(), TextStream(decode, gen.stop))
        sched.submit(job)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        if gen.stream:
            return StreamingResponse(_sse(job, rid, kind), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _whole(request, job, rid, kind)

    async def _whole(request: Request, job: Job, rid: str, kind: str):
        watcher = asyncio.ensure_future(_until_disconnect(request))
        parts: list[str] = []
        try:
            while True:
                get = asyncio.ensure_future(job.events.get())
                await asyncio.wait({get, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():  # the client went away
                    get.cancel()
                    sched.cancel(job)
                    return Response(status_code=499)
                ev: Event = get.result()
                if ev.kind == "error":
                    return _error(ev.error)
                if ev.kind == "text":
                    parts.append(ev.text)
                    continue
                return _body(rid, kind, "".join(parts), ev)
        finally:
            watcher.cancel()
            if not job.finished:
                sched.cancel(job)

    def _body(rid: str, kind: str, text: str, ev: Event) -> dict:
        if kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": ev.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": ev.finish_reason}
            obj = "text_completion"
        return {"id": rid, "object": obj, "created": int(time.time()), "model": lim.model_name,
                "choices": [choice], "usage": ev.usage}

    async def _sse(job: Job, rid: str, kind: str):
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        head = {"id": rid, "object": obj, "created": int(time.time()), "model": lim.model_name}

        def chunk(text: str | None, finish: str | None, usage: dict | None = None, role: bool = False) -> str:
            if kind == "chat":
                delta = {} if text is None else {"content": text}
                if role:
                    delta = {"role": "assistant", **delta}
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            out = {**head, "choices": [choice]}
            if usage is not None:
                out["usage"] = usage
            return f"data: {json.dumps(out)}\n\n"

        first = True
        try:
            while True:
                ev: Event = await job.events.get()
                if ev.kind == "error":
                    yield f"data: {json.dumps(ev.error.body())}\n\n"
                    break
                if ev.kind == "text":
                    yield chunk(ev.text, None, role=first)
                    first = False
                    continue
                # the last chunk: the finish reason and the usage (OpenAI's include_usage: a chunk of
                # its own, with no choices, after it)
                if job.gen.include_usage:
                    yield chunk(None if kind == "chat" else "", ev.finish_reason, role=first)
                    yield f"data: {json.dumps({**head, 'choices': [], 'usage': ev.usage})}\n\n"
                else:
                    yield chunk(None if kind == "chat" else "", ev.finish_reason, ev.usage, role=first)
                break
            yield "data: [DONE]\n\n"
        finally:  # also on cancellation: the client went away mid-stream
            if not job.finished:
                sched.cancel(job)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _generate(request, "chat")

    return app
