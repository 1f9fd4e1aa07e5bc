"""`python -m aiollm.generate`: see aiollm.cli.generate."""

import sys

from aiollm.cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
