"""Runner: every policy of a scenario over the same workloads, replication by replication.

Replication r uses seed `seed + r` for its workload and client jitter; all policies of a replication
share that workload, so differences between policies are never differences in traffic. A scenario's
variants (other settings to compare) each run all policies on the same seeds. `run_unit` is the piece of
work sweeps and optimize farm out: one replication of every policy at one set of overrides, from plain
arguments a worker process (or a Ray task) can receive.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd

from simadmit.config.loading import scenario_from_dict, variant_spec
from simadmit.config.schema import ScenarioSpec
from simadmit.results import records, summary
from simadmit.sim.simulation import Simulation, policy_requests
from simadmit.sim.world import World, build_policies, build_world
from simadmit.workload.build import generate

Progress = Callable[[str, int, int], None]  # (label, done, total)


@dataclass
class ScenarioResult:
    """Tables and summary of a scenario's runs."""

    requests: pd.DataFrame
    timeseries: pd.DataFrame
    summary: dict[str, dict[str, dict]]  # policy -> tier (or "all") -> measure
    runs: dict[str, list[dict[str, dict]]] = field(default_factory=dict)  # per-replication summaries
    events: int = 0
    simulated_requests: int = 0
    complete: bool = True  # False when interrupted: only the runs that finished are here


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a study: `partial` holds every run that finished before it (`complete` False)."""

    def __init__(self, partial: ScenarioResult) -> None:
        super().__init__()
        self.partial = partial


def run_scenario(
    spec: ScenarioSpec,
    world: World,
    seed: int | None = None,
    replications: int = 1,
    progress: Progress | None = None,
    keep_tables: bool = True,
) -> ScenarioResult:
    """Simulate each policy on each replication's workload; summarise with confidence intervals.

    Ctrl-C raises `Interrupted` carrying every run that finished (a run is kept whole or not at all).
    """
    base_seed = spec.workload.seed if seed is None else seed
    policies = build_policies(spec)
    finished: list[_Run] = []
    try:
        for r in range(replications):
            s = base_seed + r
            workload = generate(spec.workload, s)
            shared = policy_requests(workload)
            for name, policy in policies.items():
                label, n = f"{name} (seed {s})", len(workload)
                tick = None
                if progress is not None:
                    progress(label, 0, n)
                    tick = functools.partial(_tick, progress, label, n)
                result = Simulation(world, workload, policy, s, shared, progress=tick).run(name)
                table = records.request_table(result, workload, world)  # built once, read three ways
                run = summary.run_summary(result, workload, world, table)
                frames = (
                    (records.requests_frame(result, table), records.timeseries_frame(result, table))
                    if keep_tables
                    else None
                )
                finished.append(_Run(name, run, frames, result.events, len(workload)))
                if progress is not None:
                    progress(label, n, n)
    except KeyboardInterrupt:
        raise Interrupted(replace(_assemble(list(policies), finished), complete=False)) from None
    return _assemble(list(policies), finished)


@dataclass(frozen=True)
class _Run:
    """One finished (policy, replication): its summary, its tables if kept, and its size."""

    policy: str
    summary: dict[str, dict]
    frames: tuple[pd.DataFrame, pd.DataFrame] | None
    events: int
    requests: int


def _assemble(policies: list[str], runs: list[_Run]) -> ScenarioResult:
    per_policy = {p: [r.summary for r in runs if r.policy == p] for p in policies}
    per_policy = {p: s for p, s in per_policy.items() if s}
    requests = [r.frames[0] for r in runs if r.frames is not None]
    series = [r.frames[1] for r in runs if r.frames is not None]
    return ScenarioResult(
        requests=pd.concat(requests, ignore_index=True) if requests else pd.DataFrame(),
        timeseries=pd.concat(series, ignore_index=True) if series else pd.DataFrame(),
        summary={name: summary.combine(s) for name, s in per_policy.items()},
        runs=per_policy,
        events=sum(r.events for r in runs),
        simulated_requests=sum(r.requests for r in runs),
    )


def _tick(progress: Progress, label: str, total: int, done: int) -> None:
    progress(label, done, total)


def arrival_rates(spec: ScenarioSpec) -> dict[str, float]:
    """Nominal mean arrival rate of first attempts, per tier and for "all" (NaN for a trace's own rate)."""
    nominal = spec.workload.rate_rps
    rate = math.nan if nominal is None else nominal * spec.workload.rate_multiplier
    total = sum(t.share for t in spec.workload.tiers)
    return {**{t.name: rate * t.share / total for t in spec.workload.tiers}, "all": rate}


def run_unit(document: dict[str, object], source: str, overrides: dict[str, object], seed: int) -> dict:
    """One replication of every policy at one point: what `run_scenario(..., seed, 1)` summarises."""
    spec = scenario_from_dict(document, source, overrides)
    world = build_world(spec, Path(source).parent)
    result = run_scenario(spec, world, seed=seed, replications=1, keep_tables=False)
    return {
        "overrides": overrides,
        "seed": seed,
        "arrival_rate_rps": arrival_rates(spec),
        "summary": {policy: runs[0] for policy, runs in result.runs.items()},
    }


def run_study(
    spec: ScenarioSpec,
    base: Path,
    seed: int | None = None,
    replications: int = 1,
    progress: Progress | None = None,
    keep_tables: bool = True,
) -> ScenarioResult:
    """Run a scenario, or each of its variants: results are keyed `variant/policy` when there are variants.

    Ctrl-C raises `Interrupted` with the runs of every variant that finished.
    """
    if not spec.variants:
        return run_scenario(spec, build_world(spec, base), seed, replications, progress, keep_tables)
    parts = []
    for variant in spec.variants:
        vspec = variant_spec(spec, variant)
        try:
            result = run_scenario(vspec, build_world(vspec, base), seed, replications, progress, keep_tables)
        except Interrupted as e:
            parts.append((variant.name, e.partial))
            raise Interrupted(replace(_merge(parts), complete=False)) from None
        parts.append((variant.name, result))
    return _merge(parts)


def _merge(parts: list[tuple[str, ScenarioResult]]) -> ScenarioResult:
    def tagged(frame: pd.DataFrame, name: str) -> pd.DataFrame:
        if frame.empty:
            return frame
        frame = frame.copy()
        frame["policy"] = name + "/" + frame["policy"].astype(str)
        return frame

    return ScenarioResult(
        requests=pd.concat([tagged(r.requests, n) for n, r in parts], ignore_index=True),
        timeseries=pd.concat([tagged(r.timeseries, n) for n, r in parts], ignore_index=True),
        summary={f"{n}/{p}": s for n, r in parts for p, s in r.summary.items()},
        runs={f"{n}/{p}": s for n, r in parts for p, s in r.runs.items()},
        events=sum(r.events for _, r in parts),
        simulated_requests=sum(r.simulated_requests for _, r in parts),
    )
