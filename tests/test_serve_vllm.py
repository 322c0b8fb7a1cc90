"""The live gateway in front of a real vLLM CPU server (SmolLM2-135M; see tests/vllm_server.py): the routes,
/tokenize, the streaming format and the /metrics gauges are vLLM's own, not a fake's.

Admission here is deterministic whatever the CPU does: the pool budget is set so that exactly a known
number of requests fit, and requests are held in flight by their length, so no check depends on timings.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import yaml

from simadmit.config.loading import scenario_from_dict
from simadmit.serve.app import GatewayServer
from simadmit.serve.settings import serve_settings
from tests.serve_fake import serving
from tests.serve_helpers import until
from tests.vllm_server import VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[1]


def gateway_for(server: VllmServer, tmp_path: Path, max_pool: float) -> GatewayServer:
    scenario = {
        "workload": {
            "rate_rps": 1,
            "duration_s": 1,
            "tiers": [{"name": "chat", "prompt_tokens": {"kind": "fixed", "value": 16},
                       "output_tokens": {"kind": "fixed", "value": 8}, "max_tokens": 64}],
        },
        "pools": [{"name": "cpu", "profile": str(ROOT / "calibration/smollm2-135m-cpu.yaml"), "replicas": 1}],
        # The engine shares the machine's cores with the tests, and vLLM's API server has gone silent for over
        # 3 s under that load (a CI run cut the two running requests off as stale): staleness is not what this
        # test checks (test_serve_reliability does), so a slow poll must not count as a dead backend here.
        "gateway": {"poll_interval_s": 0.2, "estimate_output": "learned", "http": {"stale_after_s": 60.0}},
        "policies": [{"kind": "gpu_seconds", "budgets_s": {"chat": 1000.0}, "headroom": 1.0,
                      "max_pool_gpu_seconds": max_pool}],
    }  # fmt: skip
    (tmp_path / "scenario.yaml").write_text(yaml.safe_dump(scenario))
    spec = scenario_from_dict(scenario, tmp_path / "scenario.yaml")
    return GatewayServer(serve_settings(spec, tmp_path, [server.url], None))


def test_gateway_in_front_of_vllm(vllm_server: VllmServer, tmp_path: Path) -> None:
    """A chat request streams through with vLLM's tokens and its prompt counted by vLLM's /tokenize; the
    view takes vLLM's running-request gauge; with room for exactly two requests of 256 output tokens
    (the pool budget is two and a half times what the profile charges one), a third is refused with a 429
    while the two run, and everything is released once they finish."""
    one = gateway_for(vllm_server, tmp_path, max_pool=1.0).gateway.estimators[0].estimate(32, 256)
    gw = gateway_for(vllm_server, tmp_path, max_pool=2.5 * one)
    estimate = gw.gateway.estimators[0]

    async def main() -> None:
        async with serving(gw.app) as url, httpx.AsyncClient(base_url=url, timeout=300) as client:
            await until(lambda: gw.pools[0].backends[0].polled_ok_at > -1, timeout_s=30)
            body = {"model": vllm_server.model, "messages": [{"role": "user", "content": "Say hello."}],
                    "max_tokens": 8, "stream": True}  # fmt: skip
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200
            events = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and all(json.loads(e)["choices"] for e in events[:-1])
            learner = gw.gateway.learner
            assert learner is not None and learner.count["chat"] == 1 and 1 <= learner.total["chat"] <= 8

            long = {
                "model": vllm_server.model,
                "prompt": list(range(100, 132)),
                "max_tokens": 256,
                "ignore_eos": True,
            }
            running = [asyncio.create_task(client.post("/v1/completions", json=long)) for _ in range(2)]
            await until(lambda: gw.pools[0].own_requests == 2, timeout_s=60)
            assert gw.pools[0].own_gpu_s == pytest.approx(2 * estimate.estimate(32, 256))
            refused = await client.post("/v1/completions", json=long)
            assert (
                refused.status_code == 429 and refused.json()["error"]["reason"] == "pool_headroom_exhausted"
            )
            await until(lambda: gw.pools[0].backends[0].gauges.running >= 1, timeout_s=60)
            for t in running:
                r = await t
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 256
            await until(lambda: gw.pools[0].own_requests == 0)
            metrics = (await client.get("/metrics")).text
            assert 'simadmit_gateway_decisions_total{pool="cpu",reason="admitted",tier="chat"} 3.0' in metrics

    asyncio.run(main())
