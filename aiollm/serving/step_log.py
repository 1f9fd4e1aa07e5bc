"""An instance's own timings, one JSON line per prefill batch, decode step or KV pull.

Why: the planner's simulator is only as good as its latency profile, and a profile measured alone
on an idle machine misses what a real deployment adds (instances sharing cores, the event loop's
work between steps). With `--step-log PATH` a prefill or decode instance records what each batch,
step and pull actually took while serving, so a benchmark can fit the simulator's latency model to
the same run under the same core sharing (bench/planner.py's simulator-vs-real check).

Lines (times are time.time() seconds, so logs of several processes line up):
  {"kind": "prefill", "start": t, "end": t, "lengths": [prompt tokens...], "recv": [t...]}
  {"kind": "decode", "start": t, "end": t, "batch": B, "context": tokens in the batch's KV}
  {"kind": "pull", "start": t, "end": t, "tokens": prompt tokens pulled}
"""

from __future__ import annotations

import json
from pathlib import Path


class StepLog:
    """Appends timing records to a file (line-buffered, so a killed process loses at most one line)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)

    def record(self, kind: str, start: float, end: float, **fields) -> None:
        self._file.write(json.dumps({"kind": kind, "start": start, "end": end, **fields}) + "\n")

    def close(self) -> None:
        self._file.close()


def read_step_log(path: str | Path) -> list[dict]:
    """The records of one log (a truncated last line, from a killed process, is skipped)."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
