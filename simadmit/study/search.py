"""Search: the policy settings with the best objective that meet every SLO at 1x, 1.5x and 2x traffic.

A setting is feasible when the mean over replications meets every SLO (`simadmit.study.slo`) at every
traffic level; the objective (goodput, throughput, their per-GPU versions, or rejection) is measured at
the first level (by default 1x, the scenario's own traffic). The search is coordinate-wise on a shrinking
grid: each dimension in turn is tried at a few evenly spaced values with the others held at the best
setting so far; the best value is kept and that dimension's range is halved around it; a few rounds
refine to a small fraction of the starting range. Integer dimensions whose range is down to a handful of
values are tried exhaustively. Feasible settings rank above infeasible ones; among feasible ones the
higher objective wins (ties go to fewer GPUs); among infeasible ones the smaller total SLO violation wins,
so the search walks towards feasibility. What is searched, and from where, is `simadmit.study.dimensions`.

Every candidate runs on the same seeds (common random numbers), so candidates differ by their settings,
never by their traffic, and every simulation is cached (on disk under `DIR/points/` with `out`, so an
interrupted search resumes). Candidates run at the heaviest load first: one whose SLO violation there
already exceeds the whole violation of the best setting so far (or that violates anything when the best
is feasible) cannot win, and is dropped before its other loads run. Dropping never changes the answer.
Because the winner is the best of many noisy evaluations on the same seeds, its own figures flatter it
(the winner's curse): it is run again on fresh seeds, and those figures are the ones reported.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd

from simadmit.config.errors import InputError, problem, read_mapping
from simadmit.config.loading import scenario_from_dict
from simadmit.config.overrides import apply_overrides, list_index, lookup
from simadmit.config.schema import policy_name
from simadmit.results import summary
from simadmit.results.run_folder import update_in_place
from simadmit.sim.world import build_world
from simadmit.study.backends import Backend, WorkerPool, process_map
from simadmit.study.dimensions import Dimension, concerning, default_dimensions, start_value
from simadmit.study.grid import digest as _digest
from simadmit.study.grid import inputs_digest
from simadmit.study.runner import run_unit
from simadmit.study.slo import SLO
from simadmit.study.store import PointStore

OBJECTIVES = {  # name -> (measure of "all", +1 maximise / -1 minimise, divided by GPUs)
    "goodput": ("goodput_rps", 1, False),
    "goodput_per_gpu": ("goodput_rps", 1, True),
    "throughput": ("throughput_rps", 1, False),
    "throughput_per_gpu": ("throughput_rps", 1, True),
    "rejection": ("rejection_rate", -1, False),
    "failure": ("failure_rate", -1, False),
}


MAX_SIMULATIONS = 1_000_000  # one optimize run's: each takes a fraction of a second at the least


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
    fresh_seeds: int = field(default=2, metadata={"help": "seeds the winner is re-run on, after the search"})
    drop: bool = field(default=True, metadata={"help": "drop candidates that cannot win before all loads"})


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
    best: Evaluation  # as the search saw it, on the search's seeds
    confirmed: Evaluation  # the same setting on fresh seeds: what to expect
    simulations: int
    unconditional_throughput_rps: float  # on the search's seeds
    fresh_seeds: tuple[int, ...]
    unconditional_fresh_rps: float  # on the fresh seeds: what `confirmed` is compared with


OnSimulation = Callable[[str], None]  # called with the policy's name after each simulation


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
        store: PointStore | None = None,
        on_simulation: OnSimulation | None = None,
    ) -> None:
        self.document = document
        self.source = source
        self.slos = slos
        self.config = config
        self.backend = backend
        self.store = store
        self.on_simulation = on_simulation
        self.measure, self.sign, self.per_gpu = OBJECTIVES[objective]
        spec = scenario_from_dict(document, source)
        self.policy = policy_name(spec.policies[0])
        self.inputs = inputs_digest(document, spec, source.parent)
        self.base_rate = spec.workload.rate_multiplier
        self.first_seed = spec.workload.seed if config.seed is None else config.seed
        self.seeds = tuple(range(self.first_seed, self.first_seed + config.replications))
        self.cache: dict[tuple, dict] = {}
        self.simulations = 0

    def _overrides(self, setting: tuple, load: float) -> dict[str, object]:
        return {**dict(setting), "workload.rate_multiplier": self.base_rate * load}

    def _key(self, unit: tuple) -> str:
        setting, load, seed = unit
        return _digest([self.inputs, sorted(self._overrides(setting, load).items()), seed])

    def _run(self, units: list[tuple]) -> None:
        """Simulate the units not cached (nor saved under `out`), in parallel."""
        todo = []
        for u in dict.fromkeys(units):
            if u in self.cache:
                continue
            saved = self.store.get(self._key(u)) if self.store is not None else None
            if saved is not None:
                self.cache[u] = self._policy_summary(saved)
            else:
                todo.append(u)
        args = [(self.document, str(self.source), self._overrides(s, load), seed) for s, load, seed in todo]
        for i, record in self.backend(run_unit, args, self.config.jobs):
            if self.store is not None:
                self.store.save(self._key(todo[i]), record)
            self.cache[todo[i]] = self._policy_summary(record)
            self.simulations += 1
            if self.on_simulation is not None:
                self.on_simulation(self.policy)

    @staticmethod
    def _policy_summary(record: dict) -> dict:
        (policy_summary,) = record["summary"].values()
        return policy_summary

    def evaluate(
        self, settings: list[tuple], incumbent: Evaluation | None = None, seeds: tuple[int, ...] | None = None
    ) -> list[Evaluation | None]:
        """Each setting at every load and seed; None for a setting dropped because `incumbent` beats it."""
        seeds = seeds or self.seeds
        alive = list(dict.fromkeys(settings))
        done: list[float] = []
        for load in sorted(self.config.loads, reverse=True):  # the heaviest load decides most often
            self._run([(s, load, seed) for s in alive for seed in seeds])
            done.append(load)
            if incumbent is not None and self.config.drop:
                alive = [s for s in alive if not self._beaten(s, seeds, done, incumbent)]
        kept = set(alive)
        return [self._judge(s, seeds) if s in kept else None for s in settings]

    def _violation(self, per_load: dict[float, dict[str, dict]]) -> float:
        return sum(
            slo.violation_in(measures[slo.tier]) for slo in self.slos for measures in per_load.values()
        )

    def _beaten(
        self, setting: tuple, seeds: tuple[int, ...], loads: list[float], incumbent: Evaluation
    ) -> bool:
        """True when the violation at `loads` alone already ranks `setting` below `incumbent`."""
        partial = self._violation({load: self._mean(setting, load, seeds) for load in loads})
        return partial > 0 if incumbent.feasible else partial > incumbent.violation

    def _mean(self, setting: tuple, load: float, seeds: tuple[int, ...]) -> dict[str, dict]:
        return summary.combine([self.cache[(setting, load, seed)] for seed in seeds])

    def _judge(self, setting: tuple, seeds: tuple[int, ...]) -> Evaluation:
        per_load = {load: self._mean(setting, load, seeds) for load in self.config.loads}
        margins = {
            slo.text: min(slo.margin(per_load[load][slo.tier][slo.measure]) for load in self.config.loads)
            for slo in self.slos
        }
        spec = scenario_from_dict(self.document, self.source, dict(setting))
        gpus = sum(c.replicas * c.gpus_per_replica for c in build_world(spec, self.source.parent).pools)
        value = per_load[self.config.loads[0]]["all"][self.measure]
        objective = value / gpus if self.per_gpu else value
        feasible = all(m >= 0 for m in margins.values())
        return Evaluation(setting, feasible, objective, gpus, margins, self._violation(per_load), per_load)

    def rows(self) -> list[dict[str, object]]:
        """One row per setting, load and set of seeds simulated: the SLO measures and the objective's."""
        groups: dict[tuple, list[int]] = {}
        for setting, load, seed in self.cache:
            groups.setdefault((setting, load), []).append(seed)
        out = []
        for (setting, load), seeds in groups.items():
            fresh = [s for s in seeds if s not in self.seeds]
            for kind, chosen in (("search", [s for s in seeds if s in self.seeds]), ("fresh seeds", fresh)):
                if not chosen:
                    continue
                m = summary.combine([self.cache[(setting, load, s)] for s in sorted(chosen)])
                row: dict[str, object] = {"policy": self.policy, **dict(setting), "load": load, "seeds": kind,
                                          "replications": len(chosen)}  # fmt: skip
                row.update({slo.text: m[slo.tier][slo.measure] for slo in self.slos})
                row[f"all.{self.measure}"] = m["all"][self.measure]
                row["meets_slos"] = all(slo.margin(m[slo.tier][slo.measure]) >= 0 for slo in self.slos)
                out.append(row)
        return out

    def upper_bound(self, dims: list[Dimension]) -> int:
        """The most simulations `search_policy` can take (dropping and repeats make it fewer)."""
        return simulations_bound(self.config, dims)


def simulations_bound(config: SearchConfig, dims: list[Dimension]) -> int:
    """The most simulations one policy's search, its fresh seeds and its reference can take."""
    settings = 1 + config.rounds * sum(config.candidates + 1 for _ in dims)
    per_setting = len(config.loads) * config.replications
    fresh = config.fresh_seeds if dims else 0
    return settings * per_setting + (len(config.loads) + 1) * fresh + 1


def search_policy(search: Search, dims: list[Dimension]) -> Evaluation:
    """Coordinate-wise search on a shrinking grid; returns the best evaluation seen."""
    current = {d.path: start_value(search.document, search.source, d) for d in dims}
    ranges = {d.path: (d.lo, d.hi) for d in dims}

    def setting(values: dict[str, float]) -> tuple:
        return tuple((d.path, d.value(values[d.path])) for d in dims)

    (best,) = search.evaluate([setting(current)])
    assert best is not None  # nothing is dropped without an incumbent
    for _r in range(search.config.rounds if dims else 0):
        for d in dims:
            lo, hi = ranges[d.path]
            values = sorted({*d.grid(lo, hi, search.config.candidates), current[d.path]})
            trials = [setting({**current, d.path: v}) for v in values]
            evaluations = [e for e in search.evaluate(trials, best) if e is not None]
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
    overrides: dict[str, object] | None = None,
    out: Path | None = None,
    progress: Callable[[int, int, str], None] | None = None,
) -> list[PolicyResult]:
    """Search each policy of the scenario on its own; re-run each winner on fresh seeds; compare it with
    unconditional admission on the same pool.

    `overrides` are `--set` assignments applied to the scenario first. With `out`, every simulation is
    saved under `out/points/` (a later call with the same inputs reuses it) and the searched points are
    written to `out/optimize.csv` and `out/optimize.parquet`. `progress(done, at most, policy)` follows
    the simulations. Every problem with the SLOs, the objective or the searched paths is reported before
    anything runs.
    """
    overrides = overrides or {}
    raw = read_mapping(scenario, "scenario")
    spec = scenario_from_dict(raw, scenario, overrides)
    document = apply_overrides(raw, overrides)
    raw_policies: list[object] = list(document["policies"])  # type: ignore[call-overload]
    tiers = {t.name for t in spec.workload.tiers} | {"all"}
    bad = [problem("--slo", s.text, f"unknown tier {s.tier!r}; tiers: {', '.join(sorted(tiers))}")
           for s in slos if s.tier not in tiers]  # fmt: skip
    if objective not in OBJECTIVES:
        bad.append(problem("--objective", objective, f"expected one of {', '.join(OBJECTIVES)}"))
    for d in dimensions or []:  # a policy path no policy answers would be searched for none, silently
        head, _, rest = d.path.partition(".")
        if head == "policies" and list_index(raw_policies, rest.partition(".")[0]) is None:
            names = ", ".join(policy_name(p) for p in spec.policies)
            bad.append(f"--search {d}: {d.path} names no policy of the scenario (its policies: {names})")
    plans = []
    for i, (raw_policy, policy) in enumerate(zip(raw_policies, spec.policies, strict=True)):
        name = policy_name(policy)
        doc = {**copy.deepcopy(document), "policies": [raw_policy]}
        dims = dimensions
        if dims is None:
            dims = default_dimensions(doc, scenario, name, OBJECTIVES.get(objective, ("", 1, False))[2])
        dims = concerning(dims, raw_policies, i, name)
        bad += [line for d in dims for line in _dimension_problems(doc, scenario, d)]
        plans.append((name, doc, dims))
    total = sum(simulations_bound(config, dims) for _, _, dims in plans)
    if total > MAX_SIMULATIONS:  # a typo (--rounds 100000000), not a search that could finish
        bad.append(
            problem(
                "--rounds, --candidates, --fresh-seeds",
                f"{config.rounds}, {config.candidates}, {config.fresh_seeds}",
                f"up to {total:,} simulations ({len(config.loads)} loads x {config.replications} replications "
                f"each); optimize runs at most {MAX_SIMULATIONS:,}",
            )
        )
    if bad:
        raise InputError(list(dict.fromkeys(bad)))
    store = PointStore(out) if out is not None else None
    if backend is process_map:  # one set of workers for the whole search
        with WorkerPool() as pool:
            return _search_all(plans, scenario, slos, objective, config, pool, store, out, progress)
    return _search_all(plans, scenario, slos, objective, config, backend, store, out, progress)


def _dimension_problems(document: dict, scenario: Path, d: Dimension) -> list[str]:
    """A searched field its range's ends break (the schema refuses false:true for a number), or a true/false
    field over a range of numbers, where 0 and 1 would silently stand for false and true."""
    out = []
    for v in (d.lo, d.hi):
        try:
            spec = scenario_from_dict(document, scenario, {d.path: d.value(v)})
        except InputError as e:
            out += [f"--search {d}: {line}" for line in e.problems]
            continue
        if isinstance(lookup(spec.model_dump(), d.path), bool) and not d.boolean:
            out.append(f"--search {d}: true or false, not a number: write {d.path}=false:true to try both")
    return out


def _search_all(
    plans: list[tuple[str, dict, list[Dimension]]],
    scenario: Path,
    slos: list[SLO],
    objective: str,
    config: SearchConfig,
    backend: Backend,
    store: PointStore | None,
    out: Path | None,
    progress: Callable[[int, int, str], None] | None,
) -> list[PolicyResult]:
    """Each policy's search, its winner on fresh seeds, and its unconditional reference."""
    count = [0]
    searches = [
        Search(doc, scenario, slos, objective, config, backend, store, lambda p: _tick(count, total, p, progress))
        for _, doc, _ in plans
    ]  # fmt: skip
    total = sum(s.upper_bound(dims) for s, (_, _, dims) in zip(searches, plans, strict=True))
    results, rows = [], []
    for search, (name, doc, dims) in zip(searches, plans, strict=True):
        best = search_policy(search, dims)
        first = search.first_seed + config.replications + 1000  # seeds no candidate was ranked on
        fresh = tuple(range(first, first + config.fresh_seeds)) if dims else ()  # nothing ranked: no curse
        confirmed = search.evaluate([best.setting], seeds=fresh)[0] if fresh else best
        assert confirmed is not None
        shared = tuple((p, v) for p, v in best.setting if not p.startswith("policies."))
        reference_config = replace(config, loads=config.loads[:1])
        reference = Search({**doc, "policies": [{"kind": "unconditional"}]}, scenario, [], objective,
                           reference_config, backend, store, lambda p: _tick(count, total, p, progress))  # fmt: skip
        (uncond,) = reference.evaluate([shared])
        (uncond_fresh,) = reference.evaluate([shared], seeds=fresh) if fresh else (uncond,)
        assert uncond is not None and uncond_fresh is not None
        throughput = uncond.summaries[config.loads[0]]["all"]["throughput_rps"]
        throughput_fresh = uncond_fresh.summaries[config.loads[0]]["all"]["throughput_rps"]
        simulations = search.simulations + reference.simulations
        results.append(PolicyResult(name, best, confirmed, simulations, throughput, fresh, throughput_fresh))
        rows += search.rows()
        if out is not None:
            _write_points(out, rows)
    return results


def _tick(
    count: list[int], total: int, policy: str, progress: Callable[[int, int, str], None] | None
) -> None:
    count[0] += 1
    if progress is not None:
        progress(count[0], max(total, count[0]), policy)


def _write_points(out: Path, rows: list[dict[str, object]]) -> None:
    table = pd.DataFrame(rows)
    update_in_place(
        out,
        {"optimize.csv": lambda p: table.to_csv(p, index=False),
         "optimize.parquet": lambda p: table.to_parquet(p, index=False)},
        {"command": "optimize", "partial": False},
    )  # fmt: skip
