"""python -m draftrelay.worker ... == draftrelay worker ..."""

import argparse
import sys

from draftrelay.worker.cli import add_arguments, run

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m draftrelay.worker", description="serve a drafter over TCP")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
