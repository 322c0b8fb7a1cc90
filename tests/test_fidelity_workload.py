"""The fidelity benchmark's `--workload`: a user's tiers replace its own mix, checked before any server starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from benchmarks.fidelity import TIERS, point_duration, scenario, workload_tiers
from benchmarks.gateway_fidelity import POLICIES as GATEWAY_POLICIES
from benchmarks.gateway_fidelity import prepare_point
from simadmit.config.loading import scenario_from_dict
from simadmit.workload.build import generate
from tests.vllm_server import MAX_MODEL_LEN

ROOT = Path(__file__).resolve().parent.parent


def test_the_bundled_prompt_heavy_mix_replaces_the_benchmarks_own() -> None:
    tiers = workload_tiers(ROOT / "benchmarks" / "workloads" / "prompt_heavy.yaml")
    assert [t["name"] for t in tiers] == ["documents", "long_documents"]
    doc = scenario(Path("smollm2-135m-cpu"), 20.0, "poisson", 100.0, tiers=tiers)
    prompts = generate(scenario_from_dict(doc, ROOT / "x.yaml").workload).prompt
    # 2,000 requests: the mix is prompt-heavy (mean ~530 tokens) with 7% of 1,500-1,800 tokens; the share's
    # standard error is sqrt(0.07 x 0.93 / 2000) = 0.6 points, so 2 points is over 3 of them
    assert 450 < prompts.mean() < 620
    assert abs((prompts >= 1500).mean() - 0.07) < 0.02
    assert TIERS != tiers


def test_a_bad_workload_stops_with_its_file_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump(
            {"workload": {"tiers": [{"name": "a", "share": 1, "prompt_tokens": {"kind": "lognormal"}}]}}
        )
    )
    with pytest.raises(SystemExit) as e:
        workload_tiers(bad)
    assert str(e.value).startswith(f"{bad}: workload.tiers.0.prompt_tokens")
    missing = tmp_path / "none.yaml"
    missing.write_text("name: x\n")
    with pytest.raises(SystemExit) as e:
        workload_tiers(missing)
    assert str(e.value).startswith(f"{missing}: workload.tiers")


@pytest.mark.parametrize(
    "path", sorted((ROOT / "benchmarks" / "workloads").glob("*.yaml")), ids=lambda p: p.stem
)
def test_every_bundled_workload_fits_the_test_servers_context(path: Path) -> None:
    """A request whose prompt and answer exceed the context is refused by vLLM (400), so a bundled mix that
    could draw one would measure refusals, not latencies."""
    for tier in workload_tiers(path):
        assert tier["prompt_tokens"]["max"] + tier["max_tokens"] <= MAX_MODEL_LEN, tier["name"]


def test_the_gateway_benchmark_sends_a_workloads_tiers_under_each_policy(tmp_path: Path) -> None:
    tiers = workload_tiers(ROOT / "benchmarks" / "workloads" / "prompt_heavy.yaml")
    for policy in GATEWAY_POLICIES:
        point = prepare_point(Path("smollm2-135m-cpu"), policy, 2, 2.0, 30.0, tmp_path / policy, tiers)
        assert [t.name for t in point.spec.workload.tiers] == ["documents", "long_documents"]
        budgets = point.spec.policies[0].budgets_s  # type: ignore[union-attr]
        assert set(budgets) == {"documents", "long_documents"}  # no tier left without a budget
        assert point.spec.gateway.replicas == 2
        # 2 requests/s for 30 s: 60 expected, a Poisson count whose standard error is ~8
        assert 30 <= len(point.plan.workload) <= 95


def test_a_light_point_runs_long_enough_for_its_requests() -> None:
    """At 30% of a slow server's capacity (0.18 requests/s) 40 s of arrivals drew 1-3 requests, which judge
    nothing: the point is stretched to `min_requests` expected arrivals, while a busy point keeps the given
    duration. Over 6 seeds of a Poisson stream with mean 20 the mean count has standard error
    sqrt(20 / 6) = 1.8, so above 14 is over 3 of them (40 s would give 7.2)."""
    assert point_duration(1.0, 40.0, 20) == 40.0
    duration = point_duration(0.18, 40.0, 20)
    counts = [
        len(generate(scenario_from_dict(scenario(Path("smollm2-135m-cpu"), 0.18, "poisson", duration, seed), ROOT / "x.yaml").workload).arrival)
        for seed in range(1, 7)
    ]  # fmt: skip
    assert sum(counts) / len(counts) > 14, counts
