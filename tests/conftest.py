"""Shared fixtures of the CPU tests."""

from __future__ import annotations

import itertools
import sys
import types

import pytest


@pytest.fixture
def install_driver(monkeypatch):
    """install(module, gpu_name): `module` stands in for cuda.bindings.driver, and CPU torch answers as
    one CUDA device whose current stream is handle 0 (the CUDA stream backend's tests on a CPU)."""
    import torch

    def install(module, gpu_name: str) -> None:
        pkg, sub = types.ModuleType("cuda"), types.ModuleType("cuda.bindings")
        pkg.bindings, sub.driver = sub, module
        monkeypatch.setitem(sys.modules, "cuda", pkg)
        monkeypatch.setitem(sys.modules, "cuda.bindings", sub)
        monkeypatch.setitem(sys.modules, "cuda.bindings.driver", module)
        stream = types.SimpleNamespace(device=torch.device("cpu"), cuda_stream=0)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: stream)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: gpu_name)

    return install


def write_hf_pair(tmp_path, target, drafter) -> list[str]:
    """`target` and `drafter` written as two HF checkpoints (tmp_path/target, tmp_path/drafter) sharing
    one byte-level tokenizer.json: the directories, target first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from draftrelay.checkpoint.hf import save_hf_dir

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    dirs = []
    for name, model in (("target", target), ("drafter", drafter)):
        d = tmp_path / name
        save_hf_dir(model, d)
        tok.save(str(d / "tokenizer.json"))
        dirs.append(str(d))
    return dirs


def exact_law(target, prompt: list[int], vocab: int, n_tokens: int, keep: int):
    """The exact law of the last `keep` of the first `n_tokens` tokens the target samples at temperature 1
    after `prompt` (the joint over all vocab ** n_tokens continuations, summed over the leading
    n_tokens - keep): a float64 array [vocab] * keep, what the sampling tests hold the engine's counts to."""
    import torch

    with torch.inference_mode():
        def probs(seqs):
            c = target.new_cache(len(seqs), max(8, len(seqs[0])))
            lg = target(torch.tensor(seqs), torch.zeros(len(seqs), dtype=torch.long), c, torch.arange(len(seqs)))
            return torch.softmax(lg[:, -1].double(), -1)

        joint = torch.ones((), dtype=torch.float64)
        for j in range(n_tokens):
            seqs = [prompt + list(t) for t in itertools.product(range(vocab), repeat=j)]
            joint = joint[..., None] * probs(seqs).view(*([vocab] * (j + 1)))
        return joint.sum(tuple(range(n_tokens - keep))).numpy()


def run_interpreted(tmp_path, source: str, interpret: bool = True) -> str:
    """Run a check script under Triton's interpreter (TRITON_INTERPRET=1; interpret=False: without it, for
    Triton's compiler) in a child process with this tree's src first on the path, a random seed as its
    argument; its stdout (the assertion carries the tails of both streams when it fails). Skips where
    Triton is not installed (the test extra installs it)."""
    import importlib.util
    import os
    import subprocess

    import torch

    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed (pip install -e .[test] brings it)")
    script = tmp_path / "check.py"
    script.write_text(source)
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
           **({"TRITON_INTERPRET": "1"} if interpret else {}),
           "PYTHONPATH": os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "src"),
                                          os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, str(script), str(int(torch.randint(0, 1 << 30, ())))], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout

