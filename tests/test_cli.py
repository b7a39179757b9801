"""The `draftrelay` command: every subcommand has a --help that explains it; bad use exits 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from draftrelay.cli import COMMANDS


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "draftrelay", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_subcommand_has_help(name):
    p = run(name, "--help")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("usage: draftrelay " + name) and "options:" in p.stdout


def test_top_level_help_lists_every_subcommand():
    p = run("--help")
    assert p.returncode == 0 and all(name in p.stdout for name in COMMANDS)


def test_bad_use_is_a_clear_error():
    p = run("drill", "explode")
    assert p.returncode == 2 and "invalid choice: 'explode'" in p.stderr
    p = run("nonsense")
    assert p.returncode == 2 and "invalid choice" in p.stderr
    p = run()
    assert p.returncode == 2 and "usage: draftrelay" in p.stdout


@pytest.mark.parametrize("var,value,argv", [
    ("DRAFTRELAY_CPU_LINEAR", "openblas", ["-m", "draftrelay", "generate", "hi", "--model", "tiny"]),
    ("DRAFTRELAY_SKINNY", "fast", ["-m", "draftrelay", "worker", "--model", "tiny", "--port", "0"]),
    ("DRAFTRELAY_SKINNY", "fast", ["-m", "draftrelay.worker", "--model", "tiny", "--port", "0"]),
])
def test_a_bad_setting_is_one_line_and_exit_2(var, value, argv):
    """A DRAFTRELAY_* setting read at import with a value it does not take: the command names the
    variable and the value in one line and exits 2, no traceback (draftrelay.SettingError)."""
    import os

    env = {**os.environ, var: value}
    p = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    assert f"{var}={value!r}" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
