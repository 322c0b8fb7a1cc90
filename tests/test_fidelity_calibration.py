"""The fidelity runs' calibration: one whose rounds disagreed (the machine's speed moved under it) is set aside
and the steadiest of the attempts kept, with every measured row still on disk."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.fidelity import MEASUREMENTS, keep_steadiest, set_aside, unsteadiness
from simadmit.config.profile import load_profile, save_profile
from tests.helpers import ROOT

PROFILE = ROOT / "calibration" / "smollm2-135m-cpu.yaml"


def attempt(folder: Path, drift: dict[str, float], rows: str) -> None:
    """A calibration in `folder`: the bundled profile with these medians between rounds, and a measurements
    file holding `rows` (to tell the attempts apart after they move)."""
    base = load_profile(PROFILE)
    moved = {phase: {"cells": 4, "median": m, "max_abs": abs(m)} for phase, m in drift.items()}
    folder.mkdir(parents=True, exist_ok=True)
    save_profile(
        replace(base, fit={**base.fit, "drift_between_rounds": moved}), folder / "profile.yaml", "test"
    )
    (folder / MEASUREMENTS).write_text(rows)


def test_unsteadiness_is_the_largest_phase_move(tmp_path: Path) -> None:
    attempt(tmp_path, {"prefill": 0.44, "decode": -0.03}, "")
    assert unsteadiness(tmp_path / "profile.yaml") == pytest.approx(0.44)
    attempt(tmp_path, {"prefill": 0.02, "decode": -0.12}, "")
    assert unsteadiness(tmp_path / "profile.yaml") == pytest.approx(0.12)
    attempt(tmp_path, {}, "")
    assert unsteadiness(tmp_path / "profile.yaml") == 0.0


@pytest.mark.parametrize(
    ("drifts", "kept"),
    [
        ([0.44, 0.05], 2),  # the second attempt was steady: it stays
        ([0.20, 0.30], 1),  # the first was the steadier: it comes back
        ([0.30, 0.20, 0.25], 2),
        ([0.15, 0.15], 2),  # a tie keeps the latest
    ],
)
def test_the_steadiest_attempt_is_kept_and_none_is_lost(
    tmp_path: Path, drifts: list[float], kept: int
) -> None:
    for k, d in enumerate(drifts, start=1):
        attempt(tmp_path, {"prefill": d}, f"attempt {k}\n")
        if k < len(drifts):
            set_aside(tmp_path, tmp_path / f"unsteady-{k}")
    keep_steadiest(tmp_path)
    assert (tmp_path / MEASUREMENTS).read_text() == f"attempt {kept}\n"
    assert unsteadiness(tmp_path / "profile.yaml") == pytest.approx(drifts[kept - 1])
    aside = sorted(f.read_text() for f in tmp_path.glob(f"unsteady-*/{MEASUREMENTS}"))
    assert aside == sorted(f"attempt {k}\n" for k in range(1, len(drifts) + 1) if k != kept)
    assert all((f / "profile.yaml").exists() for f in tmp_path.glob("unsteady-*"))
