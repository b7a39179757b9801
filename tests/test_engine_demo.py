"""`draftrelay demo` and `draftrelay generate` as a user runs them (CPU only)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import write_hf_pair
from draftrelay import cli


def test_demo_runs_end_to_end_and_prints_the_table(tmp_path):
    """The random tiny pair (the shipped demo pair has its own test, tests/test_demo_pair.py)."""
    out_json = tmp_path / "demo.json"
    proc = subprocess.run([sys.executable, "-m", "draftrelay.cli", "demo", "--model", "tiny", "--max-tokens", "48",
                           "--device", "cpu", "--json", str(out_json)], capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "identical in off, sync, async: yes" in out
    header = next(line for line in out.splitlines() if line.startswith("mode"))
    for col in ("tok/s", "step p50 ms", "TTFT ms", "accepted", "rounds ok/fail/wd/t-o"):
        assert col in header
    assert sum(line.split()[0] in ("off", "sync", "async") for line in out.splitlines() if line.strip()) >= 3
    res = json.loads(out_json.read_text())["modes"]
    for mode in ("sync", "async"):
        t = res[mode]["total"]
        assert t["round_mode"] == mode, t["refusal"]
        assert t["rounds"]["ok"] > 0 and t["mean_accepted"] > 0.5
    assert res["off"]["total"]["output_tokens"] == res["async"]["total"]["output_tokens"] == 3 * 48


def test_demo_bad_arguments(capsys):
    assert cli.main(["demo", "--modes", "off,turbo"]) == 2
    assert "--modes" in capsys.readouterr().err
    assert cli.main(["demo", "--model", "/no/such/dir"]) == 2
    assert "/no/such/dir" in capsys.readouterr().err
    assert cli.main(["demo", "--worker", "localhost"]) == 2
    assert "HOST:PORT" in capsys.readouterr().err
    assert cli.main(["demo", "--threads", "-1"]) == 2
    assert "--threads -1" in capsys.readouterr().err


def test_the_fastest_mode_is_named_against_off():
    from draftrelay.engine.cli_demo import best_mode

    def res(**tps):
        return {m: {"total": {"tokens_per_s": v}} for m, v in tps.items()}

    assert best_mode(res(off=100.0, sync=150.0, async_=120.0)) == ("sync", 1.5)
    assert best_mode(res(off=100.0, sync=90.0, cache=130.0)) == ("cache", 1.3)
    assert best_mode(res(sync=150.0, async_=120.0)) is None and best_mode(res(off=1.0)) is None


def test_generate_off_mode(capsys, tmp_path):
    js = tmp_path / "m.json"
    assert cli.main(["generate", "hello", "--mode", "off", "--max-tokens", "12", "--device", "cpu",
                     "--json", str(js)]) == 0
    cap = capsys.readouterr()
    assert cap.out.startswith("hello")
    assert "[off] 12 tokens" in cap.err
    m = json.loads(js.read_text())
    assert m["requests"][0]["output_tokens"] == 12 and m["total"]["ttft_s_mean"] > 0


def test_generate_bad_arguments(capsys):
    assert cli.main(["generate", "x", "--max-tokens", "0"]) == 2
    assert "--max-tokens" in capsys.readouterr().err
    assert cli.main(["generate", "x", "--slot-ring"]) == 2
    assert "--graphs" in capsys.readouterr().err
    assert cli.main(["generate", "x", "--graphs", "--device", "cpu"]) == 2
    assert "CUDA" in capsys.readouterr().err


def _hf_dirs(tmp_path):
    """The tiny pair written as two HF checkpoints sharing a byte-level tokenizer.json."""
    from draftrelay.model import tiny_pair

    return write_hf_pair(tmp_path, *tiny_pair())


def test_generate_with_hf_checkpoints_and_a_local_worker(tmp_path, capsys):
    tdir, ddir = _hf_dirs(tmp_path)
    js = tmp_path / "m.json"
    assert cli.main(["generate", "Hello", "--model", tdir, "--drafter", ddir, "--mode", "sync", "--max-tokens", "16",
                     "--device", "cpu", "--json", str(js)]) == 0
    cap = capsys.readouterr()
    assert cap.out.startswith("Hello") and "[sync] 16 tokens" in cap.err
    m = json.loads(js.read_text())["total"]
    assert m["rounds"]["ok"] > 0 and m["mean_accepted"] > 0.5  # the worker loaded the drafter checkpoint
    # a drafter whose tokenizer differs is refused at the handshake, with the reason
    (tmp_path / "drafter" / "tokenizer.json").write_text((tmp_path / "drafter" / "tokenizer.json").read_text()
                                                         .replace('"ByteLevel"', '"ByteLevel" ', 1))
    assert cli.main(["generate", "Hello", "--model", tdir, "--drafter", ddir, "--mode", "sync", "--max-tokens", "4",
                     "--device", "cpu"]) == 1
    assert "IDENTITY_MISMATCH" in capsys.readouterr().err
