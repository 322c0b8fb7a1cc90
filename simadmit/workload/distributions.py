"""Length and service-time distributions, sampled in bulk with a caller's seeded generator.

Each spec is a small frozen object with one method, `sample(rng, n)`, in the spirit of Ciw's distributions.
Lengths are integers (tokens); service times are floats (seconds).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Fixed:
    """Always the same value."""

    value: float

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, self.value, dtype=float)

    @property
    def mean(self) -> float:
        return self.value


@dataclass(frozen=True, slots=True)
class LogNormal:
    """Log-normal given by its median and the sigma of log(x), clipped to [low, high]."""

    median: float
    sigma: float
    low: float = 0.0
    high: float = float("inf")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.clip(rng.lognormal(np.log(self.median), self.sigma, n), self.low, self.high)

    @property
    def mean(self) -> float:
        return float(self.median * np.exp(self.sigma**2 / 2))


@dataclass(frozen=True, slots=True)
class Exponential:
    """Exponential with the given mean (the M in M/M/c)."""

    mean: float

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.exponential(self.mean, n)


@dataclass(frozen=True, slots=True)
class Empirical:
    """Resamples observed values (e.g. a trace's prompt lengths) with replacement."""

    values: tuple[float, ...]

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.choice(np.asarray(self.values, dtype=float), size=n, replace=True)

    @property
    def mean(self) -> float:
        return float(np.mean(self.values))


Distribution = Fixed | LogNormal | Exponential | Empirical


TOKENS_CEILING = 1e9  # above any model's context, so such a request is refused as too long all the same


def sample_tokens(dist: Distribution, rng: np.random.Generator, n: int) -> np.ndarray:
    """Token counts: samples rounded to integers of at least 1 (a heavy tail is held below int64 overflow)."""
    return np.clip(np.rint(dist.sample(rng, n)), 1, TOKENS_CEILING).astype(np.int64)
