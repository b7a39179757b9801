"""Text tokenizers of real checkpoints, all `tokenizers.Tokenizer`s: read from an HF directory's
tokenizer.json, or built from a GGUF file's vocabulary, merges and pre-tokenizer type.

A GGUF file carries no tokenizer.json, only what llama.cpp's converter kept of it: the tokens by id,
their types (normal, control, user-defined, ...), the BPE merges, and the name of the pre-tokenizer
(`tokenizer.ggml.pre`). The pipeline around the BPE model (normalizer, pre-tokenizer split, decoder,
BOS template) is rebuilt here per pre-tokenizer name, as the HF tokenizer.json of that family has it;
a name without a known pipeline is refused instead of tokenizing differently from the model's training.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

from draftrelay.model import ModelError

# The split regexes of the byte-level BPE families (as their tokenizer.json files state them).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = ("qwen2", "llama-bpe", "gpt2", "default")

# llama.cpp's token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


@dataclass
class GGUFVocab:
    """The tokenizer fields of a GGUF file (tokenizer.ggml.* and tokenizer.chat_template)."""
    model: str
    pre: str
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_id: int | None = None
    eos_id: int | None = None
    eot_id: int | None = None
    add_bos: bool = False
    chat_template: str = ""
    extra_eos: list[int] = field(default_factory=list)

    def digest(self) -> str:
        """What identifies the tokenization (model, pre-tokenizer, tokens, types, merges): equal for two
        files that tokenize alike, whatever their other metadata. The worker handshake compares it."""
        h = hashlib.sha256()
        for part in (self.model, self.pre, "\x00".join(self.tokens), ",".join(map(str, self.token_types)),
                     "\x00".join(self.merges)):
            h.update(part.encode("utf-8"))
            h.update(b"\x01")
        return "gguf-" + h.hexdigest()[:16]


class HFTokenizer:
    """A `tokenizers.Tokenizer` with what a serving front needs beside it: the chat template, the BOS/EOS
    tokens, the ids that end a generation, and a hash that identifies the vocabulary."""

    def __init__(self, tok, name: str, chat_template: str = "", bos_token: str = "", eos_token: str = "",
                 stop_ids: tuple[int, ...] = (), vocab_hash: str = "") -> None:
        self.tok, self.name = tok, name
        self.chat_template, self.bos_token, self.eos_token = chat_template, bos_token, eos_token
        self.stop_ids, self.vocab_hash = stop_ids, vocab_hash

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    @classmethod
    def from_dir(cls, path: str) -> HFTokenizer:
        """tokenizer.json of an HF model directory (tokenizer_config.json: chat template, BOS/EOS)."""
        from tokenizers import Tokenizer

        fn = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(fn):
            raise ModelError(f"{path}: no tokenizer.json (needed to encode prompts)")
        try:
            tok = Tokenizer.from_file(fn)
        except Exception as exc:
            raise ModelError(f"{fn}: cannot load: {exc}") from None
        conf: dict = {}
        try:
            with open(os.path.join(path, "tokenizer_config.json")) as f:
                conf = json.load(f)
        except (OSError, json.JSONDecodeError):
            pass
        template = conf.get("chat_template") if isinstance(conf, dict) else None
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)

        def token_text(v) -> str:
            return v.get("content", "") if isinstance(v, dict) else v if isinstance(v, str) else ""

        return cls(tok, os.path.basename(os.path.abspath(path)), template if isinstance(template, str) else "",
                   token_text(conf.get("bos_token")), token_text(conf.get("eos_token")))

    @classmethod
    def from_gguf_vocab(cls, vocab: GGUFVocab, name: str, where: str) -> HFTokenizer:
        tok = build_gguf_tokenizer(vocab, where)

        def text(i: int | None) -> str:
            return vocab.tokens[i] if i is not None and 0 <= i < len(vocab.tokens) else ""

        stops = tuple(dict.fromkeys(i for i in (vocab.eos_id, vocab.eot_id, *vocab.extra_eos) if i is not None))
        return cls(tok, name, vocab.chat_template, text(vocab.bos_id), text(vocab.eos_id), stops, vocab.digest())


def build_gguf_tokenizer(v: GGUFVocab, where: str):
    """The tokenizers.Tokenizer that the HF tokenizer.json of this vocabulary describes."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    if v.model != "gpt2":
        raise ModelError(f"{where}: tokenizer.ggml.model {v.model!r} is not supported (byte-level BPE 'gpt2' only)")
    if v.pre not in PRE_TOKENIZERS:
        raise ModelError(f"{where}: tokenizer.ggml.pre {v.pre!r} is not supported "
                         f"(supported: {', '.join(PRE_TOKENIZERS)})")
    if len(v.token_types) != len(v.tokens):
        raise ModelError(f"{where}: {len(v.token_types)} token types for {len(v.tokens)} tokens")
    vocab = {t: i for i, t in enumerate(v.tokens)}
    if len(vocab) != len(v.tokens):
        raise ModelError(f"{where}: tokenizer.ggml.tokens holds duplicate tokens")
    merges = []
    for m in v.merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise ModelError(f"{where}: merge {m!r} is not two tokens separated by a space")
        merges.append((a, b))
    try:
        # llama-bpe (Llama 3) sets ignore_merges: a word that is itself a token is not re-merged
        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                         ignore_merges=v.pre == "llama-bpe")
    except Exception as exc:
        raise ModelError(f"{where}: cannot build the BPE model: {exc}") from None
    tok = Tokenizer(bpe)
    if v.pre == "qwen2":
        tok.normalizer = normalizers.NFC()
    if v.pre in ("qwen2", "llama-bpe"):
        split = QWEN2_SPLIT if v.pre == "qwen2" else LLAMA3_SPLIT
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=v.pre == "llama-bpe", use_regex=False)])
    else:  # GPT-2's own byte-level split
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # control tokens are special (skipped when decoding with skip_special_tokens), user-defined ones are
    # plain added tokens; both are matched whole in the input before the split, as in tokenizer.json
    added = [AddedToken(t, special=ty == CONTROL, normalized=False)
             for t, ty in zip(v.tokens, v.token_types, strict=True) if ty in (CONTROL, USER_DEFINED)]
    tok.add_tokens([a for a in added if not a.special])
    tok.add_special_tokens([a for a in added if a.special])
    if v.add_bos:
        if v.bos_id is None:
            raise ModelError(f"{where}: tokenizer.ggml.add_bos_token is set but no bos_token_id")
        bos = v.tokens[v.bos_id]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, v.bos_id)])
    return tok
