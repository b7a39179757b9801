"""Tokenizers built from a GGUF file's vocabulary equal the HF tokenizer.json of the same vocabulary.

The references are tokenizer.json documents in the published layout of each family (Qwen2's, Llama 3's,
GPT-2's), over a vocabulary trained here; the GGUF side gets only what llama.cpp's converter keeps of
them (tokens by id, token types, merges, the pre-tokenizer's name) and must tokenize every text of the
corpus to the same ids, and decode them to the same text.
"""

from __future__ import annotations

import json

import pytest
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

from draftrelay.checkpoint import gguf as G
from draftrelay.checkpoint.tokenizer import LLAMA3_SPLIT, QWEN2_SPLIT, GGUFVocab, HFTokenizer
from draftrelay.model import ModelConfig, ModelError, Transformer
from gguf_files import write_gguf

TRAIN = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. It's 2024; we've got 1,234,567 reasons.\n",
    "import numpy as np\nx = np.arange(10)  # ten values\nprint(x.sum())\n\n\n",
    "Café, naïve, résumé — déjà vu. Ünïcödé text: 東京 is Tokyo, 北京 is Beijing. 🙂🚀\n",
    "class Foo:\n\tdef __init__(self):\n\t\tself.items = []  # TODO\r\n",
    "I'M HERE, you're there, they'll come, she'd know, I've seen 3.14159 and 42!!!",
]
CORPUS = TRAIN + [
    "fibonacci numbers: 0 1 1 2 3 5 8 13 21 34 55 89 144 233 377 610 987 1597",
    "e\u0301 (decomposed) vs \u00e9 (composed), Ａ full-width, ﬁ ligature",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text <tool_call>{\"name\": \"f\"}</tool_call>",
    "   leading spaces, trailing spaces   \n\n  \t mixed \r\n whitespace",
    "DON'T SHOUT'S 'quoted' \"double\" `backticks` ~tilde~ @user #tag $100 50% a&b a|b",
    "مرحبا بالعالم — Привет, мир — नमस्ते दुनिया — 안녕하세요",
    "",
]
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PLAIN_ADDED = ["<tool_call>", "</tool_call>"]


def bytelevel(**kw) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False, **kw}


def trained(split: str | None, nfc: bool, size: int = 700) -> tuple[dict, list[str]]:
    """A byte-level BPE vocabulary (token -> id) and its merges ("a b"), trained on TRAIN."""
    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.train_from_iterator(TRAIN, trainers.BpeTrainer(vocab_size=size, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = json.loads(tok.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return model["vocab"], merges


def reference_json(family: str) -> dict:
    """The tokenizer.json a checkpoint of `family` ships, over a vocabulary trained here."""
    split = {"qwen2": QWEN2_SPLIT, "llama-bpe": LLAMA3_SPLIT, "gpt2": None}[family]
    vocab, merges = trained(split, nfc=family == "qwen2")
    added = []
    for content in SPECIAL + PLAIN_ADDED + (["<|begin_of_text|>"] if family == "llama-bpe" else []):
        added.append({"id": len(vocab), "content": content, "single_word": False, "lstrip": False,
                      "rstrip": False, "normalized": False, "special": content not in PLAIN_ADDED})
        vocab[content] = len(vocab)
    doc = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
           "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                     "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                     "ignore_merges": family == "llama-bpe", "vocab": vocab, "merges": merges}}
    if family == "qwen2":  # Qwen2 / Qwen2.5
        doc["normalizer"] = {"type": "NFC"}
        doc["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
            bytelevel()]}
        doc["post_processor"] = bytelevel()
        doc["decoder"] = bytelevel()
    elif family == "llama-bpe":  # Llama 3: BOS from the template
        bos = vocab["<|begin_of_text|>"]
        doc["normalizer"] = None
        doc["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated", "invert": False},
            bytelevel(trim_offsets=True)]}
        doc["post_processor"] = {"type": "Sequence", "processors": [
            bytelevel(add_prefix_space=True, use_regex=True),
            {"type": "TemplateProcessing",
             "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                        {"Sequence": {"id": "A", "type_id": 0}}],
             "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                      {"Sequence": {"id": "A", "type_id": 0}},
                      {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}},
                      {"Sequence": {"id": "B", "type_id": 1}}],
             "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [bos],
                                                      "tokens": ["<|begin_of_text|>"]}}}]}
        doc["decoder"] = bytelevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    else:  # GPT-2
        doc["normalizer"] = None
        doc["pre_tokenizer"] = bytelevel(use_regex=True)
        doc["post_processor"] = bytelevel(trim_offsets=True)
        doc["decoder"] = bytelevel(use_regex=True)
    return doc


def gguf_vocab_of(doc: dict, family: str) -> dict:
    """What llama.cpp's converter writes for this tokenizer.json: tokens by id, types, merges, pre."""
    vocab = doc["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    added = {a["content"]: a for a in doc["added_tokens"]}
    types = [(3 if added[t]["special"] else 4) if t in added else 1 for t in tokens]
    out = {"model": "gpt2", "pre": family, "tokens": tokens, "types": types, "merges": doc["model"]["merges"],
           "eos": vocab["<|im_end|>"], "chat_template": "{{ messages }}"}
    if family == "llama-bpe":
        out.update(bos=vocab["<|begin_of_text|>"], add_bos=True)
    return out


@pytest.mark.parametrize("family", ["qwen2", "llama-bpe", "gpt2"])
def test_gguf_tokenizer_equals_the_hf_tokenizer_json(tmp_path, family):
    doc = reference_json(family)
    ref = Tokenizer.from_str(json.dumps(doc))
    v = gguf_vocab_of(doc, family)
    cfg = ModelConfig(vocab_size=len(v["tokens"]), hidden_size=32, n_layers=1, n_heads=2, n_kv_heads=2, head_dim=16,
                      intermediate_size=64)
    path = tmp_path / "t.gguf"
    write_gguf(Transformer.random(cfg), path, "llama", vocab=v)
    ck = G.read_gguf(path)
    ours = HFTokenizer.from_gguf_vocab(ck.vocab, "t", str(path))
    assert ours.chat_template == "{{ messages }}" and ours.stop_ids == (v["eos"],)
    merged = 0
    for text in CORPUS:
        want = ref.encode(text).ids
        assert ours.encode(text) == want, text
        assert ours.decode(want) == ref.decode(want), text
        merged += sum(1 for i in want if i >= 256)
    assert merged > 100  # the merges are exercised, not just single bytes
    if family == "llama-bpe":
        assert ours.encode("hi")[0] == v["bos"]
    ids = ours.encode("<|im_start|>user<|im_end|>")
    assert ids[-1] == v["eos"] and ours.tok.decode(ids, skip_special_tokens=True) == "user"


def test_vocabulary_digest_follows_the_tokenization_only():
    base = dict(model="gpt2", pre="qwen2", tokens=["a", "b", "ab"], token_types=[1, 1, 1], merges=["a b"])
    d = GGUFVocab(**base).digest()
    assert GGUFVocab(**base, eos_id=2, chat_template="x").digest() == d  # other metadata: the same
    for change in ({"merges": []}, {"tokens": ["a", "b", "ba"]}, {"pre": "llama-bpe"}, {"token_types": [1, 1, 3]}):
        assert GGUFVocab(**{**base, **change}).digest() != d, change


@pytest.mark.parametrize("change,match", [
    ({"model": "llama"}, "tokenizer.ggml.model 'llama' is not supported"),
    ({"pre": "deepseek-llm"}, "tokenizer.ggml.pre 'deepseek-llm' is not supported"),
    ({"merges": ["ab"]}, "merge 'ab' is not two tokens"),
    ({"token_types": [1]}, "1 token types for 3 tokens"),
    ({"tokens": ["a", "b", "a"]}, "duplicate tokens"),
    ({"add_bos": True}, "add_bos_token is set but no bos_token_id"),
])
def test_refuses_vocabularies_it_cannot_tokenize_alike(change, match):
    base = dict(model="gpt2", pre="qwen2", tokens=["a", "b", "ab"], token_types=[1, 1, 1], merges=["a b"])
    with pytest.raises(ModelError, match=match):
        HFTokenizer.from_gguf_vocab(GGUFVocab(**{**base, **change}), "t", "f.gguf")
