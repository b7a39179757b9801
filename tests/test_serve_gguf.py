"""`draftrelay serve --model FILE.gguf --drafter FILE.gguf`: the tiny pair written as two GGUF files
(gguf.GGUFWriter, with a chat template of its own in the metadata), served and asked through the real
`openai` client: greedy completions equal `draftrelay generate` on the same file, chat completions are
rendered with the file's template, and the drafter answering the rounds is the GGUF one."""

from __future__ import annotations

import subprocess
import sys

import pytest

openai = pytest.importorskip("openai")

from gguf_files import byte_vocab, write_gguf  # noqa: E402
from test_serve import ENV, Server  # noqa: E402

# a layout no built-in default produces: a chat answered from it came through the GGUF metadata
TEMPLATE = ("{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[ASSISTANT] {% endif %}")
PROMPT = "Hello there"


@pytest.fixture(scope="module")
def gguf_server(tmp_path_factory):
    from draftrelay.model import tiny_pair

    d = tmp_path_factory.mktemp("gguf")
    vocab = {**byte_vocab(), "chat_template": TEMPLATE}
    target, drafter = tiny_pair()
    paths = [str(d / "target.gguf"), str(d / "drafter.gguf")]
    for model, path in zip((target, drafter), paths, strict=True):
        write_gguf(model, path, "llama", vocab=vocab)
    gen = subprocess.Popen([sys.executable, "-m", "draftrelay", "generate", PROMPT, "--model", paths[0],
                            "--mode", "off", "--max-tokens", "24", "--device", "cpu"], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, env=ENV)
    srv = Server("--model", paths[0], "--drafter", paths[1], "--mode", "sync", "--max-model-len", "512",
                 "--device", "cpu")
    try:
        srv.wait_ready()
        gen_out, _ = gen.communicate(timeout=120)
        # bytes, not text mode: a carriage return in the output must stay one
        yield srv, gen_out.decode("utf-8").removesuffix("\n"), paths[0]
    finally:
        srv.terminate()
        rc = srv.stop()
        if gen.poll() is None:
            gen.kill()
    assert rc == 0 and not srv.leftover


def test_gguf_pair_served_with_its_chat_template(gguf_server):
    srv, generated, target_path = gguf_server
    assert f"chat template: {target_path} (tokenizer.chat_template)" in srv.log()
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
    (m,) = c.models.list().data
    assert m.id == "test model"  # the GGUF file's general.name

    r = c.completions.create(model=m.id, prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.usage.prompt_tokens == len(PROMPT.encode()) and r.usage.completion_tokens == 24
    assert PROMPT + r.choices[0].text == generated  # `generate` prints an HF tokenizer's text as it is
    sd = r.usage.model_extra["spec_decode"]
    assert sd["rounds"]["ok"] > 0 and sd["num_accepted_tokens"] > 0  # the GGUF drafter answered the rounds
    streamed = c.completions.create(model=m.id, prompt=PROMPT, max_tokens=24, temperature=0, stream=True)
    assert "".join(x.choices[0].text for x in streamed) == r.choices[0].text

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    ch = c.chat.completions.create(model=m.id, messages=msgs, max_tokens=16, temperature=0)
    rendered = "[SYSTEM] Be brief.\n[USER] Hi!\n[ASSISTANT] "
    assert ch.usage.prompt_tokens == len(rendered.encode())
    alone = c.completions.create(model=m.id, prompt=rendered, max_tokens=16, temperature=0)
    assert ch.choices[0].message.content == alone.choices[0].text and ch.usage.completion_tokens == 16
