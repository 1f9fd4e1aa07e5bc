"""aiollm's benchmark suite: `python -m bench NAME [--json PATH]`.

Each benchmark module defines `add_arguments(parser)` and `run(args) -> dict`; the returned figures
are printed as a table and written to `--json PATH`. Ratios against the peer or limit measured in the
same run are keys named `ratio_*`.
"""
