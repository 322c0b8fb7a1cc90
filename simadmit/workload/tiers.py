"""Tiers and `max_tokens` for replayed traces: pure functions over a trace table.

A trace says how many tokens each request produced, not which tier it belongs to nor what `max_tokens`
its client sent. Both are assumptions of the scenario, made explicit here. A tier comes from a column of
the trace, from a rule on lengths (long prompts are batch work), or from seeded shares. `max_tokens` is
what the cost estimator sees, so it must be what a real client would send, never the true output: a fixed
value, or the true output times a safety factor, and in both cases never below the true output (the real
client's limit let that output through).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import pandas as pd

from simadmit.config.errors import InputError, problem


@dataclass(frozen=True, slots=True)
class ByColumn:
    """Tier from a column of the trace, renamed through `names`; values not in `names` keep their own name
    unless `default` is set, which then replaces them."""

    column: str = "tier"
    names: Mapping[str, str] = field(default_factory=dict)
    default: str | None = None

    def assign(self, frame: pd.DataFrame, rng: np.random.Generator) -> np.ndarray:
        if self.column not in frame:
            raise InputError(
                [
                    problem(
                        None,
                        "workload.trace.tiers.column",
                        f"the trace has no column {self.column!r} (map it with workload.trace.columns.tier)",
                    )
                ]
            )
        values = frame[self.column].astype(str).to_numpy(dtype=object)
        known = np.isin(values, list(self.names))
        mapped = np.array([self.names.get(v, v) for v in values], dtype=object)
        return mapped if self.default is None else np.where(known, mapped, self.default)


@dataclass(frozen=True, slots=True)
class LengthRule:
    """Requests whose `column` is > `above` (and <= `at_most`, when set) belong to `tier`."""

    tier: str
    column: Literal["prompt_tokens", "output_tokens"] = "prompt_tokens"
    above: int = 0
    at_most: int | None = None

    def matches(self, frame: pd.DataFrame) -> np.ndarray:
        v = frame[self.column].to_numpy()
        return (v > self.above) & (v <= (self.at_most if self.at_most is not None else np.inf))


@dataclass(frozen=True, slots=True)
class ByLength:
    """The first matching rule gives the tier; requests no rule matches get `default`."""

    rules: tuple[LengthRule, ...]
    default: str

    def assign(self, frame: pd.DataFrame, rng: np.random.Generator) -> np.ndarray:
        tier = np.full(len(frame), self.default, dtype=object)
        done = np.zeros(len(frame), dtype=bool)
        for rule in self.rules:
            hit = rule.matches(frame) & ~done
            tier[hit] = rule.tier
            done |= hit
        return tier


@dataclass(frozen=True, slots=True)
class ByShare:
    """Each request independently joins a tier with probability proportional to its share."""

    shares: Mapping[str, float]

    def assign(self, frame: pd.DataFrame, rng: np.random.Generator) -> np.ndarray:
        names = list(self.shares)
        p = np.array([self.shares[n] for n in names], dtype=float)
        if len(p) == 0 or (p < 0).any() or p.sum() <= 0:
            raise ValueError(f"shares must be >= 0 with a positive sum, got {dict(self.shares)}")
        return np.array(names, dtype=object)[rng.choice(len(names), size=len(frame), p=p / p.sum())]


TierRule = ByColumn | ByLength | ByShare


def assign_tiers(frame: pd.DataFrame, rule: TierRule, rng: np.random.Generator) -> np.ndarray:
    """Tier name per row of a trace table (`rng` is only drawn from by `ByShare`)."""
    return rule.assign(frame, rng)


@dataclass(frozen=True, slots=True)
class FixedMaxTokens:
    """Every client sends the same `max_tokens` (raised to the true output where that is longer)."""

    value: int


@dataclass(frozen=True, slots=True)
class ScaledMaxTokens:
    """Clients send the true output times `factor`, rounded up, optionally capped at `cap`; never below
    the true output."""

    factor: float
    cap: int | None = None


MaxTokensPolicy = FixedMaxTokens | ScaledMaxTokens


def max_tokens(output_tokens: np.ndarray, policy: MaxTokensPolicy) -> np.ndarray:
    """The `max_tokens` each request's client sends, given the true output lengths."""
    out = np.asarray(output_tokens, dtype=np.int64)
    if isinstance(policy, FixedMaxTokens):
        return np.maximum(out, policy.value)
    # rounded to 9 decimals first so that 100 x 1.1 is 110, not the 111 of ceil(110.00000000000001)
    scaled = np.ceil(np.round(out * policy.factor, 9)).astype(np.int64)
    if policy.cap is not None:
        scaled = np.minimum(scaled, policy.cap)
    return np.maximum(out, scaled)
