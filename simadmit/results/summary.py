"""Summary: the measures of a run per policy and tier, and how they combine across replications.

Measures (defined once, as in the README's "Measures, defined once"): TTFT = first token - first arrival
(retries included); E2E = finish - first arrival. `ttft_p99_s` and the other latency percentiles count
every arrival of the measurement window: a request that never got its answer (rejected after its retries,
abandoned, aborted, too long, still in flight) counts as an infinite latency, so a p99 is finite only when
fewer than 1% of requests failed; `served_ttft_p99_s` and its kin are over completed requests only, reported
beside them. `failure_rate` = requests never answered / requests; `rejection_rate` counts only the refused
ones (429 after every retry, or 400 too long). Queue wait = first scheduled in an engine step - admission.
Utilization = fraction of replica-time running steps (what a GPU dashboard shows: near 100% as soon as a
continuous-batching engine always has a request); work utilization = GPU-seconds of completed work at the
profile's saturation rates / GPU-seconds the ready replicas offered (the x-axis of p99-vs-utilization
curves), and paid work utilization the same work / GPU-seconds paid for, cold starts included; goodput = completed requests meeting their tier's TTFT and E2E SLO, per second. Wasted GPU-seconds
= GPU time (at saturation rates) spent on requests with a deadline that brought no answer by it: answers
that came late, and the work done on requests aborted mid-service (`results.deadlines.deadline_waste`);
wasted share = that / the GPU-seconds the ready replicas offered. Requests that arrive during the warm-up
are left out.

Each run keeps its latencies as `LatencyHistogram`s (under `DISTRIBUTIONS`), so that a percentile over
several replications is the pooled sample's quantile with a sectioning interval (`results.intervals`),
not the mean of each run's percentile.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from simadmit.results.deadlines import deadline_waste
from simadmit.results.histogram import LatencyHistogram
from simadmit.results.intervals import FEW_BEYOND, pooled_quantile, t975
from simadmit.results.records import true_cost, utilization
from simadmit.sim.simulation import RunResult
from simadmit.sim.world import World
from simadmit.workload.build import Workload

DISTRIBUTIONS = "distributions"  # a run's latency histograms, per group: not a measure
# percentile measure -> (histogram, quantile, over every arrival)
PERCENTILES = {
    **{f"{m}_p{p}_s": (f"{m}_s", p / 100, True) for m in ("ttft", "e2e") for p in (50, 90, 99)},
    **{f"served_{m}_p{p}_s": (f"{m}_s", p / 100, False) for m in ("ttft", "e2e") for p in (50, 90, 99)},
    "queue_wait_p99_s": ("queue_wait_s", 0.99, False),
}
FAILED = ("rejected", "abandoned", "aborted", "in_flight", "too_long")


def tier_measures(
    req: pd.DataFrame,
    completed_any: pd.DataFrame,
    window: tuple[float, float],
    util: float,
    gpu_s: tuple[float, float],
    ttft_slo: float,
    e2e_slo: float,
) -> dict:
    """The measures of one group of requests (a tier, or all) that arrived in the measurement window.

    Throughput and work utilization are about the window itself, whenever the requests arrived
    (`completed_any`): throughput counts completions inside it, work utilization the work done inside it
    (each request's cost spread evenly over its time in the engine). A backlog drained after the traffic
    stopped does not inflate them, and warm-up arrivals served inside the window are not lost. `gpu_s` is
    (GPU-seconds the ready replicas offered, GPU-seconds paid for: cold starts and draining included).
    """
    n = len(req)
    window_s = window[1] - window[0]
    done_in_window = finished_in(completed_any, window)
    start, finish = completed_any["scheduled_s"].to_numpy(), completed_any["finish_s"].to_numpy()
    inside = np.clip(np.minimum(finish, window[1]) - np.maximum(start, window[0]), 0.0, None)
    share = np.where(finish > start, inside / np.maximum(finish - start, 1e-12), 0.0)
    work_done = float((completed_any["true_cost_gpu_s"].to_numpy() * share).sum())
    completed = req[req["outcome"] == "completed"]
    ttft = completed["ttft_s"].to_numpy()
    e2e = completed["e2e_s"].to_numpy()
    wait = req["queue_wait_s"].dropna().to_numpy()
    wasted = float(req["wasted_gpu_s"].sum())
    good = int(((ttft <= ttft_slo) & (e2e <= e2e_slo)).sum())
    admitted = int(req["admit_s"].notna().sum())
    attempts = int(req["attempts"].sum())
    histograms = latency_histograms(req)
    return {
        "requests": n,
        "attempts": attempts,
        "admitted": admitted,
        **outcome_measures(req["outcome"]),
        "attempt_rejection_rate": 1 - admitted / attempts if n else math.nan,
        **percentiles(histograms, PERCENTILES),
        "queue_wait_mean_s": float(wait.mean()) if len(wait) else math.nan,
        "utilization": util,
        "work_utilization": work_done / gpu_s[0] if gpu_s[0] > 0 else math.nan,
        "paid_work_utilization": work_done / gpu_s[1] if gpu_s[1] > 0 else math.nan,
        "wasted_gpu_s": wasted,
        "wasted_share": wasted / gpu_s[0] if gpu_s[0] > 0 else math.nan,
        "goodput_rps": good / window_s,
        "slo_attainment": good / n if n else math.nan,
        "offered_rps": n / window_s,
        "carried_rps": attempts / window_s,
        "admitted_rps": admitted / window_s,
        "retries_per_request": (attempts - n) / n if n else math.nan,
        "throughput_rps": len(done_in_window) / window_s,
        "output_tokens_per_s": float(done_in_window["output_tokens"].sum()) / window_s,
        DISTRIBUTIONS: {name: h.to_json() for name, h in histograms.items()},
    }


def outcome_measures(outcome: pd.Series) -> dict[str, float]:
    """Requests per outcome, `failure_rate` (never answered) and `rejection_rate` (refused) of a group."""
    n = len(outcome)
    counts = {name: int((outcome == name).sum()) for name in ("completed", *FAILED)}
    return {
        **counts,
        "failure_rate": (n - counts["completed"]) / n if n else math.nan,
        "rejection_rate": (counts["rejected"] + counts["too_long"]) / n if n else math.nan,
    }


def latency_histograms(req: pd.DataFrame) -> dict[str, LatencyHistogram]:
    """TTFT and E2E of a group's completed requests, the others counted as missing (never answered: an
    infinite latency), and the queue wait of those that were scheduled."""
    completed = req[req["outcome"] == "completed"]
    failed = len(req) - len(completed)
    return {
        "ttft_s": LatencyHistogram.of(completed["ttft_s"].to_numpy(dtype=float), missing=failed),
        "e2e_s": LatencyHistogram.of(completed["e2e_s"].to_numpy(dtype=float), missing=failed),
        "queue_wait_s": LatencyHistogram.of(req["queue_wait_s"].dropna().to_numpy(dtype=float)),
    }


def percentiles(
    histograms: dict[str, LatencyHistogram], which: dict[str, tuple[str, float, bool]]
) -> dict[str, float]:
    """Percentile measures (as `PERCENTILES`: name -> histogram, quantile, over every arrival) read off."""
    return {key: histograms[h].quantile(q, every) for key, (h, q, every) in which.items()}


def finished_in(completed_any: pd.DataFrame, window: tuple[float, float]) -> pd.DataFrame:
    """Completed requests that finished inside the window, whenever they arrived: what throughput counts."""
    return completed_any[completed_any["finish_s"].between(*window)]


def measurement_window(workload: Workload, world: World) -> tuple[float, float]:
    """From the end of the warm-up to the last arrival: the span whose traffic the summary describes."""
    last = float(workload.arrival[-1]) if len(workload) else 0.0
    return world.warmup_s, max(last, world.warmup_s + 1e-9)


def run_summary(result: RunResult, workload: Workload, world: World, req: pd.DataFrame) -> dict[str, dict]:
    """Measures per tier and for all requests ("all") of one run, from its `records.request_table`."""
    req = req.assign(
        true_cost_gpu_s=_true_cost(result, req, world),
        wasted_gpu_s=deadline_waste(result, workload, world)[req["request_id"].to_numpy()],
    )
    start, end = measurement_window(workload, world)
    completed = req[req["outcome"] == "completed"]
    req = req[req["arrival_s"] >= start]
    window = end - start
    gpu_s = [_gpu_seconds(result, cfg.gpus_per_replica, p, start, end) for p, cfg in enumerate(world.pools)]
    fleet = [_paid_replicas(result, p, start, end) for p in range(len(world.pools))]
    paid_gpu_s = [f["paid"] * cfg.gpus_per_replica for f, cfg in zip(fleet, world.pools, strict=True)]
    out = {}
    for t, name in enumerate(world.tier_names):
        pool = world.pool_of_tier[t]
        out[name] = tier_measures(
            req[req["tier"] == name],
            completed[completed["tier"] == name],
            (start, end),
            utilization(result, world, start, end, pool),
            (gpu_s[pool], paid_gpu_s[pool]),
            world.tier_ttft_slo[t],
            world.tier_e2e_slo[t],
        )
    everything = tier_measures(
        req, completed, (start, end), utilization(result, world, start, end), (sum(gpu_s), sum(paid_gpu_s)),
        math.inf, math.inf,
    )  # fmt: skip
    tiers = out.values()
    everything["goodput_rps"] = sum(m["goodput_rps"] for m in tiers)
    everything["slo_attainment"] = sum(m["goodput_rps"] for m in tiers) * window / max(len(req), 1)
    true = float(req["true_cost_gpu_s"].sum())
    everything["estimate_over_true_cost"] = (
        float(req["estimate_gpu_s"].sum()) / true if true > 0 else math.nan
    )
    out["all"] = everything
    for p, cfg in enumerate(world.pools):
        f = fleet[p]
        out[f"pool:{cfg.name}"] = {
            "utilization": utilization(result, world, start, end, p),
            "peak_in_flight_gpu_s": result.peak_in_flight_gpu_s[p],
            "replicas_mean": f["serving"] / window,
            "replicas_max": float(max(e[1] for e in result.replica_log[p])),
            "paid_replicas_mean": f["paid"] / window,
            "paid_gpu_s": paid_gpu_s[p],
            "cold_start_gpu_s": f["starting"] * cfg.gpus_per_replica,
        }
    return out


def _gpu_seconds(result: RunResult, gpus_per_replica: int, pool: int, start: float, end: float) -> float:
    """GPU-seconds a pool's ready replicas (serving or draining) offered in [start, end]."""
    alive = sum(max(0.0, min(end, b) - max(start, a)) for a, b in result.lifetimes[pool])
    return alive * gpus_per_replica


def _paid_replicas(result: RunResult, pool: int, start: float, end: float) -> dict[str, float]:
    """Replica-seconds in [start, end]: serving; starting (cold starts: paid for, serving nothing); and
    paid = serving + starting + draining, what the GPUs cost."""
    log = result.replica_log[pool]
    times = np.array([e[0] for e in log] + [max(result.end_s, end)])
    spans = np.clip(times[1:], start, end) - np.clip(times[:-1], start, end)
    serving, starting, draining = (np.array([e[i] for e in log], dtype=float) for i in (1, 2, 3))
    return {
        "serving": float((serving * spans).sum()),
        "starting": float((starting * spans).sum()),
        "paid": float(((serving + starting + draining) * spans).sum()),
    }


def _true_cost(result: RunResult, req: pd.DataFrame, world: World) -> np.ndarray:
    """GPU-seconds each request really needs (`records.true_cost`): its actual output, not max_tokens."""
    return true_cost(
        result, world, np.asarray(req["pool"].cat.codes), req["request_id"].to_numpy(),
        req["prompt_tokens"].to_numpy(), req["output_tokens"].to_numpy(),
    )  # fmt: skip


def combine(replications: list[dict[str, dict]]) -> dict[str, dict]:
    """Every measure over several replications: a percentile is the pooled sample's quantile with its
    sectioning interval (`results.intervals`), any other measure the mean with a 95% t half-width.

    `<measure>_ci95` is the half-width when there are several replications (for a percentile, the larger
    side of its asymmetric interval); `<percentile>_beyond` counts the pooled observations beyond it (below
    `FEW_BEYOND` its interval is rough); `<measure>_missing` counts replications that produced no value
    (no request of the group completed, say), left out of the mean: present only when one or more did not.
    """
    out: dict[str, dict] = {}
    several = len(replications) > 1
    for group in replications[0]:
        measures: dict[str, float] = {}
        runs = [r[group] for r in replications]
        for key in replications[0][group]:
            if key == DISTRIBUTIONS:
                continue
            if key in PERCENTILES and DISTRIBUTIONS in runs[0]:
                name, q, every = PERCENTILES[key]
                est = pooled_quantile(
                    [LatencyHistogram.from_json(r[DISTRIBUTIONS][name]) for r in runs], q, every
                )
                measures[key] = est.value
                if several:
                    measures[f"{key}_ci95"] = est.half_width
                measures[f"{key}_beyond"] = float(est.beyond)
                empty = len(runs) - est.sections
            else:
                values = np.array([r[key] for r in runs], dtype=float)
                values = values[~np.isnan(values)]
                measures[key] = float(values.mean()) if len(values) else math.nan
                if several:
                    half = math.nan
                    if len(values) > 1:
                        half = float(t975(len(values) - 1) * values.std(ddof=1) / math.sqrt(len(values)))
                    measures[f"{key}_ci95"] = half
                empty = len(runs) - len(values)
            if empty:
                measures[f"{key}_missing"] = float(empty)
        out[group] = measures
    return out


def notes(summary: dict[str, dict[str, dict]]) -> list[str]:
    """What a reader of a combined summary must know: percentiles resting on few observations beyond them
    (TTFT and E2E share their counts), measures some replications could not give (left out), and requests
    refused as too long for the server (per tier)."""
    lines = []
    for policy, groups in summary.items():
        thin: dict[str, float] = {}
        missing = []
        for group, measures in groups.items():
            for key, value in measures.items():
                base = key.removesuffix("_beyond")
                if base != key and value < FEW_BEYOND and math.isfinite(measures[base]):
                    label = base.replace("ttft_", "").replace("e2e_", "").removesuffix("_s").replace("_", " ")
                    thin.setdefault(f"{group} {label}", value)
                if key.endswith("_missing"):
                    missing.append(
                        f"{group} {key.removesuffix('_missing')} ({value:.0f} of the replications)"
                    )
        if thin:
            listed = ", ".join(f"{k} ({v:.0f})" for k, v in thin.items())
            lines.append(f"{policy}: fewer than {FEW_BEYOND} observations beyond {listed}: rough, run longer")
        if missing:
            lines.append(f"{policy}: no value, left out of the mean: " + ", ".join(missing))
        long = {  # a 100% rejection with nothing else said reads as an admission policy's doing
            g: m["too_long"]
            for g, m in groups.items()
            if g != "all" and not g.startswith("pool:") and m.get("too_long", 0) > 0
        }
        if long:
            lines.append(
                f"{policy}: requests longer than the server takes (prompt + max_tokens beyond its context or "
                "KV capacity), answered 400 and counted as rejected: "
                + ", ".join(f"{g} {n:.0f}" for g, n in long.items())
            )
    return lines
