"""Sweep table: a plan's saved units combined into one tidy table, and the files it is written to.

One row per point x policy x tier, with every summary measure, its 95% confidence half-width across
replications (`<measure>_ci95`) and the scenario's nominal arrival rate for the group (`arrival_rate_rps`:
noise-free, so it orders points along the load axis; the measured rate for a trace replayed at its own
pace). Groups of the summary that are not tiers (per-pool figures) get their own rows, with NaN for the
measures they lack. `sweep.json` beside the table records the grid and the tiers' SLOs for the plots, and
each tier's utilization targets (`simadmit.study.targets`) are written with it.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pandas as pd

from simadmit.results import summary
from simadmit.results.run_folder import Writer, update_in_place
from simadmit.study.grid import SweepPlan
from simadmit.study.store import PointStore
from simadmit.study.targets import utilization_targets


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


def assemble_runs(plan: SweepPlan, store: PointStore) -> pd.DataFrame:
    """One row per point x seed x policy x tier: each replication on its own, for resampling."""
    rows = []
    for u in plan.units():
        record = store.load(u.key)
        for policy, groups in record["summary"].items():
            for tier, measures in groups.items():
                rows.append({"point": u.point, **dict(u.overrides), "seed": u.seed, "policy": policy, "tier": tier,
                             **measures})  # fmt: skip
    return pd.DataFrame(rows)


def _rate(nominal: float, measures: dict) -> float:
    """The nominal arrival rate, or the measured one where the scenario has none (a trace at its own pace)."""
    return nominal if math.isfinite(nominal) else float(measures.get("offered_rps", math.nan))


def write_table(plan: SweepPlan, table: pd.DataFrame, out: Path, runs: pd.DataFrame | None = None) -> None:
    """sweep.parquet, sweep.csv, sweep.json (the grid and the tiers' SLOs, for plots) and each tier's
    utilization targets (intervals resampled from `runs`), each file replaced atomically, manifest.json last."""
    meta = {
        "scenario": str(plan.source),
        "params": {p.path: list(p.values) for p in plan.params},
        "tier_slo": plan.tier_slo,
    }
    meta_text = json.dumps(meta, indent=2, default=str, allow_nan=True) + "\n"
    files: dict[str, Writer] = {
        "sweep.parquet": lambda p: table.to_parquet(p, index=False),
        "sweep.csv": lambda p: table.to_csv(p, index=False),
        "sweep.json": lambda p: _write_text(p, meta_text),
    }
    for tier in sla_tiers(plan.tier_slo):
        targets = utilization_targets(table, plan.tier_slo, tier, runs)
        files[f"utilization_targets_{tier}.csv"] = functools.partial(_to_csv, targets)
    update_in_place(out, files, {"command": "sweep", "partial": False})


def sla_tiers(tier_slo: dict[str, dict[str, float]]) -> list[str]:
    """The tiers with a finite TTFT or E2E SLA: those a utilization target can be read for."""
    return [t for t, slo in tier_slo.items() if math.isfinite(slo["ttft_s"]) or math.isfinite(slo["e2e_s"])]


def _to_csv(frame: pd.DataFrame, path: Path) -> None:
    frame.to_csv(path, index=False)


def _write_text(path: Path, text: str) -> None:
    path.write_text(text)
