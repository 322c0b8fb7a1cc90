"""The gateway's own latency (`gateway.latency_s`): a request's way through the gateway process and its proxy
hops. Every first token and end a client sees carries it once, it takes no engine time, every gateway
(simulated or live) predicts first tokens that late, and lone requests through a gateway and straight to
its backend measure it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import StreamingResponse
from starlette.routing import Route

from simadmit.admission.view import ReplicaLoad
from simadmit.calibrate.api_latency import measure_gateway_latency
from simadmit.calibrate.client import discover
from simadmit.config.loading import scenario_from_dict
from simadmit.config.schema import ScenarioSpec
from simadmit.sim.world import build_world
from simadmit.study.runner import run_scenario
from tests.fake_vllm import FakeVllm
from tests.helpers import ROOT
from tests.serve_fake import serving
from tests.serve_helpers import make_server
from tests.test_invariants import _small_doc

LATENCY = 0.04


def _spec(latency: float, policy: dict) -> ScenarioSpec:
    doc = _small_doc()
    doc["gateway"]["latency_s"] = latency
    doc["policies"] = [policy]
    return scenario_from_dict(doc, ROOT / "tests" / "small.yaml")


@pytest.mark.parametrize(
    "policy", [{"kind": "unconditional"}, {"kind": "gpu_seconds", "max_pool_gpu_seconds": 3}]
)
def test_clients_see_it_once_and_the_engines_never(policy: dict) -> None:
    """The same scenario and seed with and without the latency, under policies that do not predict first
    tokens: the same decisions and engine schedule, each answer's TTFT and E2E longer by exactly it."""
    base, late = (
        run_scenario(spec, build_world(spec, ROOT), keep_tables=True).requests
        for spec in (_spec(0.0, policy), _spec(LATENCY, policy))
    )
    for col in ("decision", "reason", "attempt_s", "admit_s", "scheduled_s", "replica"):
        assert base[col].equals(late[col]), col
    done = (base["outcome"] == "completed") & (base["decision"] == "admit")
    assert done.sum() > 100
    for col in ("ttft_s", "e2e_s"):
        assert np.allclose((late[col] - base[col])[done], LATENCY, rtol=0, atol=1e-9), col


def test_simulated_and_live_gateways_predict_first_tokens_that_late(tmp_path: Path) -> None:
    """Both build their engine models with `World.engine_models`: the latency is added once to every
    predicted first token, idle or busy, so a learned correction need not stand in for a fixed cost."""
    load = ReplicaLoad(running=6, prefill_tokens=300, max_seqs=8, kv_used=4000, kv_capacity=10**6)
    policy = {"kind": "predicted_ttft"}
    without, with_it = (build_world(_spec(x, policy), ROOT).engine_models()[0] for x in (0.0, LATENCY))
    assert with_it.ttft(load, 500, 100.0) - without.ttft(load, 500, 100.0) == pytest.approx(
        LATENCY, abs=1e-12
    )
    live = [make_server(tmp_path, ["http://127.0.0.1:9"], gateway__latency_s=x) for x in (0.0, LATENCY)]
    idle = ReplicaLoad(max_seqs=64)
    a, b = (s.gateway.views[0].engine for s in live)
    assert a is not None and b is not None
    assert b.ttft(idle, 10, 5.0) - a.ttft(idle, 10, 5.0) == pytest.approx(LATENCY, abs=1e-12)


def _slow_proxy(backend: str, delay_s: float) -> Starlette:
    """A stand-in gateway: holds each completion `delay_s`, then streams the backend's answer through."""
    client = httpx.AsyncClient(timeout=30)

    async def completions(request: HttpRequest) -> StreamingResponse:
        body = await request.body()
        await asyncio.sleep(delay_s)
        upstream = await client.send(
            client.build_request("POST", f"{backend}/v1/completions", content=body), stream=True
        )

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        return StreamingResponse(relay(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


HELD_S = 0.1
ENGINE_S = 0.2


def test_a_gateway_that_holds_requests_is_measured_by_what_it_holds(tmp_path: Path) -> None:
    """Through a proxy that holds each request 100 ms, in front of a backend whose engine clocks count 200 ms
    of each first token, the latency measured is the 100 ms and what one more loopback hop adds (the engine's
    time and the backend's own way out not counted); through the live gateway it is measured too, and is no
    more than such a hop."""

    async def measure(backend: str) -> tuple[float | None, float | None]:
        async with httpx.AsyncClient(timeout=30) as client:
            endpoint = await discover(client, backend, None)
            async with serving(_slow_proxy(backend, HELD_S)) as proxy:
                held = await measure_gateway_latency(client, endpoint, proxy, requests=6)
            async with serving(make_server(tmp_path, [backend]).app) as gateway:
                live = await measure_gateway_latency(client, endpoint, gateway, requests=6)
        return held, live

    with FakeVllm(prefill_s=ENGINE_S, outside_s=0.005) as server:
        held, live = asyncio.run(measure(server.url))
    assert held is not None and HELD_S <= held <= HELD_S + 0.08, held
    assert live is not None and 0.0 <= live < HELD_S, live
