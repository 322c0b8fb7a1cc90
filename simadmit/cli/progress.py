"""Progress of the long commands: a live bar on a terminal, plain lines in pipes, files and CI logs.

A live bar redraws in place, which a pipe or a file cannot do: there, `UnitProgress` prints one line
at the start, one when the first unit finishes, then at most one every few seconds, and one at the end, so a log shows
that the command is alive without a line per unit.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

LINE_EVERY_S = 5.0


class UnitProgress:
    """Units done out of a total, on stderr; `total` may grow (a search learns how much is left)."""

    def __init__(self, description: str, total: int) -> None:
        self.description = description
        self.total = total
        self.done = 0
        self.started = time.monotonic()
        self.last_line = 0.0
        self.lines = 0  # lines printed: the start, the first unit finished, then every LINE_EVERY_S
        self.first = 0
        self.err = Console(stderr=True, highlight=False, soft_wrap=True)
        self.bar: Progress | None = None
        self.task: TaskID | None = None
        if sys.stderr.isatty():
            self.bar = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("elapsed"),
                TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=self.err,
            )  # fmt: skip
            self.task = self.bar.add_task(description, total=total)

    def __enter__(self) -> UnitProgress:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def update(self, done: int, total: int | None = None, description: str | None = None) -> None:
        self.done, self.total = done, total or self.total
        self.description = description or self.description
        if self.bar is not None and self.task is not None:
            self.bar.update(self.task, completed=done, total=self.total, description=self.description)
            return
        now = time.monotonic() - self.started
        first = self.lines == 0 or (self.lines == 1 and done > self.first)
        if first or now - self.last_line >= LINE_EVERY_S or done >= self.total:
            self.first = done if self.lines == 0 else self.first
            self.lines += 1
            self.last_line = now
            self.err.print(f"{self.description}: {done}/{self.total} done, {now:.0f} s")
