"""Arrival processes: functions of a seeded generator that return sorted arrival times in seconds.

Poisson is the baseline (inter-arrival CV 1). Gamma renewal with CV > 1 and a two-state MMPP model bursts
at the same mean rate, which is what makes fixed queue limits and stale gateway views misbehave.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Poisson:
    """Exponential inter-arrival times."""

    def intervals(self, rng: np.random.Generator, rate: float, n: int) -> np.ndarray:
        return rng.exponential(1.0 / rate, n)


@dataclass(frozen=True, slots=True)
class GammaRenewal:
    """Gamma inter-arrival times with coefficient of variation `cv` (cv > 1 is burstier than Poisson)."""

    cv: float

    def intervals(self, rng: np.random.Generator, rate: float, n: int) -> np.ndarray:
        shape = 1.0 / self.cv**2
        return rng.gamma(shape, 1.0 / (rate * shape), n)


@dataclass(frozen=True, slots=True)
class MMPP2:
    """Two-state Markov-modulated Poisson process: bursts of `burst_factor` x the calm rate.

    The state durations are exponential with means `calm_s` and `burst_s`; the calm rate is set so the
    long-run mean rate equals the requested rate.
    """

    burst_factor: float
    calm_s: float
    burst_s: float

    def intervals(self, rng: np.random.Generator, rate: float, n: int) -> np.ndarray:
        p_burst = self.burst_s / (self.calm_s + self.burst_s)
        calm_rate = rate / (1 - p_burst + p_burst * self.burst_factor)
        rates = (calm_rate, calm_rate * self.burst_factor)
        means = (self.calm_s, self.burst_s)
        times = np.empty(n)
        t, state, k = 0.0, 0, 0
        while k < n:
            end = t + rng.exponential(means[state])
            # draw this state's arrivals in bulk; expected count plus a margin
            m = int(rates[state] * (end - t) * 1.5) + 8
            arr = t + np.cumsum(rng.exponential(1.0 / rates[state], m))
            while arr[-1] < end:
                arr = np.concatenate([arr, arr[-1] + np.cumsum(rng.exponential(1.0 / rates[state], m))])
            arr = arr[arr < end][: n - k]
            times[k : k + len(arr)] = arr
            k += len(arr)
            t, state = end, 1 - state
        return np.diff(times, prepend=0.0)


ArrivalProcess = Poisson | GammaRenewal | MMPP2


def arrival_times(
    process: ArrivalProcess, rng: np.random.Generator, rate: float, duration_s: float | None, count: int | None
) -> np.ndarray:
    """Arrival times of `count` requests, or of all requests before `duration_s` (exactly one must be set)."""
    if count is not None:
        return np.cumsum(process.intervals(rng, rate, count))
    assert duration_s is not None
    chunk = int(rate * duration_s * 1.1) + 16
    times = np.cumsum(process.intervals(rng, rate, chunk))
    while times[-1] < duration_s:
        times = np.concatenate([times, times[-1] + np.cumsum(process.intervals(rng, rate, chunk))])
    return times[times < duration_s]
