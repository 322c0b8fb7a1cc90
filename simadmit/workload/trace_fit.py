"""Burstiness of a recorded trace and a generator fitted to it.

Inter-arrival CV and the index of dispersion of counts say how far a trace is from Poisson; `fit_trace`
summarises it as a rate curve (steps per bin) plus the burstiness left around that curve, so synthetic
streams can reproduce a trace's load pattern at any rate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simadmit.workload.arrivals import RateCurve, TimeVarying


def iat_cv(times: np.ndarray) -> float:
    """Coefficient of variation of inter-arrival times (1 for Poisson)."""
    gaps = np.diff(np.sort(times))
    return float(gaps.std() / gaps.mean())


def idc(times: np.ndarray, window_s: float, span_s: float | None = None) -> float:
    """Index of dispersion of counts: variance / mean of arrivals per `window_s` bin over [0, span_s].

    The span defaults to the last arrival; the last bin may be partial, as in a histogram of the trace.
    """
    times = np.asarray(times, dtype=float)
    span = float(times.max()) if span_s is None else span_s
    counts = np.histogram(times, np.arange(0.0, span + window_s, window_s))[0]
    return float(counts.var() / counts.mean())


@dataclass(frozen=True, slots=True)
class TraceFit:
    """A trace summarised as a rate curve and the burstiness around it."""

    rate: float  # mean arrival rate over the trace, req/s
    shape: RateCurve  # step curve, one step per bin, mean 1 over the trace
    cv: float  # inter-arrival CV once the rate curve is taken out (1 = Poisson around the curve)
    iat_cv: float  # raw inter-arrival CV of the trace
    idc: float  # index of dispersion of counts in `idc_window_s` bins
    idc_window_s: float
    span_s: float  # first to last arrival

    def process(self) -> TimeVarying:
        """Generates streams with this rate curve and this CV (run it with `rate` for the trace's rate)."""
        return TimeVarying(self.shape, self.cv)


MAX_BINS = 100_000


def fit_trace(arrival_s: np.ndarray, bin_s: float = 60.0, idc_window_s: float = 1.0) -> TraceFit:
    """Estimate a rate curve (requests per `bin_s` bin, as steps) and the burstiness around it.

    The CV is measured in operational time: each arrival is mapped through the fitted cumulative rate,
    which removes the slow drift the curve already explains, and the CV of the resulting gaps is what a
    gamma renewal process must add around the curve. For traces with quantized timestamps (Mooncake) load
    with `bucket_jitter` first, or the CV measures the quantization.
    """
    t = np.sort(np.asarray(arrival_s, dtype=float)) - float(np.min(arrival_s))
    span = float(t[-1])
    if len(t) < 3 or span <= 0:
        raise ValueError("need at least 3 arrivals spread over time to fit a trace")
    if span / bin_s > MAX_BINS:  # a step per bin: memory and time grow with their count
        raise ValueError(
            f"arrival.bin_s {bin_s:g} s cuts the trace's {span:.3g} s into {span / bin_s:.3g} bins: at most "
            f"{MAX_BINS:,}; make bin_s larger"
        )
    edges = np.append(np.arange(0.0, span, bin_s), span)
    counts = np.histogram(t, edges)[0]
    rate = len(t) / span
    steps = counts / np.diff(edges) / rate
    points = tuple(
        (float(e), float(s)) for lo, hi, s in zip(edges[:-1], edges[1:], steps, strict=True) for e in (lo, hi)
    )
    shape = RateCurve(points)
    cv = iat_cv(shape.cumulative(t))
    return TraceFit(rate, shape, cv, iat_cv(t), idc(t, idc_window_s, span), idc_window_s, span)
