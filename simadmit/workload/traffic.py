"""Traffic from specs: arrival processes, trace-backed length distributions, and trace replay workloads.

Turns the validated scenario models into the pure objects of `arrivals`, `traces` and `tiers`. Traces
are read once per process and option set (they are a few MB) and shared by every replication and policy.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from simadmit.config.errors import InputError
from simadmit.config.workload_schema import (
    DiurnalSpec,
    FitArrivalSpec,
    GammaSpec,
    MaxTokensSpec,
    MMPPSpec,
    ProfileArrivalSpec,
    TraceFileSpec,
    TraceTiersSpec,
    WorkloadSpec,
)
from simadmit.workload import arrivals, tiers, trace_fit, traces

_COLUMNS = {"azure": traces.AZURE_COLUMNS, "mooncake": traces.MOONCAKE_COLUMNS}


def load(spec: TraceFileSpec, speedup: float = 1.0, seed: int = 0) -> traces.TraceLoad:
    """Read a trace as the spec says, `speedup` times faster than its own setting."""
    file_only = TraceFileSpec.model_validate(spec.model_dump(include=set(TraceFileSpec.model_fields)))
    return _load(file_only, speedup * spec.speedup, seed)  # the file part is hashable: cache on it


@lru_cache(maxsize=16)
def _load(spec: TraceFileSpec, speedup: float, seed: int) -> traces.TraceLoad:
    if spec.format == "mapped":
        assert spec.columns is not None
        c = spec.columns
        columns = traces.Columns(c.arrival, c.prompt_tokens, c.output_tokens, c.arrival_unit, c.tier)
    else:
        columns = _COLUMNS[spec.format]
    options = traces.TraceOptions(
        start_s=spec.start_s,
        end_s=float("inf") if spec.end_s is None else spec.end_s,
        speedup=speedup,
        sample=spec.sample,
        seed=seed,
        bucket_jitter=spec.bucket_jitter,
        on_error=spec.on_error,
    )
    return traces.load_trace(spec.path, columns, options)


def arrival_process(spec: WorkloadSpec) -> tuple[arrivals.ArrivalProcess, float]:
    """The arrival process of a synthetic workload and its mean rate (before rate_multiplier)."""
    a = spec.arrival
    rate = spec.rate_rps
    if isinstance(a, GammaSpec):
        process: arrivals.ArrivalProcess = arrivals.GammaRenewal(a.cv)
    elif isinstance(a, MMPPSpec):
        process = arrivals.MMPP2(a.burst_factor, a.calm_s, a.burst_s)
    elif isinstance(a, ProfileArrivalSpec | DiurnalSpec):
        process = arrivals.TimeVarying(rate_curve(a), a.cv)
    elif isinstance(a, FitArrivalSpec):
        fit = trace_fit.fit_trace(load(a.trace).frame["arrival_s"].to_numpy(), a.bin_s)
        process = fit.process()
        rate = rate if rate is not None else fit.rate
    else:
        process = arrivals.Poisson()
    assert rate is not None, "checked by the scenario schema"
    return process, rate


def rate_curve(a: ProfileArrivalSpec | DiurnalSpec) -> arrivals.Shape:
    """The curve a `profile` or `diurnal` arrival puts on the rate over time."""
    if isinstance(a, ProfileArrivalSpec):
        return arrivals.RateCurve(tuple(a.points))
    return arrivals.Diurnal(a.amplitude, a.period_s, a.peak_s)


def trace_lengths(spec: TraceFileSpec, column: str) -> tuple[float, ...]:
    """A trace's prompt or output lengths, for an empirical length distribution."""
    return tuple(load(spec).frame[column].astype(float))


def tier_rule(spec: TraceTiersSpec, shares: dict[str, float], mapped_tier: str | None) -> tiers.TierRule:
    """`mapped_tier`: the trace's own name of the column `columns.tier` maps (read as `tier`)."""
    if spec.by == "length":
        rules = tuple(tiers.LengthRule(r.tier, r.column, r.above, r.at_most) for r in spec.rules)
        return tiers.ByLength(rules, spec.default or next(iter(shares)))
    if spec.by == "column":
        column = "tier" if spec.column == mapped_tier else spec.column
        return tiers.ByColumn(column, dict(spec.names), spec.default)
    return tiers.ByShare(shares)


def max_tokens_policy(spec: MaxTokensSpec) -> tiers.MaxTokensPolicy:
    if spec.kind == "fixed":
        assert spec.value is not None  # MaxTokensSpec requires it
        return tiers.FixedMaxTokens(spec.value)
    return tiers.ScaledMaxTokens(spec.factor or 1.0, spec.cap)


def replay(
    spec: WorkloadSpec, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Arrival times, tier indices, prompt, actual output and max_tokens of a trace replay."""
    assert spec.trace is not None
    frame = load(spec.trace, spec.rate_multiplier, seed).frame
    if spec.duration_s is not None:
        frame = frame[frame["arrival_s"] < spec.duration_s]
    if spec.requests is not None:
        frame = frame.iloc[: spec.requests]
    names = [t.name for t in spec.tiers]
    columns = spec.trace.columns
    rule = tier_rule(
        spec.trace.tiers, {t.name: t.share for t in spec.tiers}, columns.tier if columns else None
    )
    assigned = tiers.assign_tiers(frame, rule, np.random.default_rng([seed, 1]))
    unknown = sorted(set(assigned) - set(names))
    if unknown:
        raise InputError(
            [f"workload.trace.tiers: the trace yields tiers {unknown} that workload.tiers lacks"]
        )
    tier = np.array([names.index(t) for t in assigned], dtype=np.int64)
    output = frame["output_tokens"].to_numpy(dtype=np.int64)
    cap = tiers.max_tokens(output, max_tokens_policy(spec.trace.max_tokens))
    return (
        frame["arrival_s"].to_numpy(dtype=float),
        tier,
        frame["prompt_tokens"].to_numpy(np.int64),
        output,
        cap,
    )
