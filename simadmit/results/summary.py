"""Summary: the measures of a run per policy and tier, and their confidence intervals across seeds.

Measures (defined once, as in the README): TTFT = first token - first arrival (retries included);
E2E = finish - first arrival; queue wait = first scheduled in an engine step - admission; utilization =
fraction of replica-time running steps (what a GPU dashboard shows: near 100% as soon as a continuous-batching
engine always has a request); work utilization = GPU-seconds of completed work at the profile's saturation
rates / GPU-seconds available (the x-axis of p99-vs-utilization curves); goodput = completed requests meeting their tier's TTFT and E2E SLO,
per second. Requests that arrive during the warm-up are left out.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from simadmit.results.records import utilization
from simadmit.sim.simulation import RunResult
from simadmit.sim.world import World
from simadmit.workload.build import Workload

# two-sided 95% Student t quantiles for 1..30 degrees of freedom
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)  # fmt: skip


def _pct(x: np.ndarray, q: float) -> float:
    return float(np.percentile(x, q)) if len(x) else math.nan


def tier_measures(
    req: pd.DataFrame,
    completed_any: pd.DataFrame,
    window: tuple[float, float],
    util: float,
    gpu_s: float,
    ttft_slo: float,
    e2e_slo: float,
) -> dict:
    """The measures of one group of requests (a tier, or all) that arrived in the measurement window.

    Throughput and work utilization are about the window itself, whenever the requests arrived
    (`completed_any`): throughput counts completions inside it, work utilization the work done inside it
    (each request's cost spread evenly over its time in the engine). A backlog drained after the traffic
    stopped does not inflate them, and warm-up arrivals served inside the window are not lost.
    """
    n = len(req)
    window_s = window[1] - window[0]
    done_in_window = completed_any[completed_any["finish_s"].between(*window)]
    start, finish = completed_any["scheduled_s"].to_numpy(), completed_any["finish_s"].to_numpy()
    inside = np.clip(np.minimum(finish, window[1]) - np.maximum(start, window[0]), 0.0, None)
    share = np.where(finish > start, inside / np.maximum(finish - start, 1e-12), 0.0)
    work_done = float((completed_any["true_cost_gpu_s"].to_numpy() * share).sum())
    outcome = req["outcome"]
    completed = req[outcome == "completed"]
    ttft = completed["ttft_s"].to_numpy()
    e2e = completed["e2e_s"].to_numpy()
    wait = req["queue_wait_s"].dropna().to_numpy()
    good = int(((ttft <= ttft_slo) & (e2e <= e2e_slo)).sum())
    counts = {name: int((outcome == name).sum()) for name in ("completed", "rejected", "abandoned", "aborted",
                                                                 "in_flight", "too_long")}  # fmt: skip
    admitted = int(req["admit_s"].notna().sum())
    attempts = int(req["attempts"].sum())
    return {
        "requests": n,
        "attempts": int(req["attempts"].sum()),
        "admitted": admitted,
        **counts,
        "rejection_rate": (counts["rejected"] + counts["too_long"]) / n if n else math.nan,
        "attempt_rejection_rate": 1 - admitted / req["attempts"].sum() if n else math.nan,
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p90_s": _pct(ttft, 90),
        "ttft_p99_s": _pct(ttft, 99),
        "e2e_p50_s": _pct(e2e, 50),
        "e2e_p90_s": _pct(e2e, 90),
        "e2e_p99_s": _pct(e2e, 99),
        "queue_wait_mean_s": float(wait.mean()) if len(wait) else math.nan,
        "queue_wait_p99_s": _pct(wait, 99),
        "utilization": util,
        "work_utilization": work_done / gpu_s,
        "goodput_rps": good / window_s,
        "slo_attainment": good / n if n else math.nan,
        "offered_rps": n / window_s,
        "carried_rps": attempts / window_s,
        "admitted_rps": admitted / window_s,
        "retries_per_request": (attempts - n) / n if n else math.nan,
        "throughput_rps": len(done_in_window) / window_s,
        "output_tokens_per_s": float(done_in_window["output_tokens"].sum()) / window_s,
    }


def measurement_window(workload: Workload, world: World) -> tuple[float, float]:
    """From the end of the warm-up to the last arrival: the span whose traffic the summary describes."""
    last = float(workload.arrival[-1]) if len(workload) else 0.0
    return world.warmup_s, max(last, world.warmup_s + 1e-9)


def run_summary(result: RunResult, workload: Workload, world: World, req: pd.DataFrame) -> dict[str, dict]:
    """Measures per tier and for all requests ("all") of one run, from its `records.request_table`."""
    req = req.assign(true_cost_gpu_s=_true_cost(req, world))
    start, end = measurement_window(workload, world)
    completed = req[req["outcome"] == "completed"]
    req = req[req["arrival_s"] >= start]
    window = end - start
    gpu_s = [_gpu_seconds(result, cfg.gpus_per_replica, p, start, end) for p, cfg in enumerate(world.pools)]
    out = {}
    for t, name in enumerate(world.tier_names):
        pool = world.pool_of_tier[t]
        cfg = world.pools[pool]
        out[name] = tier_measures(
            req[req["tier"] == name],
            completed[completed["tier"] == name],
            (start, end),
            utilization(result, world, start, end, pool),
            gpu_s[pool],
            world.tier_ttft_slo[t],
            world.tier_e2e_slo[t],
        )
    everything = tier_measures(
        req, completed, (start, end), utilization(result, world, start, end), sum(gpu_s), math.inf, math.inf
    )
    tiers = out.values()
    everything["goodput_rps"] = sum(m["goodput_rps"] for m in tiers)
    everything["slo_attainment"] = sum(m["goodput_rps"] for m in tiers) * window / max(len(req), 1)
    true = float(req["true_cost_gpu_s"].sum())
    everything["estimate_over_true_cost"] = (
        float(req["estimate_gpu_s"].sum()) / true if true > 0 else math.nan
    )
    out["all"] = everything
    for p, cfg in enumerate(world.pools):
        log = result.replica_log[p]
        times = np.array([e[0] for e in log] + [result.end_s])
        serving = np.array([e[1] for e in log], dtype=float)
        spans = np.clip(times[1:], start, end) - np.clip(times[:-1], start, end)
        out[f"pool:{cfg.name}"] = {
            "utilization": utilization(result, world, start, end, p),
            "peak_in_flight_gpu_s": result.peak_in_flight_gpu_s[p],
            "replicas_mean": float((serving * spans).sum() / window),
            "replicas_max": float(serving.max()),
        }
    return out


def _gpu_seconds(result: RunResult, gpus_per_replica: int, pool: int, start: float, end: float) -> float:
    """GPU-seconds a pool's serving replicas offered in [start, end]."""
    alive = sum(max(0.0, min(end, b) - max(start, a)) for a, b in result.lifetimes[pool])
    return alive * gpus_per_replica


def _true_cost(req: pd.DataFrame, world: World) -> np.ndarray:
    """GPU-seconds each request really needs at saturation rates: its actual output, not max_tokens."""
    cost = np.zeros(len(req))
    for cfg in world.pools:
        mine = (req["pool"] == cfg.name).to_numpy()
        cost[mine] = cfg.estimator.estimate_many(
            req["prompt_tokens"].to_numpy()[mine], req["output_tokens"].to_numpy()[mine]
        )
    return cost


def combine(replications: list[dict[str, dict]]) -> dict[str, dict]:
    """Mean of each measure over replications, with a 95% t confidence half-width when there are several."""
    out: dict[str, dict] = {}
    for group in replications[0]:
        measures: dict[str, object] = {}
        for key in replications[0][group]:
            values = np.array([r[group][key] for r in replications], dtype=float)
            values = values[~np.isnan(values)]
            mean = float(values.mean()) if len(values) else math.nan
            measures[key] = mean
            if len(replications) > 1:
                k = len(values) - 1
                half = math.nan
                if k >= 1:
                    t = _T975[k - 1] if k <= len(_T975) else 1.96
                    half = float(t * values.std(ddof=1) / math.sqrt(len(values)))
                measures[f"{key}_ci95"] = half
        out[group] = measures
    return out
