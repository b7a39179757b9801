"""Bad input to `draftrelay generate` / `demo` gets its own clear message, and a worker that cannot help
degrades to target-only decoding (or fails at start when it can never help: another vocabulary)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from conftest import write_hf_pair
from draftrelay import cli


def test_each_bad_flag_is_named_in_its_own_message(capsys):
    assert cli.main(["generate", "x", "--max-tokens", "0", "--k", "99", "--temperature", "nan", "--top-k", "-1",
                     "--deadline-ms", "-5"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 5
    for flag, line in zip(("--max-tokens 0", "--k 99", "--temperature nan", "--top-k -1", "--deadline-ms -5"),
                          lines, strict=True):
        assert line.startswith(f"draftrelay generate: {flag}"), line
    for value in ("0", "-1", "nan", "inf"):
        assert cli.main(["generate", "x", "--deadline-ms", value]) == 2
        assert "--deadline-ms" in capsys.readouterr().err
    assert cli.main(["generate", "x", "--temperature", "inf"]) == 2
    assert "finite" in capsys.readouterr().err
    assert cli.main(["demo", "--temperature", "nan", "--deadline-ms", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "--temperature nan" in err[0] and "--deadline-ms 0" in err[1]


def test_sampling_params_refuse_non_finite_values():
    from draftrelay.engine.engine import SamplingParams

    for bad in (dict(temperature=math.nan), dict(temperature=math.inf), dict(temperature=-1.0),
                dict(max_tokens=0), dict(top_k=-2)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    p = SamplingParams()
    p.temperature = math.nan  # changed after construction: the engine validates again
    with pytest.raises(ValueError, match="temperature"):
        p.validate()


def test_non_utf8_stdin_is_a_clear_error():
    p = subprocess.run([sys.executable, "-m", "draftrelay.cli", "generate", "-", "--mode", "off"],
                       input=b"ok \xff\xfe bytes", capture_output=True, timeout=120)
    err = p.stderr.decode()
    assert p.returncode == 2 and "stdin is not UTF-8" in err and "offset 3" in err and "Traceback" not in err


def test_prompt_plus_max_tokens_beyond_the_context_is_refused_with_the_numbers(capsys):
    assert cli.main(["generate", "abc", "--mode", "off", "--device", "cpu", "--max-tokens", "1000000000"]) == 2
    err = capsys.readouterr().err
    assert "3 tokens" in err and "1000000000" in err and "context of 4096" in err and "at most --max-tokens 4093" in err
    long = "y" * 5000  # the tiny target's byte tokenizer: 5,000 tokens > 4,096 positions
    assert cli.main(["generate", long, "--mode", "off", "--device", "cpu", "--max-tokens", "1"]) == 2
    assert "5000 tokens" in capsys.readouterr().err
    from draftrelay.engine.engine import Engine, EngineConfig, SamplingParams
    from draftrelay.model import tiny_pair

    target, _ = tiny_pair()
    with Engine(target, EngineConfig(max_len=8192)) as eng, pytest.raises(ValueError, match="context of 4096"):
        eng.add_request([1] * 4000, SamplingParams(max_tokens=200))


def test_long_prompt_shows_prefill_progress(capsys):
    assert cli.main(["generate", "z" * 2100, "--mode", "off", "--device", "cpu", "--max-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "prefilling the prompt: 2100 tokens" in err and "prefill done: 2100 tokens in" in err


def _hf_pair(tmp_path, drafter_vocab: int):
    """A tiny target and a drafter of `drafter_vocab` tokens, both with the same tokenizer.json."""
    from draftrelay.model import ModelConfig, Transformer, tiny_pair

    target, _ = tiny_pair()
    drafter = Transformer.random(ModelConfig(vocab_size=drafter_vocab, hidden_size=32, n_layers=1, n_heads=2,
                                             n_kv_heads=1, head_dim=16, intermediate_size=64))
    return write_hf_pair(tmp_path, target, drafter)


def test_drafter_of_another_vocabulary_is_refused_at_start_naming_both_sizes(tmp_path, capsys):
    tdir, ddir = _hf_pair(tmp_path, 512)
    assert cli.main(["generate", "Hello", "--model", tdir, "--drafter", ddir, "--mode", "sync",
                     "--max-tokens", "4", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "vocab_size" in err and "256" in err and "512" in err and "IDENTITY_MISMATCH" in err


def test_full_worker_means_target_only_with_a_warning_and_strict_keeps_the_error(capsys):
    from draftrelay.wire import DrafterClient
    from draftrelay.worker.process import start_worker_process

    with start_worker_process(["--model", "tiny", "--device", "cpu", "--rows", "1", "--max-requests", "1"],
                              timeout=120) as w:
        hog = DrafterClient(w.host, w.port, max_requests=1, timeout=5.0)
        hog.connect()  # takes the only row
        try:
            args = ["generate", "Hi", "--worker", f"{w.host}:{w.port}", "--mode", "sync", "--max-tokens", "6",
                    "--device", "cpu"]
            assert cli.main(args) == 0
            cap = capsys.readouterr()
            assert "warning" in cap.err and "OVER_CAPACITY" in cap.err and "target-only" in cap.err
            assert "[off] 6 tokens" in cap.err and cap.out.startswith("Hi")
            assert cli.main([*args, "--strict"]) == 1
            assert "OVER_CAPACITY" in capsys.readouterr().err
        finally:
            hog.close()
