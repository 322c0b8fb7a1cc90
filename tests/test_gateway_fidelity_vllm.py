"""The admission layer's fidelity, reduced: `replay` through one live `simadmit gateway` process in front of
the real vLLM CPU server, against `simulate` of the requests it sent (`benchmarks/gateway_fidelity.py` made
small: a short calibration, the capacity from one burst, two loads, two 20-second repeats each in rounds).

The target is a rejection rate within 2 points of the real one, plus the noise of the real side: a run of
~25-45 requests moves the rate by 2-4 points per request, so the allowance is the larger of the real repeats'
own range and twice the binomial standard error of their mean (at 30% rejected over 2 x 45 requests: ~10
points). With one gateway its books are exact, so the admitted work in flight (each admitted request's
estimate from send to last byte) may pass the budget line only by what the client's view of the intervals
adds: at most one request's estimate, when the client kept up (a client whose event loop lags by half a
second sees a whole batch of finishes late, and its intervals overlap by that much: that run's peak says
nothing about the gateway). The same plumbing is first checked on a fake server (no vLLM needed).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from benchmarks.fidelity import calibrate
from benchmarks.gateway_fidelity import (
    BUDGET_LINE,
    capacity,
    finish_point,
    prepare_point,
    replay_repeat,
    run_point,
)
from tests.fake_openai import fake_server
from tests.vllm_server import VllmServer

ROOT = Path(__file__).resolve().parents[1]

LOADS = (0.8, 1.5)
REPEATS = 2
DURATION_S = 20.0


def test_the_budget_measures_through_a_gateway_process_on_a_fake_server(tmp_path: Path) -> None:
    """The benchmark's plumbing on a fake vLLM (2.8 s per request): a `simadmit gateway` process, replay
    through it, the simulation beside it. The budget binds (some rejections); every admission carries the
    gateway's view (the work in flight before the request); with one gateway the view holds its exact books
    (an own request the backend runs before its first token counted twice, on the cautious side), so it
    never falls short of the truth before the admission by more than the client's view of the intervals
    adds (ms at each end: a small fraction of a request), and the work in flight passes the line by at most
    one request."""
    with fake_server(ttft_s=0.2, itl_s=0.04) as server:
        point = run_point(
            server.url,
            ROOT / "calibration" / "smollm2-135m-cpu.yaml",
            "gpu_seconds",
            1,
            8.0,
            6.0,
            1,
            tmp_path,
        )
    req = pd.read_parquet(tmp_path / "real" / "repeat-1" / "requests.parquet")
    admitted = req[req["decision"] == "admit"]
    assert (req["decision"] == "reject").any() and admitted["predicted_wait_s"].notna().all()
    (b,) = point.budgets
    assert b.view_gap_mean < 0.25 * b.largest_estimate, b
    assert point.sim_view_gap <= 1e-9  # the simulated gateway holds the same exact books
    assert b.peak <= BUDGET_LINE + b.largest_estimate, b
    assert abs(b.vllm_count_gap) < 1.0, b  # the fake counts its requests exactly


@pytest.fixture(scope="module")
def profile(vllm_server: VllmServer, engine_alone: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The pool budget keeps the batch near 16 sequences (16 running on average at 150%, at most 24), and a
    # 90 s calibration to 64 would not end within its budget's cap on this CPU.
    return calibrate(vllm_server.url, tmp_path_factory.mktemp("gateway-fidelity"), "90s", max_concurrency=16)


def allowance(real_mean: float, real_range: float, requests: int) -> float:
    """The real side's noise: its repeats' range, or twice the binomial standard error of their mean."""
    p = real_mean
    binomial = 2 * math.sqrt(max(p * (1 - p), 1 / requests) / (requests * REPEATS))
    return max(real_range, binomial)


@pytest.mark.vllm
@pytest.mark.timeout(1800)
@pytest.mark.xfail(
    reason="the rejection gap left follows the shared machine's speed between calibration and replay, both "
    "ways (up to 4.5 points at 1-1.5x capacity in the benchmark's recent runs, README), and a test's 20 s "
    "repeats share the engine's core with the test process: too close to the 2-point target plus the noise "
    "of ~45 requests to be a strict check",
    strict=False,
)
def test_one_gateway_rejects_as_simulated_at_two_loads(
    vllm_server: VllmServer, profile: Path, tmp_path: Path
) -> None:
    cap = capacity(vllm_server.url, profile, tmp_path, requests=24)
    planned = [
        prepare_point(profile, "gpu_seconds", 1, load * cap, DURATION_S, tmp_path / f"{load}")
        for load in LOADS
    ]
    for k in range(1, REPEATS + 1):  # in rounds, as the benchmark: a drift spreads over both loads
        for plan in planned:
            replay_repeat(vllm_server.url, profile, plan, k, None)
    misses = []
    for load, plan in zip(LOADS, planned, strict=True):
        point = finish_point(plan, REPEATS)
        table = point.table
        r = table[(table["tier"] == "all") & (table["measure"] == "rejection_rate")].iloc[0]
        tolerance = 0.02 + allowance(r["real_mean"], r["real_max"] - r["real_min"], point.requests)
        print(
            f"load {load:.0%} of {cap:.2f} req/s, {point.requests} requests: rejected sim {r['sim']:.1%}, "
            f"real {r['real_mean']:.1%} ({r['real_min']:.1%}-{r['real_max']:.1%}), tolerance {tolerance:.1%}"
        )
        if abs(r["sim"] - r["real_mean"]) > tolerance:
            misses.append((load, r["sim"], r["real_mean"], tolerance))
        for k, b in enumerate(point.budgets, 1):  # one gateway: its books are exact
            facts = json.loads((tmp_path / f"{load}" / "real" / f"repeat-{k}" / "replay.json").read_text())
            if facts["kept_up"]:  # a lagging client sees a batch's finishes late: its intervals overlap
                assert b.peak <= BUDGET_LINE + b.largest_estimate, (load, b)
    assert not misses, misses
