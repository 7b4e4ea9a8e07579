"""`python -m nonstop ...`: the `nonstop` command (nonstop/cli/main.py)."""

import sys

from nonstop.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
