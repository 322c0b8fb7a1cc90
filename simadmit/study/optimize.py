"""Optimize: the policy settings with the best objective that meet every SLO at 1x, 1.5x and 2x traffic.

An SLO names a tier (or `all`), a summary measure and a limit: `interactive.ttft_p99<=3s`,
`interactive.rejection<=2%`, `all.queue_wait_mean_s<=0.5s`. A setting is feasible when the mean over
replications meets every SLO at every traffic level; the objective (goodput, throughput, their per-GPU
versions, or rejection) is measured at the first level (by default 1x, the scenario's own traffic).

The search is coordinate-wise on a shrinking grid: each dimension in turn is tried at a few evenly spaced
values with the others held at the best setting so far; the best value is kept and that dimension's range
is halved around it; a few rounds refine to a small fraction of the starting range. Integer dimensions
whose range is down to a handful of values are tried exhaustively. Feasible settings rank above infeasible
ones; among feasible ones the higher objective wins (ties go to fewer GPUs); among infeasible ones the
smaller total SLO violation wins, so the search walks towards feasibility. Every setting is simulated once
per traffic level and seed and cached.

It also holds the analysis of sweep tables: `utilization_targets`, the highest GPU utilization at which a
tier's p99 TTFT and E2E stay within its SLA, per policy.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from simadmit.results import summary
from simadmit.config.errors import InputError, problem
from simadmit.config.defaults import default_max_pool_gpu_s
from simadmit.config.scenario import GpuSecondsSpec, QueueDepthSpec, load_scenario, policy_name, scenario_from_dict
from simadmit.study.sweep import Backend, curves, process_map, run_unit
from simadmit.sim.world import build_world

ALIASES = {
    **{f"{m}_{p}": f"{m}_{p}_s" for m in ("ttft", "e2e") for p in ("p50", "p90", "p99")},
    "queue_wait_mean": "queue_wait_mean_s",
    "queue_wait_p99": "queue_wait_p99_s",
    "rejection": "rejection_rate",
    "goodput": "goodput_rps",
    "throughput": "throughput_rps",
}
MEASURES = (
    "requests", "rejection_rate", "attempt_rejection_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s",
    "e2e_p50_s", "e2e_p90_s", "e2e_p99_s", "queue_wait_mean_s", "queue_wait_p99_s", "utilization",
    "work_utilization", "goodput_rps", "slo_attainment", "offered_rps", "carried_rps", "admitted_rps",
    "retries_per_request", "throughput_rps", "output_tokens_per_s",
)  # fmt: skip
OBJECTIVES = {  # name -> (measure of "all", +1 maximise / -1 minimise, divided by GPUs)
    "goodput": ("goodput_rps", 1, False),
    "goodput_per_gpu": ("goodput_rps", 1, True),
    "throughput": ("throughput_rps", 1, False),
    "throughput_per_gpu": ("throughput_rps", 1, True),
    "rejection": ("rejection_rate", -1, False),
}
_SLO = re.compile(r"^\s*([\w-]+)\.(\w+)\s*(<=|>=|<|>)\s*([-+\d.eE]+)\s*(ms|s|%)?\s*$")


@dataclass(frozen=True)
class SLO:
    """`tier.measure <= limit` (or >=), the limit in the measure's own unit (seconds, a fraction)."""

    tier: str
    measure: str
    upper: bool  # True: the measure must stay at or below the limit
    limit: float
    text: str

    def margin(self, value: float) -> float:
        """How far inside the limit the value is, in the measure's unit (negative: violated)."""
        if math.isnan(value):
            return -math.inf
        return self.limit - value if self.upper else value - self.limit

    def violation(self, value: float) -> float:
        """The shortfall relative to the limit (0 when met), comparable across SLOs."""
        return max(0.0, -self.margin(value)) / max(abs(self.limit), 1e-9)


def parse_slo(text: str) -> SLO:
    """Parse `tier.measure<=value[unit]`; units: s, ms (to seconds), % (to a fraction)."""
    m = _SLO.match(text)
    if not m:
        raise InputError(
            [problem("--slo", text, "expected tier.measure<=value, e.g. interactive.ttft_p99<=3s")]
        )
    tier, name, op, raw, unit = m.groups()
    measure = ALIASES.get(name, name)
    if measure not in MEASURES:
        known = ", ".join(sorted({*ALIASES, *MEASURES}))
        raise InputError([problem("--slo", text, f"unknown measure {name!r}; known: {known}")])
    value = float(raw) * {"ms": 1e-3, "%": 1e-2}.get(unit or "", 1.0)
    return SLO(tier, measure, op.startswith("<"), value, text.strip())


@dataclass(frozen=True)
class Dimension:
    """A searched scenario field and its range."""

    path: str
    lo: float
    hi: float
    integer: bool

    def grid(self, lo: float, hi: float, n: int) -> list[float]:
        if self.integer:
            lo_i, hi_i = math.ceil(lo), math.floor(hi)
            if hi_i - lo_i + 1 <= n:
                return [float(v) for v in range(lo_i, hi_i + 1)]
            return sorted({float(round(v)) for v in np.linspace(lo_i, hi_i, n)})
        return [float(f"{v:.6g}") for v in np.linspace(lo, hi, n)]


def parse_dimension(text: str) -> Dimension:
    """`path=lo:hi`; integers when both ends are written as integers."""
    path, sep, raw = text.partition("=")
    ends = raw.split(":")
    try:
        lo, hi = float(ends[0]), float(ends[1])
    except (ValueError, IndexError):
        lo = hi = math.nan
    if not sep or len(ends) != 2 or not lo <= hi:
        raise InputError(
            [problem("--search", text, "expected path=lo:hi with lo <= hi, e.g. pools.0.replicas=1:16")]
        )
    return Dimension(path.strip(), lo, hi, "." not in raw and "e" not in raw.lower())


def default_dimensions(document: dict, source: Path, policy: str, per_gpu: bool) -> list[Dimension]:
    """The knobs of one policy, over a range around the scenario's values; replicas only per GPU.

    More replicas always buy goodput and a shorter poll interval always helps, so replicas are searched
    only for a per-GPU objective and the poll interval only when named with --search.
    """
    spec = scenario_from_dict(document, source)
    world = build_world(spec, source.parent)
    p = next(s for s in spec.policies if policy_name(s) == policy)
    dims = []
    if isinstance(p, GpuSecondsSpec):
        gpus = sum(c.replicas * c.gpus_per_replica for c in world.pools)
        pool_max = p.max_pool_gpu_seconds or default_max_pool_gpu_s(gpus, p.budgets_s, p.default_budget_s)
        dims.append(Dimension(f"policies.{policy}.headroom", 0.5, 1.0, False))
        dims.append(Dimension(f"policies.{policy}.max_pool_gpu_seconds", pool_max / 4, pool_max * 4, False))
        dims += [
            Dimension(f"policies.{policy}.budgets_s.{t}", b / 4, b * 4, False) for t, b in p.budgets_s.items()
        ]
    elif isinstance(p, QueueDepthSpec):
        dims.append(Dimension(f"policies.{policy}.max_queued", 1, max(4, 4 * p.max_queued), True))
    if per_gpu:
        dims += [
            Dimension(f"pools.{i}.replicas", max(1, pool.replicas // 4), 4 * pool.replicas, True)
            for i, pool in enumerate(spec.pools)
        ]
    return dims


@dataclass(frozen=True)
class SearchConfig:
    """How hard to search."""

    loads: tuple[float, ...] = field(
        default=(1.0, 1.5, 2.0), metadata={"help": "traffic multipliers to meet"}
    )
    replications: int = field(default=1, metadata={"help": "seeds per setting and load"})
    seed: int | None = field(default=None, metadata={"help": "first seed (default: the scenario's)"})
    rounds: int = field(default=3, metadata={"help": "refinement rounds over all dimensions"})
    candidates: int = field(default=5, metadata={"help": "values tried per dimension and round"})
    jobs: int = field(default=1, metadata={"help": "parallel worker processes"})


@dataclass(frozen=True)
class Evaluation:
    """One setting at every load: its SLO margins at the worst load, objective and GPU count."""

    setting: tuple[tuple[str, float | int], ...]
    feasible: bool
    objective: float
    gpus: int
    margins: dict[str, float]  # slo text -> smallest margin over the loads
    violation: float
    summaries: dict[float, dict[str, dict]]  # load -> tier -> measures (mean over seeds)

    def rank(self, sign: int) -> tuple[float, float, float]:
        if self.feasible:
            return (1.0, sign * self.objective, -self.gpus)
        return (0.0, -self.violation, -self.gpus)


@dataclass(frozen=True)
class PolicyResult:
    """The winner for one policy, and what the search cost."""

    policy: str
    best: Evaluation
    simulations: int
    unconditional_throughput_rps: float


class Search:
    """Evaluate settings of one policy (all loads, all seeds), caching every simulation."""

    def __init__(
        self,
        document: dict,
        source: Path,
        slos: list[SLO],
        objective: str,
        config: SearchConfig,
        backend: Backend = process_map,
    ) -> None:
        self.document = document
        self.source = source
        self.slos = slos
        self.config = config
        self.backend = backend
        self.measure, self.sign, self.per_gpu = OBJECTIVES[objective]
        spec = scenario_from_dict(document, source)
        self.base_rate = spec.workload.rate_multiplier
        self.first_seed = spec.workload.seed if config.seed is None else config.seed
        self.cache: dict[tuple, dict] = {}
        self.simulations = 0

    def _overrides(self, setting: tuple, load: float) -> dict[str, object]:
        return {**dict(setting), "workload.rate_multiplier": self.base_rate * load}

    def evaluate(self, settings: list[tuple]) -> list[Evaluation]:
        seeds = range(self.first_seed, self.first_seed + self.config.replications)
        wanted = [(s, load, seed) for s in settings for load in self.config.loads for seed in seeds]
        todo = list(dict.fromkeys(w for w in wanted if w not in self.cache))
        args = [(self.document, str(self.source), self._overrides(s, load), seed) for s, load, seed in todo]
        for i, record in self.backend(run_unit, args, self.config.jobs):
            (policy_summary,) = record["summary"].values()
            self.cache[todo[i]] = policy_summary
        self.simulations += len(todo)
        return [self._judge(s, seeds) for s in settings]

    def _judge(self, setting: tuple, seeds: range) -> Evaluation:
        per_load = {
            load: summary.combine([self.cache[(setting, load, seed)] for seed in seeds])
            for load in self.config.loads
        }
        margins = {
            slo.text: min(slo.margin(per_load[load][slo.tier][slo.measure]) for load in self.config.loads)
            for slo in self.slos
        }
        violation = sum(
            slo.violation(per_load[load][slo.tier][slo.measure])
            for slo in self.slos
            for load in self.config.loads
        )
        spec = scenario_from_dict(self.document, self.source, dict(setting))
        gpus = sum(c.replicas * c.gpus_per_replica for c in build_world(spec, self.source.parent).pools)
        value = per_load[self.config.loads[0]]["all"][self.measure]
        objective = value / gpus if self.per_gpu else value
        feasible = all(m >= 0 for m in margins.values())
        return Evaluation(setting, feasible, objective, gpus, margins, violation, per_load)


def _start(document: dict, source: Path, dim: Dimension) -> float:
    """The scenario's own value of a dimension (clamped into its range), or the range's middle."""
    node: object = scenario_from_dict(document, source).model_dump()
    for key in dim.path.split("."):
        if isinstance(node, list):
            by_name = [x for x in node if key in (x.get("name"), x.get("kind"))]
            node = node[int(key)] if key.isdigit() else (by_name[0] if by_name else None)
        elif isinstance(node, dict):
            node = node.get(key)
    value = float(node) if isinstance(node, int | float) else (dim.lo + dim.hi) / 2
    value = min(max(value, dim.lo), dim.hi)
    return float(round(value)) if dim.integer else value


def search_policy(search: Search, dims: list[Dimension]) -> Evaluation:
    """Coordinate-wise search on a shrinking grid; returns the best evaluation seen."""
    current = {d.path: _start(search.document, search.source, d) for d in dims}
    ranges = {d.path: (d.lo, d.hi) for d in dims}

    def setting(values: dict[str, float]) -> tuple:
        return tuple((d.path, int(values[d.path]) if d.integer else values[d.path]) for d in dims)

    (best,) = search.evaluate([setting(current)])
    for r in range(search.config.rounds if dims else 0):
        for d in dims:
            lo, hi = ranges[d.path]
            values = sorted({*d.grid(lo, hi, search.config.candidates), current[d.path]})
            trials = [setting({**current, d.path: v}) for v in values]
            evaluations = search.evaluate(trials)
            winner = max([best, *evaluations], key=lambda e: e.rank(search.sign))
            best = winner
            current = {path: float(v) for path, v in winner.setting}
            half = (hi - lo) / 4
            ranges[d.path] = (max(d.lo, current[d.path] - half), min(d.hi, current[d.path] + half))
    return best


def optimize(
    scenario: Path,
    slos: list[SLO],
    objective: str,
    config: SearchConfig,
    dimensions: list[Dimension] | None = None,
    backend: Backend = process_map,
) -> list[PolicyResult]:
    """Search each policy of the scenario on its own; compare each winner with unconditional admission.

    Every problem with the SLOs, the objective or the searched paths is reported before anything runs.
    """
    spec, _ = load_scenario(scenario, None)
    tiers = {t.name for t in spec.workload.tiers} | {"all"}
    bad = [problem("--slo", s.text, f"unknown tier {s.tier!r}; tiers: {', '.join(sorted(tiers))}")
           for s in slos if s.tier not in tiers]  # fmt: skip
    if objective not in OBJECTIVES:
        bad.append(problem("--objective", objective, f"expected one of {', '.join(OBJECTIVES)}"))
    document = yaml.safe_load(Path(scenario).read_text())
    plans = []
    for raw in document["policies"]:
        name = raw.get("name") or raw["kind"]
        doc = {**copy.deepcopy(document), "policies": [raw]}
        dims = dimensions
        if dims is None:
            dims = default_dimensions(doc, scenario, name, OBJECTIVES.get(objective, ("", 1, False))[2])
        dims = [
            d
            for d in dims
            if not d.path.startswith("policies.") or d.path.split(".")[1] in (name, raw["kind"])
        ]
        for d in dims:
            for v in (d.lo, d.hi):
                try:
                    scenario_from_dict(doc, scenario, {d.path: int(v) if d.integer else v})
                except InputError as e:
                    bad += [f"--search {d.path}={d.lo:g}:{d.hi:g}: {line}" for line in e.problems]
        plans.append((name, doc, dims))
    if bad:
        raise InputError(list(dict.fromkeys(bad)))
    results = []
    for name, doc, dims in plans:
        search = Search(doc, scenario, slos, objective, config, backend)
        best = search_policy(search, dims)
        shared = tuple((p, v) for p, v in best.setting if not p.startswith("policies."))
        reference_config = SearchConfig(config.loads[:1], config.replications, config.seed, jobs=config.jobs)
        reference = Search({**doc, "policies": [{"kind": "unconditional"}]}, scenario, [], objective,
                           reference_config, backend)  # fmt: skip
        (uncond,) = reference.evaluate([shared])
        throughput = uncond.summaries[config.loads[0]]["all"]["throughput_rps"]
        results.append(PolicyResult(name, best, search.simulations + reference.simulations, throughput))
    return results


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
            group["ttft_p99_s"].to_numpy() / slo["ttft_s"], group["e2e_p99_s"].to_numpy() / slo["e2e_s"]
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
