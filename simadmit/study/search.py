"""Search: the policy settings with the best objective that meet every SLO at 1x, 1.5x and 2x traffic.

A setting is feasible when the mean over replications meets every SLO (`simadmit.study.slo`) at every
traffic level; the objective (goodput, throughput, their per-GPU versions, or rejection) is measured at
the first level (by default 1x, the scenario's own traffic). The search is coordinate-wise on a shrinking
grid: each dimension in turn is tried at a few evenly spaced values with the others held at the best
setting so far; the best value is kept and that dimension's range is halved around it; a few rounds
refine to a small fraction of the starting range. Integer dimensions whose range is down to a handful of
values are tried exhaustively. Feasible settings rank above infeasible ones; among feasible ones the
higher objective wins (ties go to fewer GPUs); among infeasible ones the smaller total SLO violation wins,
so the search walks towards feasibility. Every setting is simulated once per traffic level and seed and
cached. What is searched, and from where, is `simadmit.study.dimensions`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from simadmit.config.errors import InputError, problem
from simadmit.config.loading import load_scenario, scenario_from_dict
from simadmit.config.schema import policy_name
from simadmit.results import summary
from simadmit.sim.world import build_world
from simadmit.study.backends import Backend, process_map
from simadmit.study.dimensions import Dimension, concerning, default_dimensions, start_value
from simadmit.study.runner import run_unit
from simadmit.study.slo import SLO

OBJECTIVES = {  # name -> (measure of "all", +1 maximise / -1 minimise, divided by GPUs)
    "goodput": ("goodput_rps", 1, False),
    "goodput_per_gpu": ("goodput_rps", 1, True),
    "throughput": ("throughput_rps", 1, False),
    "throughput_per_gpu": ("throughput_rps", 1, True),
    "rejection": ("rejection_rate", -1, False),
    "failure": ("failure_rate", -1, False),
}


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
            slo.violation_in(per_load[load][slo.tier]) for slo in self.slos for load in self.config.loads
        )
        spec = scenario_from_dict(self.document, self.source, dict(setting))
        gpus = sum(c.replicas * c.gpus_per_replica for c in build_world(spec, self.source.parent).pools)
        value = per_load[self.config.loads[0]]["all"][self.measure]
        objective = value / gpus if self.per_gpu else value
        feasible = all(m >= 0 for m in margins.values())
        return Evaluation(setting, feasible, objective, gpus, margins, violation, per_load)


def search_policy(search: Search, dims: list[Dimension]) -> Evaluation:
    """Coordinate-wise search on a shrinking grid; returns the best evaluation seen."""
    current = {d.path: start_value(search.document, search.source, d) for d in dims}
    ranges = {d.path: (d.lo, d.hi) for d in dims}

    def setting(values: dict[str, float]) -> tuple:
        return tuple((d.path, int(values[d.path]) if d.integer else values[d.path]) for d in dims)

    (best,) = search.evaluate([setting(current)])
    for _r in range(search.config.rounds if dims else 0):
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
    for i, (raw, policy) in enumerate(zip(document["policies"], spec.policies, strict=True)):
        name = policy_name(policy)
        doc = {**copy.deepcopy(document), "policies": [raw]}
        dims = dimensions
        if dims is None:
            dims = default_dimensions(doc, scenario, name, OBJECTIVES.get(objective, ("", 1, False))[2])
        dims = concerning(dims, document["policies"], i, name)
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
