"""Point store: a sweep's finished units on disk, one JSON file each under `DIR/points/<key>.json`.

Each unit is saved as soon as it finishes, written to a temporary file and then renamed, so an
interruption never leaves half a result: a unit either has its file or is run again. A file that holds no
saved unit (damaged, emptied, edited by hand) counts as none: its unit is run again and the file replaced,
as everything here can be recomputed. Keys come from
`simadmit.study.grid`, so a saved result is found again only for the same inputs, code, point and seed.
"""

from __future__ import annotations

import json
from pathlib import Path

from simadmit.results.run_folder import replace_file, write_failed, write_text

KEPT = "the runs saved so far are kept: run the same command to resume"


class PointStore:
    """Finished units on disk, one JSON file each, written atomically."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory / "points"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise write_failed(self.directory, e, KEPT) from None

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def has(self, key: str) -> bool:
        return self.get(key) is not None

    def save(self, key: str, record: dict) -> None:
        """Save one unit; a folder it cannot be written in (permission denied, a full disk) is an `InputError`
        naming it, the units saved before kept."""
        text = json.dumps(record, allow_nan=True)
        try:
            replace_file(self.path(key), lambda p: write_text(p, text))
        except OSError as e:
            raise write_failed(self.directory, e, KEPT) from None

    def load(self, key: str) -> dict:
        record = self.get(key)
        if record is None:
            raise KeyError(f"no saved unit {key} in {self.directory}")  # `has` says which are saved
        return record

    def get(self, key: str) -> dict | None:
        """The saved unit, or None where its file is missing or holds none (not JSON, not a run's record, a
        measure that is not a number)."""
        try:
            record = json.loads(self.path(key).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        whole = isinstance(record, dict) and all(
            isinstance(record.get(f), dict) and _numbers(record[f]) for f in ("summary", "arrival_rate_rps")
        )
        return record if whole else None


def _numbers(value: object) -> bool:
    """Whether every value under a saved mapping (through nested mappings and lists) is a number, as a run
    writes them: a text or null edited in would otherwise fail the table built from it."""
    if isinstance(value, dict):
        return all(_numbers(v) for v in value.values())
    if isinstance(value, list):
        return all(_numbers(v) for v in value)
    return isinstance(value, int | float) and not isinstance(value, bool)
