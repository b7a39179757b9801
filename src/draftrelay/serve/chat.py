"""Chat templates: the model's own, rendered with jinja2 the way transformers renders them.

Where the template comes from, first found wins: a `chat_template` attribute of the loaded target
(a GGUF loader puts `tokenizer.chat_template` there), else `tokenizer_config.json` of the model
directory (a string, or a list of named templates: "default" is used). A model with neither (the
built-in tiny models) gets a plain ChatML layout, which the server says at start.

Rendering as transformers does: a sandboxed environment with trim_blocks and lstrip_blocks, the
variables `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, the `raise_exception` and
`strftime_now` globals and a `tojson` filter that keeps non-ASCII. The rendered text already holds
the special tokens the template writes, so it is encoded without adding any (no double BOS).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from datetime import datetime

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class TemplateError(ValueError):
    pass


def _token_str(v) -> str:
    if isinstance(v, dict):  # {"content": "<s>", "lstrip": false, ...}
        v = v.get("content", "")
    return v if isinstance(v, str) else ""


def find_template(target, model_dir: str | None) -> tuple[str, str, str, str]:
    """(template, where it came from, bos_token, eos_token)."""
    tmpl = getattr(target, "chat_template", None)
    bos = _token_str(getattr(target, "bos_token", ""))
    eos = _token_str(getattr(target, "eos_token", ""))
    if isinstance(tmpl, str) and tmpl:
        return tmpl, "the model file", bos, eos
    fn = os.path.join(model_dir, "tokenizer_config.json") if model_dir else ""
    if fn and os.path.isfile(fn):
        try:
            with open(fn) as f:
                cfg = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise TemplateError(f"{fn}: cannot read: {exc}") from None
        bos, eos = bos or _token_str(cfg.get("bos_token")), eos or _token_str(cfg.get("eos_token"))
        t = cfg.get("chat_template")
        if isinstance(t, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
            t = named.get("default") or next(iter(named.values()), None)
        if isinstance(t, str) and t:
            return t, fn, bos, eos
    jfn = os.path.join(model_dir, "chat_template.jinja") if model_dir else ""
    if jfn and os.path.isfile(jfn):
        with open(jfn) as f:
            return f.read(), jfn, bos, eos
    return CHATML, "built-in ChatML (the model has no chat template)", bos, eos


def compile_template(source: str, bos: str = "", eos: str = "") -> Callable[[list[dict]], str]:
    """messages -> prompt text, with the generation prompt for the assistant's turn appended."""
    from jinja2 import TemplateError as JinjaError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        tmpl = env.from_string(source)
    except JinjaError as exc:
        raise TemplateError(f"the chat template does not compile: {exc}") from None

    def render(messages: list[dict]) -> str:
        try:
            return tmpl.render(messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos)
        except TemplateError:
            raise
        except JinjaError as exc:
            raise TemplateError(f"the chat template failed on these messages: {exc}") from None

    return render
