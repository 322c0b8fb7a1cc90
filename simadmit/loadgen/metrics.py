"""Polling the server's `/metrics` during a replay: the time series beside the client's own records.

Each poll keeps vLLM's running and waiting requests and KV usage (`calibrate.metrics.published_gauges`) and the
running totals of the queue-time histogram and of preemptions, whose differences between two polls give the
mean queue wait and the preemptions in between. An endpoint without vLLM's `/metrics` (a gateway that
exposes none, or only its own) leaves the series empty rather than fill it with an idle engine's zeros.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

import httpx

from simadmit.calibrate.metrics import published_gauges, sample_totals

COUNTERS = {
    "queue_time_sum_s": "vllm:request_queue_time_seconds_sum",
    "queue_time_count": "vllm:request_queue_time_seconds_count",
    "preemptions_total": "vllm:num_preemptions_total",
    "generation_tokens_total": "vllm:generation_tokens_total",
}


def counter_totals(text: str) -> dict[str, float]:
    """The counters above summed over engines (NaN when the server does not expose one)."""
    totals = sample_totals(text, COUNTERS.values())
    return {key: math.nan if (t := totals[name]) is None else t for key, name in COUNTERS.items()}


@dataclass
class MetricsPoller:
    """Polls `base_url/metrics` every `interval_s` into `rows`; `t0` is the run's time zero (loop clock)."""

    client: httpx.AsyncClient
    base_url: str
    t0: float
    interval_s: float = 1.0
    rows: list[dict[str, float]] = field(default_factory=list)
    failed: int = 0

    async def poll(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            response = await self.client.get(f"{self.base_url}/metrics", timeout=5.0)
            response.raise_for_status()
            gauges = published_gauges(response.text)
            row = {"t_s": loop.time() - self.t0, "queued": gauges.waiting, "running": gauges.running,
                   "kv_usage": gauges.kv_usage, **counter_totals(response.text)}  # fmt: skip
        except (httpx.HTTPError, ValueError):
            self.failed += 1
            return
        self.rows.append(row)

    async def run(self) -> None:
        """Poll until cancelled, on a fixed grid (a slow poll does not shift the next one)."""
        loop = asyncio.get_running_loop()
        k = 0
        while True:
            await self.poll()
            k += 1
            await asyncio.sleep(max(0.0, self.t0 + k * self.interval_s - loop.time()))
