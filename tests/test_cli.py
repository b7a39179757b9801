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
