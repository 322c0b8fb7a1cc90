"""The gateway's own Prometheus metrics: decisions, predicted wait, in-flight work, the autoscaling load.

Each gateway has its own registry (several can run in one process, in the tests). The queue-wait load is the
metric the simulator's autoscaler scales on (`queue_wait_load`): in-flight GPU-seconds per GPU, divided by
the fraction of attempts admitted over the last `window_s`, so that rejections do not hide demand; an HPA
reads it through a custom-metrics adapter.
"""

from __future__ import annotations

import math
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge

from simadmit.admission.policies import PoolView
from simadmit.fleet.autoscaler import queue_wait_load
from simadmit.serve.backends import LivePool

PREFIX = "simadmit_gateway"


class RefusalWindow:
    """Attempts and rejections over the last `window_s` seconds, in one-second buckets."""

    def __init__(self, window_s: float = 15.0) -> None:
        self.window_s = window_s
        self.buckets: deque[list[float]] = deque()  # [second, attempts, rejections]

    def record(self, now: float, rejected: bool) -> None:
        second = float(int(now))
        if not self.buckets or self.buckets[-1][0] != second:
            self.buckets.append([second, 0.0, 0.0])
        bucket = self.buckets[-1]
        bucket[1] += 1
        bucket[2] += rejected

    def refused_fraction(self, now: float) -> float:
        while self.buckets and self.buckets[0][0] <= now - self.window_s:
            self.buckets.popleft()
        attempts = sum(b[1] for b in self.buckets)
        return sum(b[2] for b in self.buckets) / attempts if attempts else 0.0


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.decisions = Counter(
            f"{PREFIX}_decisions", "admission decisions by pool, tier and reason (admitted or why not)",
            ["pool", "tier", "reason"], registry=r,
        )  # fmt: skip
        self.invalid = Counter(
            f"{PREFIX}_invalid_requests",
            "requests refused before admission (4xx), by kind",
            ["kind"],
            registry=r,
        )
        self.upstream_failures = Counter(
            f"{PREFIX}_upstream_failures", "admitted requests a backend failed (502/503)", ["backend", "status"],
            registry=r,
        )  # fmt: skip
        self.client_gone = Counter(
            f"{PREFIX}_client_disconnects", "admitted requests whose client left before the end", registry=r
        )
        self.shed = Counter(
            f"{PREFIX}_shed", "admitted requests dropped once their deadline was lost, by pool, tier and reason "
            "(deadline_lost: before their first token; deadline_passed: answering)", ["pool", "tier", "reason"],
            registry=r,
        )  # fmt: skip
        self.predicted_wait = Gauge(
            f"{PREFIX}_predicted_wait_seconds", "the wait predicted at this gateway's latest decision: the "
            "policy's own (gpu_seconds: in-flight, or remaining, work per GPU; predicted_ttft: the first token's), "
            "else in-flight GPU-seconds per available GPU", ["pool"], registry=r,
        )  # fmt: skip
        self.in_flight = Gauge(
            f"{PREFIX}_in_flight_gpu_seconds", "predicted GPU-seconds in flight in this gateway's view",
            ["pool"], registry=r,
        )  # fmt: skip
        self.own_in_flight = Gauge(
            f"{PREFIX}_own_in_flight_gpu_seconds", "GPU-seconds this gateway admitted and not yet finished",
            ["pool"], registry=r,
        )  # fmt: skip
        self.load = Gauge(
            f"{PREFIX}_queue_wait_load",
            "in-flight GPU-seconds per GPU / fraction admitted: the load to autoscale on", ["pool"], registry=r,
        )  # fmt: skip
        self.available_gpus = Gauge(
            f"{PREFIX}_available_gpus", "GPUs of the backends taking work", ["pool"], registry=r
        )
        self.backend_up = Gauge(
            f"{PREFIX}_backend_up", "1 while a backend takes work, 0 while refused or stale", ["pool", "backend"],
            registry=r,
        )  # fmt: skip
        self.backend_requests = Gauge(
            f"{PREFIX}_backend_requests", "a backend's running and waiting requests at its last poll",
            ["pool", "backend", "state"], registry=r,
        )  # fmt: skip
        self.windows: dict[str, RefusalWindow] = {}

    def decided(self, pool: str, tier: str, reason: str, admitted: bool, now: float, wait: float) -> None:
        """Count a decision and publish the wait it was made on (when finite)."""
        self.decisions.labels(pool, tier, reason).inc()
        self.windows.setdefault(pool, RefusalWindow()).record(now, not admitted)
        if math.isfinite(wait):
            self.predicted_wait.labels(pool).set(wait)

    def view(self, pool: LivePool, view: PoolView, now: float) -> None:
        """Publish a pool's state after a refresh of the view."""
        name = pool.name
        gpus = view.available_gpus
        refused = self.windows.setdefault(name, RefusalWindow()).refused_fraction(now)
        self.in_flight.labels(name).set(view.in_flight_gpu_s)
        self.own_in_flight.labels(name).set(pool.own_gpu_s)
        self.load.labels(name).set(queue_wait_load(view.in_flight_gpu_s, gpus, refused))
        self.available_gpus.labels(name).set(gpus)
        for b in pool.backends:
            self.backend_up.labels(name, b.shown).set(1.0 if pool.takes_work(b) else 0.0)
            self.backend_requests.labels(name, b.shown, "running").set(b.gauges.running)
            self.backend_requests.labels(name, b.shown, "waiting").set(b.gauges.waiting)
