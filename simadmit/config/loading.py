"""Loading: a scenario file (or document) read, overridden, validated and checked against the disk.

`load_scenario` and `scenario_from_dict` apply dotted-path overrides (`simadmit.config.overrides`) to the
raw document before validation, so an override is checked exactly like a value written in the file. After
the schema, every profile and trace the scenario names must exist; trace paths are then made absolute, so
the spec can be used from any directory. Each variant is validated as its own scenario (`variant_spec`),
so a bad variant is reported before anything runs.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from simadmit.config.errors import InputError, problem, pydantic_problems, read_yaml
from simadmit.config.overrides import apply_overrides
from simadmit.config.profile import load_profile
from simadmit.config.resources import resolve_profile, resolve_trace
from simadmit.config.schema import (
    ContinuousEngineSpec,
    ScenarioSpec,
    VariantSpec,
    engine_limits_problem,
    scenario_problems,
)
from simadmit.config.workload_schema import EmpiricalSpec, FitArrivalSpec, TraceFileSpec


def load_scenario(path: str | Path, overrides: dict[str, object] | None = None) -> tuple[ScenarioSpec, Path]:
    """Read, validate and return a scenario with the directory its relative paths are resolved against."""
    path = Path(path)
    data = read_yaml(path, "scenario")
    if not isinstance(data, dict):
        raise InputError([problem(path, None, "a scenario must be a YAML mapping")])
    return scenario_from_dict(data, path, overrides), path.parent


def scenario_from_dict(
    data: dict[str, object], source: str | Path | None = None, overrides: dict[str, object] | None = None
) -> ScenarioSpec:
    """Validate a scenario document, applying `overrides` (`{"workload.seed": 3}`) first."""
    data = apply_overrides(data, overrides or {})
    spec = _validate(data, source)
    for i, variant in enumerate(spec.variants):
        try:
            variant_spec(spec, variant)
        except InputError as e:
            raise InputError(
                [problem(source, f"variants.{i} ({variant.name})", p) for p in e.problems]
            ) from None
    base = Path(source).parent if source is not None else Path(".")
    missing = [
        problem(source, f"pools.{i}.profile", f"profile {p.profile!r} not found")
        for i, p in enumerate(spec.pools)
        if resolve_profile(p.profile, base) is None
    ]
    traces = trace_refs(spec)
    missing += [
        problem(source, f"{where}.path", f"trace {t.path!r} not found")
        for where, t in traces
        if resolve_trace(t.path, base) is None
    ]
    if missing:
        raise InputError(missing)
    limits = [
        problem(source, f"pools.{i}.engine", message)
        for i, p in enumerate(spec.pools)
        if (message := _engine_against_profile(p.engine, resolve_profile(p.profile, base)))
    ]
    if limits:
        raise InputError(limits)
    if not traces:
        return spec
    return ScenarioSpec.model_validate(
        apply_overrides(
            spec.model_dump(),
            {f"{where}.path": str(resolve_trace(t.path, base)) for where, t in traces},
        )
    )


def _validate(data: object, source: str | Path | None) -> ScenarioSpec:
    """The schema, then the rules across sections; every problem as one `file: field: message` line."""
    try:
        spec = ScenarioSpec.model_validate(data)
    except ValidationError as e:
        raise InputError(pydantic_problems(source, e)) from None
    problems = [problem(source, field, message) for field, message in scenario_problems(spec)]
    if problems:
        raise InputError(problems)
    return spec


def _engine_against_profile(engine: object, profile_path: Path | None) -> str | None:
    """An engine override that breaks the profile's own limits (max_num_batched_tokens >= max_num_seqs)."""
    if not isinstance(engine, ContinuousEngineSpec) or profile_path is None:
        return None
    if engine.max_num_seqs is None and engine.max_num_batched_tokens is None:
        return None
    limits = load_profile(profile_path).engine
    return engine_limits_problem(
        engine.max_num_batched_tokens or limits.max_num_batched_tokens,
        engine.max_num_seqs or limits.max_num_seqs,
    )


def trace_refs(spec: ScenarioSpec) -> list[tuple[str, TraceFileSpec]]:
    """Every trace file the scenario reads, with its field path."""
    w = spec.workload
    refs: list[tuple[str, TraceFileSpec]] = []
    if w.trace is not None:
        refs.append(("workload.trace", w.trace))
    if isinstance(w.arrival, FitArrivalSpec):
        refs.append(("workload.arrival.trace", w.arrival.trace))
    for i, t in enumerate(w.tiers):
        for field_name in ("prompt_tokens", "output_tokens"):
            dist = getattr(t, field_name)
            if isinstance(dist, EmpiricalSpec) and dist.trace is not None:
                refs.append((f"workload.tiers.{i}.{field_name}.trace", dist.trace))
    return refs


def variant_spec(spec: ScenarioSpec, variant: VariantSpec) -> ScenarioSpec:
    """The scenario as one of its variants sees it (without the variants list)."""
    doc = spec.model_dump(exclude={"variants"})
    return _validate(apply_overrides(doc, variant.set), None)
