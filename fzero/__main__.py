"""`python -m fzero`: the command line (demo, estimate, bench); see fzero/_cli.py."""

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
