"""The admission layer's fidelity, reduced: `replay` through one live `simadmit gateway` process in front of
the real vLLM CPU server, against `simulate` of the requests it sent (`benchmarks/gateway_fidelity.py` made
small: a short calibration, the capacity from one burst, two loads, two 20-second repeats each).

The target is a rejection rate within 2 points of the real one, plus the noise of the real side: a run of
~25-45 requests moves the rate by 2-4 points per request, so the allowance is the larger of the real repeats'
own range and twice the binomial standard error of their mean (at 30% rejected over 2 x 45 requests: ~10
points). With one gateway its books are exact, so the admitted work in flight (each admitted request's
estimate from send to last byte) may pass the budget line only by what the client's view of the intervals
adds: at most one request's estimate.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchmarks.fidelity import calibrate
from benchmarks.gateway_fidelity import BUDGET_LINE, capacity, run_point
from tests.vllm_server import VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

LOADS = (0.8, 1.5)
REPEATS = 2
DURATION_S = 20.0


@pytest.fixture(scope="module")
def profile(vllm_server: VllmServer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return calibrate(vllm_server.url, tmp_path_factory.mktemp("gateway-fidelity"), "45s")


def allowance(real_mean: float, real_range: float, requests: int) -> float:
    """The real side's noise: its repeats' range, or twice the binomial standard error of their mean."""
    p = real_mean
    binomial = 2 * math.sqrt(max(p * (1 - p), 1 / requests) / (requests * REPEATS))
    return max(real_range, binomial)


def test_one_gateway_rejects_as_simulated_at_two_loads(
    vllm_server: VllmServer, profile: Path, tmp_path: Path
) -> None:
    cap = capacity(vllm_server.url, profile, tmp_path, requests=24)
    misses = []
    for load in LOADS:
        point = run_point(
            vllm_server.url, profile, "gpu_seconds", 1, load * cap, DURATION_S, REPEATS, tmp_path / f"{load}"
        )
        table = point.table
        r = table[(table["tier"] == "all") & (table["measure"] == "rejection_rate")].iloc[0]
        tolerance = 0.02 + allowance(r["real_mean"], r["real_max"] - r["real_min"], point.requests)
        print(
            f"load {load:.0%} of {cap:.2f} req/s, {point.requests} requests: rejected sim {r['sim']:.1%}, "
            f"real {r['real_mean']:.1%} ({r['real_min']:.1%}-{r['real_max']:.1%}), tolerance {tolerance:.1%}"
        )
        if abs(r["sim"] - r["real_mean"]) > tolerance:
            misses.append((load, r["sim"], r["real_mean"], tolerance))
        for b in point.budgets:  # one gateway: its books are exact
            assert b.peak <= BUDGET_LINE + b.largest_estimate, (load, b)
    assert not misses, misses
