"""python -m draftrelay.worker ... == draftrelay worker ..."""

import argparse
import sys

from draftrelay import SettingError
from draftrelay.worker.cli import add_arguments, run

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m draftrelay.worker", description="serve a drafter over TCP")
    add_arguments(parser)
    try:
        sys.exit(run(parser.parse_args()))
    except SettingError as exc:  # one line, as `draftrelay worker` prints it (an engine shows it in its warning)
        print(f"draftrelay worker: {exc}", file=sys.stderr)
        sys.exit(2)
