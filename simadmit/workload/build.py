"""Workload: the requests of one run, generated up front from a seed as numpy arrays.

Generated once per seed, then shared by every policy in a comparison, so they all see the same arrival
stream. Arrival times, tier choice and each tier's lengths come from separate seeded streams, so changing
one tier's length distribution does not move the arrivals.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from simadmit.config.workload_schema import (
    DistSpec,
    EmpiricalSpec,
    ExponentialSpec,
    FixedSpec,
    LogNormalSpec,
    WorkloadSpec,
)
from simadmit.workload import arrivals, distributions, traffic


@dataclass(frozen=True)
class Workload:
    """One row per request (index = request id); `output` is the truth the gateway never sees."""

    tier_names: tuple[str, ...]
    arrival: np.ndarray  # seconds, sorted
    tier: np.ndarray  # index into tier_names
    prompt: np.ndarray  # prompt tokens
    output: np.ndarray  # actual output tokens (<= max_tokens)
    max_tokens: np.ndarray  # what the client asks for
    deadline: np.ndarray  # absolute deadline, inf when none

    def __len__(self) -> int:
        return len(self.arrival)


def distribution(spec: DistSpec) -> distributions.Distribution:
    """The sampler for a validated distribution spec."""
    if isinstance(spec, FixedSpec):
        return distributions.Fixed(spec.value)
    if isinstance(spec, LogNormalSpec):
        return distributions.LogNormal(spec.median, spec.sigma, spec.min, spec.max)
    if isinstance(spec, ExponentialSpec):
        return distributions.Exponential(spec.mean)
    assert isinstance(spec, EmpiricalSpec)
    if spec.trace is not None:
        return distributions.Empirical(traffic.trace_lengths(spec.trace, spec.column))
    assert spec.values is not None
    return distributions.Empirical(tuple(spec.values))


def assign_tiers(spec: WorkloadSpec, arrival: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A tier for each arrival, in proportion to the shares of the tiers active at that time."""
    u = rng.random(len(arrival))
    tier = np.full(len(arrival), -1, dtype=np.int64)
    edges = sorted(
        {0.0, *(t.start_s for t in spec.tiers), *(t.end_s for t in spec.tiers if np.isfinite(t.end_s))}
    )
    edges.append(np.inf)
    for lo, hi in itertools.pairwise(edges):
        shares = np.array([t.share if t.start_s <= lo and t.end_s >= hi else 0.0 for t in spec.tiers])
        inside = (arrival >= lo) & (arrival < hi)
        if shares.sum() == 0:
            continue
        cum = np.cumsum(shares / shares.sum())
        tier[inside] = np.minimum(np.searchsorted(cum, u[inside], side="right"), len(cum) - 1)
    return tier


def generate(spec: WorkloadSpec, seed: int | None = None) -> Workload:
    """Draw the requests of one replication (seed defaults to the scenario's)."""
    seed = spec.seed if seed is None else seed
    names = tuple(t.name for t in spec.tiers)
    if spec.trace is not None:
        arrival, tier, prompt, output, max_tokens = traffic.replay(spec, seed)
        deadline = arrival + np.array([t.deadline_s or np.inf for t in spec.tiers])[tier]
        return Workload(names, arrival, tier, prompt, np.minimum(output, max_tokens), max_tokens, deadline)
    process, rate = traffic.arrival_process(spec)
    arrival = arrivals.arrival_times(
        process, np.random.default_rng([seed, 0]), rate * spec.rate_multiplier, spec.duration_s, spec.requests
    )
    tier = assign_tiers(spec, arrival, np.random.default_rng([seed, 1]))
    arrival, tier = arrival[tier >= 0], tier[tier >= 0]  # no tier sends at that time
    n = len(arrival)
    prompt = np.zeros(n, dtype=np.int64)
    output = np.zeros(n, dtype=np.int64)
    max_tokens = np.zeros(n, dtype=np.int64)
    deadline = np.full(n, np.inf)
    for i, t in enumerate(spec.tiers):
        assert t.prompt_tokens is not None and t.output_tokens is not None and t.max_tokens is not None
        idx = np.flatnonzero(tier == i)
        rng = np.random.default_rng([seed, 2, i])
        prompt[idx] = distributions.sample_tokens(distribution(t.prompt_tokens), rng, len(idx))
        out = distributions.sample_tokens(distribution(t.output_tokens), rng, len(idx))
        output[idx] = np.minimum(out, t.max_tokens)
        max_tokens[idx] = t.max_tokens
        if t.deadline_s is not None:
            deadline[idx] = arrival[idx] + t.deadline_s
    return Workload(names, arrival, tier, prompt, output, max_tokens, deadline)
