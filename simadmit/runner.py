"""Runner: every policy of a scenario over the same workloads, replication by replication.

Replication r uses seed `seed + r` for its workload and client jitter; all policies of a replication
share that workload, so differences between policies are never differences in traffic.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pandas as pd

from simadmit import records, summary
from simadmit.scenario import ScenarioSpec
from simadmit.simulation import Simulation, policy_requests
from simadmit.workload import generate
from simadmit.world import World, build_policies

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


def run_scenario(
    spec: ScenarioSpec,
    world: World,
    seed: int | None = None,
    replications: int = 1,
    progress: Progress | None = None,
    keep_tables: bool = True,
) -> ScenarioResult:
    """Simulate each policy on each replication's workload; summarise with confidence intervals."""
    base_seed = spec.workload.seed if seed is None else seed
    policies = build_policies(spec)
    per_policy: dict[str, list[dict[str, dict]]] = {name: [] for name in policies}
    request_frames, series_frames = [], []
    events = simulated = 0
    for r in range(replications):
        s = base_seed + r
        workload = generate(spec.workload, s)
        shared = policy_requests(workload)
        for name, policy in policies.items():
            label = f"{name} (seed {s})"
            tick = None
            if progress is not None:
                progress(label, 0, len(workload))
                tick = lambda i, label=label, n=len(workload): progress(label, i, n)  # noqa: E731
            result = Simulation(world, workload, policy, s, shared, progress=tick).run(name)
            if progress is not None:
                progress(label, len(workload), len(workload))
            events += result.events
            simulated += len(workload)
            per_policy[name].append(summary.run_summary(result, workload, world))
            if keep_tables:
                request_frames.append(records.requests_frame(result, workload, world))
                series_frames.append(records.timeseries_frame(result, workload, world))
    return ScenarioResult(
        requests=pd.concat(request_frames, ignore_index=True) if request_frames else pd.DataFrame(),
        timeseries=pd.concat(series_frames, ignore_index=True) if series_frames else pd.DataFrame(),
        summary={name: summary.combine(runs) for name, runs in per_policy.items()},
        runs=per_policy,
        events=events,
        simulated_requests=simulated,
    )
