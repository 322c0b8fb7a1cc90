"""Arrival processes: functions of a seeded generator that return sorted arrival times in seconds.

Poisson is the baseline (inter-arrival CV 1). Gamma renewal with CV > 1 and a two-state MMPP model bursts
at the same mean rate, which is what makes fixed queue limits and stale gateway views misbehave. A
time-varying rate follows a shape over time (a ramp, spike and drain, or a daily sinusoid) scaled by the
mean rate; `trace_fit` estimates such a shape and the burstiness left around it from a recorded trace.

Every process has `times(rng, rate, duration_s, count)`: all arrivals before `duration_s`, or the first
`count` arrivals. Generating by duration never restarts a process partway, so a longer duration extends
the same stream rather than gluing independent pieces together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Poisson:
    """Exponential inter-arrival times."""

    def intervals(self, rng: np.random.Generator, rate: float, n: int) -> np.ndarray:
        return rng.exponential(1.0 / rate, n)

    def times(
        self, rng: np.random.Generator, rate: float, duration_s: float | None, count: int | None
    ) -> np.ndarray:
        return _renewal_times(self, rng, rate, duration_s, count)


@dataclass(frozen=True, slots=True)
class GammaRenewal:
    """Gamma inter-arrival times with coefficient of variation `cv` (cv > 1 is burstier than Poisson)."""

    cv: float

    def intervals(self, rng: np.random.Generator, rate: float, n: int) -> np.ndarray:
        shape = 1.0 / self.cv**2
        return rng.gamma(shape, 1.0 / (rate * shape), n)

    def times(
        self, rng: np.random.Generator, rate: float, duration_s: float | None, count: int | None
    ) -> np.ndarray:
        return _renewal_times(self, rng, rate, duration_s, count)


def _renewal_times(
    process: Poisson | GammaRenewal,
    rng: np.random.Generator,
    rate: float,
    duration_s: float | None,
    count: int | None,
) -> np.ndarray:
    # a renewal process has no state but its last arrival, so drawing it in chunks is exact
    if count is not None:
        return np.cumsum(process.intervals(rng, rate, count))
    assert duration_s is not None
    chunk = int(rate * duration_s * 1.1) + 16
    times = np.cumsum(process.intervals(rng, rate, chunk))
    while times[-1] < duration_s:
        times = np.concatenate([times, times[-1] + np.cumsum(process.intervals(rng, rate, chunk))])
    return times[times < duration_s]


MAX_SOJOURNS = 10_000_000  # calm periods and bursts in one run


@dataclass(frozen=True, slots=True)
class MMPP2:
    """Two-state Markov-modulated Poisson process: bursts of `burst_factor` x the calm rate.

    The state durations are exponential with means `calm_s` and `burst_s`; the calm rate is set so the
    long-run mean rate equals the requested rate. The first state is drawn from the stationary
    distribution, so the mean rate holds from time 0, not only in the long run.
    """

    burst_factor: float
    calm_s: float
    burst_s: float

    def rates(self, rate: float) -> tuple[float, float]:
        """(calm rate, burst rate) for a long-run mean `rate`."""
        p_burst = self.burst_s / (self.calm_s + self.burst_s)
        calm = rate / (1 - p_burst + p_burst * self.burst_factor)
        return calm, calm * self.burst_factor

    def intervals(self, rng: np.random.Generator, rate: float, n: int) -> np.ndarray:
        return np.diff(self.times(rng, rate, None, n), prepend=0.0)

    def times(
        self, rng: np.random.Generator, rate: float, duration_s: float | None, count: int | None
    ) -> np.ndarray:
        span = duration_s if duration_s is not None else (count or 0) / rate
        switches = 2 * span / (self.calm_s + self.burst_s)
        if switches > MAX_SOJOURNS:  # each calm period and burst is drawn: time and memory grow with them
            raise ValueError(
                f"arrival.calm_s {self.calm_s:g} s and burst_s {self.burst_s:g} s switch state about "
                f"{switches:.3g} times in the run's {span:.3g} s: at most {MAX_SOJOURNS:,}; make them longer"
            )
        rates = np.array(self.rates(rate))
        means = np.array([self.calm_s, self.burst_s])
        state = int(rng.random() < self.burst_s / (self.calm_s + self.burst_s))
        # Whole sojourns are drawn in bulk: given its length, a state's arrivals are a Poisson number of
        # uniform points, sorted. Sojourns follow one another, so one global sort orders each of them.
        # Draws hold 16, 32, ... up to 4096 sojourns whatever the length asked for, so short streams stay
        # cheap and a longer stream starts with exactly the draws of a shorter one.
        t, total, parts, size = 0.0, 0, [], 16
        while (duration_s is not None and t < duration_s) or (count is not None and total < count):
            states = (state + np.arange(size)) % 2
            ends = t + np.cumsum(rng.exponential(means[states]))
            starts = np.concatenate([[t], ends[:-1]])
            n = rng.poisson(rates[states] * (ends - starts))
            parts.append(np.sort(np.repeat(starts, n) + rng.random(n.sum()) * np.repeat(ends - starts, n)))
            t, state, total = float(ends[-1]), (state + size) % 2, total + int(n.sum())
            size = min(2 * size, 4096)
        times = np.concatenate(parts)
        return times[times < duration_s] if duration_s is not None else times[:count]


@dataclass(frozen=True, slots=True)
class RateCurve:
    """Piecewise-linear rate multiplier through `(t, factor)` points, held at the last factor afterwards.

    The first point is at t = 0; times never decrease, and two points at the same time make a jump. With
    rate 10, `((0, 0.5), (600, 1), (900, 3), (960, 1))` ramps from 5 to 10 req/s over ten minutes, then
    climbs to a 30 req/s spike and drains back to 10 req/s.
    """

    points: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        t, f = self._arrays()
        if len(t) == 0 or t[0] != 0 or (np.diff(t) < 0).any() or (f < 0).any() or not np.isfinite(t).all():
            raise ValueError("profile points need t starting at 0, never decreasing, and factors >= 0")
        if not (f > 0).any():
            raise ValueError("profile factors are all 0: nothing would arrive")

    def _arrays(self) -> tuple[np.ndarray, np.ndarray]:
        pts = np.asarray(self.points, dtype=float).reshape(-1, 2)
        return pts[:, 0], pts[:, 1]

    def _segments(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per point: start time, factor, slope to the next point (0 after the last), cumulative at start."""
        t, f = self._arrays()
        dt = np.diff(t)
        slope = np.append(np.divide(np.diff(f), dt, out=np.zeros_like(dt), where=dt > 0), 0.0)
        cum = np.concatenate([[0.0], np.cumsum((f[:-1] + f[1:]) / 2 * dt)])
        return t, f, slope, cum

    def factor(self, t: np.ndarray) -> np.ndarray:
        ts, f, slope, _ = self._segments()
        k = np.searchsorted(ts, t, side="right") - 1
        return f[k] + slope[k] * (t - ts[k])

    def cumulative(self, t: np.ndarray) -> np.ndarray:
        """Integral of the factor from 0 to t."""
        ts, f, slope, cum = self._segments()
        k = np.searchsorted(ts, t, side="right") - 1
        x = t - ts[k]
        return cum[k] + f[k] * x + slope[k] * x * x / 2

    def inverse(self, c: np.ndarray) -> np.ndarray:
        """The time at which the cumulative reaches c (exact: solves each segment's quadratic)."""
        ts, f, slope, cum = self._segments()
        if f[-1] == 0 and (c > cum[-1]).any():
            raise ValueError("the profile ends at rate 0: ask for a duration, not a count")
        k = np.searchsorted(cum, c, side="right") - 1  # the last segment starting at or before c
        d = c - cum[k]
        root = f[k] + np.sqrt(np.maximum(f[k] ** 2 + 2 * slope[k] * d, 0.0))
        # x solves slope/2 x^2 + f x = d; this form stays accurate when slope is 0 or tiny
        return ts[k] + np.divide(2 * d, root, out=np.zeros_like(d), where=root > 0)

    def pieces(self, a: float, b: float) -> tuple[np.ndarray, np.ndarray]:
        """Cut [a, b) at the profile's points: (edges, upper bound of the factor on each piece)."""
        ts, f, slope, _ = self._segments()
        edges = np.unique(np.concatenate([[a, b], ts[(ts > a) & (ts < b)]]))
        k = np.searchsorted(ts, edges[:-1], side="right") - 1
        ends = (f[k] + slope[k] * (edges[:-1] - ts[k]), f[k] + slope[k] * (edges[1:] - ts[k]))
        return edges, np.maximum(*ends)

    @property
    def dead_after(self) -> float:
        """Time after which nothing arrives: the last point if the profile ends at 0, else infinity."""
        t, f = self._arrays()
        return float(t[-1]) if f[-1] == 0 else math.inf


@dataclass(frozen=True, slots=True)
class Diurnal:
    """Daily sinusoid: factor 1 + amplitude x cos(2 pi (t - peak_s) / period_s), mean 1 over a period."""

    amplitude: float
    period_s: float = 86_400.0
    peak_s: float = 0.0

    def __post_init__(self) -> None:
        if not (0 <= self.amplitude <= 1 and self.period_s > 0):
            raise ValueError("diurnal needs 0 <= amplitude <= 1 and period_s > 0")

    def factor(self, t: np.ndarray) -> np.ndarray:
        return 1 + self.amplitude * np.cos(2 * np.pi * (t - self.peak_s) / self.period_s)

    def cumulative(self, t: np.ndarray) -> np.ndarray:
        w = 2 * np.pi / self.period_s
        return t + self.amplitude / w * (np.sin(w * (t - self.peak_s)) - np.sin(-w * self.peak_s))

    def inverse(self, c: np.ndarray) -> np.ndarray:
        """The time at which the cumulative reaches c, by bisection to float precision.

        The cumulative is increasing and within amplitude x period / pi of t, which brackets the root.
        """
        half = self.amplitude * self.period_s / np.pi + 1e-9
        lo, hi = c - half, c + half
        for _ in range(64):
            mid = (lo + hi) / 2
            low = self.cumulative(mid) < c
            lo, hi = np.where(low, mid, lo), np.where(low, hi, mid)
        return (lo + hi) / 2

    def pieces(self, a: float, b: float) -> tuple[np.ndarray, np.ndarray]:
        return np.array([a, b]), np.array([1 + self.amplitude])

    @property
    def dead_after(self) -> float:
        return math.inf


Shape = RateCurve | Diurnal


@dataclass(frozen=True, slots=True)
class TimeVarying:
    """Arrivals whose rate is `rate x shape.factor(t)`.

    With cv = 1 this is a non-homogeneous Poisson process, generated exactly by thinning (Lewis and
    Shedler): candidates from a Poisson process at an upper bound of the rate on each piece of the shape,
    each kept with probability rate(t) / bound. With cv != 1 it is a gamma renewal process with that CV run
    in operational time (time measured by the cumulative rate) and mapped back to real time, so the rate
    follows the shape and the burstiness around it is the gamma's.
    """

    shape: Shape
    cv: float = 1.0

    def times(
        self, rng: np.random.Generator, rate: float, duration_s: float | None, count: int | None
    ) -> np.ndarray:
        if self.cv != 1.0:
            horizon = None if duration_s is None else float(self.shape.cumulative(np.array(duration_s)))
            operational = _renewal_times(GammaRenewal(self.cv), rng, rate, horizon, count)
            return self.shape.inverse(operational)
        if duration_s is not None:
            return self._thin(rng, rate, 0.0, duration_s)
        assert count is not None
        parts, a, width, total = [], 0.0, count / rate, 0
        while total < count:
            if a >= self.shape.dead_after:
                raise ValueError("the profile ends at rate 0: ask for a duration, not a count")
            parts.append(self._thin(rng, rate, a, a + width))
            a, width, total = a + width, 2 * width, total + len(parts[-1])
        return np.concatenate(parts)[:count]

    def _thin(self, rng: np.random.Generator, rate: float, a: float, b: float) -> np.ndarray:
        edges, bound = self.shape.pieces(a, b)
        width = np.diff(edges)
        n = rng.poisson(rate * bound * width)
        cand = np.sort(np.repeat(edges[:-1], n) + rng.random(n.sum()) * np.repeat(width, n))
        keep = rng.random(len(cand)) * np.repeat(bound, n) < self.shape.factor(cand)
        return cand[keep]


ArrivalProcess = Poisson | GammaRenewal | MMPP2 | TimeVarying


def arrival_times(
    process: ArrivalProcess,
    rng: np.random.Generator,
    rate: float,
    duration_s: float | None,
    count: int | None,
) -> np.ndarray:
    """Arrival times of `count` requests, or of all requests before `duration_s` (exactly one must be set)."""
    if (duration_s is None) == (count is None):
        raise ValueError("set exactly one of duration_s and count")
    return process.times(rng, rate, duration_s, count)
