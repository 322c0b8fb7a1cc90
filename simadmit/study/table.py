"""Sweep table: a plan's saved units combined into one tidy table, and the files it is written to.

One row per point x policy x tier, with every summary measure, its 95% confidence half-width across
replications (`<measure>_ci95`) and the scenario's nominal arrival rate for the group (`arrival_rate_rps`:
noise-free, so it orders points along the load axis; the measured rate for a trace replayed at its own
pace). Groups of the summary that are not tiers (per-pool figures) get their own rows, with NaN for the
measures they lack. `sweep.json` beside the table records the grid and the tiers' SLOs for the plots.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd

from simadmit.results import summary
from simadmit.study.grid import SweepPlan
from simadmit.study.store import PointStore


def assemble(plan: SweepPlan, store: PointStore) -> pd.DataFrame:
    """One row per point x policy x tier: means over the point's replications with 95% half-widths."""
    units = plan.units()
    rows = []
    for i, point in enumerate(plan.points):
        records = [store.load(u.key) for u in units if u.point == i]
        for policy in records[0]["summary"]:
            combined = summary.combine([r["summary"][policy] for r in records])
            for tier, measures in combined.items():
                rows.append(
                    {
                        "point": i,
                        **dict(point),
                        "policy": policy,
                        "tier": tier,
                        "seed": plan.seeds[i][0],
                        "replications": len(records),
                        **measures,
                        "arrival_rate_rps": _rate(
                            records[0]["arrival_rate_rps"].get(tier, math.nan), measures
                        ),
                    }
                )
    return pd.DataFrame(rows)


def _rate(nominal: float, measures: dict) -> float:
    """The nominal arrival rate, or the measured one where the scenario has none (a trace at its own pace)."""
    return nominal if math.isfinite(nominal) else float(measures.get("offered_rps", math.nan))


def write_table(plan: SweepPlan, table: pd.DataFrame, out: Path) -> None:
    """sweep.parquet and sweep.csv, plus sweep.json describing the grid and the tiers' SLOs (for plots)."""
    out.mkdir(parents=True, exist_ok=True)
    table.to_parquet(out / "sweep.parquet", index=False)
    table.to_csv(out / "sweep.csv", index=False)
    meta = {
        "scenario": str(plan.source),
        "params": {p.path: list(p.values) for p in plan.params},
        "tier_slo": plan.tier_slo,
    }
    (out / "sweep.json").write_text(json.dumps(meta, indent=2, default=str, allow_nan=True) + "\n")
