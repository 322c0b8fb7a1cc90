"""The machine's drift during a calibration, read from each cell measured in both rounds."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from simadmit.calibrate.drift import DRIFT_WARNING, drift_warnings, round_drift
from simadmit.calibrate.measurements import Measurement

ROW = Measurement(
    phase="decode", concurrency=8, seq=0, attempt=1, model="m", start_unix_s=1.7e9, prompt_tokens_target=128,
    prompt_tokens=128, output_tokens_target=64, output_tokens=64, ttft_s=0.25, itl_mean_s=0.04, itl_p50_s=0.04,
    itl_p90_s=0.05, itl_max_s=0.1, n_chunks=64, e2e_s=2.8, status="ok",
)  # fmt: skip


def cell(
    phase: str, concurrency: int, prompt: int, value: float, rounds: dict[int, float]
) -> list[Measurement]:
    """Five requests per round of one cell, its reading `value` times the round's speed factor, +-2% noise."""
    rng = random.Random(concurrency * 1000 + prompt)
    rows = []
    for k, factor in rounds.items():
        for seq in range(5):
            v = value * factor * rng.uniform(0.98, 1.02)
            rows.append(replace(ROW, phase=phase, concurrency=concurrency, prompt_tokens_target=prompt,
                                seq=seq, round=k, ttft_s=v, itl_mean_s=v))  # fmt: skip
    return rows


def test_a_phase_that_slowed_between_rounds_is_told_and_warned_of() -> None:
    """Decode cells 20% slower in round 2, prefill cells steady: decode's drift reads +20% within the rows'
    noise (medians of five draws within +-2%, so within 4% of the factor) and warns; prefill's reads ~0."""
    rows = [r for c in (1, 4, 16) for r in cell("decode", c, 128, 0.03 * c, {1: 1.0, 2: 1.2})]
    rows += [r for p in (64, 512, 2048) for r in cell("prefill", 1, p, p / 1000, {1: 1.0, 2: 1.0})]
    drift = round_drift(rows)
    assert drift["decode"].cells == 3 and drift["decode"].median == pytest.approx(0.2, abs=0.05)
    assert abs(drift["prefill"].median) < 0.05
    (warning,) = drift_warnings(drift)
    assert warning.startswith("unsteady machine: decode cells measured +")


def test_only_cells_measured_in_two_rounds_count() -> None:
    """The warm-up and rows of files older than rounds (round 0), a cell in one round only and failed rows
    say nothing about drift; a steady machine raises no warning."""
    rows = cell("decode", 4, 128, 0.05, {0: 1.0, 1: 2.0})  # round 0 against round 1: not compared
    rows += cell("context", 2, 1536, 0.05, {1: 1.0})
    rows += [replace(r, status="timeout") for r in cell("mixed", 2, 1024, 0.05, {1: 1.0, 2: 3.0})]
    assert round_drift(rows) == {}
    steady = cell("decode", 4, 128, 0.05, {1: 1.0, 2: 1.0 + DRIFT_WARNING / 2})
    assert drift_warnings(round_drift(steady)) == []


def timed(row: Measurement, gaps: list[float]) -> Measurement:
    """`row` with its tokens recorded: the first at its TTFT, then these gaps."""
    times = tuple(row.ttft_s + t for t in [0.0, *np.cumsum(gaps)])
    window = times[-1] - times[0]
    return replace(row, output_tokens=len(times), token_times_s=times, itl_mean_s=window / len(gaps))


def test_a_batch_mates_prefill_inside_a_window_is_not_the_machine() -> None:
    """A mixed cell whose steps take 40 ms in both rounds, but whose windows in round 2 each hold a batch-mate's
    1.5 s prefill step: the mean gap rises ~60%, the machine did not move, and no warning is raised; a decode
    cell whose gaps all grow 20% still reads +20% from its recorded tokens."""
    rng = random.Random(7)

    def gaps(step: float, long_step: float | None) -> list[float]:
        g = [step * rng.uniform(0.98, 1.02) for _ in range(63)]
        if long_step is not None:
            g[rng.randrange(10, 50)] = long_step
        return g

    rows = []
    for k in (1, 2):
        for seq in range(5):
            base = replace(ROW, phase="mixed", concurrency=2, prompt_tokens_target=1024, seq=seq, round=k)
            rows.append(timed(base, gaps(0.04, None if k == 1 else 1.5)))
            base = replace(ROW, phase="decode", concurrency=8, seq=seq, round=k)
            rows.append(timed(base, gaps(0.05 * (1.0 if k == 1 else 1.2), None)))
    mixed_means = [
        np.median([r.itl_mean_s for r in rows if r.phase == "mixed" and r.round == k]) for k in (1, 2)
    ]
    assert mixed_means[1] / mixed_means[0] > 1.5  # what a window's mean reads: not a speed
    drift = round_drift(rows)
    assert abs(drift["mixed"].median) < 0.05
    assert drift["decode"].median == pytest.approx(0.2, abs=0.05)
    (warning,) = drift_warnings(drift)
    assert warning.startswith("unsteady machine: decode cells")
