"""LatencyHistogram: a run's latencies in logarithmic buckets, small enough to save and exact enough to pool.

Percentiles over several replications must come from the pooled sample, not from averaging each run's
percentile (a high quantile of a short, autocorrelated run is biased low). Keeping every latency of every
run would make a sweep's saved results large, so each run keeps a histogram instead: bucket i holds the
values in (gamma^(i-1), gamma^i], gamma = (1 + a) / (1 - a), and a quantile read from it is within a
relative error a = 0.5% of the sample's own (the DDSketch construction: Masson, Rim and Lee, "DDSketch:
a fast and fully-mergeable quantile sketch with relative-error guarantees", VLDB 2019). Histograms of
several runs add up bucket by bucket. A request that never got its answer counts as `missing`, an
infinite latency: a percentile over every arrival is infinite once more than its tail share is missing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

ACCURACY = 0.005  # relative error of a quantile read from the histogram
_LOG_GAMMA = math.log((1 + ACCURACY) / (1 - ACCURACY))
_GAMMA = math.exp(_LOG_GAMMA)
TINY_S = 1e-6  # values at or below a microsecond share the zero bucket (read back as 0)


@dataclass(frozen=True)
class LatencyHistogram:
    """Counts of latencies per logarithmic bucket, plus the requests that never got an answer."""

    zero: int  # values <= TINY_S
    offset: int  # bucket index of counts[0]
    counts: np.ndarray  # int64 counts of buckets offset, offset + 1, ...
    missing: int = 0  # never answered: an infinite latency

    @classmethod
    def of(cls, values: np.ndarray, missing: int = 0) -> LatencyHistogram:
        """The histogram of finite latencies `values`, and `missing` requests that never got one."""
        values = np.asarray(values, dtype=float)
        positive = values[values > TINY_S]
        zero = len(values) - len(positive)
        if not len(positive):
            return cls(zero, 0, np.zeros(0, dtype=np.int64), missing)
        index = bucket(positive)
        offset = int(index.min())
        return cls(zero, offset, np.bincount(index - offset).astype(np.int64), missing)

    @property
    def answered(self) -> int:
        return self.zero + int(self.counts.sum())

    def total(self, every_arrival: bool = True) -> int:
        """Observations a percentile is taken over: every arrival, or only the answered ones."""
        return self.answered + (self.missing if every_arrival else 0)

    def quantile(self, q: float, every_arrival: bool = True) -> float:
        """The lower q-quantile (smallest x with at least a share q at or below it): the value of the
        observation of rank ceil(q n); +inf when that rank falls among the missing; NaN when empty."""
        n = self.total(every_arrival)
        if n == 0:
            return math.nan
        rank = max(1, math.ceil(q * n - 1e-9))
        if rank <= self.zero:
            return 0.0
        cumulative = self.zero + np.cumsum(self.counts)
        k = int(np.searchsorted(cumulative, rank, side="left"))
        if k >= len(self.counts):
            return math.inf
        return float(2 * _GAMMA ** (self.offset + k) / (_GAMMA + 1))  # the bucket's centre, relatively

    def at_most(self, x: float, every_arrival: bool = True) -> int:
        """How many observations lie at or below x (the whole bucket holding x counts as at or below)."""
        if math.isinf(x):
            return self.total(every_arrival) if x > 0 else 0
        if x <= TINY_S:
            return self.zero if x >= 0 else 0
        k = int(bucket(np.array([x]))[0]) - self.offset
        return self.zero + int(self.counts[: max(0, k + 1)].sum())

    def to_json(self) -> dict[str, object]:
        return {
            "zero": self.zero,
            "offset": self.offset,
            "counts": self.counts.tolist(),
            "missing": self.missing,
        }

    @classmethod
    def from_json(cls, data: dict) -> LatencyHistogram:
        return cls(int(data["zero"]), int(data["offset"]), np.asarray(data["counts"], dtype=np.int64),
                   int(data["missing"]))  # fmt: skip


def bucket(values: np.ndarray) -> np.ndarray:
    """Index of the bucket (gamma^(i-1), gamma^i] holding each positive value."""
    return np.ceil(np.log(values) / _LOG_GAMMA).astype(np.int64)


def pooled(histograms: Sequence[LatencyHistogram]) -> LatencyHistogram:
    """One histogram of every run's observations: the pooled sample."""
    filled = [h for h in histograms if len(h.counts)]
    zero = sum(h.zero for h in histograms)
    missing = sum(h.missing for h in histograms)
    if not filled:
        return LatencyHistogram(zero, 0, np.zeros(0, dtype=np.int64), missing)
    offset = min(h.offset for h in filled)
    counts = np.zeros(max(h.offset + len(h.counts) for h in filled) - offset, dtype=np.int64)
    for h in filled:
        counts[h.offset - offset : h.offset - offset + len(h.counts)] += h.counts
    return LatencyHistogram(zero, offset, counts, missing)
