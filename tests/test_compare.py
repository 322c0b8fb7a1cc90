"""The fidelity report: the same measures on both sides, errors against the real runs' mean and range."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import yaml
from typer.testing import CliRunner

from simadmit.cli import app
from simadmit.results.compare import Run, compare, measures, request_rows, run_dirs, verdict
from tests.test_loadgen import scenario_doc


def simulated(tmp_path: Path, name: str = "sim") -> Path:
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(yaml.safe_dump(scenario_doc(200, rate=4.0)))
    out = tmp_path / name
    result = CliRunner().invoke(app, ["simulate", str(scenario), "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


def test_a_folder_compared_with_itself_has_zero_error_and_passes(tmp_path: Path) -> None:
    sim = simulated(tmp_path)
    out = tmp_path / "report"
    result = CliRunner().invoke(app, ["compare", str(sim), str(sim), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "verdict: PASS" in result.output
    table = pd.read_csv(out / "compare.csv")
    defined = table.dropna(subset=["error"])
    assert len(defined) >= 3 * 13  # two tiers and all, every latency and rate measure
    assert (defined["error"] == 0).all()
    assert (table.loc[table["target"].notna(), "verdict"] == "pass").all()
    assert json.loads((out / "compare.json").read_text())["pass"] is True
    assert {p.name for p in out.glob("cdf_*.png")} == {"cdf_chat.png", "cdf_bulk.png", "cdf_all.png"}


def _run(ttft: list[float], e2e: list[float], outcome: list[str] | None = None) -> Run:
    n = len(ttft)
    attempts = pd.DataFrame(
        {
            "request_id": range(n),
            "attempt": 1,
            "tier": "t",
            "arrival_s": np.arange(n, dtype=float),
            "decision": "admit",
            "outcome": outcome or ["completed"] * n,
            "output_tokens": 11,
            "first_token_s": np.arange(n) + np.array(ttft),
            "finish_s": np.arange(n) + np.array(e2e),
            "ttft_s": ttft,
            "e2e_s": e2e,
            "queue_wait_s": np.nan,
        }  # fmt: skip
    )
    return Run("x", request_rows(attempts), math.nan)


def test_measures_follow_their_definitions() -> None:
    """Means and percentiles over completed requests; inter-token latency = decode time / (output - 1);
    a failed request counts in the failure rate and not in the latencies; throughput = completions in the
    window (warm-up end to the last arrival) per second."""
    run = _run([1.0, 2.0, 3.0, 9.0], [2.0, 4.0, 5.0, 9.5], ["completed"] * 3 + ["aborted"])
    m = measures(run, "all", 0.0)
    assert m["ttft_mean_s"] == 2.0 and m["ttft_p50_s"] == 2.0
    assert m["itl_mean_s"] == np.mean([0.1, 0.2, 0.2])
    assert m["failure_rate"] == 0.25 and m["rejection_rate"] == 0.0
    assert m["throughput_rps"] == 1 / 3  # only the first request finishes by t = 3, the last arrival
    assert measures(run, "all", 1.0)["ttft_mean_s"] == 2.5


def test_error_is_against_the_real_mean_and_a_wide_real_spread_admits_values_inside_it() -> None:
    real = [_run([1.0] * 5, [2.0] * 5), _run([1.5] * 5, [3.0] * 5)]  # E2E spreads ±20% around 2.5
    table = compare([_run([1.1] * 5, [2.2] * 5)], real, 0.0).set_index(["tier", "measure"])
    row = table.loc[("all", "e2e_mean_s")]
    assert row["real_mean"] == 2.5 and row["real_min"] == 2.0 and row["real_max"] == 3.0
    assert math.isclose(row["error"], 2.2 / 2.5 - 1) and math.isclose(row["real_spread"], 0.2)
    assert row["verdict"] == "pass (within the real spread)"  # -12% is outside ±10% but inside 2.0-3.0
    assert verdict("e2e_mean_s", 1.9, np.array([2.0, 3.0])) == "fail"
    assert verdict("e2e_mean_s", 2.6, np.array([2.5, 2.5])) == "pass"
    assert verdict("ttft_p99_s", 1.26, np.array([1.0, 1.0])) == "fail"
    assert verdict("throughput_rps", 9.0, np.array([1.0])) == ""


def test_repeat_folders_stand_for_their_runs_and_bad_folders_exit_2(tmp_path: Path) -> None:
    sim = simulated(tmp_path)
    for k in (1, 2, 10):
        (tmp_path / "real" / f"repeat-{k}").mkdir(parents=True)
        (tmp_path / "real" / f"repeat-{k}" / "requests.parquet").write_bytes(
            (sim / "requests.parquet").read_bytes()
        )
    assert [p.name for p in run_dirs([tmp_path / "real"])] == ["repeat-1", "repeat-2", "repeat-10"]
    missing = CliRunner().invoke(app, ["compare", str(sim), str(tmp_path / "nowhere")])
    assert missing.exit_code == 2 and "no requests.parquet" in missing.output
    table = pd.read_parquet(sim / "requests.parquet")
    pd.concat([table, table.assign(policy="other")]).to_parquet(tmp_path / "two.parquet")
    (tmp_path / "two").mkdir()
    (tmp_path / "two.parquet").rename(tmp_path / "two" / "requests.parquet")
    several = CliRunner().invoke(app, ["compare", str(tmp_path / "two"), str(sim)])
    assert several.exit_code == 2 and "--policy" in several.output
    chosen = CliRunner().invoke(
        app, ["compare", str(tmp_path / "two"), str(tmp_path / "real"), "--policy", "other"]
    )
    assert chosen.exit_code == 0 and "3 real runs" in chosen.output, chosen.output
