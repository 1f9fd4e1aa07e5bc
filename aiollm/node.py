"""`python -m aiollm.node`: see aiollm.cli.node."""

import sys

from aiollm.cli.node import main

if __name__ == "__main__":
    sys.exit(main())
