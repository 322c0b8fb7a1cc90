"""Deadlines: what a run did with requests that carried one, and the GPU time spent on lost causes.

A request with a deadline that completes after it was served for nothing: its GPU-seconds (at the
profile's saturation rates, for its true lengths; on a classical server, its service time) are wasted.
Door rejection (predicted late: never admitted) and post-queue shedding (admitted, still queued when the
deadline was lost: dropped before any GPU time) are the two ways to waste less; this counts both and what
was wasted anyway.

`deadline_waste` prices, per request, the GPU time spent on a request with a deadline that brought no
answer in time: the whole of an answer that came late, and the tokens prefilled and decoded before an abort
(shed past its deadline, or its client gone). The summary reports its sum per tier as `wasted_gpu_s`.
"""

from __future__ import annotations

import math

import numpy as np

from simadmit.results.records import true_cost
from simadmit.sim.ledger import ABORTED, COMPLETED
from simadmit.sim.simulation import RunResult
from simadmit.sim.world import World
from simadmit.workload.build import Workload


def deadline_waste(result: RunResult, workload: Workload, world: World) -> np.ndarray:
    """GPU-seconds (at the true profile's saturation rates; a classical server's service time) each request
    spent without answering by its deadline; 0 for requests without one, answered in time, or never served."""
    led = result.ledger
    has = np.isfinite(workload.deadline)
    outcome = np.asarray(led.outcome)
    late = has & (outcome == COMPLETED) & (np.asarray(led.finish, dtype=float) > workload.deadline)
    aborted = has & (outcome == ABORTED)
    pool = np.asarray(led.pool)
    prompt_done = np.asarray(led.aborted_prompt_done)
    output_done = np.asarray(led.aborted_output_done)
    rid = np.arange(len(workload))
    cost = true_cost(result, world, pool, rid, workload.prompt, workload.output)
    waste = np.where(late, cost, 0.0)
    scheduled = ~np.isnan(np.asarray(led.scheduled, dtype=float))
    for p, cfg in enumerate(world.pools):
        mine = aborted & (pool == p)
        if result.service_times(p) is not None:
            # a classical server runs an aborted request to the end of its service: all of it is lost
            waste[mine] = np.where(scheduled[mine], cost[mine], 0.0)
        else:
            waste[mine] = cfg.estimator.estimate_many(prompt_done[mine], output_done[mine])
    return waste


def deadline_report(result: RunResult, workload: Workload, world: World) -> dict[str, float]:
    """Counts and GPU-seconds over the requests that had a deadline (all arrivals, warm-up included)."""
    led = result.ledger
    has = np.isfinite(workload.deadline)
    finish = np.array(led.finish, dtype=float)
    done = np.array(led.outcome) == COMPLETED
    late = has & done & (finish > workload.deadline)
    cost = true_cost(
        result, world, np.asarray(led.pool), np.arange(len(workload)), workload.prompt, workload.output
    )
    served = has & done
    scheduled = np.array(led.scheduled, dtype=float)
    shed = np.zeros(len(workload), dtype=bool)
    shed[result.shed] = True
    shed_running = shed & ~np.isnan(scheduled)
    return {
        "with_deadline": int(has.sum()),
        "completed_in_time": int((served & ~late).sum()),
        "completed_late": int(late.sum()),
        "shed_queued": int((shed & np.isnan(scheduled)).sum()),  # dropped before any GPU time
        "shed_running": int(shed_running.sum()),  # aborted past their deadline, part of their work done
        "wasted_gpu_s": float(cost[late].sum()),  # the full cost of answers delivered late
        "wasted_share": float(cost[late].sum() / cost[served].sum()) if served.any() else math.nan,
        "shed_running_gpu_s_at_most": float(cost[shed_running].sum()),  # bound on the aborted ones' work
        "wasted_total_gpu_s": float(deadline_waste(result, workload, world).sum()),  # late + aborted work
    }
