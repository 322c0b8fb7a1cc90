"""Utilization targets: from a sweep table, the highest GPU utilization at which a tier stays within its SLA.

This is the number a capacity planner sets an autoscaler to: per policy (and per value of any other swept
setting), where along the load axis a tier's p99 TTFT or p99 E2E first leaves its SLA, read off as the
pool's work utilization at that crossing, with its 95% half-width. Curves are grouped exactly as the plots
group them (`simadmit.results.curves`).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from simadmit.results.curves import curves


def utilization_targets(
    table: pd.DataFrame, tier_slo: dict[str, dict[str, float]], tier: str
) -> pd.DataFrame:
    """Per policy (and per value of any other swept setting): the highest GPU utilization at which `tier`'s
    p99 TTFT and p99 E2E stay within its SLA, interpolated to the crossing, with its 95% half-width.

    Points are taken in order of arrival rate; the target is the utilization where the p99 first leaves
    the SLA (linear between the last point inside and the first outside), or the highest utilization seen
    when it never leaves (`sla_left` False). GPU utilization is the pool's work utilization ("all" rows).
    """
    slo = tier_slo[tier]
    util = table[table["tier"] == "all"].set_index(["point", "policy"])
    rows = []
    for policy, settings, group in curves(table[table["tier"] == tier]):
        pool = util.loc[list(zip(group["point"], group["policy"], strict=True))]
        u = pool["work_utilization"].to_numpy()
        u_ci = pool.get("work_utilization_ci95", pd.Series(math.nan, index=pool.index)).to_numpy()
        excess = np.maximum(
            _excess(group["ttft_p99_s"], slo["ttft_s"]), _excess(group["e2e_p99_s"], slo["e2e_s"])
        )
        inside = excess <= 1
        out = np.flatnonzero(~inside)
        row: dict[str, object] = {"policy": policy, **settings}
        if len(out) and out[0] == 0:
            row.update(utilization_target=math.nan, ci95=math.nan, arrival_rate_rps=math.nan, sla_left=True)
        elif len(out):
            j = out[0]
            f = (1 - excess[j - 1]) / (excess[j] - excess[j - 1])
            load = group["arrival_rate_rps"].to_numpy()
            best = int(np.argmax(u[:j]))
            if u[best] >= u[j - 1] + f * (u[j] - u[j - 1]):  # utilization fell before the p99 left the SLA
                j, f = best + 1, 0.0
            k = min(j, len(u) - 1)

            def at(x: np.ndarray, j: int = j, k: int = k, f: float = f) -> float:
                return float(x[j - 1] + f * (x[k] - x[j - 1]))

            row.update(utilization_target=at(u), ci95=at(u_ci), arrival_rate_rps=at(load), sla_left=True)
        else:
            best = int(np.argmax(u))
            row.update(utilization_target=float(u[best]), ci95=float(u_ci[best]),
                       arrival_rate_rps=float(group["arrival_rate_rps"].iloc[best]), sla_left=False)  # fmt: skip
        rows.append(row)
    return pd.DataFrame(rows)


def _excess(p99: pd.Series, limit: float) -> np.ndarray:
    """p99 / limit; 0 without a limit (an infinite one), even for an infinite p99 (over 1% failed)."""
    values = p99.to_numpy(dtype=float)
    return values / limit if math.isfinite(limit) else np.zeros_like(values)
