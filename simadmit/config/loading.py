"""Loading: a scenario file (or document) read, overridden, validated and checked against the disk.

`load_scenario` and `scenario_from_dict` apply dotted-path overrides (`simadmit.config.overrides`) to the
raw document before validation, so an override is checked exactly like a value written in the file; a
problem with a field `--set` wrote (or a field below it) names `--set`, not the file. After
the schema, every profile and trace the scenario names must exist; trace paths are then made absolute, so
the spec can be used from any directory. Each variant is validated as its own scenario (`variant_spec`),
so a bad variant is reported before anything runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from pydantic import ValidationError

from simadmit.config.errors import (
    InputError,
    another_kind,
    not_found,
    problem,
    pydantic_problems,
    read_mapping,
)
from simadmit.config.overrides import apply_overrides, override
from simadmit.config.profile import PROFILE_FIELDS, kv_cache_problem, load_profile
from simadmit.config.resources import resolve_profile, resolve_trace
from simadmit.config.schema import (
    ContinuousEngineSpec,
    ScenarioSpec,
    VariantSpec,
    engine_limits_problem,
    scenario_problems,
)
from simadmit.config.workload_schema import EmpiricalSpec, FitArrivalSpec, TraceFileSpec

Origin = Callable[[str], str | Path | None]  # where a field was written: the option that set it, or the file


def by_option(where: str | Path | None) -> bool:
    """An origin that is a command-line option alone (`--set`), not the file nor the file with an option."""
    return isinstance(where, str) and where.startswith("--")


def load_scenario(
    path: str | Path,
    overrides: dict[str, object] | None = None,
    workload_traces: bool = True,
    given_by: Mapping[str, str] | None = None,
) -> tuple[ScenarioSpec, Path]:
    """Read, validate and return a scenario with the directory its relative paths are resolved against;
    `overrides` are the command's assignments, a problem they cause named by their option: `--set`, or
    the one `given_by` names for a path (`{"pools.0.profile": "--profile"}`)."""
    spec, base, _ = load_scenario_with_origin(path, overrides, workload_traces, given_by)
    return spec, base


def load_scenario_with_origin(
    path: str | Path,
    overrides: dict[str, object] | None = None,
    workload_traces: bool = True,
    given_by: Mapping[str, str] | None = None,
) -> tuple[ScenarioSpec, Path, Origin]:
    """`load_scenario`'s scenario and directory with the origin of its fields, for the checks after
    validation (`simadmit.workload.check`) to name a field's option or file as validation does."""
    path = Path(path)
    data = read_mapping(path, "scenario")
    set_by = {p: (given_by or {}).get(p, "--set") for p in overrides or {}}
    spec, origin = scenario_with_origin(data, path, overrides, workload_traces, set_by)
    return spec, path.parent, origin


def load_scenario_fields(path: str | Path) -> ScenarioSpec:
    """A scenario file checked against the schema and the rules across sections, not against the disk:
    for a reader of its fields alone (`plot`'s SLA lines) from a run folder that may have been copied
    where the profiles and traces it names are not."""
    path = Path(path)
    return _validate(read_mapping(path, "scenario"), path)


def scenario_from_dict(
    data: dict[str, object],
    source: str | Path | None = None,
    overrides: dict[str, object] | None = None,
    workload_traces: bool = True,
    set_by: Mapping[str, str] | None = None,
) -> ScenarioSpec:
    """Validate a scenario document, applying `overrides` (`{"workload.seed": 3}`) first (see
    `scenario_with_origin`)."""
    return scenario_with_origin(data, source, overrides, workload_traces, set_by)[0]


def scenario_with_origin(
    data: dict[str, object],
    source: str | Path | None = None,
    overrides: dict[str, object] | None = None,
    workload_traces: bool = True,
    set_by: Mapping[str, str] | None = None,
) -> tuple[ScenarioSpec, Origin]:
    """Validate a scenario document, applying `overrides` (`{"workload.seed": 3}`) first; return it with
    the origin of its fields.

    `workload_traces=False` leaves the workload's trace files unchecked (and their paths as written), for
    a caller that never draws the workload (the live gateway); the pools' own traces are always checked.
    With `set_by`, the option each override was given by (`--set`), a problem with a field an override
    wrote is reported against its option, not against `source`; without, against `source` (a caller that
    names the override itself, a sweep point).
    """
    # a path that leads nowhere: named by its option, or by the caller that names the override itself
    data, written = override(data, overrides or {}, lambda path: (set_by or {}).get(path))
    options = [(w, (set_by or {}).get(path)) for w, path in zip(written, overrides or {}, strict=True)]

    def origin(field: str) -> str | Path | None:
        """Where `field` was written: by an override of it or of a mapping or list above it, or in the file;
        a field an override wrote a part of (a rule across its parts: `slo` when `--set` wrote its e2e_s)
        was written by both."""
        by = [o for w, o in options if o is not None and (field == w or field.startswith(f"{w}."))]
        if by:
            return by[-1]
        parts = dict.fromkeys(
            o for w, o in options if o is not None and (not field or w.startswith(f"{field}."))
        )
        return " and ".join([str(source)] * (source is not None) + list(parts)) if parts else source

    return _checked(data, source, origin, workload_traces), origin


def _checked(
    data: dict[str, object], source: str | Path | None, origin: Origin, workload_traces: bool
) -> ScenarioSpec:
    """The overridden document validated, its variants too, and checked against the disk, each variant as
    the scenario is (`_on_disk`): a variant's problem names the variant, and the trace paths a variant sets
    are made absolute in its `set` as the scenario's are."""
    base = Path(source).parent if source is not None else Path(".")
    spec = _on_disk(_validate(data, source, origin), base, origin, workload_traces)
    variants = []
    for i, variant in enumerate(spec.variants):
        try:
            seen = variant_spec(spec, variant)
            checked = _on_disk(seen, base, lambda _: None, workload_traces)
        except InputError as e:
            name = f"variants.{i} ({variant.name})"
            raise InputError([problem(origin(f"variants.{i}"), name, p) for p in e.problems]) from None
        written = dict(trace_refs(seen))
        moved = {f"{w}.path": t.path for w, t in trace_refs(checked) if written[w].path != t.path}
        variants.append(variant.model_copy(update={"set": {**variant.set, **moved}}) if moved else variant)
    return spec.model_copy(update={"variants": variants}) if variants else spec


def _on_disk(spec: ScenarioSpec, base: Path, origin: Origin, workload_traces: bool) -> ScenarioSpec:
    """`spec` checked against the disk: the profiles and traces it names exist (the traces' paths made
    absolute), and engine overrides fit their profile."""
    missing = [
        problem(origin(f"pools.{i}.profile"), f"pools.{i}.profile", _not_found("profile", p.profile, base))
        for i, p in enumerate(spec.pools)
        if resolve_profile(p.profile, base) is None
    ]
    traces = [(w, t) for w, t in trace_refs(spec) if workload_traces or not w.startswith("workload.")]
    missing += [
        problem(origin(f"{where}.path"), f"{where}.path", _not_found("trace", t.path, base))
        for where, t in traces
        if resolve_trace(t.path, base) is None
    ]
    if missing:
        raise InputError(missing)
    limits = [
        problem(origin(field := f"pools.{i}.engine{part}"), field, message)
        for i, p in enumerate(spec.pools)
        for part, message in _engine_against_profile(p.engine, resolve_profile(p.profile, base))
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


def _not_found(what: str, ref: str, base: Path) -> str:
    """Why a profile or trace reference leads to no file: a folder by that name, or nothing at all."""
    path = Path(ref) if Path(ref).is_absolute() else base / ref
    if path.is_dir():
        return f"{what} {ref!r} is a folder, not a {what} file"
    return not_found(path, f"{what} {ref!r}")


def _validate(data: object, source: str | Path | None, origin: Origin | None = None) -> ScenarioSpec:
    """The schema, then the rules across sections; every problem as one `file: field: message` line, the
    file being `origin(field)` where given (`--set` for a field it wrote), else `source`."""
    try:
        spec = ScenarioSpec.model_validate(data)
    except ValidationError as e:
        fields = ScenarioSpec.model_fields
        kind = another_kind(source, data, fields, "scenario", PROFILE_FIELDS, "a calibration profile")
        raise InputError(kind or pydantic_problems(source, e, document=data, origin=origin)) from None
    problems = [
        problem(origin(field) if origin else source, field, message)
        for field, message in scenario_problems(spec)
    ]
    if problems:
        raise InputError(problems)
    return spec


def _engine_against_profile(engine: object, profile_path: Path | None) -> list[tuple[str, str]]:
    """Engine overrides that break the profile's own limits, as (the part of `engine` named, why): a batch
    whose token budget is under its sequences (max_num_batched_tokens >= max_num_seqs), a KV cache with no
    block for a sequence (`kv_cache_problem`)."""
    if not isinstance(engine, ContinuousEngineSpec) or profile_path is None:
        return []
    if (
        engine.max_num_seqs is None
        and engine.max_num_batched_tokens is None
        and engine.kv_capacity_tokens is None
    ):
        return []
    profile = load_profile(profile_path)
    found = []
    batch = engine_limits_problem(
        engine.max_num_batched_tokens or profile.engine.max_num_batched_tokens,
        engine.max_num_seqs or profile.engine.max_num_seqs,
    )
    if batch and (engine.max_num_seqs is not None or engine.max_num_batched_tokens is not None):
        found.append(("", batch))
    if engine.kv_capacity_tokens is not None and (
        kv := kv_cache_problem(engine.kv_capacity_tokens, profile.kv_block_size)
    ):
        found.append((".kv_capacity_tokens", f"{kv} (the block size is the profile's)"))
    return found


def trace_refs(spec: ScenarioSpec) -> list[tuple[str, TraceFileSpec]]:
    """Every trace file the scenario reads, with its field path: the workload's, then the pools' (service
    times and cold starts drawn from a trace's lengths)."""
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
    for i, p in enumerate(spec.pools):
        dists = {"engine.service_time": getattr(p.engine, "service_time", None)}
        dists["autoscaler.cold_start_s"] = p.autoscaler.cold_start_s if p.autoscaler else None
        for where, dist in dists.items():
            if isinstance(dist, EmpiricalSpec) and dist.trace is not None:
                refs.append((f"pools.{i}.{where}.trace", dist.trace))
    return refs


def variant_spec(spec: ScenarioSpec, variant: VariantSpec) -> ScenarioSpec:
    """The scenario as one of its variants sees it (without the variants list)."""
    doc = spec.model_dump(exclude={"variants"})
    return _validate(apply_overrides(doc, variant.set, "set"), None)
