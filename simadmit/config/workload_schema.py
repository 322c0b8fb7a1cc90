"""Workload schema: the `workload:` section of a scenario file (distributions, arrivals, traces, tiers).

These are the pydantic models a user's YAML is validated against, split from the rest of the scenario
schema (`simadmit.config.schema`) because the workload layer builds its generators from them alone. Every
model is frozen and forbids unknown fields, so a misspelled key is reported rather than silently ignored.
"""

from __future__ import annotations

import math
import types
import typing
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError


class Spec(BaseModel):
    """Base of every scenario and profile model: immutable, unknown fields are an error, and numbers are
    finite numbers, never `true`/`false` (which pydantic would read as 1 and 0).

    A field where infinity means something ("no end", "no limit") says so with `allow_inf_nan=True`; NaN
    is still refused there by its bound (NaN is not greater than anything).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_boolean_numbers(cls, data: object) -> object:
        """`true` where a number goes is an error at that field (`pydantic_problems` words it), also inside
        a mapping or list of numbers (a budget per tier, a profile's points)."""
        if not isinstance(data, dict):
            return data
        flagged = {
            key: _flag_booleans(cls.model_fields[key].annotation, value)
            for key, value in data.items()
            if key in cls.model_fields and isinstance(value, bool | dict | list | tuple)
        }
        return {**data, **flagged} if flagged else data


class BooleanInput:
    """A `true`/`false` given where a number goes: no number type accepts it, so validation fails there."""

    def __init__(self, value: bool) -> None:
        self.value = value

    def __repr__(self) -> str:
        return str(self.value).lower()


def _numeric(annotation: object) -> bool:
    """A field of int or float (perhaps optional), where pydantic would read true as 1."""
    annotation = _unwrap(annotation)
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    kinds = typing.get_args(annotation) if union else (annotation,)
    return bool not in kinds and any(k in (int, float) for k in kinds)


def _unwrap(annotation: object) -> object:
    """The type an annotation holds, without `Annotated[...]` constraints and an `| None`."""
    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(options) == 1:
            return _unwrap(options[0])
    return annotation


def _flag_booleans(annotation: object, value: object) -> object:
    """`value` with each true/false that stands where `annotation` wants a number marked as `BooleanInput`,
    in mappings, lists and pairs of numbers too (nested models mark their own fields)."""
    if isinstance(value, bool):
        return BooleanInput(value) if _numeric(annotation) else value
    annotation = _unwrap(annotation)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is dict and isinstance(value, dict) and len(args) == 2:
        return {k: _flag_booleans(args[1], v) for k, v in value.items()}
    if origin is list and isinstance(value, list) and args:
        return [_flag_booleans(args[0], v) for v in value]
    if origin is tuple and isinstance(value, list | tuple) and args:
        kinds = [args[0]] * len(value) if args[-1] is Ellipsis else list(args)
        return [_flag_booleans(k, v) for k, v in zip(kinds, value, strict=False)] + list(value[len(kinds) :])
    return value


MAX_TOKENS = 10_000_000  # longer than any model's context: a bigger token count is a typo
MAX_SECONDS = 1_000_000.0  # ~11.6 days: longer times are typos, and would stretch every per-second table
MAX_VALUE = 10_000_000.0  # a distribution's scale: tokens up to MAX_TOKENS, seconds up to MAX_SECONDS
MAX_GPUS_PER_REPLICA = 1024  # a pool's or a profile's: a larger replica is a typo
MAX_CV = 100.0  # burstier arrivals than this are a typo (and a near-zero gamma shape draws without end)
MAX_TIERS = 1000  # classes of service, not tenants (map API keys to tiers): every table has a row per tier
MAX_SHARE = 1e12  # tier shares are normalised: a larger one is a typo (and their sum could overflow)
MIN_CV = 0.001  # as regular as arrivals get: a smaller cv's gamma shape (1 / cv^2) overflows


def _one_line(v: str) -> str:
    """A name heads a row of the printed tables and is part of result keys (`variant/policy`) and file
    names (the per-tier plots of `plot` and `compare`)."""
    if any(c in "/\\" or not c.isprintable() for c in v):
        raise ValueError(f"{v!r} names table rows, results and files: no /, \\ or control characters")
    return v


Name = Annotated[str, Field(min_length=1, max_length=100), AfterValidator(_one_line)]
"""The name of a tier, pool, policy, variant or scenario."""


# --- distributions -----------------------------------------------------------------------------------


class FixedSpec(Spec):
    kind: Literal["fixed"]
    value: float = Field(gt=0, le=MAX_VALUE)


class LogNormalSpec(Spec):
    kind: Literal["lognormal"]
    median: float = Field(gt=0, le=MAX_VALUE)
    sigma: float = Field(ge=0, le=10, description="standard deviation of log(x)")
    min: float = Field(
        default=0, ge=0, le=MAX_VALUE, description="clip below (default: none; token counts are >= 1)"
    )
    max: float = Field(default=float("inf"), gt=0, allow_inf_nan=True, description="clip above")

    @model_validator(mode="after")
    def _range(self) -> LogNormalSpec:
        if self.min > self.max:
            raise ValueError(f"min ({self.min:g}) must not exceed max ({self.max:g})")
        return self


class ExponentialSpec(Spec):
    kind: Literal["exponential"]
    mean: float = Field(gt=0, le=MAX_VALUE)


class EmpiricalSpec(Spec):
    kind: Literal["empirical"]
    values: list[Annotated[float, Field(gt=0, le=MAX_VALUE)]] | None = Field(
        default=None, min_length=1, description="observed values (each > 0), resampled"
    )
    trace: TraceFileSpec | None = Field(default=None, description="or: the lengths of a trace")
    column: Literal["prompt_tokens", "output_tokens"] = "prompt_tokens"

    @model_validator(mode="after")
    def _one_source(self) -> EmpiricalSpec:
        if (self.values is None) == (self.trace is None):
            raise ValueError("set exactly one of values and trace")
        if self.values is not None and self.column != "prompt_tokens":  # else silently never read
            raise ValueError("column picks a trace's lengths: it does not apply to values")
        return self


DistSpec = Annotated[FixedSpec | LogNormalSpec | ExponentialSpec | EmpiricalSpec, Field(discriminator="kind")]


def _tokens(dist: DistSpec | None) -> DistSpec | None:
    """A distribution of token counts: its draws are rounded to whole numbers of at least 1, so a bound
    or value it gives as a count (a fixed value, a clip, an observed value) must be one; a fixed 0.4 was
    silently 1 token. A scale (a median, a mean) need not be."""
    if isinstance(dist, FixedSpec):
        counts = [("value", dist.value)]
    elif isinstance(dist, LogNormalSpec):  # min 0 and max inf: no clip
        counts = [(k, v) for k, v in (("min", dist.min), ("max", dist.max)) if v != 0 and math.isfinite(v)]
    elif isinstance(dist, EmpiricalSpec):
        counts = [("values: one of them,", v) for v in dist.values or ()]
    else:
        counts = []
    for name, count in counts:
        if count != round(count) or count < 1:
            raise ValueError(f"{name} {count:g} is not a token count (a whole number >= 1)")
    return dist


# --- workload ----------------------------------------------------------------------------------------


class PoissonSpec(Spec):
    kind: Literal["poisson"]


class GammaSpec(Spec):
    kind: Literal["gamma"]
    cv: float = Field(
        ge=MIN_CV, le=MAX_CV, description="coefficient of variation of inter-arrival times (1 = Poisson)"
    )


class MMPPSpec(Spec):
    kind: Literal["mmpp"]
    burst_factor: float = Field(gt=1, description="burst rate / calm rate")
    calm_s: float = Field(gt=0, le=MAX_SECONDS, description="mean duration of a calm period")
    burst_s: float = Field(gt=0, le=MAX_SECONDS, description="mean duration of a burst")


class ProfileArrivalSpec(Spec):
    kind: Literal["profile"]
    points: list[tuple[float, float]] = Field(
        min_length=1,
        description="(t seconds, factor x rate_rps), piecewise linear from t = 0: ramps, spikes, drains",
    )
    cv: float = Field(
        default=1.0, ge=MIN_CV, le=MAX_CV, description="burstiness around the curve (1 = Poisson)"
    )

    @model_validator(mode="after")
    def _curve(self) -> ProfileArrivalSpec:
        times = [t for t, _ in self.points]
        if times[0] != 0 or any(b < a for a, b in zip(times, times[1:], strict=False)):
            raise ValueError("times must start at 0 and never decrease, e.g. [[0, 1], [600, 3]]")
        if any(f < 0 for _, f in self.points):
            raise ValueError("factors must be >= 0")
        if all(f == 0 for _, f in self.points):
            raise ValueError("every factor is 0: nothing would arrive")
        return self


class DiurnalSpec(Spec):
    kind: Literal["diurnal"]
    amplitude: float = Field(
        ge=0, le=1, description="factor = 1 + amplitude cos(2 pi (t - peak_s) / period_s)"
    )
    period_s: float = Field(default=86_400.0, gt=0, le=MAX_SECONDS)
    peak_s: float = Field(default=0.0, ge=0, le=MAX_SECONDS)
    cv: float = Field(default=1.0, ge=MIN_CV, le=MAX_CV)


class TraceColumnsSpec(Spec):
    arrival: str
    arrival_unit: Literal["s", "ms", "us", "datetime"] = "s"
    prompt_tokens: str
    output_tokens: str
    tier: str | None = None

    @model_validator(mode="after")
    def _one_column_each(self) -> TraceColumnsSpec:
        """Two fields mapped to one column would read the same numbers: a prompt as long as its output,
        arrival times as token counts."""
        seen: dict[str, str] = {}
        for name in ("arrival", "prompt_tokens", "output_tokens", "tier"):
            column = getattr(self, name)
            if column is not None and column in seen:
                raise ValueError(f"{seen[column]} and {name} both map column {column!r}: each needs its own")
            seen.setdefault(column, name)
        return self


class TraceFileSpec(Spec):
    path: str = Field(
        min_length=1, description="trace file (relative to the scenario) or a bundled trace name"
    )
    format: Literal["azure", "mooncake", "mapped"] = "mapped"
    columns: TraceColumnsSpec | None = Field(default=None, description="required for format: mapped")
    start_s: float = Field(
        default=0.0, ge=0, description="window start, trace seconds from its first request"
    )
    end_s: float | None = Field(
        default=None, gt=0, allow_inf_nan=True, description="window end (null: to the end)"
    )
    speedup: float = Field(
        default=1.0, gt=0, description="2 replays twice as fast; multiplied by rate_multiplier"
    )
    sample: float = Field(default=1.0, gt=0, le=1, description="fraction of requests kept")
    bucket_jitter: bool = Field(
        default=False, description="Mooncake: spread a timestamp's batch over its bucket"
    )
    on_error: Literal["fail", "skip"] = Field(
        default="fail", description="skip: drop malformed rows, and count them"
    )

    @model_validator(mode="before")
    @classmethod
    def _columns_of_a_known_format(cls, data: object) -> object:
        """Columns given to a format that reads its own would be ignored: said before they are checked, so
        a partial map is one line rather than a line per column it lacks."""
        if (
            isinstance(data, dict)
            and data.get("format") in ("azure", "mooncake")
            and data.get("columns") is not None
        ):
            raise ValueError(
                f"columns apply to format: mapped (format {data['format']} reads its own columns)"
            )
        return data

    @model_validator(mode="after")
    def _columns(self) -> TraceFileSpec:
        if self.format == "mapped" and self.columns is None:
            raise ValueError("format: mapped needs columns: {arrival, prompt_tokens, output_tokens}")
        if self.end_s is not None and self.end_s <= self.start_s:
            raise ValueError(f"end_s ({self.end_s:g}) must be after start_s ({self.start_s:g})")
        return self


class FitArrivalSpec(Spec):
    kind: Literal["fit"]
    trace: TraceFileSpec
    bin_s: float = Field(default=60.0, gt=0, description="rate curve resolution")


ArrivalSpec = Annotated[
    PoissonSpec | GammaSpec | MMPPSpec | ProfileArrivalSpec | DiurnalSpec | FitArrivalSpec,
    Field(discriminator="kind"),
]


class LengthRuleSpec(Spec):
    tier: str
    column: Literal["prompt_tokens", "output_tokens"] = "prompt_tokens"
    above: int = Field(default=0, ge=0, le=MAX_TOKENS)
    at_most: int | None = Field(default=None, ge=0, le=MAX_TOKENS)

    @model_validator(mode="after")
    def _reachable(self) -> LengthRuleSpec:
        """A rule for lengths > above and <= at_most matches nothing unless above < at_most."""
        if self.at_most is not None and self.at_most <= self.above:
            raise ValueError(
                f"at_most ({self.at_most}) must exceed above ({self.above}): the rule would match no request"
            )
        return self


class TraceTiersSpec(Spec):
    by: Literal["share", "length", "column"] = "share"
    rules: list[LengthRuleSpec] = Field(default_factory=list, description="by: length; the first match wins")
    column: str = Field(default="tier", description="by: column")
    names: dict[str, str] = Field(default_factory=dict, description="by: column; trace value -> tier name")
    default: str | None = Field(
        default=None, description="rows no rule or name matches (by: length: the first tier)"
    )

    @model_validator(mode="after")
    def _settings_of_its_kind(self) -> TraceTiersSpec:
        """Rules or names under another `by` would silently never apply."""
        if self.rules and self.by != "length":
            raise ValueError(f"rules apply with by: length only, not by: {self.by}")
        if self.names and self.by != "column":
            raise ValueError(f"names apply with by: column only, not by: {self.by}")
        if self.column != "tier" and self.by != "column":  # by value: a dumped scenario writes the default
            raise ValueError(f"column applies with by: column only, not by: {self.by} (a rule names its own)")
        if self.default is not None and self.by == "share":
            raise ValueError(
                "default applies with by: length or by: column, not by: share (every row gets a tier)"
            )
        return self


class MaxTokensSpec(Spec):
    kind: Literal["fixed", "scaled"]
    value: int | None = Field(
        default=None, gt=0, le=MAX_TOKENS, description="fixed: the max_tokens every client sends"
    )
    factor: float | None = Field(
        default=None, ge=1, le=1000, description="scaled: actual output x factor, rounded up"
    )
    cap: int | None = Field(default=None, gt=0, le=MAX_TOKENS)

    @model_validator(mode="after")
    def _fields_of_its_kind(self) -> MaxTokensSpec:
        """fixed sends `value`, scaled scales by `factor` up to `cap`: a field of the other kind would be
        silently ignored."""
        if self.kind == "fixed" and self.value is None:
            raise ValueError("kind fixed needs value (the max_tokens every client sends)")
        if self.kind == "fixed" and (self.factor is not None or self.cap is not None):
            raise ValueError("factor and cap apply to kind scaled: kind fixed sends value")
        if self.kind == "scaled" and self.value is not None:
            raise ValueError("value applies to kind fixed: kind scaled sends the output x factor, up to cap")
        return self


class TraceReplaySpec(TraceFileSpec):
    tiers: TraceTiersSpec = TraceTiersSpec()
    max_tokens: MaxTokensSpec = Field(
        default=MaxTokensSpec(kind="scaled", factor=1.5),
        description="what clients send as max_tokens: the estimator sees this, never the true output",
    )


class SLOSpec(Spec):
    ttft_s: float = Field(
        default=float("inf"), gt=0, allow_inf_nan=True, description="time to first token counted as good"
    )
    e2e_s: float = Field(
        default=float("inf"), gt=0, allow_inf_nan=True, description="end-to-end latency counted as good"
    )

    @model_validator(mode="after")
    def _end_after_first_token(self) -> SLOSpec:
        if self.e2e_s < self.ttft_s < math.inf:  # the end comes after the first token: surely the two swapped
            raise ValueError(
                f"e2e_s ({self.e2e_s:g} s) under ttft_s ({self.ttft_s:g} s): a request ends after its first "
                "token, so ttft_s could never bind"
            )
        return self


class TierSpec(Spec):
    name: Name
    share: float = Field(
        default=1.0, gt=0, le=MAX_SHARE, description="fraction of arrivals (shares are normalised)"
    )
    prompt_tokens: DistSpec | None = Field(
        default=None, description="required unless the workload is a trace"
    )
    output_tokens: DistSpec | None = Field(
        default=None, description="actual output; the gateway never sees it"
    )
    max_tokens: int | None = Field(
        default=None, gt=0, le=MAX_TOKENS, description="max_tokens the client sends; caps the output"
    )
    deadline_s: float | None = Field(
        default=None, gt=0, le=MAX_SECONDS, description="client deadline after first arrival"
    )
    slo: SLOSpec = SLOSpec()
    start_s: float = Field(
        default=0.0, ge=0, le=MAX_SECONDS, description="the tier sends traffic from this time on"
    )
    end_s: float = Field(
        default=float("inf"), gt=0, allow_inf_nan=True, description="... and until this time (a shifting mix)"
    )

    _token_counts = field_validator("prompt_tokens", "output_tokens")(_tokens)

    @model_validator(mode="after")
    def _window(self) -> TierSpec:
        if self.end_s <= self.start_s:
            raise ValueError(
                f"end_s ({self.end_s:g}) must be after start_s ({self.start_s:g}): it would send nothing"
            )
        return self


class WorkloadSpec(Spec):
    seed: int = Field(default=0, ge=0, lt=2**63, description="seeds every random stream of the workload")
    arrival: ArrivalSpec = PoissonSpec(kind="poisson")
    trace: TraceReplaySpec | None = Field(
        default=None, description="replay a trace instead of drawing requests"
    )
    rate_rps: float | None = Field(
        default=None,
        gt=0,
        validate_default=True,
        description="mean arrival rate of first attempts (a fitted trace's rate if unset)",
    )
    rate_multiplier: float = Field(default=1.0, gt=0, description="scales the rate (2.0 = twice the traffic)")
    duration_s: float | None = Field(default=None, gt=0, description=f"at most {MAX_SECONDS:g} s")
    requests: int | None = Field(default=None, gt=0)
    warmup_s: float = Field(default=0.0, ge=0, description="arrivals before this are left out of the summary")
    tiers: list[TierSpec] = Field(min_length=1, max_length=MAX_TIERS)

    @field_validator("rate_rps")
    @classmethod
    def _rate_needed(cls, v: float | None, info: ValidationInfo) -> float | None:
        # a trace or arrival section that failed validation is not in info.data: no second error for it
        synthetic = "trace" in info.data and info.data["trace"] is None
        if (
            v is None
            and synthetic
            and "arrival" in info.data
            and not isinstance(info.data["arrival"], FitArrivalSpec)
        ):
            raise PydanticCustomError("missing", "required field is missing")
        return v

    @field_validator("requests")
    @classmethod
    def _reachable(cls, v: int | None, info: ValidationInfo) -> int | None:
        curve = info.data.get("arrival")
        if v is not None and isinstance(curve, ProfileArrivalSpec) and curve.points[-1][1] == 0:
            raise ValueError(
                "the arrival profile ends at rate 0, so this many requests may never arrive: use duration_s"
            )
        return v

    @field_validator("warmup_s")
    @classmethod
    def _before_end(cls, v: float, info: ValidationInfo) -> float:
        duration = info.data.get("duration_s")
        if duration is not None and v >= duration:
            raise ValueError(
                f"{v:g} s of warm-up leaves nothing of duration_s ({duration:g} s) to measure: make it shorter"
            )
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


EmpiricalSpec.model_rebuild()
