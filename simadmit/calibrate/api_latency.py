"""The API server's latency: what a lone request spends outside the engine, read off vLLM's own clocks.

A lone request's TTFT is its engine queue wait and prefill step, which vLLM's engine core stamps
(`vllm:request_queue_time_seconds`, `vllm:request_prefill_time_seconds`), plus the way in and out through
HTTP and the API server. Short requests sent one at a time, with both histograms read before and after
each, give that remainder per request directly. The fit's TTFT offset only estimates it, and soaks up
whatever the step model misses of a prefill: 0.8-58 ms across calibrations of the CPU server here, whose
remainder measured this way is 7-9 ms.
"""

from __future__ import annotations

import asyncio
import random
import statistics
from dataclasses import replace

import httpx

from simadmit.calibrate.client import Endpoint, stream_completion, tokenize
from simadmit.calibrate.metrics import histogram_totals, scrape
from simadmit.calibrate.prompts import SAMPLE_TEXT, PromptMaker

ENGINE_TIME = ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds")
PROMPT_TOKENS = 64  # short: a prefill of one step, so the remainder is not lost in a long one's noise
REQUESTS = 8


async def _engine_time(client: httpx.AsyncClient, base_url: str) -> tuple[float, float] | None:
    """(queue + prefill seconds, requests counted) summed over engines; None when the server has no such
    histograms (not vLLM V1) or /metrics fails."""
    try:
        totals = histogram_totals(await scrape(client, base_url), ENGINE_TIME)
    except (httpx.HTTPError, ValueError):
        return None
    found = [t for name in ENGINE_TIME if (t := totals[name]) is not None]
    if len(found) < len(ENGINE_TIME):
        return None
    return sum(seconds for seconds, _ in found), min(count for _, count in found)


async def ttft_split(
    client: httpx.AsyncClient,
    endpoint: Endpoint,
    prompt: list[int] | str,
    timeout_s: float = 60.0,
    engine_url: str | None = None,
) -> tuple[float, float] | None:
    """Send one request (one output token) to the idle server: (its TTFT as the client saw it, the engine's
    queue + prefill time for it), or None when the server's clocks did not count exactly this request.
    `engine_url`: the server whose clocks to read, when `endpoint` is a gateway in front of it."""
    clocks = engine_url or endpoint.base_url
    before = await _engine_time(client, clocks)
    if before is None:
        return None
    attempt = await stream_completion(client, endpoint, prompt, 1, timeout_s)
    if attempt.status != "ok":
        return None
    for _ in range(20):  # the finished request reaches the histograms moments after its last byte
        after = await _engine_time(client, clocks)
        if after is None:
            return None
        if after[1] - before[1] >= 1:
            return (attempt.ttft_s, after[0] - before[0]) if after[1] - before[1] == 1 else None
        await asyncio.sleep(0.05)
    return None


async def _times_outside(
    client: httpx.AsyncClient, ways: tuple[Endpoint, ...], engine: Endpoint, requests: int
) -> list[list[float]] | None:
    """Per way in, the times outside `engine` (client TTFT - engine time) of `requests` lone short requests,
    the ways taken in turns so a drifting machine weighs on each alike; None when fewer than half of any
    way's could be measured (a server without the engine's histograms, or a busy one)."""
    prompts = PromptMaker(await tokenize(client, engine, SAMPLE_TEXT), random.Random())
    times: list[list[float]] = [[] for _ in ways]
    for _ in range(requests):
        for way, got in zip(ways, times, strict=True):
            split = await ttft_split(client, way, prompts.make(PROMPT_TOKENS), engine_url=engine.base_url)
            if split is not None:
                got.append(split[0] - split[1])
    return times if all(2 * len(got) >= requests for got in times) else None


async def measure_api_latency(
    client: httpx.AsyncClient, endpoint: Endpoint, requests: int = REQUESTS
) -> float | None:
    """The median time outside the engine of `requests` lone short requests (never below zero); None when
    fewer than half could be measured."""
    times = await _times_outside(client, (endpoint,), endpoint, requests)
    return None if times is None else max(0.0, statistics.median(times[0]))


async def measure_gateway_latency(
    client: httpx.AsyncClient, backend: Endpoint, gateway_url: str, requests: int = REQUESTS
) -> float | None:
    """A gateway's own latency (`gateway.latency_s`): the median time outside the engine of lone short
    requests sent through the gateway at `gateway_url`, less that of the same requests sent straight to
    `backend`; never below zero. None when fewer than half of either could be measured."""
    times = await _times_outside(client, (backend, replace(backend, base_url=gateway_url)), backend, requests)
    if times is None:
        return None
    direct, gateway = times
    return max(0.0, statistics.median(gateway) - statistics.median(direct))
