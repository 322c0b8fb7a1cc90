"""Checks on a workload before a run starts: its size, its traces, and that something is left to measure.

The schema checks each value; these checks need the values together (how many requests a rate and a
duration make) or the files a workload reads (a trace's rows). They run before any simulation, so a bad
trace row or a workload too big for memory is one `file: field: message` line rather than a traceback
minutes in; a field `--set` wrote is `--set: field: message`, as validation names it. Rows skipped under
`on_error: skip` are reported back as notes, with their count.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from simadmit.config.errors import InputError, problem
from simadmit.config.loading import Origin, by_option, trace_refs
from simadmit.config.schema import BucketSpec, RateLimitSpec, ScenarioSpec, TokenBucketSpec
from simadmit.config.workload_schema import (
    MAX_SECONDS,
    DiurnalSpec,
    FitArrivalSpec,
    ProfileArrivalSpec,
    TierSpec,
    WorkloadSpec,
)
from simadmit.workload import arrivals, traffic
from simadmit.workload.build import Workload, generate

MAX_REQUESTS = 5_000_000  # per workload: every request of a run is held in memory
MAX_ATTEMPTS = 4 * MAX_REQUESTS  # per workload, at worst: the most requests at the default 3 retries each
MAX_PERIODIC_EVENTS = 10_000_000  # gateway polls or autoscaler syncs in one run: each costs simulator time
MIN_WINDOW_S = 0.001  # the measured arrivals' shortest span: per-second rates over less are meaningless
BYTES_PER_REQUEST = 2_000  # per request and policy: engine state, the request table, its first attempt
BYTES_PER_RETRY = 300  # per retry and policy: one more row of the attempts table (`simadmit.sim.ledger`)


def expected_requests(spec: WorkloadSpec) -> float:
    """How many requests a synthetic workload draws on average (its trace's rows for a replay)."""
    if spec.requests is not None:
        return float(spec.requests)
    assert spec.duration_s is not None
    a = spec.arrival
    if isinstance(a, FitArrivalSpec) and spec.rate_rps is None:
        return 0.0  # the trace's own rate: bounded by the trace, which is already in memory
    rate = (spec.rate_rps or 0.0) * spec.rate_multiplier
    curve = _rate_curve(spec)
    if curve is not None:
        return rate * float(curve.cumulative(np.array(spec.duration_s)))
    return rate * spec.duration_s


def _rate_curve(spec: WorkloadSpec) -> arrivals.Shape | None:
    """The curve a `profile` or `diurnal` arrival puts on the rate over time; None for a steady rate."""
    a = spec.arrival
    return traffic.rate_curve(a) if isinstance(a, ProfileArrivalSpec | DiurnalSpec) else None


def _rate_text(spec: WorkloadSpec, n: float) -> str:
    """The rate that draws `n` requests over the run: rate_rps, or under an arrival curve the mean it makes
    of it (a profile's factor 1e9 is 4e9 req/s, not the 4 req/s written)."""
    rate = (spec.rate_rps or 0.0) * spec.rate_multiplier
    if _rate_curve(spec) is None:
        return f"{rate:g} req/s"
    assert spec.duration_s is not None
    return f"{n / spec.duration_s:.3g} req/s on average (rate_rps x the arrival curve)"


def _size_problem(spec: ScenarioSpec, origin: Origin) -> str | None:
    """A synthetic workload too big to hold: too many requests, or too many attempts should every one be
    rejected, since each retry (up to `clients.max_retries` a request) is another row of the attempts
    table. The memory figure is that worst case; a run that admits most requests takes less."""
    w = spec.workload
    if w.trace is not None:
        return None
    n = expected_requests(w)
    retries = spec.clients.max_retries
    attempts = n * (1 + retries)
    if n <= MAX_REQUESTS and attempts <= MAX_ATTEMPTS:
        return None
    policies = len(spec.policies)
    gib = policies * n * (BYTES_PER_REQUEST + retries * BYTES_PER_RETRY) / 2**30
    memory = f"~{gib:,.0f}" if gib < 1e6 else f"~{gib:.3g}"  # no line of a hundred digits
    memory += f" GiB in memory for {policies} policies"
    if retries:
        memory += (
            f" should every attempt be rejected: up to {attempts:.3g} attempts of {retries + 1} a request"
        )
    if w.requests is not None:
        field, what = "workload.requests", f"{n:.3g} requests"
    else:  # named by the one an option wrote, if one did (--set workload.rate_multiplier=1000)
        causes = ("workload.duration_s", "workload.rate_rps", "workload.rate_multiplier")
        field = next((f for f in causes if by_option(origin(f))), causes[0])
        what = f"{w.duration_s:g} s at {_rate_text(w, n)} is about {n:.3g} requests"
    if n > MAX_REQUESTS:
        return problem(
            origin(field),
            field,
            f"{what} ({memory}); a run holds at most {MAX_REQUESTS:,} requests: shorten the run or lower the rate",
        )
    return problem(  # within the requests, so more retries than the default 3 are what is too many
        origin("clients.max_retries"),
        "clients.max_retries",
        f"{retries}: {what} ({memory}); a run makes at most {MAX_ATTEMPTS:,} attempts: retry less, shorten "
        "the run or lower the rate",
    )


def _periodic_problems(spec: ScenarioSpec, span_s: float, origin: Origin) -> list[str]:
    """Gateway polls and autoscaler syncs repeat until the last arrival at least: a period far too short for
    the run (0.001 s over days) would be billions of events, a run that never ends."""
    out = []
    g = spec.gateway
    polls = g.replicas * span_s / g.poll_interval_s if g.poll_interval_s > 0 else 0.0
    if polls > MAX_PERIODIC_EVENTS:
        out.append(
            problem(
                origin("gateway.poll_interval_s"),
                "gateway.poll_interval_s",
                f"{g.poll_interval_s:g} s: {g.replicas} gateway replicas polling until the last arrival "
                f"({span_s:.3g} s) make {polls:.3g} polls: at most {MAX_PERIODIC_EVENTS:,}; poll less often, or "
                "set 0 (a live view)",
            )
        )
    for i, pool in enumerate(spec.pools):
        a = pool.autoscaler
        field = f"pools.{i}.autoscaler.sync_period_s"
        if a is not None and span_s / a.sync_period_s > MAX_PERIODIC_EVENTS:
            out.append(
                problem(
                    origin(field),
                    field,
                    f"{a.sync_period_s:g} s until the last arrival ({span_s:.3g} s) makes "
                    f"{span_s / a.sync_period_s:.3g} syncs: at most {MAX_PERIODIC_EVENTS:,}; sync less often",
                )
            )
    return out


def _trace_notes(spec: ScenarioSpec) -> list[str]:
    """One line per trace that had rows skipped under `on_error: skip`: how many, and the first reasons."""
    notes = []
    for where, ref in trace_refs(spec):
        loaded = traffic.load(ref)
        if loaded.skipped:
            first = "; ".join(p.removeprefix(f"{loaded.source}: ") for p in loaded.problems[:3])
            notes.append(
                f"{loaded.source}: skipped {loaded.skipped} malformed row{'s' * (loaded.skipped != 1)} "
                f"({where}.on_error: skip); first: {first}"
            )
    return notes


def _unused_by_a_trace(spec: ScenarioSpec) -> list[str]:
    """One line naming what a trace replay leaves unused that the scenario set anyway (the trace's rows give
    the times and lengths), so a rate, a length distribution, a tier's window or share set by habit is not
    taken to act."""
    w = spec.workload
    if w.trace is None:
        return []
    unused = [
        name
        for name, value in (("rate_rps", w.rate_rps), ("arrival", w.arrival))
        if value != WorkloadSpec.model_fields[name].default
    ]
    unused += [
        f"tiers.{i}.{field}"
        for i, tier in enumerate(w.tiers)
        for field in ("prompt_tokens", "output_tokens", "max_tokens")
        if getattr(tier, field) is not None
    ]
    unused += [  # the trace's rows are dealt to tiers whatever the time: a tier's window never applies
        f"tiers.{i}.{field}"
        for i, tier in enumerate(w.tiers)
        for field in ("start_s", "end_s")
        if getattr(tier, field) != TierSpec.model_fields[field].default
    ]
    if w.trace.tiers.by != "share":  # shares deal the rows only by: share
        share = TierSpec.model_fields["share"].default
        unused += [f"tiers.{i}.share" for i, tier in enumerate(w.tiers) if tier.share != share]
    if not unused:
        return []
    return [
        f"workload.{', workload.'.join(unused)}: not used when replaying a trace (its rows give the times and "
        "lengths; workload.rate_multiplier scales its rate, workload.trace.max_tokens sets what clients ask for)"
    ]


def _never_served(workload: Workload, limits: Sequence[int], spec: WorkloadSpec, origin: Origin) -> list[str]:
    """A tier none of whose requests its pool takes (prompt + max_tokens beyond `limits[tier]`, the context
    or KV capacity): vLLM would answer every one with 400, a run that measures nothing of that tier. A tier
    only some of whose requests are too long is a run like any other (the summary notes them)."""
    out = []
    for i, name in enumerate(workload.tier_names):
        mine = workload.tier == i
        if not mine.any():
            continue
        least = int((workload.prompt[mine] + workload.max_tokens[mine]).min())
        if least > limits[i]:
            field = "workload.trace" if spec.trace is not None else f"workload.tiers.{i}"
            out.append(
                problem(
                    origin(field),
                    field,
                    f"every request of tier '{name}' is longer than its pool takes (prompt + max_tokens at least "
                    f"{least:,} tokens; the pool's context or KV capacity holds {limits[i]:,}): each would be "
                    "answered 400; shorten the prompts or max_tokens, or give a profile with a longer context",
                )
            )
    return out


def _never_passed(workload: Workload, spec: ScenarioSpec, origin: Origin) -> list[str]:
    """A token bucket's burst, or a rate limit's tokens per minute, under what every request of its tier
    takes (its prompt; its prompt + max_tokens): the policy could pass none of them, a run that measures
    nothing of that tier under it."""
    out = []
    for i, policy in enumerate(spec.policies):
        if not isinstance(policy, TokenBucketSpec | RateLimitSpec):
            continue
        for tier, bound in policy.tiers.items():
            if tier not in workload.tier_names:
                continue
            mine = workload.tier == workload.tier_names.index(tier)
            limit: float | None
            if isinstance(bound, BucketSpec):  # a bucket takes a request's prompt
                name, limit, what, takes = "burst", bound.burst, "prompt", workload.prompt[mine]
            else:  # a rate limit counts its prompt + max_tokens
                name, limit, what = "tpm", bound.tpm, "prompt + max_tokens"
                takes = workload.prompt[mine] + workload.max_tokens[mine]
            least = int(takes.min()) if mine.any() else 0
            if limit is not None and least > limit:
                field = f"policies.{i}.tiers.{tier}.{name}"
                why = f"{limit:g} tokens, under every request of tier '{tier}' ({what} at least {least:,} tokens)"
                out.append(problem(origin(field), field, f"{why}: the policy would pass none of them"))
    return out


def check_workload(
    spec: ScenarioSpec,
    origin: Origin,
    seed: int | None = None,
    request_limits: Sequence[int] | None = None,
) -> list[str]:
    """Raise `InputError` for what would break the run; return notes for the user (skipped trace rows).

    `origin(field)` names where a field was written (`--set`, or the scenario file), as validation does.
    Reads every trace the workload names and draws the first replication's requests (traces are cached,
    so the run reads them only once). `request_limits`, per tier, the longest request (prompt + max_tokens)
    its pool takes: a tier none of whose requests fits is refused.
    """
    size = _size_problem(spec, origin)
    if size:
        raise InputError([size])
    duration = spec.workload.duration_s
    if duration is not None and duration > MAX_SECONDS:
        raise InputError(
            [
                problem(
                    origin("workload.duration_s"),
                    "workload.duration_s",
                    f"{duration:g} s: at most {MAX_SECONDS:g} s (11.6 days) a run",
                )
            ]
        )
    notes = _unused_by_a_trace(spec) + _trace_notes(spec)
    try:
        workload = generate(spec.workload, seed)
    except ValueError as e:  # a rule of the arrival generators the schema did not foresee
        raise InputError([problem(origin("workload"), "workload", str(e))]) from None
    except InputError as e:  # a trace's tier or max_tokens rule against its rows, named by field alone
        raise InputError(
            [
                problem(origin(p.partition(":")[0]), None, p) if p.startswith("workload.") else p
                for p in e.problems
            ]
        ) from None
    if len(workload) == 0:
        raise InputError([problem(origin("workload"), "workload", "no request arrives in this workload")])
    never = _never_served(workload, request_limits, spec.workload, origin) if request_limits else []
    never += _never_passed(workload, spec, origin)
    if never:
        raise InputError(never)
    if not (workload.arrival >= spec.workload.warmup_s).any():
        last = float(workload.arrival.max())
        raise InputError(
            [
                problem(
                    origin("workload.warmup_s"),
                    "workload.warmup_s",
                    f"every request arrives within the warm-up ({spec.workload.warmup_s:g} s; the last at "
                    f"{last:.3g} s): nothing is left to measure",
                )
            ]
        )
    last = float(workload.arrival.max())
    periodic = _periodic_problems(spec, last, origin)
    if periodic:
        raise InputError(periodic)
    if last - spec.workload.warmup_s < MIN_WINDOW_S:  # the summary's window, warm-up to last arrival
        raise InputError(
            [
                problem(
                    origin("workload"),
                    "workload",
                    f"every measured request arrives at the same instant ({last:.3g} s; within "
                    f"{MIN_WINDOW_S * 1000:g} ms): the summary's rates (requests per second from the warm-up to "
                    "the last arrival) would be over no time at all; give requests that arrive over some time",
                )
            ]
        )
    return notes
