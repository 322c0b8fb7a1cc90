"""Scraping vLLM's Prometheus `/metrics`: KV-cache size, and the running/waiting/KV-usage gauges during a run.

Parsing goes through `prometheus_client`'s text parser, so label quoting and escaping follow the exposition
format rather than a regular expression. The KV capacity in tokens is `num_gpu_blocks x block_size` from the
`vllm:cache_config_info` info gauge (vLLM keeps that label name on CPU too).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from simadmit.calibrate.background import cancel


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The KV cache of one engine, from `vllm:cache_config_info`."""

    block_size: int
    num_blocks: int
    engines: int  # engines behind the endpoint (data parallel): the capacity is per engine

    @property
    def capacity_tokens(self) -> int:
        return self.block_size * self.num_blocks


@dataclass(frozen=True, slots=True)
class EngineGauges:
    """Instantaneous load of the server, summed over its engines."""

    running: float
    waiting: float
    kv_usage: float  # fraction of KV blocks in use, 0-1 (the largest over engines)


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Labels and value of every sample named `name`.

    Only the lines mentioning `name` go to the parser: parsing vLLM's whole page (50 kB of histograms) takes
    50-100 ms of pure Python, which would stall the event loop that timestamps the tokens once per poll.
    """
    relevant = "".join(line + "\n" for line in text.splitlines() if name in line)
    return [
        (dict(s.labels), float(s.value))
        for family in text_string_to_metric_families(relevant)
        for s in family.samples
        if s.name == name
    ]


def parse_cache_config(text: str) -> CacheConfig | None:
    """KV cache size from a /metrics text; None when the server does not expose `vllm:cache_config_info`."""
    found = [labels for labels, _ in _samples(text, "vllm:cache_config_info")]
    blocks = [
        (int(lb["num_gpu_blocks"]), int(lb["block_size"]))
        for lb in found
        if lb.get("num_gpu_blocks", "").isdigit()
    ]
    if not blocks:
        return None
    num_blocks, block_size = min(blocks)
    return CacheConfig(block_size=block_size, num_blocks=num_blocks, engines=len(blocks))


def parse_gauges(text: str) -> EngineGauges:
    """Running and waiting requests (summed over engines) and KV-cache usage (largest engine)."""
    running = sum(v for _, v in _samples(text, "vllm:num_requests_running"))
    waiting = sum(v for _, v in _samples(text, "vllm:num_requests_waiting"))
    usage = [v for _, v in _samples(text, "vllm:kv_cache_usage_perc")]
    return EngineGauges(running=running, waiting=waiting, kv_usage=max(usage, default=0.0))


def published_gauges(text: str) -> EngineGauges:
    """`parse_gauges` of a page a vLLM server published; ValueError when it has no
    `vllm:num_requests_running` (an HTML page, a gateway's own metrics): read as gauges, it would show an
    idle engine at every poll, and what polls it (a gateway's view, a replay's time series) be blind."""
    if "vllm:num_requests_running" not in text:
        raise ValueError("no vllm:num_requests_running gauge: not a vLLM server's /metrics")
    return parse_gauges(text)


def sample_totals(text: str, names: Iterable[str]) -> dict[str, float | None]:
    """Each sample named, summed over every engine (None for one the server does not expose), from one
    parse of the lines that mention them (see `_samples` on why only those)."""
    wanted = set(names)
    relevant = "".join(line + "\n" for line in text.splitlines() if any(w in line for w in wanted))
    totals: dict[str, float | None] = dict.fromkeys(wanted)
    for family in text_string_to_metric_families(relevant):
        for s in family.samples:
            if s.name in totals:
                totals[s.name] = (totals[s.name] or 0.0) + float(s.value)
    return totals


def histogram_totals(text: str, names: tuple[str, ...]) -> dict[str, tuple[float, float] | None]:
    """(sum, count) of each histogram named, over every engine; None for one the server does not expose."""
    totals = sample_totals(text, [f"{n}{part}" for n in names for part in ("_sum", "_count")])
    out: dict[str, tuple[float, float] | None] = {}
    for name in names:
        total, count = totals[f"{name}_sum"], totals[f"{name}_count"]
        out[name] = (total, count) if total is not None and count is not None else None
    return out


async def scrape(client: httpx.AsyncClient, base_url: str) -> str:
    response = await client.get(f"{base_url}/metrics")
    response.raise_for_status()
    return response.text


class MetricsSampler:
    """Polls /metrics in the background and keeps the gauges per phase (a failed poll is skipped, not fatal)."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, interval_s: float = 1.0) -> None:
        self._client = client
        self._base_url = base_url
        self._interval_s = interval_s
        self.phase = "setup"
        self.samples: dict[str, list[EngineGauges]] = defaultdict(list)
        self.failed_polls = 0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            started = time.perf_counter()
            try:
                self.samples[self.phase].append(parse_gauges(await scrape(self._client, self._base_url)))
            except (httpx.HTTPError, ValueError):
                self.failed_polls += 1
            await asyncio.sleep(max(0.0, self._interval_s - (time.perf_counter() - started)))

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        await cancel(self._task)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per phase: mean and max running and waiting requests, max KV usage, number of polls."""
        out = {}
        for phase, gs in self.samples.items():
            if not gs:
                continue
            out[phase] = {
                "polls": len(gs),
                "running_mean": round(sum(g.running for g in gs) / len(gs), 2),
                "running_max": max(g.running for g in gs),
                "waiting_max": max(g.waiting for g in gs),
                "kv_usage_max": round(max(g.kv_usage for g in gs), 4),
            }
        return out
