"""Intervals: a percentile over several replications, and a 95% confidence interval that survives autocorrelation.

The estimate is the pooled sample's quantile. The interval inverts one for the share of observations at or
below it: if xi is the pooled q-quantile, each replication r has a share F_r(xi) of its observations at or
below xi; the replications are independent, so mean(F_r) +- t(R-1) sd(F_r) / sqrt(R) is a confidence
interval for F(xi) however correlated the observations inside a run are (sectioning, with the replications
as sections: Asmussen and Glynn, "Stochastic Simulation", Springer 2007, III.5a; Nakayama, "Confidence
intervals using sectioning for quantiles when applying variance-reduction techniques", ACM TOMACS 24(4),
2014). Reading the pooled sample at the ends of that band gives the interval for the quantile, as the
distribution-free order-statistic interval does for independent data (Serfling, "Approximation Theorems
of Mathematical Statistics", Wiley 1980, 2.6.1), with the binomial variance replaced by the variance across
replications. The alternatives were measured on M/M/1 at rho = 0.9, 5 replications of 4,000 customers:
the mean of per-run p99s with a t-interval is ~19% low and covers the true p99 ~60% of the time; the
pooled p99 with sectioning on the per-run p99s covers ~75%; this interval ~92%.
(tests/test_intervals.py checks it.) Below ~100 observations beyond the quantile every interval is rough.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from simadmit.results.histogram import LatencyHistogram, pooled

# two-sided 95% Student t quantiles for 1..30 degrees of freedom
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)  # fmt: skip
FEW_BEYOND = 100  # fewer observations than this beyond a quantile: its interval is rough


def t975(dof: int) -> float:
    """Two-sided 95% Student t quantile (normal beyond 30 degrees of freedom)."""
    return _T975[dof - 1] if dof <= len(_T975) else 1.96


@dataclass(frozen=True)
class QuantileEstimate:
    """A pooled quantile, its 95% interval [low, high] (NaN with fewer than two replications), how many
    pooled observations lie beyond it, and how many replications had observations at all."""

    value: float
    low: float
    high: float
    beyond: int
    sections: int

    @property
    def half_width(self) -> float:
        """The larger distance from the estimate to an end of the interval (the interval is asymmetric)."""
        if math.isnan(self.low) or math.isinf(self.value):
            return math.nan if math.isnan(self.low) else math.inf
        return max(self.value - self.low, self.high - self.value)


def pooled_quantile(
    histograms: Sequence[LatencyHistogram], q: float, every_arrival: bool
) -> QuantileEstimate:
    """The q-quantile of the replications' pooled sample, with the sectioning interval described above."""
    pool = pooled(histograms)
    value = pool.quantile(q, every_arrival)
    n = pool.total(every_arrival)
    beyond = n - max(1, math.ceil(q * n - 1e-9)) if n else 0  # ranked above the quantile's rank
    sections = [h for h in histograms if h.total(every_arrival) > 0]
    if len(sections) < 2 or math.isnan(value):
        return QuantileEstimate(value, math.nan, math.nan, beyond, len(sections))
    shares = np.array([h.at_most(value, every_arrival) / h.total(every_arrival) for h in sections])
    h = t975(len(sections) - 1) * float(shares.std(ddof=1)) / math.sqrt(len(sections))
    low = pool.quantile(max(q - h, 0.0), every_arrival)
    high = pool.quantile(q + h, every_arrival) if q + h < 1 else math.inf
    return QuantileEstimate(value, min(low, value), max(high, value), beyond, len(sections))
