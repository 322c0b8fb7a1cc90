"""HorizontalAutoscaler: the Kubernetes HPA algorithm, as a plain object fed one metric sample per sync.

Per the Kubernetes documentation: desired = ceil(current x metric / target); no change while the ratio is
within the tolerance (default 0.1); recommendations are stabilised: scaling down takes the highest
recommendation of the last `scale_down_stabilization_s` (default 300 s), scaling up the lowest of the last
`scale_up_stabilization_s` (default 0 s); the result is clamped to [min, max] replicas.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

MAX_RECOMMENDATION = 1e9  # replicas: far above any max_replicas the schema allows


@dataclass(frozen=True, slots=True)
class AutoscalerConfig:
    metric: str  # "gpu_utilization" or "queue_wait"
    target: float
    min_replicas: int
    max_replicas: int
    sync_period_s: float = 15.0
    tolerance: float = 0.1
    scale_up_stabilization_s: float = 0.0
    scale_down_stabilization_s: float = 300.0


def queue_wait_load(in_flight_gpu_s: float, gpus: int, refused_fraction: float) -> float:
    """The load an autoscaler scales on: in-flight GPU-seconds per GPU, divided by the fraction of attempts
    admitted, so rejections cannot hide demand (floored at 5% admitted)."""
    return in_flight_gpu_s / max(gpus, 1) / max(1.0 - refused_fraction, 0.05)


class HorizontalAutoscaler:
    def __init__(self, cfg: AutoscalerConfig) -> None:
        self.cfg = cfg
        self.history: deque[tuple[float, int]] = deque()  # (time, raw recommendation)

    def raw_recommendation(self, current: int, metric: float) -> int:
        """ceil(current x metric / target), or `current` when the ratio is within the tolerance.

        A ratio beyond any fleet (a tiny target: metric / target may overflow to infinity) recommends
        `MAX_RECOMMENDATION`, which the result is clamped below anyway.
        """
        ratio = metric / self.cfg.target
        if abs(ratio - 1.0) <= self.cfg.tolerance:
            return current
        return math.ceil(min(current * ratio, MAX_RECOMMENDATION))

    def recommend(self, now: float, current: int, metric: float) -> int:
        """The replica count to run now, after stabilisation and clamping."""
        cfg = self.cfg
        raw = self.raw_recommendation(current, metric)
        self.history.append((now, raw))
        horizon = max(cfg.scale_down_stabilization_s, cfg.scale_up_stabilization_s)
        while self.history and self.history[0][0] < now - horizon:
            self.history.popleft()
        desired = raw
        if raw < current:  # scale down only as far as the highest recent recommendation allows
            recent = [r for t, r in self.history if t >= now - cfg.scale_down_stabilization_s]
            desired = min(current, max(recent))
        elif raw > current:  # scale up only as far as the lowest recent recommendation allows
            recent = [r for t, r in self.history if t >= now - cfg.scale_up_stabilization_s]
            desired = max(current, min(recent))
        return max(cfg.min_replicas, min(cfg.max_replicas, desired))
