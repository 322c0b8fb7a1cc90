"""Compare two folders of `simulate` outputs (one sub-folder per scenario): summaries and request tables.

Used to check that a change meant to keep behaviour does keep it: run every bundled scenario before and
after at the same seed (see `scripts/run_bundled.sh`), then `python scripts/same_answers.py BEFORE AFTER`.
Exits 1 and names each difference if any summary value or request-table cell differs.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pandas as pd


def _diff(a: object, b: object, path: str, out: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            _diff(a.get(key), b.get(key), f"{path}.{key}", out)
    elif isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return
    elif a != b:
        out.append(f"{path}: {a!r} != {b!r}")


def main(before: Path, after: Path) -> int:
    problems: list[str] = []
    runs = sorted(p.name for p in before.iterdir() if (p / "summary.json").is_file())
    for name in runs:
        a = json.loads((before / name / "summary.json").read_text())
        b = json.loads((after / name / "summary.json").read_text())
        _diff(a, b, name, problems)
        ra = pd.read_parquet(before / name / "requests.parquet")
        rb = pd.read_parquet(after / name / "requests.parquet")
        if not ra.equals(rb):
            problems.append(f"{name}: requests.parquet differs")
    for line in problems:
        print(line)
    print(f"{len(runs)} runs compared, {len(problems)} differences")
    return 1 if problems or not runs else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
