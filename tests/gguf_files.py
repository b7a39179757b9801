"""GGUF files for tests, written with gguf.GGUFWriter the way llama.cpp's converter writes them (its
tensor names, its metadata keys, its q/k row permutation for llama), independently of the loader."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, quants

from draftrelay.model import Transformer

BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
         "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
TOP = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
       "lm_head.weight": "output.weight"}


def gguf_name(name: str) -> str:
    if name in TOP:
        return TOP[name]
    _, i, rest = name.split(".", 2)
    module, leaf = rest.rsplit(".", 1)
    return f"blk.{i}.{BLOCK[module]}.{leaf}"


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's LlamaModel.permute (for rows of q and k)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_vocab() -> dict:
    """The 256 byte-level tokens, no merges: the tiny models' vocabulary as a GGUF gpt2 tokenizer."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    return {"model": "gpt2", "pre": "gpt2", "tokens": alphabet, "types": [1] * len(alphabet), "merges": []}


def write_gguf(model: Transformer, path, arch: str = "llama", qtype: Q = Q.F32, vocab: dict | None = None,
               meta: dict | None = None, extra: dict | None = None, skip: tuple[str, ...] = (),
               quantize=None) -> None:
    """model -> a GGUF file: 2-D weights stored as qtype (norms and biases F32, as llama.cpp keeps them).
    meta: metadata that replaces or adds to the model's (a value None drops a key); extra: extra tensors
    (name -> float32 array); skip: names left out;
    quantize(name, array) -> (data, qtype) overrides the storage of a 2-D weight."""
    cfg = model.cfg
    w = GGUFWriter(str(path), arch)
    w.add_name("test model")
    keys = {"block_count": cfg.n_layers, "context_length": cfg.max_position_embeddings,
            "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
            "attention.head_count": cfg.n_heads, "attention.head_count_kv": cfg.n_kv_heads,
            "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
            "rope.dimension_count": cfg.head_dim, "rope.freq_base": float(cfg.rope_theta),
            "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps)}
    if cfg.rope_scaling:
        keys.update({"rope.scaling.type": cfg.rope_scaling["rope_type"],
                     "rope.scaling.factor": float(cfg.rope_scaling["factor"])})
    values = {f"{arch}.{k}": v for k, v in keys.items()}
    values.update(meta or {})  # meta replaces or adds keys
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    v = vocab or byte_vocab()
    w.add_tokenizer_model(v["model"])
    w.add_tokenizer_pre(v["pre"])
    w.add_token_list(v["tokens"])
    w.add_token_types(v["types"])
    if v["merges"]:
        w.add_token_merges(v["merges"])
    for key in ("bos", "eos", "eot"):
        if v.get(key) is not None:
            getattr(w, f"add_{key}_token_id")(v[key])
    w.add_add_bos_token(bool(v.get("add_bos", False)))
    if v.get("chat_template"):
        w.add_chat_template(v["chat_template"])
    for name, t in model.named_hf_tensors():
        gname = gguf_name(name)
        if gname in skip:
            continue
        a = t.detach().float().cpu().numpy().copy()
        if arch == "llama" and (".attn_q." in gname or ".attn_k." in gname):
            a = llama_permute(a, cfg.n_heads if ".attn_q." in gname else cfg.n_kv_heads)
        if a.ndim == 1:
            w.add_tensor(gname, a.astype(np.float32))
            continue
        if quantize is not None:
            data, qt = quantize(gname, a)
        else:
            data, qt = quants.quantize(a, qtype), qtype
        if qt in (Q.F32, Q.F16):
            w.add_tensor(gname, data)
        else:
            w.add_tensor(gname, data, raw_dtype=qt)
    for name, a in (extra or {}).items():
        w.add_tensor(name, np.asarray(a, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def random_kquant_blocks(rows: int, cols: int, qtype: Q, seed: int) -> np.ndarray:
    """Valid random blocks of a k-quant type (gguf cannot quantize to them): random bits, with the f16
    super-block scales set to small finite values."""
    from gguf.constants import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    scales = rng.uniform(1e-3, 4e-3, (rows, cols // block)).astype(np.float16).view(np.uint8).reshape(
        rows, cols // block, 2)
    if qtype in (Q.Q4_K, Q.Q5_K):  # d, dmin first
        blocks[..., 0:2] = scales
        blocks[..., 2:4] = scales
    elif qtype == Q.Q6_K:  # d last
        blocks[..., size - 2:] = scales
    else:
        raise ValueError(qtype)
    return blocks.reshape(rows, -1)


def reference_weights(path, arch: str, n_heads: int, n_kv: int) -> dict[str, torch.Tensor]:
    """Every tensor of the file by GGUF name, dequantized by gguf.quants.dequantize (llama q/k rows put
    back in HF order), as float32: what a loader must produce."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    out = {}
    for t in r.tensors:
        a = quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
            heads = n_heads if ".attn_q." in t.name else n_kv
            a = a.reshape(heads, a.shape[0] // heads // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        out[t.name] = torch.from_numpy(a.copy())
    return out
