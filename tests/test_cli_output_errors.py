"""Unusable output destinations and bundled scenario names, through the console command: one line naming
the path, exit code 2, no traceback, and nothing simulated first."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.console import run

SHORT = ("--set", "workload.duration_s=5", "--set", "workload.warmup_s=1")


def _clean_failure(result, fragment: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert fragment in output, output
    assert "Traceback" not in output
    assert "simulated requests" not in output  # refused before running


@pytest.mark.parametrize("command", ["simulate", "sweep", "optimize"])
def test_out_is_a_file(tmp_path: Path, command: str) -> None:
    target = tmp_path / "results.txt"
    target.write_text("mine")
    extra = ("--slo", "interactive.ttft_p99<=3s") if command == "optimize" else ()
    result = run(command, "--out", str(target), *extra)
    _clean_failure(result, f"{target}: is a file, not a folder")
    assert target.read_text() == "mine"


def test_out_below_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    _clean_failure(run("simulate", "--out", str(tmp_path / "f" / "run"), *SHORT), "is a file, not a folder")


def test_out_without_permission(tmp_path: Path) -> None:
    """Permission denied (tests/test_outputs.py injects the same error for root, who may write anywhere)."""
    if os.geteuid() == 0:
        pytest.skip("root ignores directory permissions")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    result = run("simulate", "--out", str(locked / "run"), *SHORT)
    _clean_failure(result, f"{locked / 'run'}: cannot write in {locked} (Permission denied)")


def test_out_holding_other_files_is_not_replaced(tmp_path: Path) -> None:
    (tmp_path / "notes.md").write_text("keep me")
    _clean_failure(
        run("simulate", "--out", str(tmp_path), *SHORT), "holds files simadmit did not write (notes.md)"
    )
    assert (tmp_path / "notes.md").read_text() == "keep me"


def test_sweep_and_optimize_take_bundled_scenario_names(tmp_path: Path) -> None:
    """A bundled name is found (the errors are about the scenario's own fields and tiers, not a missing file)."""
    sweep = run(
        "sweep", "retry_storm", "--param", "workload.rate_multiplierr=1", "--out", str(tmp_path / "s")
    )
    _clean_failure(sweep, "rate_multiplierr")
    assert "not found" not in sweep.stderr
    optimize = run("optimize", "retry_storm", "--slo", "gold.ttft_p99<=3s", "--out", str(tmp_path / "o"))
    _clean_failure(optimize, "unknown tier 'gold'; tiers: all, interactive")
