"""Settings mean what a queueing person means: checked against theory on the textbook server.

A default must never change the distribution a user wrote (a log-normal service time is not clipped unless
the user asks), and `max_queued: 0` is a loss system, M/M/c/c, whose blocking probability is Erlang B.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from tests.helpers import classical_scenario, run
from tests.queueing import mmck_blocking

SEEDS = range(4)


def test_a_lognormal_service_time_keeps_its_mean_without_a_min() -> None:
    """Log-normal service, median 0.5 s and sigma 1: mean 0.5 e^0.5 = 0.824 s, so lambda = 0.971 is rho = 0.8.

    Clipping at 1 s (a default minimum) would make every service at least 1 s and rho about 1.2. The
    busy fraction over 4 x 20k customers has a standard error near 1% (service CV 1.31, Poisson counts),
    so it is held to 5% of 0.8.
    """
    service = {"kind": "lognormal", "median": 0.5, "sigma": 1.0}
    mean = 0.5 * math.exp(0.5)
    lam = 0.8 / mean
    busy = np.array(
        [
            run(classical_scenario(lam, service, 1, 20_000, warmup_s=100, seed=s)).summary["unconditional"][
                "all"
            ]["utilization"]
            for s in SEEDS
        ]
    )
    assert busy.mean() == pytest.approx(0.8, rel=0.05)


def test_max_queued_zero_is_a_loss_system_erlang_b() -> None:
    """M/M/2/2: no waiting room in front of 2 servers at a = 2 Erlang. Erlang B gives 2/5 = 0.4 blocked, and
    nobody admitted waits. Over 4 x 50k arrivals the binomial standard error is 0.001 (a few times more
    with autocorrelation): 4%, as for M/M/c/K in tests/test_theory.py."""
    results = [
        run(
            classical_scenario(
                2.0,
                {"kind": "exponential", "mean": 1.0},
                2,
                50_000,
                policy={"kind": "queue_depth", "max_queued": 0},
                warmup_s=100,
                seed=s,
            )  # fmt: skip
        ).summary["queue_depth"]["all"]
        for s in SEEDS
    ]
    blocked = np.array([r["rejection_rate"] for r in results])
    assert blocked.mean() == pytest.approx(mmck_blocking(2.0, 1.0, 2, 2), rel=0.04)
    assert max(r["queue_wait_mean_s"] for r in results) < 1e-9
