"""OpenAI request bodies -> one validated generation request, or an ApiError naming the field.

Only what the engine can honour is accepted: n = 1 (one sequence per request), no logprobs, no
penalties or logit bias, no echo. A parameter the engine cannot apply is refused by name rather
than silently ignored, so a client never gets output that looks as if it had been honoured.
Fields that change nothing about the output (user, metadata, ...) are accepted and ignored.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from draftrelay.engine.request import SamplingParams

MAX_STOP = 16  # stop strings per request (OpenAI allows 4; vLLM more)
MAX_STOP_LEN = 256


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 etype: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.etype, self.code = status, message, param, etype, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.etype, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


@dataclass
class Limits:
    """What a request is checked against."""

    model_name: str
    max_model_len: int  # prompt + max_tokens may not exceed it
    vocab_size: int
    stop_token_ids: tuple[int, ...]  # the model's own end-of-sequence ids
    encode: Callable[[str], list[int]]  # completions' prompt text -> ids
    render_chat: Callable[[list[dict]], list[int]] | None = None  # messages -> prompt ids


@dataclass
class GenRequest:
    kind: str  # "completion" | "chat"
    prompt_ids: list[int]
    params: SamplingParams
    seeded: bool  # a seed was given: the same seed gives the same sample, whatever else runs
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage only
    extra: dict = field(default_factory=dict)


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _int(body: dict, name: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise bad(name, f"must be an integer, got {json.dumps(v)[:40]}")
    if lo is not None and v < lo:
        raise bad(name, f"must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise bad(name, f"must be <= {hi}, got {v}")
    return v


def _num(body: dict, name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(name, f"must be a number, got {json.dumps(v)[:40]}")
    v = float(v)
    if not math.isfinite(v):
        raise bad(name, f"must be finite, got {v}")
    return v


def _refuse_unsupported(body: dict) -> None:
    n = _int(body, "n", 1)
    if n != 1:
        raise bad("n", f"only n = 1 is supported (one sequence per request), got {n}")
    best_of = _int(body, "best_of", 1)
    if best_of != 1:
        raise bad("best_of", f"only best_of = 1 is supported, got {best_of}")
    for name in ("presence_penalty", "frequency_penalty"):
        if _num(body, name, 0.0) != 0.0:
            raise bad(name, "penalties are not supported (only 0)")
    if body.get("logit_bias"):
        raise bad("logit_bias", "not supported")
    if body.get("logprobs") not in (None, False, 0):
        raise bad("logprobs", "not supported")
    if body.get("top_logprobs") not in (None, 0):
        raise bad("top_logprobs", "not supported")
    if body.get("echo"):
        raise bad("echo", "not supported")
    if body.get("suffix"):
        raise bad("suffix", "not supported")
    if body.get("tools"):
        raise bad("tools", "tool calling is not supported")
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise bad("response_format", "only {\"type\": \"text\"} is supported")


def _stop(body: dict, vocab: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """`stop`: a string or a list of strings (token ids may be mixed in); `stop_token_ids`: ids."""
    v = body.get("stop")
    items = [] if v is None else [v] if isinstance(v, str) else v
    if not isinstance(items, list):
        raise bad("stop", "must be a string or a list of strings / token ids")
    strs, ids = [], []
    for x in items:
        if isinstance(x, str):
            if not x:
                raise bad("stop", "an empty stop string would stop at once")
            if len(x) > MAX_STOP_LEN:
                raise bad("stop", f"a stop string may have at most {MAX_STOP_LEN} characters")
            strs.append(x)
        elif isinstance(x, int) and not isinstance(x, bool):
            ids.append(x)
        else:
            raise bad("stop", f"entries must be strings or token ids, got {json.dumps(x)[:40]}")
    extra = body.get("stop_token_ids")
    if extra is not None:
        if not isinstance(extra, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in extra):
            raise bad("stop_token_ids", "must be a list of token ids")
        ids += extra
    if len(strs) > MAX_STOP:
        raise bad("stop", f"at most {MAX_STOP} stop strings, got {len(strs)}")
    for t in ids:
        if not 0 <= t < vocab:
            name = "stop_token_ids" if extra and t in extra else "stop"
            raise bad(name, f"token id {t} is outside the vocabulary [0, {vocab})")
    return tuple(strs), tuple(ids)


def _prompt(body: dict, lim: Limits) -> list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        ids = lim.encode(p)
    elif isinstance(p, list) and p and all(isinstance(x, int) and not isinstance(x, bool) for x in p):
        ids = list(p)
        bad_ids = [x for x in ids if not 0 <= x < lim.vocab_size]
        if bad_ids:
            raise bad("prompt", f"token id {bad_ids[0]} is outside the vocabulary [0, {lim.vocab_size})")
    elif isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise bad("prompt", f"one prompt per request (n = 1 only), got a batch of {len(p)}")
    elif p is None:
        raise bad("prompt", "is required")
    else:
        raise bad("prompt", "must be a string, a list of token ids, or a list of one of those")
    if not ids:
        raise bad("prompt", "encodes to no tokens")
    return ids


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "must be a non-empty list of messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, "must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad(f"{where}.role", f"unknown role {json.dumps(role)[:40]}")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise bad(f"{where}.content[{j}]", "only text parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise bad(f"{where}.content", "must be a string or a list of text parts")
        out.append({**m, "role": role, "content": content})
    return out


def parse_request(body: dict, kind: str, lim: Limits) -> GenRequest:
    """A completions (kind 'completion') or chat completions ('chat') body, checked."""
    model = body.get("model")
    if model is not None and model != lim.model_name:
        raise ApiError(400, f"model: {json.dumps(model)[:80]} is not served here (this server serves "
                            f"{lim.model_name!r})", param="model", code="model_not_found")
    _refuse_unsupported(body)
    if kind == "chat":
        msgs = _messages(body)
        if lim.render_chat is None:
            raise bad("messages", "this model has no chat template")
        try:
            ids = lim.render_chat(msgs)
        except ValueError as exc:
            raise bad("messages", str(exc)) from None
        if not ids:
            raise bad("messages", "the rendered conversation encodes to no tokens")
    else:
        ids = _prompt(body, lim)
    room = lim.max_model_len - len(ids)
    if room < 1:
        raise bad("messages" if kind == "chat" else "prompt",
                  f"{len(ids)} tokens leave no room for output in the model's context of {lim.max_model_len}")
    name = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    # completions default to 16 tokens as OpenAI's do; chat to the rest of the context, as vLLM's does
    max_tokens = _int(body, name, 16 if kind == "completion" else room, lo=1)
    if max_tokens > room:
        raise bad(name, f"prompt ({len(ids)} tokens) + {name} ({max_tokens}) = {len(ids) + max_tokens} "
                        f"exceeds the model's context of {lim.max_model_len} tokens")
    temperature = _num(body, "temperature", 1.0)
    if temperature < 0:
        raise bad("temperature", f"must be >= 0, got {temperature}")
    top_p = _num(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise bad("top_p", f"must be within (0, 1], got {top_p}")
    top_k = _int(body, "top_k", 0, lo=-1)
    seed = _int(body, "seed", None)
    stop, stop_ids = _stop(body, lim.vocab_size)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", "must be true or false")
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise bad("stream_options", "must be an object")
    include_usage = bool((so or {}).get("include_usage", False))
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=max(0, top_k), top_p=top_p,
                            seed=seed or 0, stop_token_ids=tuple(dict.fromkeys(lim.stop_token_ids + stop_ids)))
    return GenRequest(kind, ids, params, seed is not None, stop, stream, include_usage)
