"""How far the machine's speed moved during a calibration: each cell measured in two rounds, against itself.

A cell's requests are alike, so the time of their steps (a prefill's TTFT, a decode window's usual gap between
tokens) should not change from one round to the next; where the median does, the machine's speed did, and the
profile carries the average of the two speeds. A window's usual gap is the median of its recorded ones, not
their mean: how many of a batch-mate's long prefill steps fall inside a window depends on how the cell's
requests lined up in that round (the mixed cell's mean moved by -38% and +51% between rounds whose gaps moved
by +2% and -8%), and that is not the machine. A phase whose cells moved by more than `DRIFT_WARNING` (the
median over its cells) makes the profile warn: the replays it predicts may run at either speed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from simadmit.calibrate.fit import reading, typical_step_s
from simadmit.calibrate.measurements import Measurement

DRIFT_WARNING = 0.10  # a tenth: the size of the targets a profile is judged by


@dataclass(frozen=True, slots=True)
class PhaseDrift:
    """Last round over first round - 1, per cell of a phase measured in both: the median and the largest."""

    cells: int
    median: float
    max_abs: float

    def report(self) -> dict[str, object]:
        return {"cells": self.cells, "median": round(self.median, 4), "max_abs": round(self.max_abs, 4)}


def step_time(row: Measurement) -> float | None:
    """The machine's speed as one request read it: a prefill's TTFT, a decode window's usual gap between tokens
    (None: a row the fit does not use)."""
    value = reading(row)
    return value if value is None or row.phase == "prefill" else typical_step_s(row)


def round_drift(rows: Sequence[Measurement]) -> dict[str, PhaseDrift]:
    """Per phase, how each cell's median step time moved from its first round to its last (round 0, the
    warm-up and files written before rounds were recorded, is left out)."""
    readings: dict[tuple[str, int, int], dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r.ok and r.round > 0 and (value := step_time(r)) is not None:
            readings[(r.phase, r.concurrency, r.prompt_tokens_target)][r.round].append(value)
    moves: dict[str, list[float]] = defaultdict(list)
    for (phase, _, _), by_round in readings.items():
        if len(by_round) > 1:
            first, last = by_round[min(by_round)], by_round[max(by_round)]
            moves[phase].append(float(np.median(last) / np.median(first)) - 1.0)
    return {
        phase: PhaseDrift(len(m), float(np.median(m)), float(np.max(np.abs(m)))) for phase, m in moves.items()
    }


def drift_warnings(drift: dict[str, PhaseDrift], limit: float = DRIFT_WARNING) -> list[str]:
    """A warning per phase whose cells moved by more than `limit` between rounds (median over its cells)."""
    return [
        f"unsteady machine: {phase} cells measured {d.median:+.0%} between the calibration's rounds (median "
        f"over {d.cells}); the profile holds their average: calibrate again when the machine is quiet"
        for phase, d in drift.items()
        if abs(d.median) > limit
    ]
