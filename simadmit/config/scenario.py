"""Scenario files: the YAML a user writes, validated up front with pydantic.

Everything is checked before a simulation starts, and every problem is reported on its own line as
`file: field.path: message` (exit code 2 from the CLI). After validation the simulator runs on plain
dataclasses built from these models, never on pydantic objects.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from simadmit.config.defaults import DEFAULT_BUDGET_S, DEFAULT_BUDGETS_S, DEFAULT_HEADROOM
from simadmit.config.errors import InputError, problem, pydantic_problems, read_yaml
from simadmit.config.resources import resolve_profile, resolve_trace


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- distributions -----------------------------------------------------------------------------------


class FixedSpec(_Model):
    kind: Literal["fixed"]
    value: float = Field(gt=0)


class LogNormalSpec(_Model):
    kind: Literal["lognormal"]
    median: float = Field(gt=0)
    sigma: float = Field(ge=0, description="standard deviation of log(x)")
    min: float = Field(default=1, ge=0)
    max: float = Field(default=float("inf"), gt=0)


class ExponentialSpec(_Model):
    kind: Literal["exponential"]
    mean: float = Field(gt=0)


class EmpiricalSpec(_Model):
    kind: Literal["empirical"]
    values: list[float] | None = Field(default=None, min_length=1, description="observed values, resampled")
    trace: TraceFileSpec | None = Field(default=None, description="or: the lengths of a trace")
    column: Literal["prompt_tokens", "output_tokens"] = "prompt_tokens"

    @model_validator(mode="after")
    def _one_source(self) -> EmpiricalSpec:
        if (self.values is None) == (self.trace is None):
            raise ValueError("set exactly one of values and trace")
        return self


DistSpec = Annotated[FixedSpec | LogNormalSpec | ExponentialSpec | EmpiricalSpec, Field(discriminator="kind")]


# --- workload ----------------------------------------------------------------------------------------


class PoissonSpec(_Model):
    kind: Literal["poisson"]


class GammaSpec(_Model):
    kind: Literal["gamma"]
    cv: float = Field(gt=0, description="coefficient of variation of inter-arrival times (1 = Poisson)")


class MMPPSpec(_Model):
    kind: Literal["mmpp"]
    burst_factor: float = Field(gt=1, description="burst rate / calm rate")
    calm_s: float = Field(gt=0, description="mean duration of a calm period")
    burst_s: float = Field(gt=0, description="mean duration of a burst")


class ProfileArrivalSpec(_Model):
    kind: Literal["profile"]
    points: list[tuple[float, float]] = Field(
        min_length=1, description="(t seconds, factor x rate_rps), piecewise linear from t = 0: ramps, spikes, drains"
    )
    cv: float = Field(default=1.0, gt=0, description="burstiness around the curve (1 = Poisson)")


class DiurnalSpec(_Model):
    kind: Literal["diurnal"]
    amplitude: float = Field(ge=0, le=1, description="factor = 1 + amplitude cos(2 pi (t - peak_s) / period_s)")
    period_s: float = Field(default=86_400.0, gt=0)
    peak_s: float = Field(default=0.0, ge=0)
    cv: float = Field(default=1.0, gt=0)


class TraceColumnsSpec(_Model):
    arrival: str
    arrival_unit: Literal["s", "ms", "us", "datetime"] = "s"
    prompt_tokens: str
    output_tokens: str
    tier: str | None = None


class TraceFileSpec(_Model):
    path: str = Field(description="trace file (relative to the scenario) or a bundled trace name")
    format: Literal["azure", "mooncake", "mapped"] = "mapped"
    columns: TraceColumnsSpec | None = Field(default=None, description="required for format: mapped")
    start_s: float = Field(default=0.0, ge=0, description="window start, trace seconds from its first request")
    end_s: float | None = Field(default=None, gt=0, description="window end (null: to the end)")
    speedup: float = Field(default=1.0, gt=0, description="2 replays twice as fast; multiplied by rate_multiplier")
    sample: float = Field(default=1.0, gt=0, le=1, description="fraction of requests kept")
    bucket_jitter: bool = Field(default=False, description="Mooncake: spread a timestamp's batch over its bucket")
    on_error: Literal["fail", "skip"] = Field(default="fail", description="skip: drop malformed rows, and count them")

    @model_validator(mode="after")
    def _columns(self) -> TraceFileSpec:
        if self.format == "mapped" and self.columns is None:
            raise ValueError("format: mapped needs columns: {arrival, prompt_tokens, output_tokens}")
        return self


class FitArrivalSpec(_Model):
    kind: Literal["fit"]
    trace: TraceFileSpec
    bin_s: float = Field(default=60.0, gt=0, description="rate curve resolution")


ArrivalSpec = Annotated[
    PoissonSpec | GammaSpec | MMPPSpec | ProfileArrivalSpec | DiurnalSpec | FitArrivalSpec,
    Field(discriminator="kind"),
]


class LengthRuleSpec(_Model):
    tier: str
    column: Literal["prompt_tokens", "output_tokens"] = "prompt_tokens"
    above: int = 0
    at_most: int | None = None


class TraceTiersSpec(_Model):
    by: Literal["share", "length", "column"] = "share"
    rules: list[LengthRuleSpec] = Field(default_factory=list, description="by: length; the first match wins")
    column: str = Field(default="tier", description="by: column")
    names: dict[str, str] = Field(default_factory=dict, description="by: column; trace value -> tier name")
    default: str | None = None


class MaxTokensSpec(_Model):
    kind: Literal["fixed", "scaled"]
    value: int | None = Field(default=None, gt=0, description="fixed: the max_tokens every client sends")
    factor: float | None = Field(default=None, ge=1, description="scaled: actual output x factor, rounded up")
    cap: int | None = Field(default=None, gt=0)


class TraceReplaySpec(TraceFileSpec):
    tiers: TraceTiersSpec = TraceTiersSpec()
    max_tokens: MaxTokensSpec = Field(
        default=MaxTokensSpec(kind="scaled", factor=1.5),
        description="what clients send as max_tokens: the estimator sees this, never the true output",
    )


class SLOSpec(_Model):
    ttft_s: float = Field(default=float("inf"), gt=0, description="time to first token counted as good")
    e2e_s: float = Field(default=float("inf"), gt=0, description="end-to-end latency counted as good")


class TierSpec(_Model):
    name: str
    share: float = Field(default=1.0, gt=0, description="fraction of arrivals (shares are normalised)")
    prompt_tokens: DistSpec | None = Field(default=None, description="required unless the workload is a trace")
    output_tokens: DistSpec | None = Field(default=None, description="actual output; the gateway never sees it")
    max_tokens: int | None = Field(default=None, gt=0, description="max_tokens the client sends; caps the output")
    deadline_s: float | None = Field(default=None, gt=0, description="client deadline after first arrival")
    slo: SLOSpec = SLOSpec()
    start_s: float = Field(default=0.0, ge=0, description="the tier sends traffic from this time on")
    end_s: float = Field(default=float("inf"), gt=0, description="... and until this time (a shifting mix)")


class WorkloadSpec(_Model):
    seed: int = 0
    arrival: ArrivalSpec = PoissonSpec(kind="poisson")
    trace: TraceReplaySpec | None = Field(default=None, description="replay a trace instead of drawing requests")
    rate_rps: float | None = Field(
        default=None,
        gt=0,
        validate_default=True,
        description="mean arrival rate of first attempts (a fitted trace's rate if unset)",
    )
    rate_multiplier: float = Field(default=1.0, gt=0, description="scales the rate (2.0 = twice the traffic)")
    duration_s: float | None = Field(default=None, gt=0)
    requests: int | None = Field(default=None, gt=0)
    warmup_s: float = Field(default=0.0, ge=0, description="arrivals before this are left out of the summary")
    tiers: list[TierSpec] = Field(min_length=1)

    @field_validator("rate_rps")
    @classmethod
    def _rate_needed(cls, v: float | None, info: ValidationInfo) -> float | None:
        synthetic = info.data.get("trace") is None and not isinstance(info.data.get("arrival"), FitArrivalSpec)
        if v is None and synthetic and "arrival" in info.data:
            raise PydanticCustomError("missing", "required field is missing")
        return v

    @model_validator(mode="after")
    def _one_length(self) -> WorkloadSpec:
        if self.trace is None:
            if (self.duration_s is None) == (self.requests is None):
                raise ValueError("set exactly one of duration_s and requests")
            for t in self.tiers:
                if t.prompt_tokens is None or t.output_tokens is None or t.max_tokens is None:
                    raise ValueError(f"tier {t.name!r} needs prompt_tokens, output_tokens and max_tokens")
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        return self


# --- pools -------------------------------------------------------------------------------------------


class ContinuousEngineSpec(_Model):
    kind: Literal["continuous"] = "continuous"
    max_num_seqs: int | None = Field(default=None, gt=0, description="overrides the profile")
    max_num_batched_tokens: int | None = Field(default=None, gt=0, description="overrides the profile")
    kv_capacity_tokens: int | None = Field(default=None, gt=0, description="overrides the profile")


class ClassicalEngineSpec(_Model):
    kind: Literal["classical"]
    service_time: DistSpec = Field(description="service time of one request, seconds (batch of 1)")


def _engine_kind(value: object) -> str:
    """Engines default to continuous batching when `kind` is left out."""
    if isinstance(value, dict):
        return str(value.get("kind", "continuous"))
    return str(getattr(value, "kind", "continuous"))


EngineSpec = Annotated[
    Annotated[ContinuousEngineSpec, Tag("continuous")] | Annotated[ClassicalEngineSpec, Tag("classical")],
    Discriminator(_engine_kind),
]


class AutoscalerSpec(_Model):
    metric: Literal["gpu_utilization", "queue_wait"] = Field(
        description="gpu_utilization: busy fraction of ready replicas over the sync period; queue_wait: "
        "in-flight GPU-seconds per ready GPU, divided by (1 - rejection rate): demand the gateway turned away "
        "still counts"
    )
    target: float = Field(gt=0, description="0.7 for gpu_utilization; seconds of in-flight work per GPU for queue_wait")
    min_replicas: int = Field(default=1, gt=0)
    max_replicas: int = Field(gt=0)
    sync_period_s: float = Field(default=15.0, gt=0)
    tolerance: float = Field(default=0.1, ge=0)
    scale_up_stabilization_s: float = Field(default=0.0, ge=0)
    scale_down_stabilization_s: float = Field(default=300.0, ge=0)
    cold_start_s: DistSpec = Field(
        default=FixedSpec(kind="fixed", value=90.0), description="time before a new replica serves"
    )

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalerSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must not exceed max_replicas")
        return self


class PoolSpec(_Model):
    name: str = "pool"
    profile: str = Field(description="profile file (relative to the scenario) or a bundled profile name")
    replicas: int = Field(gt=0)
    gpus_per_replica: int | None = Field(default=None, gt=0, description="defaults to the profile's")
    engine: EngineSpec = ContinuousEngineSpec()
    tiers: list[str] | None = Field(default=None, description="tiers this pool serves (default: all)")
    autoscaler: AutoscalerSpec | None = None


# --- gateway, clients, policies ----------------------------------------------------------------------


class GatewaySpec(_Model):
    replicas: int = Field(default=1, gt=0, description="gateway replicas, each with its own stale view")
    poll_interval_s: float = Field(default=0.2, ge=0, description="0 = every decision sees live state")
    routing: Literal["least_work", "round_robin", "least_loaded"] = "least_work"
    dispatch: Literal["immediate", "central"] = Field(
        default="immediate",
        description="immediate: route at admission to a replica's waiting queue; "
        "central: hold in the gateway's queue until a replica has a free batch slot",
    )
    estimate_output: Literal["max_tokens", "learned"] = Field(
        default="max_tokens",
        description="what a request's decode is charged: its max_tokens, or the mean output its tier has "
        "produced so far (capped at max_tokens)",
    )


class BackoffSpec(_Model):
    base_s: float = Field(default=1.0, gt=0)
    cap_s: float = Field(default=30.0, gt=0)
    jitter: Literal["none", "full", "equal", "decorrelated"] = Field(
        default="full",
        description="none: the exponential span itself; full: U(0, span); equal: span/2 + U(0, span/2); "
        "decorrelated: min(cap, U(base, 3 x previous wait))",
    )


class RetryBudgetSpec(_Model):
    ratio: float = Field(gt=0, description="retries allowed per first attempt (0.2 = at most 20% extra load)")
    burst: float = Field(default=10.0, ge=1, description="most retries saved up at once")


class ClientSpec(_Model):
    max_retries: int = Field(default=3, ge=0, description="retries after a 429 (0 = never retry)")
    honor_retry_after: bool = True
    backoff: BackoffSpec = BackoffSpec()
    retry_budget: RetryBudgetSpec | None = Field(
        default=None, description="client-side budget: each first attempt earns `ratio` retries, up to `burst`"
    )
    abandon_after_s: float | None = Field(
        default=None, gt=0, description="give up (and abort) without a first token this long after arriving"
    )


class UnconditionalSpec(_Model):
    kind: Literal["unconditional"]
    name: str | None = None


class QueueDepthSpec(_Model):
    kind: Literal["queue_depth"]
    name: str | None = None
    max_queued: int = Field(ge=0, description="reject when this many admitted requests wait unscheduled")
    retry_after_s: float = Field(default=1.0, gt=0)


class GpuSecondsSpec(_Model):
    kind: Literal["gpu_seconds"]
    name: str | None = None
    budgets_s: dict[str, float] = Field(
        default_factory=lambda: dict(DEFAULT_BUDGETS_S),
        description="wait budget per tier, seconds of predicted wait",
    )
    default_budget_s: float = Field(default=DEFAULT_BUDGET_S, gt=0, description="budget of tiers not in budgets_s")
    headroom: float = Field(default=DEFAULT_HEADROOM, gt=0, le=1.0)
    max_pool_gpu_seconds: float | None = Field(
        default=None, gt=0, description="default: available GPUs x the largest budget"
    )
    tier_max_gpu_seconds: dict[str, float] = Field(
        default_factory=dict, description="caps on one tier's in-flight GPU-seconds (e.g. {batch: 6})"
    )


PolicySpec = Annotated[UnconditionalSpec | QueueDepthSpec | GpuSecondsSpec, Field(discriminator="kind")]


class VariantSpec(_Model):
    name: str
    set: dict[str, object] = Field(description="overrides of this variant, by path, as with --set")


class ScenarioSpec(_Model):
    name: str = "scenario"
    description: str = ""
    variants: list[VariantSpec] = Field(
        default_factory=list,
        description="settings other than the policy to compare (pool layout, clients, autoscaler...): every "
        "policy runs in every variant, all on the same seeds",
    )
    workload: WorkloadSpec
    pools: list[PoolSpec] = Field(min_length=1)
    gateway: GatewaySpec = GatewaySpec()
    clients: ClientSpec = ClientSpec()
    policies: list[PolicySpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _cross_checks(self) -> ScenarioSpec:
        tiers = {t.name for t in self.workload.tiers}
        served: set[str] = set()
        for pool in self.pools:
            unknown = set(pool.tiers or []) - tiers
            if unknown:
                raise ValueError(f"pool {pool.name!r} serves unknown tiers {sorted(unknown)}")
            served |= set(pool.tiers or tiers)
        if tiers - served:
            raise ValueError(f"no pool serves tiers {sorted(tiers - served)}")
        names = [policy_name(p) for p in self.policies]
        if len(set(names)) != len(names):
            raise ValueError(f"policy names must be unique (set name:), got {names}")
        return self


def policy_name(spec: UnconditionalSpec | QueueDepthSpec | GpuSecondsSpec) -> str:
    return spec.name or spec.kind


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
    data = _apply_overrides(data, overrides or {})
    try:
        spec = ScenarioSpec.model_validate(data)
    except ValidationError as e:
        raise InputError(pydantic_problems(source, e)) from None
    for i, variant in enumerate(spec.variants):
        try:
            variant_spec(spec, variant)
        except InputError as e:
            raise InputError([problem(source, f"variants.{i} ({variant.name})", p) for p in e.problems]) from None
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
    if not traces:
        return spec
    return ScenarioSpec.model_validate(
        _apply_overrides(
            spec.model_dump(),
            {f"{where}.path": str(resolve_trace(t.path, base)) for where, t in traces},
        )
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
    try:
        return ScenarioSpec.model_validate(_apply_overrides(doc, variant.set))
    except ValidationError as e:
        raise InputError(pydantic_problems(None, e)) from None


def _apply_overrides(data: dict[str, object], overrides: dict[str, object]) -> dict[str, object]:
    """Set dotted paths in a copy of a nested document.

    A list element is addressed by its index or by its `name` (or `kind`), so `policies.gpu_seconds.headroom`
    and `workload.tiers.interactive.share` work as a user would expect.
    """
    data = copy.deepcopy(data)
    for dotted, value in overrides.items():
        node: object = data
        keys = dotted.split(".")
        for depth, key in enumerate(keys):
            last = depth == len(keys) - 1
            if isinstance(node, list):
                i = _list_index(node, key)
                if i is None:
                    raise InputError([problem("--set", dotted, f"no element {key!r} in this list")])
                if last:
                    node[i] = copy.deepcopy(value)
                else:
                    node = node[i]
            elif isinstance(node, dict):
                if last:
                    node[key] = copy.deepcopy(value)
                else:
                    node = node.setdefault(key, {})
            else:
                raise InputError([problem("--set", dotted, f"{'.'.join(keys[:depth])} is not a mapping or list")])
    return data


def _list_index(items: list[object], key: str) -> int | None:
    if key.lstrip("-").isdigit():
        i = int(key)
        return i if -len(items) <= i < len(items) else None
    for i, item in enumerate(items):
        if isinstance(item, dict) and (item.get("name") == key or (item.get("kind") == key and "name" not in item)):
            return i
    return None


EmpiricalSpec.model_rebuild()
