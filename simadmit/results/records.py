"""Records: the tables a run leaves behind, built from its ledger after the run.

`requests_frame`: one row per attempt (a retried request has several), with the request's times and final
outcome on the row of the attempt that was admitted. `timeseries_frame`: one row per second of simulated
time with arrivals, admits, rejects, queued and running requests, in-flight GPU-seconds, utilization and
serving replicas.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from simadmit.sim.ledger import OUTCOMES
from simadmit.sim.simulation import RunResult
from simadmit.sim.world import World
from simadmit.workload.build import Workload


def request_table(result: RunResult, workload: Workload, world: World) -> pd.DataFrame:
    """One row per request: lengths, times, outcome and the derived TTFT, E2E and queue wait."""
    led = result.ledger
    pool = np.asarray(led.pool)
    routed = np.asarray(world.pool_of_tier, dtype=int)[workload.tier]
    # each request's estimate in the pool it was routed to (np.choose takes at most 64 pools)
    est = np.asarray(result.estimates)[routed, np.arange(len(routed))] if len(routed) else np.zeros(0)
    df = pd.DataFrame(
        {
            "request_id": np.arange(len(workload)),
            "tier": pd.Categorical.from_codes(workload.tier, pd.Index(workload.tier_names)),
            "pool": pd.Categorical.from_codes(routed, pd.Index([p.name for p in world.pools])),
            "arrival_s": workload.arrival,
            "prompt_tokens": workload.prompt,
            "max_tokens": workload.max_tokens,
            "output_tokens": workload.output,
            "estimate_gpu_s": est,
            "attempts": np.asarray(led.attempts),
            "admit_s": np.asarray(led.admit),
            "scheduled_s": np.asarray(led.scheduled),
            "first_token_s": np.asarray(led.first_token),
            "finish_s": np.asarray(led.finish),
            "replica": np.where(pool >= 0, np.asarray(led.replica), -1),
            "preemptions": np.asarray(led.preemptions),
            "outcome": pd.Categorical.from_codes(np.asarray(led.outcome), pd.Index(OUTCOMES)),
        }
    )
    completed = df["outcome"] == "completed"
    df["ttft_s"] = (df["first_token_s"] - df["arrival_s"]).where(completed)
    df["e2e_s"] = (df["finish_s"] - df["arrival_s"]).where(completed)
    df["queue_wait_s"] = df["scheduled_s"] - df["admit_s"]
    return df


def requests_frame(result: RunResult, req: pd.DataFrame) -> pd.DataFrame:
    """One row per attempt: the gateway's decision, joined with the request's fate (`request_table`)."""
    led = result.ledger
    att = pd.DataFrame(
        {
            "request_id": np.asarray(led.att_rid, dtype=np.int64),
            "attempt_s": np.asarray(led.att_time, dtype=float),
            "gateway": np.asarray(led.att_gateway, dtype=np.int64),
            "reason": pd.Categorical(led.att_reason),
            "retry_after_s": np.asarray(led.att_retry_after, dtype=float),
            "predicted_wait_s": np.asarray(led.att_predicted_wait, dtype=float),
        }
    )
    att["attempt"] = att.groupby("request_id").cumcount() + 1
    att["decision"] = np.where(att["reason"] == "admitted", "admit", "reject")
    df = att.merge(req, on="request_id", how="left")
    admitted = df["decision"] == "admit"
    for col in ("admit_s", "scheduled_s", "first_token_s", "finish_s", "ttft_s", "e2e_s", "queue_wait_s"):
        df.loc[~admitted, col] = np.nan
    df.insert(0, "policy", result.policy)
    df.insert(1, "seed", result.seed)
    cols = ["policy", "seed", "request_id", "attempt", "tier", "pool", "gateway", "arrival_s", "attempt_s",
            "decision", "reason", "retry_after_s", "predicted_wait_s", "admit_s", "scheduled_s", "first_token_s",
            "finish_s", "prompt_tokens", "max_tokens", "output_tokens", "estimate_gpu_s", "replica", "preemptions",
            "outcome", "ttft_s", "e2e_s", "queue_wait_s"]  # fmt: skip
    return df[cols]


def true_cost(
    result: RunResult, world: World, pool: np.ndarray, rid: np.ndarray, prompt: np.ndarray, output: np.ndarray
) -> np.ndarray:
    """GPU-seconds of work each request (`rid`, served by pool index `pool`, with its true lengths) takes:
    at its pool's profile's saturation rates; on a classical server, whose work is no function of tokens,
    its service time (times the replica's GPUs), the time it holds its server. Requests of no pool: 0."""
    cost = np.zeros(len(rid))
    for p, cfg in enumerate(world.pools):
        mine = pool == p
        service = result.service_times(p)
        if service is not None:
            cost[mine] = service[rid[mine]] * cfg.gpus_per_replica
        else:
            cost[mine] = cfg.estimator.estimate_many(prompt[mine], output[mine])
    return cost


def busy_seconds_until(periods: list[tuple[float, float]], t: np.ndarray) -> np.ndarray:
    """Total busy time in [0, t] for each t, given one replica's disjoint, sorted busy periods."""
    if not periods:
        return np.zeros_like(t)
    arr = np.asarray(periods, dtype=float)
    starts, ends = arr[:, 0], arr[:, 1]
    done = np.concatenate([[0.0], np.cumsum(ends - starts)])
    k = np.searchsorted(ends, t, side="right")  # periods over by t
    busy = done[k]
    straddle = (k < len(starts)) & (starts[np.minimum(k, len(starts) - 1)] < t)
    busy += np.where(straddle, t - starts[np.minimum(k, len(starts) - 1)], 0.0)
    return busy


def utilization(result: RunResult, world: World, start: float, end: float, pool: int | None = None) -> float:
    """Fraction of replica-time in [start, end] spent running engine steps (what GPU dashboards show)."""
    if end <= start:
        return float("nan")
    busy, alive = 0.0, 0.0
    for p, periods in enumerate(result.busy_periods):
        if pool is not None and p != pool:
            continue
        for per, (born, retired) in zip(periods, result.lifetimes[p], strict=True):
            b = busy_seconds_until(per, np.array([start, end]))
            busy += float(b[1] - b[0])
            alive += max(0.0, min(end, retired) - max(start, born))
    return busy / alive if alive > 0 else float("nan")


def serving_replicas(result: RunResult, t: np.ndarray) -> np.ndarray:
    """Replicas serving (ready, not draining) at each time t, summed over pools."""
    total = np.zeros(len(t))
    for log in result.replica_log:
        times = np.array([e[0] for e in log])
        serving = np.array([e[1] for e in log])
        k = np.searchsorted(times, t, side="right") - 1
        total += np.where(k >= 0, serving[np.maximum(k, 0)], 0)
    return total


def timeseries_frame(result: RunResult, req: pd.DataFrame) -> pd.DataFrame:
    """Per second of simulated time: traffic, decisions, queue and batch occupancy, in-flight work, utilization."""
    end = max(1, int(np.ceil(result.end_s)))
    grid = np.arange(end + 1, dtype=float)
    led = result.ledger
    att_t = np.asarray(led.att_time, dtype=float)
    admitted = np.asarray([r == "admitted" for r in led.att_reason], dtype=bool)
    bins = np.arange(end + 1, dtype=float)
    arrivals = np.histogram(att_t, bins)[0]
    admits = np.histogram(att_t[admitted], bins)[0]
    rejects = arrivals - admits
    adm = req["admit_s"].to_numpy()
    ok = ~np.isnan(adm)
    adm = adm[ok]
    sched = req["scheduled_s"].to_numpy()[ok]
    fin = req["finish_s"].to_numpy()[ok]
    fin = np.where(np.isnan(fin), np.inf, fin)
    left_queue = np.where(np.isnan(sched), fin, sched)
    est = req["estimate_gpu_s"].to_numpy()[ok]
    t = grid[1:]

    def count_at(times: np.ndarray) -> np.ndarray:
        return np.searchsorted(np.sort(times), t, side="right")

    queued = count_at(adm) - count_at(left_queue)
    running = count_at(left_queue[~np.isnan(sched)]) - count_at(fin[~np.isnan(sched)])
    order_in, order_out = np.argsort(adm), np.argsort(fin)
    cum_in = np.concatenate([[0.0], np.cumsum(est[order_in])])
    cum_out = np.concatenate([[0.0], np.cumsum(est[order_out])])
    in_flight = (
        cum_in[np.searchsorted(adm[order_in], t, side="right")]
        - cum_out[np.searchsorted(fin[order_out], t, side="right")]
    )
    busy = np.zeros_like(grid)
    for periods in result.busy_periods:
        for per in periods:
            busy += busy_seconds_until(per, grid)
    replicas = serving_replicas(result, grid[:-1] + 0.5)
    util = np.diff(busy) / np.maximum(replicas, 1)
    return pd.DataFrame(
        {
            "policy": result.policy,
            "seed": result.seed,
            "t_s": grid[:-1],
            "arrivals": arrivals,
            "admits": admits,
            "rejects": rejects,
            "queued": queued,
            "running": running,
            "in_flight_gpu_s": np.maximum(in_flight, 0.0),
            "utilization": util,
            "replicas": replicas,
        }
    )
