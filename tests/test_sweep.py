"""Sweeps: the grid, its validation, rows equal to individual runs, and resuming after an interruption."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

from simadmit.cli.main import app
from simadmit.config.errors import InputError
from simadmit.config.loading import load_scenario
from simadmit.sim.world import build_world
from simadmit.study import backends
from simadmit.study.backends import process_map, run_sweep
from simadmit.study.dimensions import parse_dimension
from simadmit.study.grid import parse_param, plan_sweep
from simadmit.study.runner import run_scenario
from simadmit.study.store import PointStore

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ROOT / "scenarios" / "default.yaml"
runner = CliRunner()


def short_scenario(tmp_path: Path, duration_s: float = 20.0) -> Path:
    """The default scenario, shortened so a point takes a fraction of a second."""
    doc = yaml.safe_load(DEFAULT.read_text())
    doc["workload"].update(duration_s=duration_s, warmup_s=2)
    path = tmp_path / "short.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_param_syntax() -> None:
    """Ranges give evenly spaced values (integers when written as integers), lists give themselves."""
    assert parse_param("workload.rate_multiplier=0.25:3.0:12").values[:3] == (0.25, 0.5, 0.75)
    assert parse_param("workload.rate_multiplier=0.1:0.3:3").values == (0.1, 0.2, 0.3)
    assert parse_param("pools.0.replicas=2:8:4").values == (2, 4, 6, 8)
    huge = parse_param("workload.rate_rps=1:1e308:3").values  # not integers of 308 digits
    assert huge == (1.0, 5e307, 1e308) and all(isinstance(v, float) for v in huge)
    ends = ("1_000:3_000", "2.0:8")  # whole numbers however written; a float written as such stays one
    assert [type(v) for r in ends for v in parse_param(f"x={r}:3").values] == [int] * 3 + [float] * 3
    assert [parse_dimension(f"x={r}").integer for r in ends] == [True, False]  # optimize's rule is the same
    assert parse_param("policies.gpu_seconds.headroom=0.7,0.8,0.9,1.0").values == (0.7, 0.8, 0.9, 1.0)
    assert parse_param("gateway.routing=[least_work, round_robin]").values == ("least_work", "round_robin")
    for bad in ("workload.rate_multiplier", "=1,2", "x=1:2:1", "x="):
        with pytest.raises(InputError):
            parse_param(bad)


def test_bad_paths_and_values_are_reported_before_anything_runs(tmp_path: Path) -> None:
    """Every wrong path and every wrong value gets its own line, and no point is run or saved."""
    params = [
        parse_param("workload.rate_multiplierr=1,2"),
        parse_param("policies.gpu_seconds.headroom=0.5,1.5"),
    ]
    with pytest.raises(InputError) as e:
        plan_sweep(DEFAULT, params)
    lines = e.value.problems
    assert any("rate_multiplierr" in line and "unknown field" in line for line in lines)
    assert any("headroom=1.5" in line and "less than or equal to 1" in line for line in lines)
    assert not any("headroom=0.5" in line for line in lines)
    out = tmp_path / "out"
    result = runner.invoke(app, ["sweep", str(DEFAULT), "--param", "pools.7.replicas=3", "--out", str(out)])
    assert result.exit_code == 2
    assert "no element '7'" in result.output
    assert "Traceback" not in result.output and not out.exists()


def test_rows_equal_individual_runs(tmp_path: Path) -> None:
    """Each row of a parallel sweep is what `run_scenario` gives for that point, seeds and replications."""
    scenario = short_scenario(tmp_path)
    params = [
        parse_param("workload.rate_multiplier=0.2,1.0"),
        parse_param("policies.gpu_seconds.headroom=0.8,1.0"),
    ]
    plan = plan_sweep(scenario, params, replications=2, seed=5)
    table = run_sweep(plan, tmp_path / "out", jobs=2)
    groups = table["tier"].nunique()  # two tiers, "all", and per-pool figures
    assert {"interactive", "batch", "all"} <= set(table["tier"])
    assert len(table) == 4 * table["policy"].nunique() * groups  # points x policies x groups
    assert table["policy"].nunique() == len(load_scenario(scenario)[0].policies)
    assert (tmp_path / "out" / "sweep.parquet").is_file() and (tmp_path / "out" / "sweep.csv").is_file()
    assert len(pd.read_csv(tmp_path / "out" / "sweep.csv")) == len(table)
    for point in plan.points:
        overrides = dict(point)
        spec, base = load_scenario(scenario, overrides)
        expected = run_scenario(
            spec, build_world(spec, base), seed=5, replications=2, keep_tables=False
        ).summary
        mine = table[
            (table["workload.rate_multiplier"] == overrides["workload.rate_multiplier"])
            & (table["policies.gpu_seconds.headroom"] == overrides["policies.gpu_seconds.headroom"])
        ]
        assert len(mine) == len(expected) * groups == len(expected) * len(expected["unconditional"])
        for _, row in mine.iterrows():
            for measure, value in expected[row["policy"]][row["tier"]].items():
                got = row[measure]
                assert (math.isnan(value) and math.isnan(got)) or got == value, (
                    point,
                    row["policy"],
                    measure,
                )
            assert row["replications"] == 2 and row["seed"] == 5
    rate = table[(table["tier"] == "all") & (table["workload.rate_multiplier"] == 0.2)]["arrival_rate_rps"]
    assert (rate == 0.2 * 120).all()


def _interrupt_after(n: int):
    def progress(done: int, total: int) -> None:
        if done >= n and done < total:
            raise KeyboardInterrupt

    return progress


@pytest.mark.parametrize("jobs", [1, 2])
def test_resume_neither_loses_nor_repeats_points(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, jobs: int
) -> None:
    """An interrupted sweep keeps what finished; running it again runs exactly the rest, once each."""
    scenario = short_scenario(tmp_path, duration_s=12)
    plan = plan_sweep(scenario, [parse_param("workload.rate_multiplier=0.2:1.0:5")], replications=2)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        run_sweep(plan, out, jobs=jobs, progress=_interrupt_after(3))
    store = PointStore(out)
    saved = {u.key for u in plan.units() if store.has(u.key)}
    assert len(saved) >= 3  # a process pool may finish one more unit before the interruption lands
    (store.directory / ".half-written.123.tmp").write_text("{")  # a write cut short is never a result

    ran = []

    def counting(document: dict, source: str, overrides: dict, seed: int) -> dict:
        ran.append((overrides["workload.rate_multiplier"], seed))
        return real(document, source, overrides, seed)

    real = backends.run_unit
    monkeypatch.setattr(backends, "run_unit", counting)
    resumed = run_sweep(plan, out, jobs=1)
    expected_rest = {
        (dict(u.overrides)["workload.rate_multiplier"], u.seed) for u in plan.units() if u.key not in saved
    }
    assert sorted(ran) == sorted(expected_rest) and len(ran) == len(plan.units()) - len(saved)

    monkeypatch.setattr(backends, "run_unit", real)
    fresh = run_sweep(plan, tmp_path / "fresh", jobs=1)
    pd.testing.assert_frame_equal(resumed, fresh)
    assert resumed.groupby(["point", "policy", "tier"]).size().eq(1).all()

    ran.clear()
    monkeypatch.setattr(backends, "run_unit", counting)
    more = plan_sweep(scenario, [parse_param("workload.rate_multiplier=0.2:1.0:5")], replications=3)
    run_sweep(more, out, jobs=1)
    assert sorted(ran) == sorted((r, plan.seeds[0][0] + 2) for r in (0.2, 0.4, 0.6, 0.8, 1.0))


def test_process_map_yields_every_result_once() -> None:
    """The process backend returns each task's result under its own index, whatever order they finish in."""
    results = dict(process_map(pow, [(2, k) for k in range(6)], jobs=2))
    assert results == {k: 2**k for k in range(6)}


def test_sweep_command(tmp_path: Path) -> None:
    """The command writes the table and reports each policy's utilization target."""
    scenario = short_scenario(tmp_path)
    out = tmp_path / "out"
    args = [
        "sweep",
        str(scenario),
        "--param",
        "workload.rate_multiplier=0.1,0.2,1.0",
        "--jobs",
        "1",
        "--out",
        str(out),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "best utilization target, interactive" in result.output
    assert all(len(line) <= 80 for line in result.output.splitlines() if str(out) not in line)
    targets = pd.read_csv(out / "utilization_targets_interactive.csv")
    assert set(targets["policy"]) == {"unconditional", "queue_depth", "gpu_seconds", "predicted_ttft"}
    assert targets["utilization_target"].between(0, 1).all()
    again = runner.invoke(app, args)  # everything saved: nothing runs, same table
    assert again.exit_code == 0
    table = pd.read_parquet(out / "sweep.parquet")
    assert len(table) == 3 * table["policy"].nunique() * table["tier"].nunique()  # points x policies x groups


def test_results_are_not_reused_when_the_profile_changes(tmp_path: Path) -> None:
    """The keys of saved points cover the files the scenario reads, not only the scenario document."""
    profile = tmp_path / "profile.yaml"
    profile.write_text((ROOT / "calibration" / "llama-3.1-8b-h100.yaml").read_text())
    doc = yaml.safe_load(DEFAULT.read_text())
    doc["pools"][0]["profile"] = "profile.yaml"
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(yaml.safe_dump(doc))
    params = [parse_param("workload.rate_multiplier=0.2,1.0")]
    before = {u.key for u in plan_sweep(scenario, params).units()}
    assert before == {u.key for u in plan_sweep(scenario, params).units()}
    profile.write_text(profile.read_text() + "\n# re-measured\n")
    assert before.isdisjoint(u.key for u in plan_sweep(scenario, params).units())
