"""What the `demo` and `generate` commands share: loading a target and its tokenizer, starting a
local drafter worker, and the round spec that points the proxy at it."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from draftrelay import model as M
from draftrelay.checkpoint import hf
from draftrelay.checkpoint.tokenizer import HFTokenizer
from draftrelay.wire.protocol import tokenizer_hash_of_dir

from .calibrate import round_settings  # noqa: F401  (the CLIs' one import of what loading shares)


class ByteTokenizer:
    """The tiny models' vocabulary: the 256 byte values (prompts are UTF-8 bytes)."""

    name = M.TINY_TOKENIZER_ID

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def printable(text: str, limit: int = 0) -> str:
    """Text for a terminal: control and other non-printable characters escaped, optionally cut."""
    out = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)
    return out if not limit or len(out) <= limit else out[:limit] + "..."


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine")
    return dev


@dataclass
class Target:
    model: M.Transformer
    tokenizer: ByteTokenizer | HFTokenizer
    stop_ids: tuple[int, ...]
    tokenizer_hash: str  # sent in the worker handshake ('' = not checked)
    name: str


def is_gguf(spec: str) -> bool:
    return spec.lower().endswith(".gguf") and not os.path.isdir(spec)


def load_target(spec: str, device: torch.device) -> Target:
    """'tiny' (the target half of the built-in pair), a local HF directory or a GGUF file. The tokenizer
    keeps the checkpoint's chat template (`target.tokenizer.chat_template`) for a serving front."""
    dtype = hf.default_dtype(device)
    if spec == "tiny":  # fp32 everywhere: tiny, and greedy outputs then match across modes bit for bit
        target, _ = M.tiny_pair(M.TINY_SEED, device=device, dtype=torch.float32)
        return Target(target, ByteTokenizer(), (), M.TINY_TOKENIZER_ID, "tiny-target")
    if is_gguf(spec):
        from draftrelay.checkpoint import gguf

        ck = gguf.read_gguf(spec)
        tok = HFTokenizer.from_gguf_vocab(ck.vocab, ck.name or os.path.basename(spec), spec)
        model = gguf.load_gguf(spec, device=device, dtype=dtype, checkpoint=ck)
        return Target(model, tok, tok.stop_ids, tok.vocab_hash, ck.name or os.path.basename(spec))
    if not os.path.isdir(spec):
        raise M.ModelError(f"--model {spec!r}: not 'tiny', an existing model directory, nor a .gguf file")
    model = hf.load_hf_dir(spec, device=device, dtype=dtype)
    return Target(model, HFTokenizer.from_dir(spec), _eos_ids(spec), tokenizer_hash_of_dir(spec),
                  os.path.basename(os.path.abspath(spec)))


def _eos_ids(path: str) -> tuple[int, ...]:
    ids: list[int] = []
    for fn in ("generation_config.json", "config.json"):
        try:
            with open(os.path.join(path, fn)) as f:
                v = json.load(f).get("eos_token_id")
        except (OSError, json.JSONDecodeError, AttributeError):
            continue
        if isinstance(v, int):
            ids.append(v)
        elif isinstance(v, list):
            ids += [x for x in v if isinstance(x, int)]
        if ids:
            break
    return tuple(ids)


def drafter_model_id(spec: str) -> str:
    """The identity the worker announces for `--model spec` (checked in the handshake)."""
    if spec == "tiny":
        return M.tiny_model_id(M.TINY_SEED)
    return os.path.basename(os.path.abspath(spec)) if os.path.isdir(spec) or is_gguf(spec) else ""


def drafter_config(spec: str) -> M.ModelConfig | None:
    """The shape of the drafter `spec` names, read without its weights ('tiny', a GGUF file's metadata, a
    model directory's config.json); None for the test and replay drafters or a spec that cannot be read
    (the worker then says why when it loads it)."""
    try:
        if spec == "tiny":
            return M.tiny_pair(M.TINY_SEED)[1].cfg
        if is_gguf(spec):
            from draftrelay.checkpoint.gguf import read_gguf

            return read_gguf(spec).config
        if os.path.isdir(spec):
            from draftrelay.checkpoint.hf import read_config

            return read_config(spec)
    except (M.ModelError, OSError, ValueError):
        return None
    return None


def default_threads() -> int:
    """The CPU threads this process may use (its affinity mask, not the machine's core count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def start_local_worker(drafter: str, device: torch.device, n_draft: int, max_ctx: int, rows: int,
                       threads: int = 0, dtype: str = "", warm_batch: int = 0, warm_max_kv: int = 0,
                       quant: str = "none", draft_vocab: str = "", cpus: str = "", warm_depths: bool = False,
                       warm_min_kv: int = 0, head_int8: bool = False):
    """A `draftrelay worker` child process on a free loopback port.

    threads (CPU): the worker's torch threads; 0 = every core this process may use. The target and
    a local drafter take turns (the target waits while a round is out and the drafter idles during the
    verify), so each may use all the cores; 'tiny' stays single-threaded, where it runs fastest.
    dtype: the drafter's compute dtype ("": the worker's default; float32 for 'tiny').
    warm_batch (GPU): capture the drafter's draft-step graphs for n_draft drafts and up to warm_batch
    requests at every KV bucket before the worker listens (a server's first round at a new batch
    size or context would otherwise wait for a capture, past its deadline); warm_max_kv > 0: only for
    contexts up to that many tokens (fewer graphs, a shorter start; longer contexts capture on first
    use). warm_depths: the graphs for every depth 1..n_draft, not n_draft alone (the depth policy asks any:
    a worker holding only a deeper step runs that one for a shallower round and returns the first drafts,
    so every depth would cost, and be measured at, the deepest round's forwards). warm_min_kv > 0: none for
    contexts shorter than that (one request whose prompt is that long). quant: the worker's
    --quant (int8 / int4: a CPU drafter's products on int8 / int4 weights, worker/quant.py; int8 on a GPU: the
    fast path's int8 tiles, int8_layers.py). draft_vocab:
    the worker's --draft-vocab (its head restricted, draft_vocab.py). head_int8: the worker's --head-int8 (a GPU
    drafter's greedy picks read its head as int8, int8_head.py).
    cpus (CPU): the worker's --cpus, its own cores (cpus.py); its threads default to one a CPU there."""
    from draftrelay.worker.process import start_worker_process

    args = ["--model", drafter, "--device", str(device), "--n-out-max", str(max(8, n_draft)),
            *(["--dtype", dtype or "float32"] if drafter == "tiny" or dtype else []),
            "--max-ctx", str(max_ctx), "--rows", str(max(16, rows)), "--max-requests", str(max(16, rows)),
            *(["--quant", quant] if quant != "none" else []),
            *(["--draft-vocab", draft_vocab] if draft_vocab else []),
            *(["--head-int8"] if head_int8 else [])]
    if warm_batch > 0 and device.type == "cuda" and n_draft > 0:
        steps = range(1, n_draft + 1) if warm_depths else [n_draft]
        args += ["--warm-graphs", ",".join(map(str, steps)), "--warm-batch", str(warm_batch)]
        if warm_max_kv > 0:
            args += ["--warm-max-kv", str(warm_max_kv)]
        if warm_min_kv > 0:
            args += ["--warm-min-kv", str(warm_min_kv)]
    env = None
    if device.type == "cpu":
        from draftrelay import cpus as C

        n = threads or (1 if drafter == "tiny" else len(C.parse(cpus)) if cpus else default_threads())
        args += ["--threads", str(n), *(["--cpus", cpus] if cpus else [])]
        env = {"OMP_NUM_THREADS": str(n), **{k: v for k, v in CPU_WORKER_OMP_ENV.items() if k not in os.environ}}
    return start_worker_process(args, env=env)


# A local CPU worker's OpenMP threads: GNU OpenMP lets an idle thread spin 300,000 pauses before it sleeps
# (measured here: 3-10 ms of CPU after each burst of work), so every round ended with the worker spinning
# on a core the target's verify needs. 10,000 spins (about 0.5 ms) still bridge the microsecond gaps
# between one forward's operations. A setting in the environment wins; a remote worker is started without this.
CPU_WORKER_OMP_ENV = {"GOMP_SPINCOUNT": "10000"}


def worker_spec(host: str, port: int, model_id: str, tokenizer_hash: str, n_draft: int, max_requests: int) -> dict:
    return {"kind": "worker", "host": host, "port": int(port), "model_id": model_id,
            "tokenizer_hash": tokenizer_hash, "n_out_max": max(1, n_draft), "max_requests": max_requests}


# Waits of the proxy and the emulated stream: (spin, nap) in µs. On a GPU host the proxy spins up to
# 20 ms after each round (at most one core, and only while rounds keep coming: then it naps), so it
# sees the next round's announcement within a load instead of a nap's wake-up; on a small CPU-only
# machine every polling thread competes with the target's own compute, so the hand-off naps longer.
SPIN_NAP_US = {"cuda": (20_000, 20), "cpu": (0, 200)}
CPU_WAIT_SLICE_US, CPU_SUPERVISE_MS, CPU_HEARTBEAT_MS = 20_000, 50.0, 100.0


def handoff_config(spec: dict, device: torch.device, deadline_ms: float, worker_shares_gpu: bool,
                   host_rounds: bool = False, **fields):
    """The hand-off for rounds to the worker `spec`: the CUDA stream on a GPU, the emulated one on a
    CPU. A worker on the engine's own GPU gets memop parking (HandoffConfig.cuda_wait says why).

    host_rounds (GPU): the emulated stream even on a GPU, so drafts reach the engine on the host and the
    speculation cache selects its branches there ("host selection", engine/spec_cache.py). The engine
    reads each step's acceptance on the host anyway; what it adds is one host-to-device copy of the
    drafts per verify (a few hundred bytes) instead of the verify reading them from the reply buffer.

    A worker on the engine's GPU is named (HandoffConfig.worker_shares_gpu): the speculation cache
    declines there by default (SpecCache.bind says why)."""
    from draftrelay.handoff.rounds import HandoffConfig

    gpu = device.type == "cuda"
    spin, nap = SPIN_NAP_US["cuda" if gpu else "cpu"]
    if not gpu:  # the watchdog wakes every 1 % of its deadline (1 ms at least): a CPU is shared
        fields.setdefault("watchdog_poll_us", max(1000, int(deadline_ms * 10)))
        # every periodic wake-up in the engine and the proxy lands on the target's cores: the sleeping
        # waits re-check their word every 20 ms (the writers wake them at once anyway), the supervisor
        # judges the proxy every 50 ms and the heartbeat beats every 100 ms, all well inside the loss
        # limit (>= 400 ms); the defaults (2 / 10 / 20 ms) cost the demo's verify ~10 % (demo_round.py)
        fields.setdefault("wait_slice_us", CPU_WAIT_SLICE_US)
        fields.setdefault("supervise_ms", CPU_SUPERVISE_MS)
        fields.setdefault("heartbeat_ms", CPU_HEARTBEAT_MS)
        # the stream's wait on `released` (run by the engine thread itself: EmulatedStream.inline) sleeps
        # at once too, as the proxy's does: a spin there holds a core while the proxy and the worker run
        fields.setdefault("stream_spin_us", spin)
    if gpu and host_rounds:  # a GPU host has cores to spare: the emulated stream polls (spin, then nap)
        fields.setdefault("wait", "poll")
    return HandoffConfig(round_spec=spec, deadline_ms=deadline_ms, spin_us=spin, nap_us=nap,
                         backend="cuda" if gpu and not host_rounds else "emulated",
                         cuda_wait="memop" if worker_shares_gpu and gpu and not host_rounds else "",
                         worker_shares_gpu=bool(gpu and worker_shares_gpu), **fields)


def check_worker(spec: dict, timeout_s: float = 5.0) -> str:
    """Handshake once with the worker the spec names; '' if it accepts us, else why not."""
    from draftrelay.wire.client import WireError
    from draftrelay.wire.roundfn import client_from_spec

    client = client_from_spec(spec)
    try:
        info = client.connect(timeout=timeout_s)
        return "" if info else "no handshake"
    except WireError as exc:
        return f"worker {spec['host']}:{spec['port']}: {exc}"
    finally:
        client.close()


def parse_hostport(s: str) -> tuple[str, int]:
    host, sep, port = s.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--worker {s!r}: expected HOST:PORT")
    return host or "127.0.0.1", int(port)
