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


@pytest.mark.parametrize("max_queued", [0, 3])
def test_gateways_sharing_a_central_queue_each_see_its_length(max_queued: int) -> None:
    """M/M/2/(2 + max_queued) through three gateways (round-robin, each polling live, `view: metrics`) in
    front of one central dispatch queue: each sees the whole queue, not only its own requests in it, so
    `queue_depth` blocks as with one gateway (Erlang B at 0; 2/11 at 3). Counting only its own, each let
    in three times the queue (blocked 0.12 instead of 0.18 at 3). 3 x 50k arrivals: 5% (as above)."""
    blocked = np.array(
        [
            run(
                classical_scenario(
                    2.0,
                    {"kind": "exponential", "mean": 1.0},
                    2,
                    50_000,
                    policy={"kind": "queue_depth", "max_queued": max_queued},
                    warmup_s=100,
                    seed=s,
                    gateways=3,
                )  # fmt: skip
            ).summary["queue_depth"]["all"]["rejection_rate"]
            for s in range(3)
        ]
    )
    assert blocked.mean() == pytest.approx(mmck_blocking(2.0, 1.0, 2, 2 + max_queued), rel=0.05)


def test_the_work_of_a_classical_server_is_its_service_time() -> None:
    """GPU work (`work_utilization`) on a textbook server is the offered load rho = lambda E[S] / c: each
    request's work is its service time, not a price the profile puts on its tokens (which read 0.0004 here).

    M/M/2 at rho = 0.8 through the central queue: every completed request holds its server for exactly its
    service, so the work spread over its time in the server equals the busy time in the window, whatever
    the sample (identity to rounding); and the busy fraction over 20k customers is within a few standard
    errors (about 1%) of 0.8, held to 5%.
    """
    m = run(classical_scenario(1.6, {"kind": "exponential", "mean": 1.0}, 2, 20_000, warmup_s=100)).summary[
        "unconditional"
    ]["all"]
    assert m["work_utilization"] == pytest.approx(m["utilization"], rel=1e-9)
    assert m["paid_work_utilization"] == pytest.approx(m["utilization"], rel=1e-9)
    assert m["work_utilization"] == pytest.approx(0.8, rel=0.05)


def test_time_a_classical_server_spent_on_late_answers_is_its_service_time() -> None:
    """M/M/1 at rho = 0.9 with a 5 s deadline: a third of the answers come late. What was wasted on them is
    the time they held the server (finish - scheduled, their service), nothing priced from tokens."""
    result = run(
        classical_scenario(
            0.9, {"kind": "exponential", "mean": 1.0}, 1, 5_000, warmup_s=100, deadline_s=5.0
        ),
        tables=True,
    )  # fmt: skip
    req = result.requests
    req = req[(req["arrival_s"] >= 100) & (req["decision"] == "admit")]
    late = req[(req["outcome"] == "completed") & (req["e2e_s"] > 5.0)]
    assert len(late) > 0.1 * len(req)
    wasted = result.summary["unconditional"]["all"]["wasted_gpu_s"]
    assert wasted == pytest.approx((late["finish_s"] - late["scheduled_s"]).sum(), rel=1e-9)
