"""`python -m draftrelay ...` is the `draftrelay` command (works without the console script on PATH)."""

import sys

from draftrelay.cli import main

sys.exit(main())
