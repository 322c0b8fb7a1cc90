"""The simulator, run as a textbook queue, against queueing theory.

Each check runs several seeds with a warm-up cut off and compares the mean over seeds with the closed
form. Tolerances are sized from the sample: at rho = 0.9 the waiting times are strongly autocorrelated,
so the standard error of a mean over n customers is sqrt(Var_asymptotic / n), not sigma / sqrt(n).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.helpers import classical_scenario, run
from tests.queueing import (
    md1_mean_wait,
    mm1_mean_wait_variance,
    mm1_sojourn_quantile,
    mmc_mean_wait,
    mmck_blocking,
)

EXP1 = {"kind": "exponential", "mean": 1.0}
SEEDS = range(4)


def per_seed(spec_for_seed, policy: str, measure: str) -> np.ndarray:
    return np.array([run(spec_for_seed(s)).summary[policy]["all"][measure] for s in SEEDS])


def test_mm1_mean_wait_and_sojourn_p99_at_rho_0_9() -> None:
    """M/M/1, rho = 0.9, immediate routing to the engine's own FCFS queue.

    Mean wait 9 s. With 4 x 250k customers the standard error of the mean is sqrt(35,900 / 1e6) = 0.19 s
    (2.1%, Whitt's asymptotic variance): 7% is over 3 standard errors. The sojourn time is exponential with
    rate mu - lambda = 0.1, so p99 = 46.05 s; a p99 over 250k autocorrelated customers varies by about 8%
    between seeds, so the mean of 4 seeds is held to 3 standard errors of that spread plus a 3% allowance
    for the small-sample bias of a high quantile, and never beyond 15%.
    """
    lam, mu, n = 0.9, 1.0, 250_000

    def spec(seed: int):
        return classical_scenario(lam, EXP1, 1, n, dispatch="immediate", warmup_s=2000, seed=seed)

    results = [run(spec(s)).summary["unconditional"]["all"] for s in SEEDS]
    waits = np.array([r["queue_wait_mean_s"] for r in results])
    expected = mmc_mean_wait(lam, mu, 1)
    se = math.sqrt(mm1_mean_wait_variance(lam, mu, n * len(SEEDS)))
    assert abs(waits.mean() - expected) < max(0.07 * expected, 3 * se)
    p99 = np.array([r["e2e_p99_s"] for r in results])
    theory = mm1_sojourn_quantile(lam, mu, 0.99)
    tol = min(0.15 * theory, 3 * p99.std(ddof=1) / math.sqrt(len(p99)) + 0.03 * theory)
    assert abs(p99.mean() - theory) < tol, (p99, theory)
    utilization = np.array([r["utilization"] for r in results])
    assert utilization.mean() == pytest.approx(lam / mu, abs=0.01)


def test_mmc_mean_wait_erlang_c_central_queue() -> None:
    """M/M/4, rho = 0.9, one central queue feeding 4 servers: Erlang C gives W_q = 1.97 s.

    The relaxation time of M/M/c shrinks with c, so 4 x 200k customers give a standard error near 2%; 7%.
    """
    lam, mu, c = 3.6, 1.0, 4
    waits = per_seed(
        lambda s: classical_scenario(lam, EXP1, c, 200_000, warmup_s=1000, seed=s),
        "unconditional",
        "queue_wait_mean_s",
    )
    assert waits.mean() == pytest.approx(mmc_mean_wait(lam, mu, c), rel=0.07)


def test_mmc_with_immediate_routing_is_worse_than_a_central_queue() -> None:
    """Routing at once to per-replica queues (join the shortest queue) is not M/M/c: it waits longer
    than Erlang C, yet far less than c separate M/M/1 queues with random routing (W_q = 9 s)."""
    lam, c = 3.6, 4
    waits = per_seed(
        lambda s: classical_scenario(lam, EXP1, c, 100_000, dispatch="immediate", warmup_s=1000, seed=s),
        "unconditional",
        "queue_wait_mean_s",
    )
    assert mmc_mean_wait(lam, 1.0, c) * 1.05 < waits.mean() < mmc_mean_wait(lam / c, 1.0, 1) / 2


def test_mmck_blocking_probability_with_queue_depth_policy() -> None:
    """M/M/2/5: `queue_depth` with 3 waiting places in front of 2 servers, a = 2 Erlang.

    By PASTA the share of rejected arrivals is the probability the system is full, 2/11 = 0.1818. Over
    4 x 150k arrivals the binomial standard error is 0.0005 (inflated a few times by autocorrelation): 4%.
    """
    rates = per_seed(
        lambda s: classical_scenario(
            2.0, EXP1, 2, 150_000, policy={"kind": "queue_depth", "max_queued": 3}, warmup_s=100, seed=s
        ),
        "queue_depth",
        "rejection_rate",
    )
    assert rates.mean() == pytest.approx(mmck_blocking(2.0, 1.0, 2, 5), rel=0.04)


def test_md1_mean_wait_pollaczek_khinchine() -> None:
    """M/D/1 at rho = 0.9: W_q = rho D / (2 (1 - rho)) = 4.5 s, about half the M/M/1 wait; seeds spread by
    about 3%, so 4 x 200k customers are held to 6%."""
    waits = per_seed(
        lambda s: classical_scenario(0.9, {"kind": "fixed", "value": 1.0}, 1, 200_000, warmup_s=1000, seed=s),
        "unconditional",
        "queue_wait_mean_s",
    )
    assert waits.mean() == pytest.approx(md1_mean_wait(0.9, 1.0), rel=0.06)
