"""Serving roles for `python -m aiollm.node --role prefill|decode|controller|frontend`."""
