"""The fidelity report: the same measures on both sides, errors against the real runs' mean and range."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

from simadmit.cli import app
from simadmit.results.compare import Run, compare, measured, request_rows, run_dirs, verdict
from tests.test_loadgen import scenario_doc


def simulated(tmp_path: Path, name: str = "sim", rate: float = 4.0) -> Path:
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(yaml.safe_dump(scenario_doc(200, rate=rate)))
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
    assert not table["measure"].str.startswith(("served_", "queue_wait")).any()  # nothing failed; see below
    assert (table.loc[table["target"].notna(), "verdict"] == "pass").all()
    assert json.loads((out / "compare.json").read_text())["pass"] is True
    assert {p.name for p in out.glob("cdf_*.png")} == {"cdf_chat.png", "cdf_bulk.png", "cdf_all.png"}


def test_a_report_written_over_a_previous_one_keeps_none_of_its_plots(tmp_path: Path) -> None:
    """`compare --out` given the folder of an earlier report replaces it: the plot of a tier only the earlier
    report had is removed, not left beside the new report as if it were one of its own."""
    sim = simulated(tmp_path)
    out = tmp_path / "report"
    assert CliRunner().invoke(app, ["compare", str(sim), str(sim), "--out", str(out)]).exit_code == 0
    (out / "cdf_interactive.png").write_bytes((out / "cdf_all.png").read_bytes())  # the earlier report's tier
    result = CliRunner().invoke(app, ["compare", str(sim), str(sim), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert {p.name for p in out.glob("cdf_*.png")} == {"cdf_chat.png", "cdf_bulk.png", "cdf_all.png"}


def _run(ttft: list[float], e2e: list[float], outcome: list[str] | None = None, seed: int = 0) -> Run:
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
    return Run(f"seed {seed}", request_rows(attempts))


def test_measures_follow_their_definitions() -> None:
    """As in the summary: TTFT and E2E percentiles count every arrival (a request never answered is an
    infinite latency), the served ones only completed requests, each the lower empirical quantile read from
    0.5%-wide buckets; means and inter-token latency (decode time / (output - 1)) are over completed requests;
    a failed request counts in the failure rate; throughput = completions in the window (warm-up end to the
    last arrival) per second."""
    run = _run([1.0, 2.0, 3.0, 9.0], [2.0, 4.0, 5.0, 9.5], ["completed"] * 3 + ["aborted"])
    m = measured(run, "all", 0.0).values
    assert m["ttft_mean_s"] == 2.0
    assert m["ttft_p50_s"] == pytest.approx(2.0, rel=0.005)  # rank ceil(0.5 x 4) = 2 of 4 arrivals
    assert m["ttft_p99_s"] == math.inf  # rank 4 of 4: the aborted one
    assert m["served_ttft_p99_s"] == pytest.approx(3.0, rel=0.005)  # rank 3 of the 3 completed
    assert m["itl_mean_s"] == np.mean([0.1, 0.2, 0.2])
    assert m["failure_rate"] == 0.25 and m["rejection_rate"] == 0.0
    assert m["throughput_rps"] == 1 / 3  # only the first request finishes by t = 3, the last arrival
    assert measured(run, "all", 1.0).values["ttft_mean_s"] == 2.5


def test_a_side_that_left_requests_unanswered_shows_in_every_arrival_percentiles_and_the_failure_rate() -> (
    None
):
    """Real runs that failed 2 of 40 requests have an infinite TTFT p99 (beyond 1% missing): a simulation that
    answered all fails it, by -100%; the served percentiles then appear beside, over completed requests, and
    compare what both sides answered; the failure rate row carries the difference."""
    fine = [1.0] * 40
    failing = ["completed"] * 38 + ["aborted"] * 2
    real = [_run(fine, [2.0] * 40, failing), _run(fine, [2.0] * 40, failing)]
    table = compare([_run(fine, [2.0] * 40)], real, 0.0).set_index(["tier", "measure"])
    p99 = table.loc[("all", "ttft_p99_s")]
    assert p99["real_mean"] == math.inf and p99["error"] == -1.0 and p99["verdict"] == "fail"
    served = table.loc[("all", "served_ttft_p99_s")]
    assert served["error"] == 0.0 and served["sim"] == pytest.approx(1.0, rel=0.005)
    rate = table.loc[("all", "failure_rate")]
    assert rate["sim"] == 0.0 and rate["real_mean"] == 0.05
    both = compare(real[:1], real, 0.0).set_index(["tier", "measure"])
    assert both.loc[("all", "ttft_p99_s"), "error"] == 0.0  # both infinite: they agree
    assert both.loc[("all", "ttft_p99_s"), "verdict"] == "pass"


def test_simulated_seeds_pool_their_observations() -> None:
    """Two seeds: a percentile is the pooled sample's quantile (as the summary combines replications), not
    the mean of each seed's; other measures are the mean over seeds."""
    a = _run([1.0] * 50 + [3.0] * 50, [4.0] * 100, seed=1)  # p50 = 1
    b = _run([2.0] * 100, [4.0] * 100, seed=2)  # p50 = 2
    table = compare([a, b], [b], 0.0).set_index(["tier", "measure"])
    assert table.loc[("all", "ttft_p50_s"), "sim"] == pytest.approx(2.0, rel=0.005)  # rank 100 of 200
    assert table.loc[("all", "ttft_mean_s"), "sim"] == 2.0


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
    assert verdict("ttft_p99_s", math.inf, np.array([math.inf, math.inf])) == "pass"
    assert verdict("ttft_p99_s", 2.0, np.array([1.0, math.inf])) == "pass (within the real spread)"
    assert verdict("ttft_p99_s", math.inf, np.array([1.0, 1.1])) == "fail"


def test_repeat_folders_stand_for_their_runs_and_bad_folders_exit_2(tmp_path: Path) -> None:
    sim = simulated(tmp_path)
    for k in (1, 2, 10):
        (tmp_path / "real" / f"repeat-{k}").mkdir(parents=True)
        (tmp_path / "real" / f"repeat-{k}" / "requests.parquet").write_bytes(
            (sim / "requests.parquet").read_bytes()
        )
    assert [p.name for p in run_dirs([tmp_path / "real"])] == ["repeat-1", "repeat-2", "repeat-10"]
    # a user's copy and a note beside the repeats are no repeats (they were a ValueError traceback)
    shutil.copytree(tmp_path / "real" / "repeat-1", tmp_path / "real" / "repeat-1.bak")
    (tmp_path / "real" / "repeat-notes.txt").write_text("")
    assert [p.name for p in run_dirs([tmp_path / "real"])] == ["repeat-1", "repeat-2", "repeat-10"]
    missing = CliRunner().invoke(app, ["compare", str(sim), str(tmp_path / "nowhere")])
    assert missing.exit_code == 2 and "nowhere: folder not found" in missing.output
    (tmp_path / "empty").mkdir()
    empty = CliRunner().invoke(app, ["compare", str(sim), str(tmp_path / "empty")])
    assert empty.exit_code == 2 and "empty: no requests.parquet here" in empty.output
    table = pd.read_parquet(sim / "requests.parquet")
    pd.concat([table, table.assign(policy="other")]).to_parquet(tmp_path / "two.parquet")
    (tmp_path / "two").mkdir()
    (tmp_path / "two.parquet").rename(tmp_path / "two" / "requests.parquet")
    several = CliRunner().invoke(app, ["compare", str(tmp_path / "two"), str(sim)])
    assert several.exit_code == 2 and "--policy" in several.output
    chosen = CliRunner().invoke(
        app, ["compare", str(tmp_path / "two"), str(tmp_path / "real"), "--policy", "other"]
    )
    assert chosen.exit_code == 0 and "3 real runs" in " ".join(chosen.output.split()), chosen.output
    # a simulation of several policies as the real side: --policy picks it there too (it was asked for again)
    itself = CliRunner().invoke(
        app, ["compare", str(tmp_path / "two"), str(tmp_path / "two"), "--policy", "other"]
    )
    assert itself.exit_code == 0 and "verdict: PASS" in itself.output, itself.output


DAMAGED_TABLES = [
    (
        "no-tier",
        lambda t: t.drop(columns=["tier"]),
        "not a requests table of simulate or replay (no column 'tier')",
    ),
    (
        "ttft-as-text",
        lambda t: t.assign(ttft_s="x"),
        "requests.parquet: ttft_s: holds str values, not numbers",
    ),
    ("no-rows", lambda t: t.iloc[:0], "requests.parquet: holds no requests"),
    ("no-arrivals", lambda t: t.assign(arrival_s=np.nan), "arrival_s: 200 rows have no arrival time"),
    (
        "arrivals-true-or-false",
        lambda t: t.assign(arrival_s=True),
        "arrival_s: holds bool values, not numbers",
    ),
    ("no-seed", lambda t: t.assign(seed=np.nan), "requests.parquet: seed: 200 rows have no seed"),
    ("no-policy", lambda t: t.assign(policy=None), "requests.parquet: policy: 200 rows have no policy"),
]


@pytest.mark.parametrize("damage", DAMAGED_TABLES, ids=[d[0] for d in DAMAGED_TABLES])
def test_a_table_compare_cannot_measure_is_one_line_naming_file_and_column(
    tmp_path: Path, damage: tuple
) -> None:
    """A requests table with a column missing or not numbers, no rows, or no arrival times: one line naming
    the file and the column, exit 2, never a traceback nor a report over nothing."""
    _, mutate, fragment = damage
    sim = simulated(tmp_path)
    (tmp_path / "real").mkdir()
    mutate(pd.read_parquet(sim / "requests.parquet")).to_parquet(tmp_path / "real" / "requests.parquet")
    result = CliRunner().invoke(app, ["compare", str(sim), str(tmp_path / "real")])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert f"{tmp_path / 'real' / 'requests.parquet'}" in result.output and fragment in result.output


def test_a_simulation_at_another_rate_is_not_the_same_request_list(tmp_path: Path) -> None:
    """The same 200 requests in the same tiers, drawn at twice the rate: the arrivals span half the time,
    which `compare` refuses in one line rather than reporting the rate as a fidelity error."""
    sim, fast = simulated(tmp_path), simulated(tmp_path, "fast", rate=8.0)
    result = CliRunner().invoke(app, ["compare", str(fast), str(sim)])
    assert result.exit_code == 2, result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert f"{sim}: not the request list of {fast} (arrivals over" in " ".join(result.output.split())


@pytest.mark.parametrize(
    ("warmup", "fragment"),
    [
        ("abc", "workload.warmup_s: must be a finite number of seconds, 0 or more, got 'abc'"),
        (500, "workload.warmup_s: 500 s leaves out"),
    ],
)
def test_the_simulations_warmup_is_checked_like_the_option(
    tmp_path: Path, warmup: object, fragment: str
) -> None:
    """Without --warmup the simulation folder's scenario.yaml gives it: a value that is not seconds, or one
    past every arrival, is one line naming that file and field."""
    sim = simulated(tmp_path)
    doc = yaml.safe_load((sim / "scenario.yaml").read_text())
    doc["workload"]["warmup_s"] = warmup
    (sim / "scenario.yaml").write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(app, ["compare", str(sim), str(sim)])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert f"{sim / 'scenario.yaml'}: {fragment}" in result.output


def test_compare_reads_a_real_folder_with_unanswered_requests(tmp_path: Path) -> None:
    """A real run that never answered 5% of its requests: `compare` exits 0, the table keeps the infinite
    every-arrival p99 and adds the served percentiles, and its verdict fails on TTFT p99."""
    sim = simulated(tmp_path)
    table = pd.read_parquet(sim / "requests.parquet")
    lost = table["request_id"] % 20 == 0
    table["outcome"] = table["outcome"].astype(str).where(~lost, "aborted")
    for col in ("first_token_s", "finish_s", "ttft_s", "e2e_s"):
        table.loc[lost, col] = np.nan
    (tmp_path / "real").mkdir()
    table.to_parquet(tmp_path / "real" / "requests.parquet")
    out = tmp_path / "report"
    result = CliRunner().invoke(app, ["compare", str(sim), str(tmp_path / "real"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "verdict: FAIL" in result.output
    rows = pd.read_csv(out / "compare.csv").set_index(["tier", "measure"])
    assert rows.loc[("all", "ttft_p99_s"), "real_mean"] == math.inf
    assert rows.loc[("all", "ttft_p99_s"), "verdict"] == "fail"
    assert rows.loc[("all", "failure_rate"), "real_mean"] == pytest.approx(lost.mean(), abs=0.01)
    assert ("all", "served_ttft_p99_s") in rows.index
    assert json.loads((out / "compare.json").read_text())["pass"] is False


def test_a_simulation_folder_written_over_in_part_is_refused_and_a_partial_one_noted(tmp_path: Path) -> None:
    """A simulate folder whose requests table is another run's of the same requests (not the one its manifest
    lists) would compare a mix of two runs: one line, exit 2. A folder an interrupted `simulate` left holds
    whole runs, fewer than asked: compared, with a note saying so."""
    sim = simulated(tmp_path)
    mixed = tmp_path / "mixed"
    shutil.copytree(sim, mixed)
    table = pd.read_parquet(sim / "requests.parquet")
    table.assign(ttft_s=2 * table["ttft_s"], e2e_s=2 * table["e2e_s"]).to_parquet(mixed / "requests.parquet")
    refused = CliRunner().invoke(app, ["compare", str(mixed), str(sim)])
    assert refused.exit_code == 2 and len(refused.output.strip().splitlines()) == 1, refused.output
    assert f"{mixed}: incomplete folder: requests.parquet is" in " ".join(refused.output.split())
    manifest = json.loads((sim / "manifest.json").read_text())
    (sim / "manifest.json").write_text(json.dumps({**manifest, "partial": True}))
    noted = CliRunner().invoke(app, ["compare", str(sim), str(sim)])
    assert noted.exit_code == 0 and "verdict: PASS" in noted.stdout, noted.output
    assert f"note: {sim}/ holds an interrupted run" in " ".join(noted.stderr.split())


def test_two_real_runs_compare_with_each_other_but_a_swapped_pair_is_refused(tmp_path: Path) -> None:
    """A replay on the simulated side is the two folders swapped when a simulation stands among the real ones;
    with only replays on both sides it is the noise between two real runs, which compare reports."""
    sim = simulated(tmp_path)
    real = tmp_path / "real"
    shutil.copytree(sim, real)
    (real / "replay.json").write_text("{}")  # what marks a `replay --out` folder
    swapped = CliRunner().invoke(app, ["compare", str(real), str(sim)])
    assert swapped.exit_code == 2
    assert "holds a replay run: the first folder is the simulation" in swapped.output
    both_real = CliRunner().invoke(app, ["compare", str(real), str(real)])
    assert both_real.exit_code == 0, both_real.output
    assert "verdict: PASS" in both_real.output
