"""`python -m fzero`: the command line (demo, estimate, bench); see fzero/_tools/_cli.py."""

import sys

from ._tools import main

if __name__ == "__main__":
    sys.exit(main())
