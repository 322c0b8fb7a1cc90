"""Sweep grid: the `--param` grammar, the validated plan, and the digests that key its saved results.

A parameter is a dotted path into the scenario YAML (`workload.rate_multiplier`,
`policies.gpu_seconds.headroom`, resolved by `simadmit.config.overrides`) with a list of values; the grid
is every combination, and every point is validated before anything runs. The unit of work is one
(point, seed) pair, keyed by a digest of the scenario document (with the profile and trace files it
reads, and the simulator's own source), the point's parameters and the seed: a result is reused only when
everything it depends on is unchanged, so an interrupted sweep resumes and more replications reuse the
seeds already run.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

import simadmit
from simadmit.config.errors import InputError, load_yaml_text, not_yaml, problem, read_mapping
from simadmit.config.loading import load_scenario, scenario_from_dict, trace_refs
from simadmit.config.resources import resolve_profile, resolve_trace
from simadmit.config.schema import ScenarioSpec

_RANGE = re.compile(r"^[^,\[\]{}'\"]*:[^,\[\]{}'\"]*$")  # lo:hi:n, or a range mistyped (1:4, 1:2:3:4)
_MAX_PROBLEMS = 20
MAX_POINTS = 10_000  # a grid larger than this is a typo (1:2:1000000000), not a study that could finish


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
            Unit(i, point, s, digest([self.inputs, [list(kv) for kv in point], s]))
            for i, point in enumerate(self.points)
            for s in self.seeds[i]
        ]


def digest(obj: object) -> str:
    """A short stable digest of a JSON-able object: the key of a saved result."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:24]


@functools.cache
def _codedigest() -> str:
    """The simulator's source (every module of the package): results of another version are never reused."""
    h = hashlib.sha256()
    package = Path(simadmit.__file__).resolve().parent
    for f in sorted(package.rglob("*.py")):
        h.update(f.relative_to(package).as_posix().encode() + f.read_bytes())
    return h.hexdigest()


def inputs_digest(document: dict[str, object], spec: ScenarioSpec, base: Path) -> str:
    """What every result depends on besides its point and seed: the document, the files it reads, the code."""
    h = hashlib.sha256(json.dumps(document, sort_keys=True, default=str).encode() + _codedigest().encode())
    files = [resolve_profile(p.profile, base) for p in spec.pools]
    files += [resolve_trace(t.path, base) for _, t in trace_refs(spec)]
    for f in files:
        if f is not None:
            h.update(f.read_bytes())
    return h.hexdigest()[:24]


def _tidy(value: float) -> float | int:
    """Grid values without binary noise (0.30000000000000004 -> 0.3), as ints when whole and meant so."""
    return float(f"{value:.10g}")


RANGE_ENDS = "finite numbers with lo <= hi"


def range_ends(lo: str, hi: str) -> tuple[float, float] | None:
    """The ends of a range written `lo:hi` (a sweep's `--param`, optimize's `--search`): finite numbers,
    lo <= hi, and hi - lo finite too, since values are spaced across it; None when they are not."""
    try:
        ends = float(lo), float(hi)
    except ValueError:
        return None
    return ends if ends[0] <= ends[1] and math.isfinite(ends[1] - ends[0]) else None


def whole_ends(lo: str, hi: str) -> bool:
    """Both ends of a range written as whole numbers (`1:16`; not `2.0:16` nor `1:1e308`): the range then
    takes whole values, as the field it searches or sweeps surely does."""
    return all(re.fullmatch(r"\s*[-+]?[\d_]+\s*", end) for end in (lo, hi))


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse_param(text: str) -> Param:
    """`path=lo:hi:n` (n evenly spaced values, ends included), `path=a,b,c`, `path=[a, b]` or `path=v`.

    Values are read as YAML, so numbers, booleans and mappings work. A range whose ends are integers and
    whose steps are whole gives integers (`pools.0.replicas=2:8:4` -> 2, 4, 6, 8).
    """
    path, sep, raw = text.partition("=")
    path = path.strip()
    if not sep or not path or not raw.strip():
        raise InputError([problem("--param", text, "expected path=lo:hi:n or path=a,b,c")])
    parts = raw.split(":")
    if _RANGE.match(raw) and (len(parts) == 3 or _is_number(parts[0])):
        # a range, or one mistyped (1:4, 1:2:3:4): its forms said, where YAML would read it as one text
        ends = range_ends(*parts[:2]) if len(parts) == 3 else None
        count = parts[2].strip() if ends is not None else ""
        if ends is None or not count.isdecimal():  # what int() reads (`²` is a digit, no number)
            raise InputError(
                [
                    problem(
                        "--param",
                        text,
                        f"a range is lo:hi:n ({RANGE_ENDS}, n whole), e.g. 1:4:7; or values a,b,c",
                    )
                ]
            )
        lo, hi = ends
        n = int(count)
        if n < 1 or (n == 1 and lo != hi):
            raise InputError([problem("--param", text, "a range needs at least 2 values (lo:hi:n, n >= 2)")])
        if n > MAX_POINTS:
            raise InputError(
                [problem("--param", text, f"{n:,} values; a sweep runs at most {MAX_POINTS:,} points")]
            )
        step = (hi - lo) / (n - 1) if n > 1 else 0.0
        values: list[object] = [_tidy(lo + i * step) for i in range(n)]
        if step.is_integer() and whole_ends(*parts[:2]):
            values = [int(v) for v in values]  # type: ignore[call-overload]
        _distinct(text, values)
        return Param(path, tuple(values))
    try:
        parsed = (
            load_yaml_text(raw)
            if raw.lstrip().startswith("[")
            else [load_yaml_text(v) for v in raw.split(",")]
        )
    except yaml.YAMLError as e:
        # a mapping's own commas split a comma-separated list too: the YAML list form keeps them
        hint = (
            ": values with commas of their own go in a YAML list, path=[{a: 1, b: 2}, ...]"
            if "{" in raw
            else ""
        )
        raise InputError([problem("--param", text, f"values are {not_yaml(e)}{hint}")]) from None
    values = parsed if isinstance(parsed, list) else [parsed]
    if not values or any(v is None for v in values):
        why = "a value is null or empty (an empty field cannot be swept: leave it out of the grid)"
        raise InputError([problem("--param", text, why)])
    _distinct(text, values)
    return Param(path, tuple(values))


def _distinct(text: str, values: list[object]) -> None:
    """Each value once: a value given twice would run its points twice, as two points of the curve."""
    keys = [
        float(v) if isinstance(v, int | float) and not isinstance(v, bool) else (type(v).__name__, repr(v))
        for v in values
    ]  # 2 and 2.0 are one value; true and 1 are not
    twice = [v for i, v in enumerate(values) if keys[i] in keys[:i]]
    if twice:
        raise InputError([problem("--param", text, f"the value {twice[0]!r} is given twice")])


def _value_problems(document: dict, source: Path, path: str, value: object) -> list[str]:
    """What is wrong with the scenario once `path` is set to `value` (nothing: an empty list)."""
    try:
        scenario_from_dict(document, source, {path: value})
    except InputError as e:
        return e.problems
    return []


def yaml_value(value: object) -> str:
    """A swept value as the user wrote it in YAML (`true`, not Python's `True`)."""
    return yaml.safe_dump(value, default_flow_style=True, width=math.inf).removesuffix("\n...\n").strip()


def plan_sweep(
    scenario: str | Path, params: list[Param], replications: int = 1, seed: int | None = None
) -> SweepPlan:
    """Validate the scenario and every grid point before anything runs; one problem per line."""
    base_spec, base = load_scenario(scenario, None)
    source = Path(scenario)
    document = read_mapping(source, "scenario")  # as load_scenario read it: UTF-8, whatever the locale
    paths = [p.path for p in params]
    if len(set(paths)) != len(paths):
        raise InputError([problem("--param", ", ".join(paths), "each path may be swept once")])
    if math.prod(len(p.values) for p in params) > MAX_POINTS:
        sizes = " x ".join(str(len(p.values)) for p in params)
        raise InputError([problem("--param", sizes, f"a sweep runs at most {MAX_POINTS:,} points")])
    problems: list[str] = []
    for p in params:  # one line per bad value, named by the value rather than by a whole combination
        found = [(v, _value_problems(document, source, p.path, v)) for v in p.values]
        distinct = {tuple(lines) for _, lines in found}
        # every value wrong alike (an unknown path): one line for the path, not one per value
        if len(distinct) == 1 and len(found) > 1 and () not in distinct:
            problems += [f"--param {p.path}: {line}" for line in found[0][1]]
            continue
        problems += [f"--param {p.path}={yaml_value(v)}: {line}" for v, lines in found for line in lines]
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
    inputs = inputs_digest(document, base_spec, base)
    return SweepPlan(source, document, tuple(params), points, tuple(seeds), tier_slo, inputs)
