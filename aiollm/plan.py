"""`python -m aiollm.plan`: see aiollm.cli.plan."""

import sys

from aiollm.cli.plan import main

if __name__ == "__main__":
    sys.exit(main())
