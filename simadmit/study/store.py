"""Point store: a sweep's finished units on disk, one JSON file each under `DIR/points/<key>.json`.

Each unit is saved as soon as it finishes, written to a temporary file and then renamed, so an
interruption never leaves half a result: a unit either has its file or is run again. Keys come from
`simadmit.study.grid`, so a saved result is found again only for the same inputs, code, point and seed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


class PointStore:
    """Finished units on disk, one JSON file each, written atomically."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory / "points"
        self.directory.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def has(self, key: str) -> bool:
        return self.path(key).is_file()

    def save(self, key: str, record: dict) -> None:
        tmp = self.directory / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(record, allow_nan=True))
        os.replace(tmp, self.path(key))

    def load(self, key: str) -> dict:
        return json.loads(self.path(key).read_text())
