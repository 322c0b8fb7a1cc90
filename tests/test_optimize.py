"""Optimize: the SLO grammar, utilization targets, and a search whose answer queueing theory knows."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

from simadmit.cli.main import app
from simadmit.config.errors import InputError
from simadmit.config.schema import GpuSecondsSpec
from simadmit.study.dimensions import default_dimensions, parse_dimension
from simadmit.study.search import SearchConfig, optimize
from simadmit.study.slo import parse_slo
from simadmit.study.targets import utilization_targets
from tests.helpers import PROFILE
from tests.queueing import mmc_mean_wait

runner = CliRunner()
LAMBDA, MU = 4.0, 1.0  # arrivals/s at the scenario's traffic; services/s per server
WORST = 2.0  # the SLO must hold at 1x, 1.5x and 2x traffic: 2x binds


def mmc_scenario(tmp_path: Path, duration_s: float = 1500) -> Path:
    """M/M/c: Poisson arrivals, exponential service, one central FIFO queue, live state, no admission."""
    doc = {
        "name": "mmc",
        "workload": {
            "seed": 11, "rate_rps": LAMBDA, "duration_s": duration_s, "warmup_s": 100,
            "tiers": [{"name": "only", "share": 1, "prompt_tokens": {"kind": "fixed", "value": 10},
                       "output_tokens": {"kind": "fixed", "value": 1}, "max_tokens": 1}],
        },
        "pools": [{"profile": PROFILE, "replicas": 4,
                   "engine": {"kind": "classical", "service_time": {"kind": "exponential", "mean": 1 / MU}}}],
        "gateway": {"replicas": 1, "poll_interval_s": 0, "dispatch": "central"},
        "clients": {"max_retries": 0},
        "policies": [{"kind": "unconditional"}],
    }  # fmt: skip
    path = tmp_path / "mmc.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_slo_grammar() -> None:
    """Aliases, units and both directions; unknown measures, bad syntax and a floor on a measure that is
    better the lower it is (a latency, a failure rate) are errors."""
    s = parse_slo("interactive.ttft_p99<=3s")
    assert (s.tier, s.measure, s.upper, s.limit) == ("interactive", "ttft_p99_s", True, 3.0)
    assert parse_slo("interactive.rejection<=2%").limit == pytest.approx(0.02)
    assert parse_slo("all.queue_wait_mean_s<=500ms").limit == pytest.approx(0.5)
    g = parse_slo("all.goodput>=10")
    assert (g.measure, g.upper, g.margin(12.0), g.margin(8.0)) == ("goodput_rps", False, 2.0, -2.0)
    assert s.violation(2.0) == 0 and s.violation(6.0) == pytest.approx(1.0)
    for bad in ("interactive.ttft_p99", "interactive.latency<=3s", "ttft_p99<=3s"):
        with pytest.raises(InputError):
            parse_slo(bad)
    assert parse_slo("all.utilization<=80%").upper  # a ceiling on a measure that is better higher: headroom
    for floor in ("interactive.ttft_p99>=3s", "all.rejection>1%", "all.retries_per_request>=0.5"):
        with pytest.raises(InputError, match="is better the lower it is: bound it with <="):
            parse_slo(floor)
    for never in ("interactive.ttft_p99<=0", "all.e2e_p50<=0ms", "all.served_ttft_p90<=0s"):
        with pytest.raises(InputError, match="of 0 s: no request is that fast"):
            parse_slo(never)
    assert parse_slo("all.rejection<=0").limit == 0  # none turned away: a goal that can be met
    assert parse_slo("all.queue_wait_mean_s<=0").limit == 0  # nobody queued


def test_finds_the_erlang_c_replica_count(tmp_path: Path) -> None:
    """With an SLO on mean queue wait and a per-GPU objective, the answer is the fewest servers whose
    M/M/c mean wait at the worst traffic (2x) meets the SLO; the limit sits between c*-1 and c*."""
    lam = LAMBDA * WORST
    waits = {c: mmc_mean_wait(lam, MU, c) if c * MU > lam else math.inf for c in range(1, 17)}
    answer = 11
    assert waits[answer - 1] > 2 * waits[answer]  # the two candidates are far apart
    limit = math.sqrt(waits[answer - 1] * waits[answer])
    slo = parse_slo(f"all.queue_wait_mean_s<={limit:.4f}s")
    assert min(c for c, w in waits.items() if w <= slo.limit) == answer
    (result,) = optimize(
        mmc_scenario(tmp_path),
        [slo],
        "goodput_per_gpu",
        SearchConfig(jobs=2),
        [parse_dimension("pools.0.replicas=1:16")],
    )
    assert result.best.feasible
    assert dict(result.best.setting) == {"pools.0.replicas": answer}
    assert result.best.gpus == answer
    margin = result.best.margins[slo.text]
    assert 0 < margin < limit
    assert result.simulations < 16 * 3  # fewer than trying every replica count at every load
    assert result.unconditional_throughput_rps == pytest.approx(LAMBDA, rel=0.05)


def test_optimize_command_and_its_errors(tmp_path: Path) -> None:
    """The command prints the settings, the margin on each SLO, the throughput cost and the count."""
    scenario = mmc_scenario(tmp_path, duration_s=300)
    args = ["optimize", str(scenario), "--slo", "all.queue_wait_mean<=1s", "--objective", "goodput_per_gpu",
            "--search", "pools.0.replicas=6:12", "--rounds", "1", "--jobs", "1", "--out", str(tmp_path / "o")]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "pools.0.replicas = " in result.output
    assert "margin at the worst load" in result.output and "all.queue_wait_mean<=1s" in result.output
    assert "vs unconditional, same pool and seeds" in result.output and "simulations" in result.output
    assert "fresh seeds" in result.output
    lines = [line for line in result.output.splitlines() if str(tmp_path) not in line]  # paths are not cut
    assert all(len(line) <= 80 for line in lines), result.output
    bad = runner.invoke(app, ["optimize", str(scenario), "--slo", "gold.ttft_p99<=3s", "--slo", "only.speed<=1",
                              "--search", "pools.0.replicass=1:4"])  # fmt: skip
    assert bad.exit_code == 2
    assert "unknown measure 'speed'" in bad.output
    bad = runner.invoke(
        app, ["optimize", str(scenario), "--slo", "gold.ttft_p99<=3s", "--search", "pools.0.replicass=1:4"]
    )
    assert bad.exit_code == 2
    assert "unknown tier 'gold'" in bad.output and "replicass" in bad.output


def test_utilization_target_is_interpolated_to_the_sla_crossing() -> None:
    """p99 leaves the 3 s SLA halfway between the points at 50% and 70% utilization: the target is 60%.
    A policy that never leaves it reports the highest utilization seen."""
    rows = []
    for point, (util, p99, flat_p99) in enumerate([(0.3, 1.0, 1.0), (0.5, 2.0, 1.5), (0.7, 4.0, 2.0)]):
        for policy, latency in (("unconditional", p99), ("gpu_seconds", flat_p99)):
            for tier in ("interactive", "all"):
                rows.append({"point": point, "workload.rate_multiplier": point + 1, "policy": policy, "tier": tier,
                             "arrival_rate_rps": 10.0 * (point + 1), "ttft_p99_s": latency, "e2e_p99_s": latency,
                             "work_utilization": util, "work_utilization_ci95": 0.02})  # fmt: skip
    targets = utilization_targets(
        pd.DataFrame(rows), {"interactive": {"ttft_s": 3.0, "e2e_s": 10.0}}, "interactive"
    )
    t = targets.set_index("policy")
    assert t.loc["unconditional", "utilization_target"] == pytest.approx(0.6)
    assert t.loc["unconditional", "arrival_rate_rps"] == pytest.approx(25.0)
    assert t.loc["unconditional", "sla_left"]
    assert t.loc["gpu_seconds", "utilization_target"] == pytest.approx(0.7)
    assert not t.loc["gpu_seconds", "sla_left"]
    assert targets["ci95"].isna().all()  # no replications to resample


def test_an_infinite_percentile_is_judged_by_its_excess_failures() -> None:
    """A p99 over every arrival is infinite once more than 1% of requests fail: the SLO is violated, and
    the violation grows with the failures, so among infeasible settings the search prefers fewer."""
    slo = parse_slo("interactive.ttft_p99<=3s")
    few = {"ttft_p99_s": float("inf"), "failure_rate": 0.02}
    many = {"ttft_p99_s": float("inf"), "failure_rate": 0.5}
    assert slo.margin(few["ttft_p99_s"]) < 0
    assert 1.0 < slo.violation_in(few) < slo.violation_in(many)
    assert slo.violation_in({"ttft_p99_s": 6.0, "failure_rate": 0.0}) == pytest.approx(1.0)


def test_an_infinite_p99_leaves_the_sla_and_no_limit_is_no_limit() -> None:
    """More than 1% failing makes the every-arrival p99 infinite: the target is the last point inside (no
    interpolation into infinity). An infinite SLA (no E2E limit) holds even for an infinite E2E p99."""
    rows = []
    for point, (util, p99) in enumerate([(0.3, 1.0), (0.5, 2.0), (0.7, math.inf)]):
        for tier in ("interactive", "all"):
            rows.append({"point": point, "workload.rate_multiplier": point + 1, "policy": "gpu_seconds",
                         "tier": tier, "arrival_rate_rps": 10.0 * (point + 1), "ttft_p99_s": p99,
                         "e2e_p99_s": math.inf, "work_utilization": util})  # fmt: skip
    targets = utilization_targets(
        pd.DataFrame(rows), {"interactive": {"ttft_s": 3.0, "e2e_s": math.inf}}, "interactive"
    )
    assert targets["utilization_target"].tolist() == pytest.approx([0.5])
    assert targets["sla_left"].tolist() == [True]


def test_a_true_false_field_is_searched_over_false_and_true(tmp_path: Path) -> None:
    """`path=false:true` tries both values, as true/false (not as the numbers 0 and 1), and prints the one
    chosen as the scenario spells it; a range of numbers on a true/false field, or false:true on a number,
    is refused naming --search."""
    scenario = mmc_scenario(tmp_path, duration_s=200)
    slo = parse_slo("all.queue_wait_mean_s<=10s")
    args = ["optimize", str(scenario), "--slo", slo.text, "--objective", "goodput", "--search",
            "clients.honor_retry_after=false:true", "--rounds", "1", "--jobs", "1", "--out", str(tmp_path / "o")]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    (chosen,) = [
        line.split(" = ")[1] for line in result.output.splitlines() if "honor_retry_after = " in line
    ]
    assert chosen in ("true", "false"), result.output
    table = pd.read_csv(tmp_path / "o" / "optimize.csv")
    assert set(table["clients.honor_retry_after"]) == {False, True}
    for text, why in (
        (
            "clients.honor_retry_after=0:1",
            "true or false, not a number: write clients.honor_retry_after=false:true to try both",
        ),
        ("pools.0.replicas=false:true", "mmc.yaml: pools.0.replicas: Input should be a number, not false"),
    ):
        with pytest.raises(InputError) as refused:
            optimize(scenario, [slo], "goodput", SearchConfig(jobs=1, rounds=1), [parse_dimension(text)])
        assert refused.value.problems[0].endswith(why), refused.value.problems


def test_parallel_and_early_dropping_give_the_serial_exhaustive_answer(tmp_path: Path) -> None:
    """Common random numbers: every candidate runs on the same seeds, so running them in two processes
    and dropping dominated ones before their lighter loads change nothing but the number of simulations."""
    scenario = mmc_scenario(tmp_path, duration_s=300)
    slo = parse_slo("all.queue_wait_mean_s<=0.2s")
    dims = [parse_dimension("pools.0.replicas=6:16")]
    serial = optimize(scenario, [slo], "goodput_per_gpu", SearchConfig(jobs=1, rounds=2, drop=False), dims)
    fast = optimize(scenario, [slo], "goodput_per_gpu", SearchConfig(jobs=2, rounds=2), dims)
    for a, b in zip(serial, fast, strict=True):
        assert a.best == b.best and a.confirmed == b.confirmed
        assert a.unconditional_throughput_rps == b.unconditional_throughput_rps
    assert fast[0].simulations < serial[0].simulations  # infeasible candidates stopped at 2x load


def test_out_resumes_and_writes_the_searched_points(tmp_path: Path) -> None:
    """With `out`, a second identical search simulates nothing and gives the same answer; the table holds
    one row per setting and load the search ran, and the winner's rows on fresh seeds."""
    scenario = mmc_scenario(tmp_path, duration_s=200)
    slo = parse_slo("all.queue_wait_mean_s<=0.5s")
    dims = [parse_dimension("pools.0.replicas=6:12")]
    config = SearchConfig(jobs=1, rounds=1)
    (first,) = optimize(scenario, [slo], "goodput_per_gpu", config, dims, out=tmp_path / "o")
    (again,) = optimize(scenario, [slo], "goodput_per_gpu", config, dims, out=tmp_path / "o")
    assert again.simulations == 0 and again.best == first.best and again.confirmed == first.confirmed
    table = pd.read_csv(tmp_path / "o" / "optimize.csv")
    winner = table[table["pools.0.replicas"] == first.best.setting[0][1]]
    assert set(winner["seeds"]) == {"search", "fresh seeds"} and set(winner["load"]) == {1.0, 1.5, 2.0}
    assert (table["meets_slos"] == (table[slo.text] <= slo.limit)).all()
    assert len(first.fresh_seeds) == 2 and not set(first.fresh_seeds) & {11}


def _synthetic_sweep(noise_p99: float, seeds: int = 20, draw: int = 3) -> tuple[pd.DataFrame, pd.DataFrame]:
    """One policy over six loads; the mean p99 = 10 u - 3 s crosses a 3 s SLA at u = 0.6 exactly (between
    points at 0.5 and 0.7). Each replication adds its own zero-mean noise to p99; u is exact."""
    rng = np.random.default_rng(draw)
    runs = []
    for point, u in enumerate([0.2, 0.3, 0.4, 0.5, 0.7, 0.8]):
        for seed in range(seeds):
            p99 = (10 * u - 3 if u > 0.3 else 0.1) + noise_p99 * rng.standard_normal()
            for tier in ("interactive", "all"):
                runs.append({"point": point, "workload.rate_multiplier": point + 1, "seed": seed, "policy": "p",
                             "tier": tier, "arrival_rate_rps": 10.0 * (point + 1), "ttft_p99_s": p99,
                             "e2e_p99_s": 1.0, "work_utilization": u})  # fmt: skip
    runs_frame = pd.DataFrame(runs)
    keys = ["point", "workload.rate_multiplier", "policy", "tier"]
    means = runs_frame.groupby(keys, as_index=False).mean(numeric_only=True).drop(columns="seed")
    return means, runs_frame


def test_utilization_target_interval_is_the_uncertainty_of_the_crossing() -> None:
    """The bootstrap interval (replications resampled, crossing found again) covers the known crossing;
    it is wide when the p99 is noisy even though utilization is measured exactly (the old half-width, the
    utilization's spread at the point, would be zero), narrow when both are quiet, and NaN with one seed."""
    slo = {"interactive": {"ttft_s": 3.0, "e2e_s": 10.0}}
    covered, widths = 0, []
    for draw in range(20):  # a 95% interval: expect ~19 of 20 to cover; 16 is 3 binomial SDs below
        noisy_p99, runs = _synthetic_sweep(noise_p99=0.6, draw=draw)
        (t,) = utilization_targets(noisy_p99, slo, "interactive", runs, resamples=400).itertuples()
        covered += t.ci_low < 0.6 < t.ci_high
        widths.append(t.ci_high - t.ci_low)
    assert covered >= 16
    wide = float(np.median(widths))
    assert wide > 0.02
    quiet, runs = _synthetic_sweep(noise_p99=0.05)
    (q,) = utilization_targets(quiet, slo, "interactive", runs).itertuples()
    assert q.ci_low <= 0.6 <= q.ci_high and q.ci_high - q.ci_low < wide / 4
    assert q.utilization_target == pytest.approx(0.6, abs=0.01)
    one, runs = _synthetic_sweep(noise_p99=0.6, seeds=1)
    (o,) = utilization_targets(one, slo, "interactive", runs).itertuples()
    assert math.isnan(o.ci_low) and math.isnan(o.ci95)


def test_a_gpu_seconds_policy_on_its_default_budgets_searches_a_budget_per_tier_of_the_workload(
    tmp_path: Path,
) -> None:
    """The policy's default budgets name `interactive` and `batch`; a workload with one tier `only` gets
    one budget searched, for `only`, around the default budget (not `batch`, which it lacks), and the
    whole search runs."""
    doc = yaml.safe_load(mmc_scenario(tmp_path, duration_s=200).read_text())
    doc["policies"] = [{"kind": "gpu_seconds"}]
    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump(doc))
    dims = default_dimensions(doc, path, "gpu_seconds", per_gpu=False)
    budgets = [d for d in dims if ".budgets_s." in d.path]
    default = GpuSecondsSpec.model_fields["default_budget_s"].default
    assert [(d.path, d.lo, d.hi) for d in budgets] == [
        ("policies.gpu_seconds.budgets_s.only", default / 4, default * 4)
    ]
    args = ["optimize", str(path), "--slo", "all.queue_wait_mean<=1s", "--rounds", "1", "--candidates", "2",
            "--jobs", "1", "--out", str(tmp_path / "o")]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "budgets_s.only = " in result.output and "batch" not in result.output
