"""The `draftrelay` command.

Each subcommand lives with the part it drives, in a small `*_cli` / `cli` module exposing
`add_arguments(parser)` and `run(args) -> int`. Those modules import torch (or anything heavy)
inside `run` only, so `draftrelay --help` and the proxy-side commands stay light.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading

from draftrelay import SettingError

# name -> (module, one-line help). The module provides add_arguments(parser) and run(args).
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("draftrelay.engine.cli_demo", "run the built-in demo: local worker + proxy, off/sync/async side by side"),
    "generate": ("draftrelay.engine.cli_generate", "generate text for one prompt with chosen models and mode"),
    "serve": ("draftrelay.serve.cli", "serve the target over an OpenAI-compatible HTTP API (continuous batching)"),
    "worker": ("draftrelay.worker.cli", "serve a remote drafter over TCP"),
    "selftest": ("draftrelay.handoff.cli", "run the hand-off self-test (emulated stream, or CUDA with --backend cuda)"),
    "drill": ("draftrelay.handoff.drills", "run fault drills (kill, stop, idle, slow, soak, freeze) on live rounds"),
    "stats": ("draftrelay.handoff.metrics", "print hand-off and recovery counters as Prometheus text"),
}


def _load(name: str):
    module, _ = COMMANDS[name]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("draftrelay"):
            return None  # subcommand not built yet in this checkout
        raise


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="draftrelay",
        description="Remote speculative drafting: the target decodes here, its drafter runs elsewhere.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (_, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        # Only the chosen subcommand's module is imported: `draftrelay --help` stays instant.
        if name == wanted:
            mod = _load(name)
            if mod is not None:
                mod.add_arguments(p)
    return parser


class Terminated(BaseException):
    """SIGTERM, raised in the main thread: it unwinds like Ctrl-C (no `except Exception` swallows it), so every
    `finally` and `with` on the way stops the child processes it started (worker, proxy) before the command
    exits 143."""


def _on_sigterm(signum, frame) -> None:
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser(argv)  # imports the chosen command's module, which may read a setting
    except SettingError as exc:
        print(f"draftrelay: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    mod = _load(args.command)
    if mod is None:
        print(f"draftrelay: '{args.command}' is not available in this build", file=sys.stderr)
        return 2
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if in_main else None
    try:
        return int(mod.run(args) or 0)
    except SettingError as exc:
        print(f"draftrelay {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Terminated:
        print(f"draftrelay {args.command}: terminated (SIGTERM); child processes stopped", file=sys.stderr)
        return 143
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
