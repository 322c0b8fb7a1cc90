"""The open-loop replay: every request leaves at its scheduled time, whatever is still in flight.

One asyncio loop does everything: a dispatcher sleeps until the next scheduled time and starts the request
(so a slow server never delays the next arrival; with several endpoints, such as gateway replicas, the
attempts go to them in turn, as a round-robin load balancer would send them), each request retries after a 429 as the scenario's
`Client` says (backoff, jitter, Retry-After, retry budget, deadline), and a poller reads `/metrics`. The run
keeps how late each attempt left against its schedule and what the client itself cost (CPU share, event-loop
lag), because a load generator that falls behind measures itself, not the server. In front of gateways,
which serve neither `/metrics` of vLLM's kind nor `/tokenize`, the server behind them supplies both.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass

import httpx
import numpy as np

from simadmit.admission.client import Client
from simadmit.calibrate.background import cancel
from simadmit.calibrate.client import Endpoint, discover, normalize_base_url, tokenize
from simadmit.calibrate.overhead import OverheadMonitor
from simadmit.calibrate.prompts import SAMPLE_TEXT
from simadmit.loadgen.metrics import MetricsPoller
from simadmit.loadgen.plan import Plan, request_bodies
from simadmit.loadgen.sender import REJECTED, AttemptResult, send


@dataclass(frozen=True)
class ReplayConfig:
    endpoint: str
    model: str | None = None
    timeout_s: float = 600.0  # one attempt, from sending to its last token
    lead_s: float = 0.5  # time zero is this long after the bodies are ready
    metrics_interval_s: float = 1.0
    more_endpoints: tuple[str, ...] = ()  # attempts go round-robin over `endpoint` and these
    server: str | None = None  # the vLLM server behind the endpoints (gateways): /metrics and /tokenize


@dataclass(frozen=True)
class AttemptRecord:
    request_id: int
    attempt: int
    planned_s: float  # when it should have left (schedule, or the retry's due time), run time
    result: AttemptResult  # times relative to the run's time zero
    endpoint: int = 0  # which endpoint it went to (0: `endpoint`, k: `more_endpoints[k - 1]`)


@dataclass(frozen=True)
class ReplayRun:
    """What one replay measured; times are seconds from the run's time zero (the schedule's t = 0)."""

    plan: Plan
    endpoint: Endpoint
    attempts: list[AttemptRecord]
    polls: list[dict[str, float]]
    failed_polls: int
    overhead: dict[str, float]
    started_unix_s: float
    wall_s: float
    interrupted: bool = False  # Ctrl-C stopped it: only the requests that had ended are here


def _shift(r: AttemptResult, t0: float) -> AttemptResult:
    return AttemptResult(r.status, r.sent - t0, r.answered - t0, r.first_token - t0, r.finish - t0,
                         r.prompt_tokens, r.output_tokens, r.retry_after_s, r.reason, r.predicted_wait_s)  # fmt: skip


async def replay_async(plan: Plan, cfg: ReplayConfig, rng: random.Random) -> ReplayRun:
    n = len(plan.workload)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(cfg.timeout_s, connect=10.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as http, httpx.AsyncClient() as side:
        endpoint = await discover(side, normalize_base_url(cfg.endpoint), cfg.model)
        for more in cfg.more_endpoints:  # each must answer and serve the model before anything is sent
            await discover(side, normalize_base_url(more), endpoint.model)
        behind = endpoint
        if cfg.server:  # it must answer too: its /metrics and /tokenize would otherwise be lost silently
            behind = await discover(
                side, normalize_base_url(cfg.server, "--server"), endpoint.model, "--server"
            )
        ids = await tokenize(side, endpoint, SAMPLE_TEXT)
        if ids is None and behind is not endpoint:
            ids = await tokenize(side, behind, SAMPLE_TEXT)
        bodies = request_bodies(plan, endpoint.model, ids, rng)
        urls = [f"{normalize_base_url(e)}/v1/completions" for e in (cfg.endpoint, *cfg.more_endpoints)]
        turn = itertools.count()
        client = Client(plan.clients, np.random.default_rng([plan.seed, 3]).random)
        loop = asyncio.get_running_loop()
        t0 = loop.time() + cfg.lead_s
        started_unix = time.time() + cfg.lead_s
        scheduled = plan.scheduled_s.tolist()
        deadline = plan.workload.deadline.tolist()
        records: list[AttemptRecord] = []
        ended: set[int] = set()

        async def request(rid: int) -> None:
            planned, tries = t0 + scheduled[rid], 0
            abandon: float | None = None
            first_sent: float | None = None
            while True:
                tries += 1
                client.attempt(tries)
                if tries == 1 and (give_up := client.abandons_at(loop.time())) is not None:
                    abandon = give_up
                k = next(turn) % len(urls)
                elapsed = None if first_sent is None else loop.time() - first_sent
                r = await send(http, urls[k], bodies[rid], cfg.timeout_s, abandon, elapsed)
                first_sent = r.sent if first_sent is None else first_sent
                records.append(AttemptRecord(rid, tries, planned - t0, _shift(r, t0), k))
                if r.status != REJECTED:
                    break
                wait = client.after_rejection(rid, tries, r.retry_after_s, r.answered - t0, deadline[rid])
                if wait is None:
                    break
                planned = r.answered + wait
                await asyncio.sleep(max(0.0, planned - loop.time()))
            client.forget(rid)
            ended.add(rid)

        poller = MetricsPoller(side, behind.base_url, t0, cfg.metrics_interval_s)
        monitor = OverheadMonitor()
        monitor.start()
        polling = asyncio.create_task(poller.run())
        tasks: list[asyncio.Task[None]] = []
        interrupted = False
        try:
            for rid in range(n):  # the dispatcher: nothing here waits for an answer
                wait = t0 + scheduled[rid] - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                tasks.append(asyncio.create_task(request(rid)))
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:  # Ctrl-C: keep the requests that had ended, drop those still open
            interrupted = True
            _stop_interrupted(tasks)
            await asyncio.gather(*tasks, return_exceptions=True)
            records = [a for a in records if a.request_id in ended]
        wall = loop.time() - t0
        await monitor.stop()
        await cancel(polling)
        await poller.poll()  # the counters once everything has finished
    records.sort(key=lambda a: (a.request_id, a.attempt))
    return ReplayRun(
        plan, endpoint, records, poller.rows, poller.failed, monitor.report(), started_unix, wall, interrupted
    )


def _stop_interrupted(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel the requests still open, and let the run itself go on to close its books: `asyncio.run` then
    returns the partial run instead of raising KeyboardInterrupt (a second Ctrl-C still raises it)."""
    for task in tasks:
        task.cancel()
    current = asyncio.current_task()
    if current is not None:
        current.uncancel()


def replay(plan: Plan, cfg: ReplayConfig, rng: random.Random | None = None) -> ReplayRun:
    """Send the plan to the endpoint once; prompts are fresh random ids unless `rng` is given."""
    return asyncio.run(replay_async(plan, cfg, rng or random.Random()))
