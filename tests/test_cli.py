"""The command line as a user meets it: outputs of a run, and one clear line per input problem."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

from simadmit.cli.main import app

runner = CliRunner()
DEFAULT = Path(__file__).resolve().parent.parent / "scenarios" / "default.yaml"


def _write(tmp_path: Path, mutate) -> Path:
    doc = yaml.safe_load(DEFAULT.read_text())
    doc["pools"][0]["profile"] = str(DEFAULT.parent.parent / "calibration" / "llama-3.1-8b-h100.yaml")
    mutate(doc)
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _errors(result) -> list[str]:
    return [line for line in result.output.splitlines() if line.strip()]


def test_simulate_writes_tables_and_prints_the_summary(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = runner.invoke(app, ["simulate", "--out", str(out), "--set", "workload.duration_s=15"])
    assert result.exit_code == 0, result.output
    assert "gpu_seconds" in result.output and "TTFT p50" in result.output
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"unconditional", "queue_depth", "gpu_seconds", "predicted_ttft"}
    assert set(summary["gpu_seconds"]) == {"interactive", "batch", "all", "pool:llama-8b"}
    assert summary["gpu_seconds"]["pool:llama-8b"]["replicas_mean"] == pytest.approx(4)
    requests = pd.read_parquet(out / "requests.parquet")
    for column in ("request_id", "tier", "policy", "arrival_s", "decision", "reason", "first_token_s", "finish_s",
                   "prompt_tokens", "output_tokens", "outcome"):  # fmt: skip
        assert column in requests.columns
    # one row per attempt: the number of requests in the summary equals the distinct first attempts
    first = requests[(requests["policy"] == "gpu_seconds") & (requests["attempt"] == 1)]
    assert len(first) == summary["gpu_seconds"]["all"]["requests"] + (first["arrival_s"] < 10).sum()
    series = pd.read_parquet(out / "timeseries.parquet")
    assert {"arrivals", "admits", "rejects", "queued", "running", "in_flight_gpu_s", "utilization"} <= set(
        series
    )
    per_policy = series.groupby("policy")["arrivals"].sum()
    assert (per_policy == requests.groupby("policy").size()).all()


def test_replications_give_confidence_intervals(tmp_path: Path) -> None:
    result = runner.invoke(
        app, ["simulate", "--out", str(tmp_path), "--replications", "3", "--set", "workload.duration_s=15"]
    )
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "summary.json").read_text())
    measures = summary["gpu_seconds"]["interactive"]
    assert measures["ttft_p99_s_ci95"] > 0
    assert set(pd.read_parquet(tmp_path / "requests.parquet")["seed"]) == {1, 2, 3}


def test_misspelled_key_names_the_field_and_file(tmp_path: Path) -> None:
    path = _write(tmp_path, lambda d: d["workload"].__setitem__("rate_rsp", d["workload"].pop("rate_rps")))
    result = runner.invoke(app, ["simulate", str(path), "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    lines = _errors(result)
    assert any(
        str(path) in line and "workload.rate_rsp" in line and "unknown field" in line for line in lines
    )
    assert any("workload.rate_rps" in line and "missing" in line for line in lines)
    assert "Traceback" not in result.output


def test_negative_rate_is_one_clear_line(tmp_path: Path) -> None:
    path = _write(tmp_path, lambda d: d["workload"].__setitem__("rate_rps", -5))
    result = runner.invoke(app, ["simulate", str(path)])
    assert result.exit_code == 2
    lines = _errors(result)
    assert len(lines) == 1
    assert str(path) in lines[0] and "workload.rate_rps" in lines[0] and "greater than 0" in lines[0]


def test_missing_profile_file(tmp_path: Path) -> None:
    path = _write(tmp_path, lambda d: d["pools"][0].__setitem__("profile", "nowhere/h100.yaml"))
    result = runner.invoke(app, ["simulate", str(path)])
    assert result.exit_code == 2
    lines = _errors(result)
    assert (
        len(lines) == 1
        and "pools.0.profile" in lines[0]
        and "not found" in lines[0]
        and str(path) in lines[0]
    )


def test_profile_with_a_missing_key(tmp_path: Path) -> None:
    profile = yaml.safe_load((DEFAULT.parent.parent / "calibration" / "llama-3.1-8b-h100.yaml").read_text())
    del profile["kv_capacity_tokens"]
    (tmp_path / "broken.yaml").write_text(yaml.safe_dump(profile))
    path = _write(tmp_path, lambda d: d["pools"][0].__setitem__("profile", "broken.yaml"))
    result = runner.invoke(app, ["simulate", str(path)])
    assert result.exit_code == 2
    assert "broken.yaml: kv_capacity_tokens: required field is missing" in result.output


def test_missing_scenario_and_bad_override(tmp_path: Path) -> None:
    result = runner.invoke(app, ["simulate", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2 and "scenario file not found" in result.output
    result = runner.invoke(app, ["simulate", "--set", "policies.nope.headroom=0.5"])
    assert result.exit_code == 2 and "no element 'nope'" in result.output


def test_a_bundled_scenario_runs_by_name(tmp_path: Path) -> None:
    result = runner.invoke(
        app, ["simulate", "retry_storm", "--out", str(tmp_path), "--set", "workload.duration_s=20"]
    )
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary) == {"lockstep/gpu_seconds", "jittered/gpu_seconds"}
