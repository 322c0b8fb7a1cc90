"""The live gateway shedding admitted requests whose deadline is lost, and counting remaining work, against
fake vLLM backends: the same `Gateway.lost` rule and `GpuSecondsOnRemaining` policy the simulator runs.

With the test profile (serve_helpers.PROFILE) a 10-token prompt with max_tokens 100 is charged 1.01
GPU-seconds, of which its prefill is 0.01 and each decoded token 0.01. Deadlines are a second or more, so
that a slow machine still gets each request to its backend before it is shed; timings are only asserted as
lower bounds (a request shed after its deadline has passed cannot be answered before it)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest

from simadmit.admission.estimator import CostEstimator
from simadmit.admission.policies import Request
from simadmit.admission.predictive import GpuSecondsOnRemaining
from simadmit.calibrate.metrics import EngineGauges
from simadmit.serve.app import GatewayServer
from simadmit.serve.backends import Flight, LivePool
from simadmit.serve.upstream import Exchange
from tests.serve_fake import FakeVllm
from tests.serve_helpers import COST, completion, make_server, stack, until

DEADLINE_S = 1.5
SHEDDING_GPU_SECONDS: dict[str, Any] = {"gateway__shed_lost_deadlines": True}
PREDICTIVE: dict[str, Any] = {  # sheds by its own default (shed_lost_deadlines: true)
    "policies": [
        {"kind": "predicted_ttft", "budgets_s": {"interactive": 5.0, "batch": 5.0}, "e2e_budgets_s": {}}
    ],
}
STALE_AFTER: dict[str, Any] = {"gateway__http__stale_after_s": 60.0}  # a slow poll is no failure here


def run(coro: object) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


def shed_count(server: GatewayServer, tier: str, reason: str) -> float:
    labels = {"pool": "pool", "tier": tier, "reason": reason}
    return server.metrics.registry.get_sample_value("simadmit_gateway_shed_total", labels) or 0.0


def assert_books_empty(server: GatewayServer) -> None:
    pool = server.pools[0]
    assert pool.own_requests == 0 and pool.own_gpu_s == 0.0 and pool.flights == {}
    assert pool.own_by_tier.get("interactive", 0.0) == 0.0


def test_remaining_work_is_the_charges_less_what_streamed_answers_worked_off() -> None:
    """Five own requests of 10 prompt tokens charged 1.01 each, the pool's estimator pricing a prompt token
    0.001 and an output token 0.01 GPU-seconds: a completion stream 30 tokens in has 0.70 left; a chat
    stream 31 events in (the first names the role) too; a request not streamed and a stream without its
    first token all of their charge; a stream past its charge nothing. vLLM holds one request beyond the
    gateway's own (4 running, 3 of them own answering), counted in full at the mean estimate."""
    pool = LivePool("p", ["http://a"], 1, 8, 1.0, "unavailable", estimator=CostEstimator(1000, 100))
    (a,) = pool.backends
    cases = [(True, True, 30, 0), (True, True, 31, 1), (False, False, 0, 0), (True, False, 0, 0)]
    cases.append((True, True, 500, 0))
    for rid, (stream, answering, events, preamble) in enumerate(cases):
        pool.priced(COST, 10)
        pool.charge(a, "chat", COST, 10)
        if answering:
            pool.answering(a, 10)
        exchange = cast(Exchange, SimpleNamespace(stream=stream, answering=answering, events=events))
        pool.flights[rid] = Flight(Request(rid, "chat", 10, 100, 0.0), a, COST, exchange, preamble)
    pool.polled(a, EngineGauges(running=4, waiting=0, kv_usage=0.1), now=1.0)
    snapshot = pool.snapshot(1.0)
    assert snapshot.in_flight_gpu_s == pytest.approx(5 * COST + COST)
    assert snapshot.remaining_gpu_s == pytest.approx(2 * 0.70 + 2 * COST + 0.0 + COST)
    assert [f.started for f in pool.flights.values()] == [True, True, True, False, True]
    pool.poll_failed(a, now=10.0, stale_after_s=1.0)  # a stale backend leaves the view, its work with it
    assert pool.snapshot(10.0).remaining_gpu_s == 0.0


@pytest.mark.parametrize("changes", [SHEDDING_GPU_SECONDS, PREDICTIVE], ids=["gpu_seconds", "predicted_ttft"])
def test_admitted_request_whose_deadline_is_lost_is_shed_and_aborted(
    tmp_path: Path, changes: dict[str, Any]
) -> None:
    """The backend holds every request. A stream waiting for its first token is shed once even alone its
    answer would be late: 503 `deadline_lost`, no Retry-After. A request not streamed shows no first token,
    so it is shed only once its deadline has passed: 503 `deadline_passed`, never before the deadline. Both
    backend requests are aborted, the books return to zero, the metric counts each by tier and reason, and
    neither counts as a backend failure. A request without a deadline is never shed."""

    async def main() -> None:
        fake = FakeVllm()
        fake.hold()
        async with stack(tmp_path, [fake], **changes, **STALE_AFTER) as (server, client):
            assert server.gateway.sheds
            headers = {"x-deadline-s": str(DEADLINE_S)}
            sent = server.now()
            streamed = asyncio.create_task(
                client.post("/v1/completions", json=completion(stream=True), headers=headers)
            )
            plain = asyncio.create_task(client.post("/v1/completions", json=completion(), headers=headers))
            free = asyncio.create_task(client.post("/v1/completions", json=completion(stream=True)))
            s, p = await streamed, await plain
            assert server.now() - sent >= DEADLINE_S  # the plain one waited for its deadline to pass
            assert s.status_code == 503 and p.status_code == 503
            assert "retry-after" not in s.headers and "retry-after" not in p.headers
            assert (
                s.json()["error"]["reason"] == "deadline_lost" and s.json()["error"]["tier"] == "interactive"
            )
            assert p.json()["error"]["reason"] == "deadline_passed"
            await until(lambda: fake.cancelled == 2)
            await until(lambda: server.pools[0].own_requests == 1)  # the one without a deadline
            assert shed_count(server, "interactive", "deadline_lost") == 1
            assert shed_count(server, "interactive", "deadline_passed") == 1
            assert "simadmit_gateway_upstream_failures_total{" not in (await client.get("/metrics")).text
            fake.release()
            r = await free
            assert r.status_code == 200 and r.text.count("data: {") == 5
            await until(lambda: server.pools[0].own_requests == 0)
            assert_books_empty(server)
            assert fake.completed == 1 and fake.cancelled == 2

    run(main())


def test_stream_answering_past_its_deadline_ends_with_an_error_event(tmp_path: Path) -> None:
    """A stream whose first tokens came back and which then stalls is shed once its deadline has passed
    (the running rule): its 200 has gone out, so it ends with a 503 `deadline_passed` error event."""

    async def main() -> None:
        fake = FakeVllm(output_tokens=50)
        fake.stall_after = 2
        async with stack(tmp_path, [fake], **SHEDDING_GPU_SECONDS, **STALE_AFTER) as (server, client):
            sent = server.now()
            r = await client.post(
                "/v1/completions", json=completion(stream=True), headers={"x-deadline-s": str(DEADLINE_S)}
            )
            assert server.now() - sent >= DEADLINE_S
            assert r.status_code == 200 and "t1 " in r.text and "[DONE]" not in r.text
            last = json.loads(r.text.strip().split("data: ")[-1])
            assert last["error"]["code"] == 503 and last["error"]["reason"] == "deadline_passed"
            await until(lambda: fake.cancelled == 1)
            await until(lambda: server.pools[0].own_requests == 0)
            assert_books_empty(server)
            assert shed_count(server, "interactive", "deadline_passed") == 1

    run(main())


@pytest.mark.parametrize(
    "changes",
    [{}, {**PREDICTIVE, "policies__0__shed_lost_deadlines": False}],
    ids=["gpu_seconds_default", "predicted_ttft_off"],
)
def test_without_shedding_nothing_is_shed(tmp_path: Path, changes: dict[str, Any]) -> None:
    """gpu_seconds never sheds unless the gateway says so, nor predicted_ttft with its switch off: a request
    held well past its deadline stays in flight and is answered in full once the backend lets it go."""

    async def main() -> None:
        fake = FakeVllm()
        fake.hold()
        async with stack(tmp_path, [fake], **changes, **STALE_AFTER) as (server, client):
            assert not server.gateway.sheds  # no watch on deadlines: nothing could be shed
            deadline = server.now() + 1.0
            held = asyncio.create_task(
                client.post("/v1/completions", json=completion(stream=True), headers={"x-deadline-s": "1.0"})
            )
            await until(lambda: fake.running == 1)
            await until(lambda: server.now() > deadline + 20 * server.poll_s)
            assert server.pools[0].own_requests == 1 and fake.cancelled == 0
            fake.release()
            r = await held
            assert r.status_code == 200 and r.text.count("data: {") == 5 and "[DONE]" in r.text
            for reason in ("deadline_lost", "deadline_passed"):
                assert shed_count(server, "interactive", reason) == 0

    run(main())


@pytest.mark.parametrize("work", ["admitted", "remaining"])
def test_remaining_work_admits_more_once_answers_have_streamed(tmp_path: Path, work: str) -> None:
    """10 x 0.9 = 9 GPU-seconds of room. Eight streams of 1.01 are admitted (8.08) and stall after 50 of
    their 100 tokens: each has worked off its prefill (0.01) and 50 tokens (0.50), so 8 x 0.50 = 4.0
    GPU-seconds remain, while the admitted work is still 8.08. A ninth request (8.08 + 1.01 > 9) is refused
    on admitted work, and admitted on remaining work (4.0 + 1.01 <= 9); the predicted wait it is told
    (X-Queue-Predict-Wait, and the gateway's gauge) is the work its policy counted, per GPU."""

    async def main() -> None:
        fake = FakeVllm(output_tokens=100)
        fake.stall_after = 50
        changes = {"policies__0__work": work, **STALE_AFTER}
        async with stack(tmp_path, [fake], **changes) as (server, client):
            assert isinstance(server.gateway.policy, GpuSecondsOnRemaining) == (work == "remaining")
            pool = server.pools[0]
            responses: list[httpx.Response] = []
            try:
                for _ in range(8):
                    request = client.build_request("POST", "/v1/completions", json=completion(stream=True))
                    responses.append(await client.send(request, stream=True))
                assert [r.status_code for r in responses] == [200] * 8
                await until(
                    lambda: (
                        len(pool.flights) == 8 and all(f.output_tokens == 50 for f in pool.flights.values())
                    )
                )
                view = server.gateway.views[0]
                await until(lambda: view.remaining_gpu_s == pytest.approx(8 * (COST - 0.51)))
                assert view.in_flight_gpu_s == pytest.approx(8 * COST)
                request = client.build_request("POST", "/v1/completions", json=completion(stream=True))
                ninth = await client.send(request, stream=True)
                responses.append(ninth)
                # the predicted wait the ninth is told, and the gauge, are the work the policy counted
                counted = 8 * (COST - 0.51) if work == "remaining" else 8 * COST
                assert float(ninth.headers["x-queue-predict-wait"]) == pytest.approx(counted, abs=1e-3)
                metrics = (await client.get("/metrics")).text
                gauge = 'simadmit_gateway_predicted_wait_seconds{pool="pool"} '
                (line,) = [x for x in metrics.splitlines() if x.startswith(gauge)]
                assert float(line.removeprefix(gauge)) == pytest.approx(counted, abs=1e-3)
                if work == "remaining":
                    assert ninth.status_code == 200
                else:
                    await ninth.aread()
                    assert ninth.status_code == 429
                    assert ninth.json()["error"]["reason"] == "pool_headroom_exhausted"
            finally:
                for r in responses:
                    await r.aclose()
            await until(lambda: pool.own_requests == 0)
            assert_books_empty(server)

    run(main())


def test_settings_take_remaining_work(tmp_path: Path) -> None:
    """`work: remaining` is no longer refused: the gateway runs the simulator's policy on remaining work."""
    server = make_server(tmp_path, ["http://127.0.0.1:9"], policies__0__work="remaining")
    assert isinstance(server.gateway.policy, GpuSecondsOnRemaining)
    assert server.pools[0].estimator is not None
