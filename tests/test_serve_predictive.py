"""The live gateway running the predictive policy (`predicted_ttft`) against fake vLLM backends: the per-replica
loads it builds from the polled gauges and its own books, admission at an idle backend, refusals that grow
with the backlog vLLM reports or the prompts this gateway has in flight, and books that empty after a burst.

With the test profile (serve_helpers.PROFILE) a prompt token costs 1 ms of prefill and a step 1 ms plus 1 ms
per running sequence, so the predictions below can be worked out by hand."""

from __future__ import annotations

import asyncio
import math
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest

from simadmit.admission.predictive import PredictedTtft, decode_key
from simadmit.admission.view import prompt_attention_pairs
from simadmit.calibrate.metrics import EngineGauges
from simadmit.serve.app import GatewayServer
from simadmit.serve.backends import LivePool, Poll, parse_poll
from tests.serve_fake import FakeVllm
from tests.serve_helpers import completion, stack, until

BUDGET_S = 1.0  # both tiers' TTFT budget; the policy fills 0.7 of it (its margin)
PREDICTIVE: dict[str, Any] = {
    "policies": [
        {
            "kind": "predicted_ttft",
            "budgets_s": {"interactive": BUDGET_S, "batch": BUDGET_S},
            "e2e_budgets_s": {},
        }
    ],
    "gateway__http__stale_after_s": 60.0,  # a loaded machine must not turn a slow poll into a failure
}


def run(coro: object) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


def policy_of(server: GatewayServer) -> PredictedTtft:
    policy = server.gateway.policy
    assert isinstance(policy, PredictedTtft)
    return policy


# --- the replica load, without HTTP -------------------------------------------------------------------


def test_parse_poll_reads_kv_capacity_and_prompt_counter() -> None:
    text = "\n".join(
        [
            'vllm:num_requests_running{engine="0"} 3.0',
            'vllm:num_requests_waiting{engine="0"} 2.0',
            'vllm:kv_cache_usage_perc{engine="0"} 0.5',
            'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0',
            "# TYPE vllm:prompt_tokens counter",
            'vllm:prompt_tokens_total{engine="0",model_name="m"} 1234.0',
            'vllm:prompt_tokens_created{engine="0",model_name="m"} 1.7e9',
        ]
    )
    assert parse_poll(text) == Poll(EngineGauges(3.0, 2.0, 0.5), 1600, 1234)
    assert parse_poll('vllm:num_requests_running{engine="0"} 1.0\n') == Poll(EngineGauges(1.0, 0.0, 0.0))


@pytest.mark.parametrize(
    "text",
    [
        "<html><body>It works!</body></html>\n",  # a web server answering every path
        "# TYPE simadmit_gateway_requests_total counter\nsimadmit_gateway_requests_total 3.0\n",  # a gateway
        "",
    ],
    ids=["html", "another-gateway", "empty"],
)
def test_a_metrics_page_without_vllm_gauges_is_a_failed_poll(text: str) -> None:
    """A backend whose /metrics answers without vLLM's request gauges is not read as an idle engine (the
    gateway admitted to it blind, at every poll): the poll fails, and the backend goes stale."""
    with pytest.raises(ValueError, match="not a vLLM server's /metrics"):
        parse_poll(text)


def test_replica_load_is_own_unanswered_prompts_plus_others_waiting_at_the_mean_prompt() -> None:
    """3 own requests of 100, 300 and 200 tokens, the first answering: 2 pending with 500 prompt tokens.
    vLLM reports 4 running and 5 waiting: 3 of the waiting are other gateways', each priced at this gateway's
    mean prompt (200). KV capacity: the backend's published one, else the profile's."""
    pool = LivePool("p", ["http://a"], 1, 8, 1.0, "unavailable", kv_capacity_tokens=5000)
    (a,) = pool.backends
    for prompt in (100, 300, 200):
        pool.priced(1.0, prompt)
        pool.charge(a, "chat", 1.0, prompt)
    pool.answering(a, 100)
    pool.polled(a, Poll(EngineGauges(running=4, waiting=5, kv_usage=0.25), 0, 7000), now=2.0)
    (load,) = pool.snapshot(2.0).replicas
    assert pool.mean_prompt == pytest.approx(200.0)
    assert (load.running, load.waiting, load.max_seqs) == (4, 2 + 3, 8)
    assert load.prefill_tokens == 500 + 3 * 200
    own_pairs = prompt_attention_pairs(300) + prompt_attention_pairs(200)
    assert load.prefill_pairs == pytest.approx(own_pairs + 3 * pool.mean_pairs)
    assert (load.kv_capacity, load.kv_used) == (5000, 1250)
    others = 4 + 5 - 1 - 2  # running + waiting - own answering - own pending counted as waiting
    assert load.work_gpu_s == pytest.approx(3.0 + others * pool.mean_estimate)
    assert (load.prompt_tokens_total, load.polled_at) == (7000, 2.0)
    pool.polled(a, Poll(EngineGauges(4, 5, 0.25), kv_capacity=16000), now=2.1)
    assert pool.snapshot(2.1).replicas[0].kv_capacity == 16000

    pool.answering(a, 300)
    pool.release(a, "chat", 1.0, answered=False, prompt_tokens=200)  # gone before its first token
    assert (a.own_prefill_tokens, a.own_prefill_pairs) == (0, 0.0)
    pool.release(a, "chat", 1.0, answered=True, prompt_tokens=100)
    pool.release(a, "chat", 1.0, answered=True, prompt_tokens=300)
    assert (a.own_requests, a.own_answering, a.own_prefill_tokens, a.own_gpu_s) == (0, 0, 0, 0.0)


# --- through HTTP ---------------------------------------------------------------------------------------


def test_predicted_ttft_admits_at_an_idle_backend_and_refuses_a_backlog(tmp_path: Path) -> None:
    """(a) An idle backend: admitted and streamed through, the first token teaching the policy's correction.
    (b) Once the backend reports a full batch (64 of 64 running) and W waiting, a request must wait for
    W + 1 finishes, which 64 decoding sequences of the policy's prior mean output (256) give at 64/256 per
    step of ~65 ms: about 0.26 (W + 1) s, past the 0.7 s the budget allows. It is refused with 429,
    would_exceed_sla, Retry-After and X-Queue-Predict-Wait; the wait grows with W (W = 10 vs 40: 11 vs 41
    finishes). Once the backlog is gone, requests are admitted again."""

    async def main() -> None:
        fake = FakeVllm()
        async with stack(tmp_path, [fake], **PREDICTIVE) as (server, client):
            policy, backend = policy_of(server), server.pools[0].backends[0]
            r = await client.post("/v1/completions", json=completion(stream=True))
            assert r.status_code == 200 and r.text.count("data: {") == 5 and "[DONE]" in r.text
            assert float(r.headers["X-Queue-Predict-Wait"]) < 0.7 * BUDGET_S
            assert sum(policy.ratio.count.values()) == 1  # its first token was observed

            waits = []
            for backlog in (10, 40):
                fake.reported = (64.0, float(backlog))
                await until(lambda b=backlog: backend.gauges.waiting == b)
                r = await client.post("/v1/completions", json=completion())
                assert r.status_code == 429, r.text
                assert r.json()["error"]["reason"] == "would_exceed_sla"
                wait = float(r.headers["X-Queue-Predict-Wait"])
                assert wait == pytest.approx(r.json()["error"]["predicted_wait_s"], abs=1e-3)
                assert int(r.headers["Retry-After"]) >= math.floor(wait - 0.7 * BUDGET_S)
                assert 0.2 * (backlog + 1) < wait < 0.4 * (backlog + 1)
                waits.append(wait)
            assert 2.5 < waits[1] / waits[0] < 5.0  # 41 / 11 = 3.7 finishes to wait for
            assert fake.completed == 1  # nothing refused reached the backend

            fake.reported = None
            await until(lambda: backend.gauges.waiting == 0)
            assert (await client.post("/v1/completions", json=completion())).status_code == 200

    run(main())


def test_a_retry_counts_the_time_since_its_first_attempt_against_the_budget(tmp_path: Path) -> None:
    """As in the simulator, the TTFT budget runs from a request's first attempt: a retry whose client says
    (x-retry-elapsed-s) it has been trying for 1.2 s has spent the 1 s budget and is refused at an idle
    backend, where the same request as a first attempt (or 0.1 s in) is admitted."""

    async def main() -> None:
        fake = FakeVllm()
        async with stack(tmp_path, [fake], **PREDICTIVE) as (_server, client):
            late = await client.post(
                "/v1/completions", json=completion(), headers={"x-retry-elapsed-s": "1.2"}
            )
            assert late.status_code == 429 and late.json()["error"]["reason"] == "would_exceed_sla", late.text
            for headers in ({}, {"x-retry-elapsed-s": "0.1"}):
                assert (
                    await client.post("/v1/completions", json=completion(), headers=headers)
                ).status_code == 200
            assert fake.completed == 2

    run(main())


def test_own_prompts_in_flight_fill_the_budget(tmp_path: Path) -> None:
    """The backend holds every request (it reports them waiting): each 200-token prompt this gateway has in
    flight and unanswered adds 0.2 s of prefill ahead of the next, so after a few the next is refused, its
    predicted wait past the 0.7 s the budget allows; the books hold exactly the admitted prompts."""

    async def main() -> None:
        fake = FakeVllm()
        fake.hold()
        async with stack(tmp_path, [fake], **PREDICTIVE) as (server, client):
            backend = server.pools[0].backends[0]
            tasks: list[asyncio.Task[httpx.Response]] = []
            for i in range(20):
                tasks.append(
                    asyncio.create_task(client.post("/v1/completions", json=completion(prompt=[1] * 200)))
                )
                await until(lambda i=i: tasks[-1].done() or backend.own_requests == i + 1)
                if tasks[-1].done():
                    break
            refused = await tasks[-1]
            admitted = len(tasks) - 1
            assert refused.status_code == 429 and refused.json()["error"]["reason"] == "would_exceed_sla"
            assert float(refused.headers["X-Queue-Predict-Wait"]) > 0.7 * BUDGET_S
            assert 2 <= admitted <= 7  # 0.2 s each, the one in progress half done: 0.1 k + 0.2 s for the next
            assert backend.own_prefill_tokens == 200 * admitted
            fake.release()
            assert [(await t).status_code for t in tasks[:-1]] == [200] * admitted
            await until(lambda: backend.own_requests == 0)
            assert (backend.own_prefill_tokens, backend.own_prefill_pairs) == (0, 0.0)

    run(main())


def test_books_and_policy_state_empty_after_a_burst_with_clients_leaving(tmp_path: Path) -> None:
    """Two clients leave before their first token; then a burst of 40 (half streamed) against a held backend:
    some admitted, the rest refused. Once everything has ended nothing is left in flight: no request, no
    prompt tokens, no GPU-seconds, nothing pending in the policy; the first tokens taught its correction."""

    async def main() -> None:
        fake = FakeVllm()
        fake.hold()
        async with stack(tmp_path, [fake], **PREDICTIVE) as (server, client):
            pool, policy = server.pools[0], policy_of(server)
            (backend,) = pool.backends
            async with httpx.AsyncClient(base_url=str(client.base_url), timeout=0.5) as impatient:
                for _ in range(2):
                    with pytest.raises(httpx.ReadTimeout):
                        await impatient.post("/v1/completions", json=completion(prompt=[1] * 100))
            await until(lambda: pool.own_requests == 0 and fake.cancelled == 2)
            assert (backend.own_prefill_tokens, backend.own_prefill_pairs) == (0, 0.0)

            bodies = [completion(prompt=[1] * 100, stream=i % 2 == 0) for i in range(40)]
            tasks = [asyncio.create_task(client.post("/v1/completions", json=b)) for b in bodies]
            await until(lambda: sum(t.done() for t in tasks) + fake.running == len(tasks), timeout_s=30)
            admitted = fake.running
            assert 1 <= admitted < len(tasks) and backend.own_prefill_tokens == 100 * admitted
            fake.release()
            codes = [(await t).status_code for t in tasks]
            assert codes.count(200) == admitted and codes.count(429) == len(tasks) - admitted
            await until(lambda: pool.own_requests == 0)
            assert (backend.own_answering, backend.own_prefill_tokens, backend.own_prefill_pairs) == (
                0,
                0,
                0.0,
            )
            assert pool.own_gpu_s == 0.0 and policy.pending == {}
            assert sum(policy.ratio.count.values()) >= 1

    run(main())


def test_only_streamed_answers_teach_the_corrections(tmp_path: Path) -> None:
    """A whole (non-streamed) answer reaches the gateway at its end: it says nothing of when the first token
    came, nor of the time per token. Twelve of them, one after another at an idle backend, teach the policy
    nothing; twelve streamed ones each give a first token and a time per output token."""

    async def main() -> None:
        async with stack(tmp_path, [FakeVllm()], **PREDICTIVE) as (server, client):
            policy = policy_of(server)
            for _ in range(12):
                assert (await client.post("/v1/completions", json=completion())).status_code == 200
            await until(lambda: server.pools[0].own_requests == 0)
            assert sum(policy.ratio.count.values()) == 0 and sum(policy.decode_ratio.count.values()) == 0
            assert policy.pending == {} and policy.decoding == {}
            for _ in range(12):
                response = await client.post("/v1/completions", json=completion(stream=True))
                assert response.status_code == 200
            await until(lambda: server.pools[0].own_requests == 0)
            assert policy.ratio.count.get("interactive", 0) == 12
            assert policy.decode_ratio.count.get(decode_key(0), 0) == 12
            assert policy.pending == {} and policy.decoding == {}

    run(main())


# --- the command line -----------------------------------------------------------------------------------


def test_cli_starts_predicted_ttft_and_gpu_seconds_on_remaining_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--policy predicted_ttft` starts a gateway (the server itself is not run here), and so does a
    gpu_seconds policy on remaining work, which the live gateway counts from the tokens streamed back."""
    import uvicorn
    import yaml
    from typer.testing import CliRunner

    from simadmit.cli import app

    started: list[object] = []

    def run_server(served: uvicorn.Server, sockets: list[socket.socket]) -> None:
        started.append(served)
        for s in sockets:
            s.close()

    monkeypatch.setattr(uvicorn.Server, "run", run_server)
    with socket.socket() as free:  # a free port for the listening socket the command binds first
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    where = ["--host", "127.0.0.1", "--port", port, "--backend", "http://127.0.0.1:9"]
    r = CliRunner().invoke(app, ["gateway", "--policy", "predicted_ttft", *where])
    assert r.exit_code == 0 and "policy predicted_ttft" in r.output and len(started) == 1

    from tests.serve_helpers import PROFILE, SCENARIO

    (tmp_path / "fake.yaml").write_text(yaml.safe_dump(PROFILE))
    scenario = {**SCENARIO, "policies": [{"kind": "gpu_seconds", "work": "remaining"}]}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(scenario))
    r = CliRunner().invoke(app, ["gateway", "--scenario", str(tmp_path / "s.yaml"), *where])
    assert r.exit_code == 0 and "Traceback" not in r.output and len(started) == 2
