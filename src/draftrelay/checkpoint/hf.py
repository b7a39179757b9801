"""Hugging Face checkpoint directories: config.json -> ModelConfig, safetensors <-> Transformer.

Nothing is fetched from a hub. Loading is tensor by tensor: each tensor is read from its file's memory
map into the already allocated parameter, and the map is dropped right after, so the pages read do not
accumulate in the process (peak memory stays near the model's own size, not twice it).
"""

from __future__ import annotations

import json
import os

import torch

from draftrelay import hugepages
from draftrelay.model import ModelConfig, ModelError, Transformer

# The HF model types the decoder runs: plain Llama, Qwen2 (q/k/v bias), Qwen3 (q/k norms), Mistral
# (without its window).
MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")


def config_from_dict(cfg: dict, where: str = "config.json") -> ModelConfig:
    """An HF config.json's fields -> ModelConfig; refuses (by name) what the decoder would run wrong."""

    def need(key: str, typ: type = int):
        if key not in cfg:
            raise ModelError(f"{where}: missing field '{key}'")
        val = cfg[key]
        ok = isinstance(val, (int, float)) and not isinstance(val, bool) if typ is float else (
            isinstance(val, typ) and not isinstance(val, bool))
        if not ok:
            raise ModelError(f"{where}: field '{key}' must be {typ.__name__}, got {val!r}")
        return typ(val)

    mtype = cfg.get("model_type")
    if mtype not in MODEL_TYPES:
        raise ModelError(f"{where}: model_type {mtype!r} is not supported (supported: {', '.join(MODEL_TYPES)})")
    archs = cfg.get("architectures") or []
    unknown = [a for a in archs if a not in ARCHITECTURES]
    if not isinstance(archs, list) or unknown:
        raise ModelError(f"{where}: architecture(s) {unknown or archs!r} not supported "
                         f"(supported: {', '.join(ARCHITECTURES)})")
    _refuse_sliding_window(cfg, mtype, where)
    hidden = need("hidden_size")
    n_heads = need("num_attention_heads")
    n_kv = cfg.get("num_key_value_heads") or n_heads
    head_dim = cfg.get("head_dim") or (hidden // n_heads if n_heads else 0)
    if cfg.get("mlp_bias"):
        raise ModelError(f"{where}: 'mlp_bias: true' is not supported")
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ModelError(f"{where}: hidden_act {cfg.get('hidden_act')!r} is not supported (SwiGLU/silu only)")
    if cfg.get("attention_bias") and mtype != "qwen2":  # Qwen2's q/k/v biases are implied by its type
        raise ModelError(f"{where}: 'attention_bias: true' (bias on o_proj) is not supported")
    scaling = cfg.get("rope_scaling")
    rope_theta = cfg.get("rope_theta", 10000.0)
    params = cfg.get("rope_parameters")  # transformers >= 5 keeps theta and scaling together here
    if isinstance(params, dict):
        rope_theta = params.get("rope_theta", rope_theta)
        scaling = params
    if isinstance(scaling, dict):
        scaling = dict(scaling)
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind in (None, "default"):
            scaling = None
        else:
            scaling["rope_type"] = kind
    try:
        return ModelConfig(
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            n_layers=need("num_hidden_layers"),
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            intermediate_size=need("intermediate_size"),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            qkv_bias=mtype == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=mtype == "qwen3",
            name=str(cfg.get("_name_or_path", "") or mtype),
        )
    except ModelError as exc:
        raise ModelError(f"{where}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise ModelError(f"{where}: invalid value: {exc}") from None


def _refuse_sliding_window(cfg: dict, mtype: str, where: str) -> None:
    """Sliding-window attention is not implemented: a config that turns it on is refused. Qwen2/3 configs
    carry a window size with `use_sliding_window: false` (off); Mistral's is on whenever it is set."""
    window = cfg.get("sliding_window")
    if mtype in ("qwen2", "qwen3"):
        on = bool(cfg.get("use_sliding_window", False)) and window is not None
    else:
        on = window is not None
    if on:
        raise ModelError(f"{where}: sliding-window attention (sliding_window={window!r}) is not supported")
    if cfg.get("layer_types") and any(t != "full_attention" for t in cfg["layer_types"]):
        raise ModelError(f"{where}: layer_types other than 'full_attention' (sliding-window layers) "
                         "are not supported")


def read_config(path: str | os.PathLike) -> ModelConfig:
    """config.json of the model directory `path`."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ModelError(f"model directory not found: {path}")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelError(f"{path}: no config.json")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelError(f"{cfg_path}: cannot parse: {exc}") from None
    if not isinstance(cfg, dict):
        raise ModelError(f"{cfg_path}: expected a JSON object")
    out = config_from_dict(cfg, where=cfg_path)
    out.name = out.name or os.path.basename(os.path.abspath(path))
    return out


def config_to_dict(cfg: ModelConfig) -> dict:
    """ModelConfig -> the fields of an HF config.json (model_type qwen2 when q/k/v carry biases)."""
    return {
        "model_type": "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size, "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling, "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings, "hidden_act": "silu",
    }


def hf_name(name: str) -> str:
    """Our parameter name (HF's module name without 'model.') -> its key in an HF checkpoint."""
    return name if name.startswith("lm_head.") else "model." + name


def hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's weights under their HF checkpoint keys (for writing a checkpoint)."""
    return {hf_name(n): t.detach() for n, t in model.named_hf_tensors()}


def empty_model(cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype) -> Transformer:
    """A Transformer with uninitialised parameters allocated once, directly in `dtype` on `device`; on a
    CPU in one arena of huge pages, advised before the loader writes them (draftrelay/hugepages.py)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    if torch.device(device).type == "cpu" and hugepages.materialize(model, dtype):
        return model
    return model.to(dtype).to_empty(device=device)


def default_dtype(device: torch.device | str) -> torch.dtype:
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


# Checkpoint tensors that carry nothing the model lacks: RoPE frequencies it computes itself.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def load_hf_dir(path: str | os.PathLike, device: torch.device | str = "cpu",
                dtype: torch.dtype | None = None) -> Transformer:
    """config.json + safetensors (single file or sharded with model.safetensors.index.json). Every
    checkpoint tensor must be consumed: one the model has no place for is refused by name."""
    from safetensors import safe_open

    path = os.fspath(path)
    cfg = read_config(path)
    files = _weight_files(path)
    model = empty_model(cfg, device, dtype or default_dtype(device))
    wanted = {hf_name(n): p for n, p in model.named_hf_tensors()}
    loaded: set[str] = set()
    tied_head: str | None = None  # a tied model's checkpoint may hold a copy of the embedding as lm_head
    for fname in files:
        try:
            with safe_open(fname, framework="pt", device="cpu") as f:
                keys = list(f.keys())
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise ModelError(f"{fname}: cannot read safetensors: {exc}") from None
        unused = [k for k in keys if k not in wanted and not k.endswith(IGNORED_SUFFIXES)]
        if cfg.tie_word_embeddings and "lm_head.weight" in unused:
            unused.remove("lm_head.weight")
            tied_head = fname
        if unused:
            more = f" (and {len(unused) - 3} more)" if len(unused) > 3 else ""
            raise ModelError(f"{fname}: tensor(s) the model does not use: {', '.join(unused[:3])}{more}")
        for key in keys:
            if key in wanted:
                _copy_tensor(fname, key, wanted[key])
                loaded.add(key)
    missing = sorted(set(wanted) - loaded)
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ModelError(f"{path}: missing tensor(s) {', '.join(missing[:3])}{more}")
    if tied_head is not None:
        _check_tied_head(tied_head, model)
    return model.eval()


def _copy_tensor(fname: str, key: str, dst: torch.Tensor) -> None:
    """One tensor from the file into `dst`. The file is opened (mapped) for this tensor alone: closing
    it unmaps the pages just read, which would otherwise stay resident until the end of the load."""
    from safetensors import safe_open

    try:
        with safe_open(fname, framework="pt", device="cpu") as f:
            t = f.get_tensor(key)
    except Exception as exc:
        raise ModelError(f"{fname}: cannot read tensor '{key}': {exc}") from None
    if tuple(t.shape) != tuple(dst.shape):
        raise ModelError(f"{fname}: tensor '{key}' has shape {tuple(t.shape)}, "
                         f"expected {tuple(dst.shape)} from config.json")
    with torch.no_grad():
        dst.copy_(t)


def _check_tied_head(fname: str, model: Transformer) -> None:
    """A tied model uses the embedding as its head; a different lm_head in the checkpoint would be lost."""
    emb = model.embed_tokens.weight
    head = torch.empty_like(emb)
    _copy_tensor(fname, "lm_head.weight", head)
    if not torch.equal(head, emb):
        raise ModelError(f"{fname}: tensor 'lm_head.weight' differs from the embedding of a model with "
                         "tie_word_embeddings: true (the head would be lost)")


def _weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelError(f"{index}: cannot parse the shard index: {exc}") from None
        files = sorted({os.path.join(path, v) for v in weight_map.values()})
        for fn in files:
            if not os.path.isfile(fn):
                raise ModelError(f"{index}: shard {os.path.basename(fn)} is missing")
        return files
    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ModelError(f"{path}: no *.safetensors weight files")
    return files


def save_hf_dir(model: Transformer, path: str | os.PathLike, shards: int = 1) -> None:
    """Write config.json + safetensors in HF layout (tests, and random-weight checkpoints for benches)."""
    from safetensors.torch import save_file

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_dict(model.cfg), f, indent=1)
    sd = {k: v.detach().to("cpu").contiguous() for k, v in hf_state_dict(model).items()}
    names = sorted(sd)
    if shards <= 1:
        save_file(sd, os.path.join(path, "model.safetensors"))
        return
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fn = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: sd[k] for k in part}, os.path.join(path, fn))
        weight_map.update({k: fn for k in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
