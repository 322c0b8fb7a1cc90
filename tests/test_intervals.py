"""Percentile intervals over replications, checked for coverage on M/M/1 (Lindley recursion, not the simulator).

M/M/1 at rho = 0.9: the sojourn time is exponential with rate mu - lambda, so its p99 is ln(100) / 0.1 =
46.05 s. Each block is 5 replications of 4,000 customers, each starting empty, like five short simulation
runs: short enough that a run's p99 is biased low and the customers are strongly autocorrelated.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from simadmit.results.histogram import ACCURACY, LatencyHistogram, pooled
from simadmit.results.intervals import pooled_quantile, t975

LAM, MU, REPLICATIONS, CUSTOMERS = 0.9, 1.0, 5, 4000
TRUE_P99 = math.log(100) / (MU - LAM)


def mm1_sojourn_times(rng: np.random.Generator, runs: int) -> np.ndarray:
    """`runs` independent M/M/1 FCFS runs from empty: row r holds run r's sojourn times in arrival order."""
    wait = np.zeros(runs)
    out = np.empty((CUSTOMERS, runs))
    for i in range(CUSTOMERS):
        service = rng.exponential(1 / MU, runs)
        out[i] = wait + service
        wait = np.maximum(0.0, wait + service - rng.exponential(1 / LAM, runs))  # Lindley
    return out.T


def test_histogram_quantiles_are_within_their_relative_accuracy() -> None:
    x = np.random.default_rng(0).lognormal(0.0, 2.0, 50_000)
    h = LatencyHistogram.of(x, missing=0)
    for q in (0.01, 0.5, 0.9, 0.99, 0.999):
        exact = np.quantile(x, q, method="inverted_cdf")
        assert h.quantile(q) == pytest.approx(exact, rel=ACCURACY * 1.001)


def test_missing_answers_count_as_infinite_latency() -> None:
    """99 answers in 1 s and one request never answered: p98 is 1 s, p99 still 1 s (rank 99), p99.5 is
    infinite over every arrival, and 1 s over the answered ones."""
    h = LatencyHistogram.of(np.ones(99), missing=1)
    assert h.quantile(0.99) == pytest.approx(1.0, rel=ACCURACY)
    assert h.quantile(0.995) == math.inf
    assert h.quantile(0.995, every_arrival=False) == pytest.approx(1.0, rel=ACCURACY)
    assert LatencyHistogram.of(np.ones(98), missing=2).quantile(0.99) == math.inf
    assert math.isnan(LatencyHistogram.of(np.array([])).quantile(0.5))


def test_pooling_histograms_is_pooling_samples() -> None:
    rng = np.random.default_rng(1)
    parts = [rng.exponential(s, 3000) for s in (0.1, 1.0, 10.0)]
    merged = pooled([LatencyHistogram.of(p, missing=i) for i, p in enumerate(parts)])
    direct = LatencyHistogram.of(np.concatenate(parts), missing=3)
    assert merged.quantile(0.9) == direct.quantile(0.9)
    assert merged.total() == direct.total() == 9003
    again = LatencyHistogram.from_json(merged.to_json())
    assert again.quantile(0.999) == merged.quantile(0.999)


def test_pooled_p99_interval_covers_the_true_p99() -> None:
    """The 95% interval covers the true p99 in at least 90% of 1,000 independent blocks.

    The method's coverage at this small size is 91-93% (1,000 blocks each for three other seeds, 92% over
    2,000 more; 5 replications leave 4 degrees of freedom to a skewed spread), so 1,000 blocks (a standard
    error of 0.9%) keep the 90% threshold about two standard errors below it. The old estimate (mean of per-run p99s with a
    t-interval) covers it in ~60% of blocks and is ~19% low: the test also checks that it fails."""
    rng = np.random.default_rng(2024)
    covered = old_covered = 0
    pooled_estimates, old_estimates = [], []
    blocks = 0
    for _chunk in range(10):  # 100 blocks at a time keeps memory small
        x = mm1_sojourn_times(rng, 100 * REPLICATIONS)
        for b in range(100):
            runs = x[b * REPLICATIONS : (b + 1) * REPLICATIONS]
            est = pooled_quantile([LatencyHistogram.of(r) for r in runs], 0.99, every_arrival=True)
            covered += est.low <= TRUE_P99 <= est.high
            pooled_estimates.append(est.value)
            per_run = np.quantile(runs, 0.99, axis=1)
            half = t975(REPLICATIONS - 1) * per_run.std(ddof=1) / math.sqrt(REPLICATIONS)
            old_covered += abs(per_run.mean() - TRUE_P99) <= half
            old_estimates.append(per_run.mean())
            blocks += 1
    assert covered / blocks >= 0.90, covered / blocks
    assert old_covered / blocks < 0.75
    assert np.mean(old_estimates) < 0.9 * TRUE_P99 < np.mean(pooled_estimates)


def test_one_replication_has_no_interval_and_empty_ones_are_counted() -> None:
    one = pooled_quantile([LatencyHistogram.of(np.arange(1.0, 201.0))], 0.99, every_arrival=True)
    assert one.value == pytest.approx(198.0, rel=ACCURACY) and math.isnan(one.low) and one.beyond == 2
    with_empty = pooled_quantile(
        [LatencyHistogram.of(np.arange(1.0, 201.0)), LatencyHistogram.of(np.array([]))], 0.5, True
    )
    assert with_empty.sections == 1 and math.isnan(with_empty.half_width)
