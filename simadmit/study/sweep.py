"""Sweep: one scenario over a grid of parameter values, in parallel processes (or Ray), resumable.

A parameter is a dotted path into the scenario YAML (`workload.rate_multiplier`,
`policies.gpu_seconds.headroom`) with a list of values; the grid is every combination. Every point is
validated before anything runs. The unit of work is one (point, seed) pair: one replication of every
policy of the scenario on the same generated workload, exactly what `run_scenario` does for that seed.
Each finished unit is saved at once to `DIR/points/<key>.json` (written to a temporary file, then renamed,
so an interruption never leaves half a result), keyed by a digest of the scenario document (with the
profile and trace files it reads, and the simulator's own source), the point's parameters and the seed. Running the same sweep again skips saved units, so an interrupted sweep resumes
where it stopped, and raising `--replications` reuses the seeds already run.

The result is one tidy table, one row per point x policy x tier, with every summary measure, its 95%
confidence half-width across replications (`<measure>_ci95`) and the scenario's nominal arrival rate for
the group (`arrival_rate_rps`: noise-free, so it orders points along the load axis; the measured rate for a
trace replayed at its own pace). Groups of the summary that are not tiers (per-pool figures) get their own
rows, with NaN for the measures they lack.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import yaml

from simadmit.results import summary
from simadmit.config.errors import InputError, problem
from simadmit.config.resources import resolve_profile, resolve_trace
from simadmit.study.runner import run_scenario
from simadmit.config.scenario import ScenarioSpec, load_scenario, scenario_from_dict, trace_refs
from simadmit.sim.world import build_world

_RANGE = re.compile(r"^\s*(-?[\d.eE+-]+)\s*:\s*(-?[\d.eE+-]+)\s*:\s*(\d+)\s*$")
_MAX_PROBLEMS = 20
OnProgress = Callable[[int, int], None]  # (units done, units total)


@dataclass(frozen=True)
class Param:
    """One swept scenario field: its dotted path and the values it takes."""

    path: str
    values: tuple[object, ...]


@dataclass(frozen=True)
class Unit:
    """One replication of one grid point: the smallest piece of work, saved on its own."""

    point: int
    overrides: tuple[tuple[str, object], ...]
    seed: int
    key: str


@dataclass(frozen=True)
class SweepPlan:
    """A validated sweep: the scenario document, the grid and the seeds of each point."""

    source: Path
    document: dict[str, object]
    params: tuple[Param, ...]
    points: tuple[tuple[tuple[str, object], ...], ...]
    seeds: tuple[tuple[int, ...], ...]  # per point: seed, seed + 1, ... (one per replication)
    tier_slo: dict[str, dict[str, float]]  # tier -> {"ttft_s": ..., "e2e_s": ...} of the base scenario
    inputs: str  # digest of the document and of the files it reads

    def units(self) -> list[Unit]:
        return [
            Unit(i, point, s, _digest([self.inputs, [list(kv) for kv in point], s]))
            for i, point in enumerate(self.points)
            for s in self.seeds[i]
        ]


def _digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:24]


@functools.cache
def _code_digest() -> str:
    """The simulator's source: results of another version of the code are never reused."""
    h = hashlib.sha256()
    package = Path(__file__).resolve().parent
    for f in sorted(package.rglob("*.py")):
        h.update(f.relative_to(package).as_posix().encode() + f.read_bytes())
    return h.hexdigest()


def _inputs_digest(document: dict[str, object], spec: ScenarioSpec, base: Path) -> str:
    """What every result depends on besides its point and seed: the document, the files it reads, the code."""
    h = hashlib.sha256(json.dumps(document, sort_keys=True, default=str).encode() + _code_digest().encode())
    files = [resolve_profile(p.profile, base) for p in spec.pools]
    files += [resolve_trace(t.path, base) for _, t in trace_refs(spec)]
    for f in files:
        if f is not None:
            h.update(f.read_bytes())
    return h.hexdigest()[:24]


def _tidy(value: float) -> float | int:
    """Grid values without binary noise (0.30000000000000004 -> 0.3), as ints when whole and meant so."""
    return float(f"{value:.10g}")


def parse_param(text: str) -> Param:
    """`path=lo:hi:n` (n evenly spaced values, ends included), `path=a,b,c`, `path=[a, b]` or `path=v`.

    Values are read as YAML, so numbers, booleans and mappings work. A range whose ends are integers and
    whose steps are whole gives integers (`pools.0.replicas=2:8:4` -> 2, 4, 6, 8).
    """
    path, sep, raw = text.partition("=")
    path = path.strip()
    if not sep or not path or not raw.strip():
        raise InputError([problem("--param", text, "expected path=lo:hi:n or path=a,b,c")])
    m = _RANGE.match(raw)
    if m:
        lo, hi, n = float(m.group(1)), float(m.group(2)), int(m.group(3))
        if n < 1 or (n == 1 and lo != hi):
            raise InputError([problem("--param", text, "a range needs at least 2 values (lo:hi:n, n >= 2)")])
        step = (hi - lo) / (n - 1) if n > 1 else 0.0
        values: list[object] = [_tidy(lo + i * step) for i in range(n)]
        if all(float(x).is_integer() for x in (m.group(1), m.group(2), step)) and "." not in raw:
            values = [int(v) for v in values]  # type: ignore[call-overload]
        return Param(path, tuple(values))
    try:
        parsed = (
            yaml.safe_load(raw)
            if raw.lstrip().startswith("[")
            else [yaml.safe_load(v) for v in raw.split(",")]
        )
    except yaml.YAMLError:
        raise InputError([problem("--param", text, "values are not valid YAML")]) from None
    values = parsed if isinstance(parsed, list) else [parsed]
    if not values or any(v is None for v in values):
        raise InputError([problem("--param", text, "empty value")])
    return Param(path, tuple(values))


def plan_sweep(
    scenario: str | Path, params: list[Param], replications: int = 1, seed: int | None = None
) -> SweepPlan:
    """Validate the scenario and every grid point before anything runs; one problem per line."""
    base_spec, base = load_scenario(scenario, None)
    source = Path(scenario)
    document = yaml.safe_load(source.read_text())
    paths = [p.path for p in params]
    if len(set(paths)) != len(paths):
        raise InputError([problem("--param", ", ".join(paths), "each path may be swept once")])
    problems: list[str] = []
    for p in params:  # one line per bad value, named by the value rather than by a whole combination
        for v in p.values:
            try:
                scenario_from_dict(document, source, {p.path: v})
            except InputError as e:
                problems += [f"--param {p.path}={v}: {line}" for line in e.problems]
    points = tuple(
        tuple(zip(paths, combo, strict=True)) for combo in itertools.product(*(p.values for p in params))
    )
    seeds = []
    for point in points if not problems else ():
        try:
            spec = scenario_from_dict(document, source, dict(point))
        except InputError as e:
            problems += [f"point {dict(point)}: {line}" for line in e.problems]
            continue
        first = spec.workload.seed if seed is None else seed
        seeds.append(tuple(range(first, first + replications)))
    if problems:
        unique = list(dict.fromkeys(problems))
        more = [f"... and {len(unique) - _MAX_PROBLEMS} more"] if len(unique) > _MAX_PROBLEMS else []
        raise InputError(unique[:_MAX_PROBLEMS] + more)
    tier_slo = {t.name: {"ttft_s": t.slo.ttft_s, "e2e_s": t.slo.e2e_s} for t in base_spec.workload.tiers}
    inputs = _inputs_digest(document, base_spec, base)
    return SweepPlan(source, document, tuple(params), points, tuple(seeds), tier_slo, inputs)


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


class PointStore:
    """Finished units on disk, one JSON file each, written atomically."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory / "points"
        self.directory.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def has(self, key: str) -> bool:
        return self.path(key).is_file()

    def save(self, key: str, record: dict) -> None:
        tmp = self.directory / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(record, allow_nan=True))
        os.replace(tmp, self.path(key))

    def load(self, key: str) -> dict:
        return json.loads(self.path(key).read_text())


Backend = Callable[[Callable[..., dict], list[tuple], int], Iterator[tuple[int, dict]]]


def process_map(fn: Callable[..., dict], args: list[tuple], jobs: int) -> Iterator[tuple[int, dict]]:
    """Yield (index, fn(*args[index])) as results arrive; in this process when jobs == 1.

    Workers start with `forkserver`, so no thread of the parent (a progress bar) is copied into them.
    On interruption the pending work is cancelled and nothing more is yielded.
    """
    if jobs <= 1 or len(args) <= 1:
        for i, a in enumerate(args):
            yield i, fn(*a)
        return
    import multiprocessing
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    context = multiprocessing.get_context("forkserver")
    with ProcessPoolExecutor(max_workers=min(jobs, len(args)), mp_context=context) as pool:
        futures = {pool.submit(fn, *a): i for i, a in enumerate(args)}
        try:
            while futures:
                done, _ = wait(futures, return_when=FIRST_COMPLETED)
                for f in done:
                    yield futures.pop(f), f.result()
        finally:
            for f in futures:
                f.cancel()


def run_sweep(
    plan: SweepPlan,
    out: Path,
    jobs: int = 1,
    backend: Backend = process_map,
    progress: OnProgress | None = None,
) -> pd.DataFrame:
    """Run the units not yet saved in `out`, then write and return the table (sweep.parquet, sweep.csv)."""
    store = PointStore(out)
    units = plan.units()
    pending = [u for u in units if not store.has(u.key)]
    done = len(units) - len(pending)
    if progress is not None:
        progress(done, len(units))
    args = [(plan.document, str(plan.source), dict(u.overrides), u.seed) for u in pending]
    for i, record in backend(run_unit, args, jobs):
        store.save(pending[i].key, record)
        done += 1
        if progress is not None:
            progress(done, len(units))
    table = assemble(plan, store)
    write_table(plan, table, out)
    return table


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


LOAD_AXES = ("workload.rate_multiplier", "workload.rate_rps")


def curves(table: pd.DataFrame) -> list[tuple[str, dict[str, object], pd.DataFrame]]:
    """Split a sweep table into curves along the load axis: (policy, settings, rows), rows by arrival rate.

    A curve is one policy at one value of every other swept setting that concerns it. A swept
    `policies.<name>.*` field only splits the curves of that policy: the other policies' rows for its
    values are identical runs, and only the first is kept.
    """
    params = [c for c in table.columns if "." in c and c not in LOAD_AXES and not c.endswith("_ci95")]
    out: list[tuple[str, dict[str, object], pd.DataFrame]] = []
    for policy, rows in table.groupby("policy", sort=False):
        mine = [p for p in params if not p.startswith("policies.") or p.split(".")[1] == policy]
        for p in params:
            if p not in mine:
                rows = rows[rows[p] == rows[p].iloc[0]]
        varying = [p for p in mine if rows[p].nunique() > 1]
        if not varying:
            out.append((str(policy), {}, rows.sort_values("arrival_rate_rps")))
            continue
        for key, part in rows.groupby(varying, sort=True):
            values = key if isinstance(key, tuple) else (key,)
            out.append(
                (str(policy), dict(zip(varying, values, strict=True)), part.sort_values("arrival_rate_rps"))
            )
    return out
