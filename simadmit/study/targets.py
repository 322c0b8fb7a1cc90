"""Utilization targets: from a sweep table, the highest GPU utilization at which a tier stays within its SLA.

This is the number a capacity planner sets an autoscaler to: per policy (and per value of any other swept
setting), where along the load axis a tier's p99 TTFT or p99 E2E first leaves its SLA, read off as the
pool's work utilization at that crossing. Its 95% interval is the uncertainty of where the crossing is,
not the spread of the utilization at one point: replications are resampled (the same seeds at every
point, as they were run, so common random numbers stay paired), the crossing is found again in each
resample, and the 2.5% and 97.5% percentiles of those crossings are the interval. Curves are grouped
exactly as the plots group them (`simadmit.results.curves`).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from simadmit.results.curves import curves

RESAMPLES = 1000


def crossing(u: np.ndarray, excess: np.ndarray, load: np.ndarray) -> tuple[float, float, bool]:
    """(utilization, load, left) where `excess` (p99 / SLA, points by load) first passes 1.

    Linear between the last point inside and the first outside; NaN when the first point is already
    outside; the highest utilization seen (`left` False) when it never leaves. When utilization fell
    before the p99 left the SLA (a pool past saturation), the highest utilization inside is the answer.
    """
    out = np.flatnonzero(excess > 1)
    if len(out) and out[0] == 0:
        return math.nan, math.nan, True
    if not len(out):
        best = int(np.argmax(u))
        return float(u[best]), float(load[best]), False
    j = out[0]
    f = (1 - excess[j - 1]) / (excess[j] - excess[j - 1])
    best = int(np.argmax(u[:j]))
    if u[best] >= u[j - 1] + f * (u[j] - u[j - 1]):
        return float(u[best]), float(load[best]), True
    return float(u[j - 1] + f * (u[j] - u[j - 1])), float(load[j - 1] + f * (load[j] - load[j - 1])), True


def _interval(
    u: np.ndarray, excess: np.ndarray, load: np.ndarray, resamples: int, rng: np.random.Generator
) -> tuple[float, float]:
    """Percentile interval of the crossing over resampled replications (arrays: point x replication)."""
    n = u.shape[1]
    if n < 2:
        return math.nan, math.nan
    found = []
    for _ in range(resamples):
        pick = rng.integers(0, n, n)
        x, _, _ = crossing(u[:, pick].mean(axis=1), excess[:, pick].mean(axis=1), load)
        found.append(x)
    values = np.asarray(found)
    values = values[np.isfinite(values)]
    if len(values) < resamples / 2:  # mostly outside at the first point: no interval worth the name
        return math.nan, math.nan
    return float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))


def utilization_targets(
    table: pd.DataFrame,
    tier_slo: dict[str, dict[str, float]],
    tier: str,
    runs: pd.DataFrame | None = None,
    resamples: int = RESAMPLES,
    seed: int = 0,
) -> pd.DataFrame:
    """Per policy (and per value of any other swept setting): the highest GPU utilization at which `tier`'s
    p99 TTFT and p99 E2E stay within its SLA, interpolated to the crossing (`crossing`).

    `runs` (one row per point, seed, policy and tier: `simadmit.study.table.assemble_runs`) gives the 95%
    bootstrap interval of the crossing, `ci_low`..`ci_high` (`ci95`: half its width); without it, or with
    one replication, they are NaN. GPU utilization is the pool's work utilization ("all" rows).
    """
    slo = tier_slo[tier]
    rng = np.random.default_rng(seed)
    util = table[table["tier"] == "all"].set_index(["point", "policy"])
    rows = []
    for policy, settings, group in curves(table[table["tier"] == tier]):
        keys = list(zip(group["point"], group["policy"], strict=True))
        u = util.loc[keys]["work_utilization"].to_numpy(dtype=float)
        excess = _excess(group, slo)
        load = group["arrival_rate_rps"].to_numpy(dtype=float)
        target, at_load, left = crossing(u, excess, load)
        low = high = math.nan
        if runs is not None:
            per_seed_u, per_seed_excess = _per_seed(runs, keys, tier, slo)
            if per_seed_u is not None and per_seed_excess is not None:
                low, high = _interval(per_seed_u, per_seed_excess, load, resamples, rng)
        rows.append({"policy": policy, **settings, "utilization_target": target, "ci_low": low, "ci_high": high,
                     "ci95": (high - low) / 2, "arrival_rate_rps": at_load, "sla_left": left})  # fmt: skip
    return pd.DataFrame(rows)


def _excess(rows: pd.DataFrame, slo: dict[str, float]) -> np.ndarray:
    """The larger of p99 TTFT / SLA and p99 E2E / SLA: above 1, outside the SLA."""
    return np.maximum(_ratio(rows["ttft_p99_s"], slo["ttft_s"]), _ratio(rows["e2e_p99_s"], slo["e2e_s"]))


def _ratio(p99: pd.Series, limit: float) -> np.ndarray:
    """p99 / limit; 0 without a limit (an infinite one), even for an infinite p99 (over 1% failed)."""
    values = p99.to_numpy(dtype=float)
    return values / limit if math.isfinite(limit) else np.zeros_like(values)


def _per_seed(
    runs: pd.DataFrame, keys: list[tuple[object, object]], tier: str, slo: dict[str, float]
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(utilization, excess) as point x replication arrays, replications in seed order; None if ragged."""
    u, ex = [], []
    for point, policy in keys:
        mine = runs[(runs["point"] == point) & (runs["policy"] == policy)].sort_values("seed")
        u.append(mine[mine["tier"] == "all"]["work_utilization"].to_numpy(dtype=float))
        ex.append(_excess(mine[mine["tier"] == tier], slo))
    if len({len(x) for x in u + ex}) != 1:
        return None, None
    return np.array(u), np.array(ex)
