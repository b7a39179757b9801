"""benchmarks/real_pair.py's mode grammar: the @QUANT and +vocabN suffixes of a drafting mode, their errors,
and the worker started with --draft-vocab N (no model loaded, no worker started)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import real_pair as RP  # noqa: E402


@pytest.mark.parametrize("mode, want", [
    ("sync:auto", ("sync:auto", "none", 0)),
    ("sync:auto@int4", ("sync:auto", "int4", 0)),
    ("sync:auto+vocab32768", ("sync:auto", "none", 32768)),
    ("cache:auto4/8+vocab32768@int4", ("cache:auto4/8", "int4", 32768)),
    ("async:3/0.4@int8+vocab100", ("async:3/0.4", "int8", 100)),
    ("cache-raw:4/8/rows+vocab1", ("cache-raw:4/8/rows", "none", 1)),
])
def test_mode_suffixes(mode, want):
    assert RP.parse_modes(mode) == [mode]
    assert RP.mode_worker(mode, "none") == want


@pytest.mark.parametrize("mode, says", [
    ("sync:auto+vocab0", "got N = '0'"),
    ("sync:auto+vocab", "got N = ''"),
    ("sync:auto+vocabx", "got N = 'x'"),
    ("off+vocab32768", "not 'off'"),
    ("hf+vocab3", "not 'hf'"),
    ("sync:auto+vocab1+vocab2", "a second +vocabN ('+vocab2')"),
    ("sync:auto@int4@int8", "a second @QUANT ('@int8')"),
    ("+vocab5", "no mode before its suffix"),
    ("cache:auto4/8+vocab32768@bad", "@QUANT (none, int8, int4)"),
])
def test_bad_suffix_is_an_argparse_error_naming_the_value(mode, says, capsys):
    with pytest.raises(SystemExit) as exc:
        RP.main(["--modes", f"off,{mode}"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"--modes: {mode!r}" in err and says in err


def test_start_worker_appends_draft_vocab(monkeypatch):
    from draftrelay.worker import process

    seen = []

    def fake(args, **kw):
        seen.append(args)
        return "w"

    monkeypatch.setattr(process, "start_worker_process", fake)
    assert RP.start_worker("drafter.gguf", 6, 200, 2, "float32", "int4", 32768) == "w"
    assert RP.start_worker("drafter.gguf", 6, 200, 2, "float32", "none", 0) == "w"
    with_vocab, plain = seen
    assert with_vocab[with_vocab.index("--draft-vocab") + 1] == "32768"
    assert with_vocab[with_vocab.index("--quant") + 1] == "int4"
    assert "--draft-vocab" not in plain and "--quant" not in plain


@pytest.mark.parametrize("arg, want", [
    ("auto4/4", (4, 4, "all", True, [])),
    ("4/8/rows", (4, 8, "rows", False, [])),
    ("auto4/4/d2", (4, 4, "all", True, [2])),
    ("auto6/4/early/d2.4", (6, 4, "early", True, [2, 4])),
])
def test_cache_guard_depths_suffix(arg, want):
    assert RP._cache_arg_depths(arg) == want and RP._cache_arg(arg) == want[:4]
    assert RP.parse_modes(f"cache:{arg}@int4") == [f"cache:{arg}@int4"]


@pytest.mark.parametrize("mode", ["cache:4/4/d4", "cache:4/4/d0", "cache:4/4/dx", "cache:4/4/d2.2",
                                  "cache-raw:4/4/d2", "off:nope"])
def test_bad_cache_depths_and_off_variants_are_refused(mode, capsys):
    with pytest.raises(SystemExit) as exc:
        RP.main(["--modes", f"off,{mode}"])
    assert exc.value.code == 2 and f"--modes: {mode!r}" in capsys.readouterr().err


def test_placement_flags_name_a_bad_cpu_list(capsys):
    with pytest.raises(SystemExit) as exc:
        RP.main(["--modes", "off,off:whole", "--engine-cpus", "0-"])
    assert exc.value.code == 2 and "--engine-cpus: CPU list '0-'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        RP.main(["--modes", "off", "--worker-cpus", "4096"])
    assert exc.value.code == 2 and "--worker-cpus: CPU list '4096': CPU 4096 is not on" in capsys.readouterr().err
