"""GGUF checkpoints: config from the file's metadata, tensors dequantized by the `gguf` package's own
dequantizer (every quant type it implements) into the model's compute dtype, and the tokenizer fields.

Architectures: llama, qwen2 and qwen3. Whatever the decoder cannot run faithfully is refused by name: another
architecture, a tensor the model has no place for (the decoder would silently ignore it), rope scalings
other than linear, sliding-window attention, partial rotary dims.

Memory: GGUFReader parses the header only (its memory map is dropped once the tensor table is read). The
tensor data is read through one read-only map of the file, a few rows at a time: each slice is
dequantized straight into the preallocated parameter and its pages are released from the process right
after, so the peak stays near the loaded model's own size (plus one slice of temporaries), not model +
file + a full-size float32 copy of the largest tensor.
"""

from __future__ import annotations

import mmap
import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from draftrelay.checkpoint.hf import default_dtype, empty_model
from draftrelay.checkpoint.tokenizer import GGUFVocab
from draftrelay.model import ModelConfig, ModelError, Transformer

ARCHITECTURES = ("llama", "qwen2", "qwen3")
SLICE_ELEMENTS = 1 << 20  # values dequantized per step (a few MB of temporaries)

# GGUF tensor names (llama.cpp's) -> ours (HF's module names without 'model.')
GLOBAL_NAMES = {"token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
                "output.weight": "lm_head.weight"}
BLOCK_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


def our_name(gguf_name: str) -> str | None:
    """blk.3.attn_q.weight -> layers.3.self_attn.q_proj.weight; None for a name with no counterpart."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in BLOCK_NAMES \
            and parts[3] in ("weight", "bias"):
        return f"layers.{parts[1]}.{BLOCK_NAMES[parts[2]]}.{parts[3]}"
    return None


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order (rows first), as the model's tensor
    data_shape: tuple[int, ...]  # of the stored data: quantized rows are bytes
    data_dtype: np.dtype
    offset: int  # absolute, in the file
    n_bytes: int


@dataclass
class GGUFFile:
    path: str
    arch: str
    name: str
    meta: dict  # scalar metadata (no arrays)
    tensors: dict[str, TensorInfo]
    vocab: GGUFVocab
    config: ModelConfig


def _scalar_meta(reader) -> dict:
    from gguf import GGUFValueType

    out = {}
    for key, f in reader.fields.items():
        if f.types and f.types[0] != GGUFValueType.ARRAY:
            out[key] = f.contents()
    return out


def _array(reader, key: str) -> list:
    f = reader.fields.get(key)
    return [] if f is None else f.contents()


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Metadata, tensor table and tokenizer fields of a GGUF file; no tensor data is read."""
    from gguf import GGUFReader

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ModelError(f"GGUF file not found: {path}")
    try:
        reader = GGUFReader(path, "r")
    except Exception as exc:  # gguf raises ValueError/struct errors for a file that is not GGUF
        raise ModelError(f"{path}: cannot read GGUF: {exc}") from None
    try:
        meta = _scalar_meta(reader)
        tensors = {}
        for t in reader.tensors:
            tensors[t.name] = TensorInfo(t.name, t.tensor_type, tuple(int(x) for x in reversed(t.shape.tolist())),
                                         tuple(t.data.shape), t.data.dtype, int(t.data_offset), int(t.n_bytes))
        vocab = GGUFVocab(
            model=str(meta.get("tokenizer.ggml.model", "")), pre=str(meta.get("tokenizer.ggml.pre", "default")),
            tokens=_array(reader, "tokenizer.ggml.tokens"), token_types=_array(reader, "tokenizer.ggml.token_type"),
            merges=_array(reader, "tokenizer.ggml.merges"), bos_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_id=meta.get("tokenizer.ggml.eos_token_id"), eot_id=meta.get("tokenizer.ggml.eot_token_id"),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=str(meta.get("tokenizer.chat_template", "")),
            extra_eos=[int(x) for x in _array(reader, "tokenizer.ggml.eos_token_ids")])
    finally:
        del reader  # its memory map goes with it: nothing above holds a view into the file
    arch = str(meta.get("general.architecture", ""))
    cfg = config_from_meta(meta, tensors, path)
    return GGUFFile(path, arch, str(meta.get("general.name", "")), meta, tensors, vocab, cfg)


def config_from_meta(meta: dict, tensors: dict[str, TensorInfo], where: str) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelError(f"{where}: architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")

    def get(key: str, default=None, required: bool = False):
        v = meta.get(f"{arch}.{key}", default)
        if required and v is None:
            raise ModelError(f"{where}: missing metadata '{arch}.{key}'")
        return v

    if get("expert_count", 0):
        raise ModelError(f"{where}: mixture-of-experts ({arch}.expert_count = {get('expert_count')}) is not supported")
    hidden = int(get("embedding_length", required=True))
    n_heads = int(get("attention.head_count", required=True))
    n_kv = int(get("attention.head_count_kv", n_heads))
    head_dim = int(get("attention.key_length", hidden // n_heads if n_heads else 0))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise ModelError(f"{where}: value_length {get('attention.value_length')} != key_length {head_dim}")
    rot = get("rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise ModelError(f"{where}: partial rotary embedding ({arch}.rope.dimension_count = {rot}, head dim "
                         f"{head_dim}) is not supported")
    ctx = int(get("context_length", 4096))
    window = get("attention.sliding_window")
    if window and int(window) < ctx:
        raise ModelError(f"{where}: sliding-window attention ({arch}.attention.sliding_window = {window}) "
                         "is not supported")
    scaling = None
    kind = get("rope.scaling.type", "none")
    factor = get("rope.scaling.factor", get("rope.scale_linear"))
    if kind == "none" and factor not in (None, 1.0):
        kind = "linear"  # old files: rope.scale_linear alone
    if kind == "linear" and factor not in (None, 1.0):
        scaling = {"rope_type": "linear", "factor": _f32(factor)}
    elif kind not in ("none", "linear"):
        raise ModelError(f"{where}: rope scaling {kind!r} ({arch}.rope.scaling.type) is not supported "
                         "(supported: linear)")
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise ModelError(f"{where}: missing tensor 'token_embd.weight'")
    vocab = int(get("vocab_size", embd.shape[0]))
    if embd.shape[0] != vocab:
        raise ModelError(f"{where}: token_embd.weight has {embd.shape[0]} rows, {arch}.vocab_size is {vocab}")
    try:
        return ModelConfig(
            vocab_size=vocab, hidden_size=hidden, n_layers=int(get("block_count", required=True)),
            n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
            intermediate_size=int(get("feed_forward_length", required=True)),
            rope_theta=_f32(get("rope.freq_base", 10000.0)), rope_scaling=scaling,
            rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
            tie_word_embeddings="output.weight" not in tensors, max_position_embeddings=ctx,
            qkv_bias="blk.0.attn_q.bias" in tensors, qk_norm="blk.0.attn_q_norm.weight" in tensors,
            name=str(meta.get("general.name", "") or arch))
    except ModelError as exc:
        raise ModelError(f"{where}: {exc}") from None


def _f32(v) -> float:
    """A float32 metadata value as the decimal it was written from (1e-06, not 9.99999997e-07): the
    shortest repr that rounds to the same float32, which is what an HF config states."""
    return float(np.format_float_positional(np.float32(v), unique=True, trim="-"))


def unpermute_rows(n_rows: int, n_heads: int) -> np.ndarray:
    """Where each stored row of a llama q/k projection goes. llama.cpp's converter interleaves the two
    rotary halves of every head (its rope pairs neighbours); our rope (HF's) pairs the halves. Row
    h*D + 2*i + j of the file is row h*D + j*D/2 + i of the HF weight."""
    d = n_rows // n_heads
    src_of_dst = np.arange(n_rows).reshape(n_heads, d // 2, 2).swapaxes(1, 2).reshape(-1)
    return np.argsort(src_of_dst)


def load_gguf(path: str | os.PathLike, device: torch.device | str = "cpu",
              dtype: torch.dtype | None = None, checkpoint: GGUFFile | None = None) -> Transformer:
    """The model of a GGUF file, every tensor dequantized into `dtype` (default: bf16 on CUDA, fp32 else)."""
    ck = checkpoint or read_gguf(path)
    cfg = ck.config
    model = empty_model(cfg, device, dtype or default_dtype(device))
    params = dict(model.named_hf_tensors())
    plan: list[tuple[TensorInfo, torch.Tensor]] = []
    unused = []
    for name, info in ck.tensors.items():
        ours = our_name(name)
        if ours is None or ours not in params:
            unused.append(name)
            continue
        p = params.pop(ours)
        if tuple(p.shape) != info.shape:
            raise ModelError(f"{ck.path}: tensor '{name}' has shape {info.shape}, expected {tuple(p.shape)}")
        plan.append((info, p))
    if unused:
        hint = " (rope_freqs: llama3-style rope frequency factors)" if "rope_freqs.weight" in unused else ""
        more = f" (and {len(unused) - 3} more)" if len(unused) > 3 else ""
        raise ModelError(f"{ck.path}: tensor(s) the model does not use: {', '.join(unused[:3])}{more}{hint}")
    if params:
        missing = sorted(params)
        raise ModelError(f"{ck.path}: missing tensor(s) for {', '.join(missing[:3])}"
                         f"{' (and more)' if len(missing) > 3 else ''}")
    with open(ck.path, "rb") as f, torch.no_grad():
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            for info, p in plan:
                rows = None
                if ck.arch == "llama" and info.name.split(".")[2:3] in (["attn_q"], ["attn_k"]):
                    heads = cfg.n_heads if ".attn_q." in info.name else cfg.n_kv_heads
                    rows = torch.from_numpy(unpermute_rows(info.shape[0], heads))
                _fill(mm, info, p, rows, ck.path)
        finally:
            mm.close()
    return model.eval()


def _fill(mm: mmap.mmap, info: TensorInfo, dst: torch.Tensor, rows: torch.Tensor | None, where: str) -> None:
    """Dequantize one tensor from the map into dst, about SLICE_ELEMENTS values at a time; rows: the
    destination row of each stored row (None: the same). Each slice's bytes are copied out of the map
    (a few MB), so no view into the map outlives this call and the map closes cleanly on any error."""
    from gguf import quants

    n_rows = info.shape[0] if len(info.shape) > 1 else 1
    flat = dst.view(n_rows, -1)
    per_row, row_bytes = flat.shape[1], info.n_bytes // n_rows
    row_items = int(np.prod(info.data_shape)) // n_rows  # stored items (bytes, or halves/floats) per row
    if info.offset + info.n_bytes > len(mm):
        raise ModelError(f"{where}: tensor '{info.name}' runs past the end of the file (truncated?)")
    step = max(1, SLICE_ELEMENTS // per_row)
    for r0 in range(0, n_rows, step):
        r1 = min(n_rows, r0 + step)
        raw = np.frombuffer(mm[info.offset + r0 * row_bytes:info.offset + r1 * row_bytes], dtype=info.data_dtype)
        try:
            vals = quants.dequantize(raw.reshape(r1 - r0, row_items), info.qtype)
        except NotImplementedError as exc:
            raise ModelError(f"{where}: tensor '{info.name}': {exc}") from None
        vals = np.ascontiguousarray(vals, dtype=np.float32)
        with warnings.catch_warnings():  # F32 data comes back as a view of the read-only bytes: only read
            warnings.simplefilter("ignore", UserWarning)
            src = torch.from_numpy(vals).view(r1 - r0, per_row)
        if rows is None:
            flat[r0:r1].copy_(src)
        else:
            flat.index_copy_(0, rows[r0:r1], src.to(flat.dtype))
        # drop the pages just read from the process (they stay in the page cache)
        start = info.offset + r0 * row_bytes
        start -= start % mmap.PAGESIZE
        mm.madvise(mmap.MADV_DONTNEED, start, info.offset + r1 * row_bytes - start)
