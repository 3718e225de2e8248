"""`python -m tinyvila.serve`: the command line is tinyvila/serve/cli.py (an importable module, so that --tp's
spawned ranks can find their entry point)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
