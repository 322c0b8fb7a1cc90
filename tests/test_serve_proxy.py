"""The live gateway's request path against a fake vLLM: proxying, streaming, 429s, 400s, its own endpoints."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest

from tests.serve_fake import FakeVllm
from tests.serve_helpers import COST, PROMPT, completion, stack, until


def run(coro: object) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


def events(text: str) -> list[str]:
    return [line[6:] for line in text.split("\n") if line.startswith("data: ")]


def test_admitted_request_is_proxied_and_released(tmp_path: Path) -> None:
    """A request within budget reaches the backend, its answer comes back unchanged with the predicted wait,
    and once it is over nothing of it stays in the gateway's books."""

    async def main() -> None:
        fake = FakeVllm(output_tokens=3)
        async with stack(tmp_path, [fake]) as (server, client):
            r = await client.post("/v1/completions", json=completion())
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 3
            assert float(r.headers["x-queue-predict-wait"]) >= 0
            assert fake.bodies[0]["prompt"] == PROMPT and fake.bodies[0]["max_tokens"] == 100
            pool = server.pools[0]
            assert pool.own_requests == 0 and pool.own_gpu_s == 0
            assert pool.peak_own_gpu_s == pytest.approx(COST)

    run(main())


def test_missing_max_tokens_is_filled_with_the_tiers(tmp_path: Path) -> None:
    """Without max_tokens the request is charged, and capped at, its tier's max_tokens from the scenario."""

    async def main() -> None:
        fake = FakeVllm()
        async with stack(tmp_path, [fake]) as (server, client):
            r = await client.post("/v1/completions", json=completion(max_tokens=None))
            assert r.status_code == 200
            assert fake.bodies[0]["max_tokens"] == 100
            assert server.pools[0].peak_own_gpu_s == pytest.approx(COST)

    run(main())


@pytest.mark.parametrize("client_wants_usage", [False, True])
def test_stream_passes_through_and_teaches_the_learner(tmp_path: Path, client_wants_usage: bool) -> None:
    """A streamed chat answer arrives token by token; with learned estimates the gateway asks the backend
    for the usage chunk, learns the output length from it, and hides it from a client that did not ask."""

    async def main() -> None:
        fake = FakeVllm(output_tokens=4)
        async with stack(tmp_path, [fake], gateway__estimate_output="learned") as (server, client):
            body = {
                "model": "fake",
                "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": 50,
                "stream": True,
            }
            if client_wants_usage:
                body["stream_options"] = {"include_usage": True}
            for _ in range(3):
                r = await client.post("/v1/chat/completions", json=body)
                assert r.status_code == 200
                data = events(r.text)
                assert data[-1] == "[DONE]"
                tokens = [json.loads(d) for d in data[:-1] if json.loads(d)["choices"]]
                assert [t["choices"][0]["delta"]["content"] for t in tokens] == ["t0 ", "t1 ", "t2 ", "t3 "]
                usage = [json.loads(d) for d in data[:-1] if not json.loads(d)["choices"]]
                assert len(usage) == (1 if client_wants_usage else 0)
            assert all(b["stream_options"]["include_usage"] for b in fake.bodies)
            learner = server.gateway.learner
            assert learner is not None
            await until(lambda: learner.count.get("interactive", 0) == 3)
            assert learner.total["interactive"] == 12

    run(main())


def test_rejection_is_a_429_with_retry_after_and_predicted_wait(tmp_path: Path) -> None:
    """With 8 requests (8.08 GPU-s) held in flight, a ninth would pass 10 x 0.9 GPU-seconds: 429
    pool_headroom_exhausted, Retry-After in whole seconds, the predicted wait, and a JSON error body."""

    async def main() -> None:
        fake = FakeVllm()
        fake.hold()
        async with stack(tmp_path, [fake]) as (server, client):
            held = [asyncio.create_task(client.post("/v1/completions", json=completion())) for _ in range(8)]
            await until(lambda: fake.running == 8)
            r = await client.post("/v1/completions", json=completion())
            assert r.status_code == 429
            assert r.headers["retry-after"] == "1"  # (8.08 + 1.01 - 9) / 1 GPU, rounded up
            assert float(r.headers["x-queue-predict-wait"]) == pytest.approx(8 * COST, abs=1e-3)
            error = r.json()["error"]
            assert error["reason"] == "pool_headroom_exhausted" and error["tier"] == "interactive"
            fake.release()
            assert all(t.status_code == 200 for t in await asyncio.gather(*held))
            metrics = (await client.get("/metrics")).text
            assert (
                'simadmit_gateway_decisions_total{pool="pool",reason="admitted",tier="interactive"} 8.0'
                in metrics
            )
            assert 'reason="pool_headroom_exhausted",tier="interactive"} 1.0' in metrics

    run(main())


def test_tier_from_header_or_api_key(tmp_path: Path) -> None:
    """The tier header wins; else the API key's tier from the scenario; else the default (first) tier."""

    async def main() -> None:
        async with stack(tmp_path, [FakeVllm()]) as (_server, client):
            await client.post("/v1/completions", json=completion(), headers={"x-tier": "batch"})
            await client.post(
                "/v1/completions", json=completion(), headers={"authorization": "Bearer sk-batch"}
            )
            await client.post("/v1/completions", json=completion(), headers={"authorization": "Bearer other"})
            metrics = (await client.get("/metrics")).text
            assert 'reason="admitted",tier="batch"} 2.0' in metrics
            assert 'reason="admitted",tier="interactive"} 1.0' in metrics

    run(main())


@pytest.mark.parametrize("scheduling", ["fcfs", "priority"])
def test_a_priority_scheduling_pool_gets_each_requests_tier_priority(tmp_path: Path, scheduling: str) -> None:
    """Behind a pool that schedules by priority, the gateway sets each forwarded body's `priority` to its
    tier's (over whatever the client asked), as the simulated engine ranks it; behind FCFS it adds none."""

    async def main() -> None:
        fake = FakeVllm()
        engine = {"scheduling": scheduling, "tier_priority": {"batch": 1}}
        async with stack(tmp_path, [fake], pools__0__engine=engine) as (_server, client):
            await client.post("/v1/completions", json=completion(), headers={"x-tier": "batch"})
            await client.post("/v1/completions", json=completion(priority=-5), headers={"x-tier": "batch"})
            await client.post("/v1/completions", json=completion())
            sent = [b.get("priority") for b in fake.bodies]
            assert sent == ([1, 1, 0] if scheduling == "priority" else [None, -5, None])

    run(main())


BAD = [
    (b"{not json", {}, 400, "not valid JSON"),
    (b"[1, 2]", {}, 400, "JSON object"),
    (json.dumps({"model": "fake"}).encode(), {}, 400, "missing field 'prompt'"),
    (json.dumps(completion(max_tokens=-3)).encode(), {}, 400, "'max_tokens' must be a positive integer"),
    (json.dumps(completion(n=2)).encode(), {}, 400, "'n' must be 1"),
    (json.dumps(completion()).encode(), {"x-tier": "gold"}, 400, "unknown tier 'gold'"),
    (json.dumps(completion()).encode(), {"x-deadline-s": "soon"}, 400, "x-deadline-s must be a positive"),
    (
        json.dumps(completion()).encode(),
        {"x-retry-elapsed-s": "-1"},
        400,
        "x-retry-elapsed-s must be a non-neg",
    ),
    (json.dumps(completion(max_tokens=2040)).encode(), {}, 400, "exceeds the model's context of 2048"),
    (b"x" * 5_000_000, {}, 413, "exceeds the limit"),
]


def test_bad_requests_get_a_clear_4xx_and_leak_nothing(tmp_path: Path) -> None:
    """Malformed JSON, missing or wrong fields, an unknown tier, a bad deadline, a request longer than the
    context and an oversized body each get their own message; none reaches the backend or the books, and
    the gateway keeps serving."""

    async def main() -> None:
        fake = FakeVllm()
        async with stack(tmp_path, [fake]) as (server, client):
            for raw, headers, status, message in BAD:
                r = await client.post(
                    "/v1/completions", content=raw, headers={"content-type": "application/json", **headers}
                )
                assert r.status_code == status, (raw[:40], r.text)
                assert message in r.json()["error"]["message"]
            chat = await client.post("/v1/chat/completions", json={"model": "fake", "messages": []})
            assert chat.status_code == 400 and "messages" in chat.json()["error"]["message"]
            assert fake.bodies == []
            assert server.pools[0].own_requests == 0 and server.gateway.views[0].in_flight_gpu_s == 0
            assert (await client.post("/v1/completions", json=completion())).status_code == 200

    run(main())


def test_deadline_header_tightens_the_budget(tmp_path: Path) -> None:
    """A deadline shorter than the predicted wait gets would_exceed_sla where the tier's budget would admit."""

    async def main() -> None:
        fake = FakeVllm()
        fake.hold()
        async with stack(tmp_path, [fake], gateway__poll_interval_s=0) as (_server, client):
            first = asyncio.create_task(client.post("/v1/completions", json=completion()))
            await until(lambda: fake.running == 1)
            r = await client.post("/v1/completions", json=completion(), headers={"x-deadline-s": "0.5"})
            assert r.status_code == 429 and r.json()["error"]["reason"] == "would_exceed_sla"
            ok = asyncio.create_task(
                client.post("/v1/completions", json=completion(), headers={"x-deadline-s": "30"})
            )
            await until(lambda: fake.running == 2)
            fake.release()
            assert (await first).status_code == 200
            assert (await ok).status_code == 200

    run(main())


def test_health_models_and_metrics(tmp_path: Path) -> None:
    async def main() -> None:
        async with stack(tmp_path, [FakeVllm(), FakeVllm()]) as (_server, client):
            health = await client.get("/health")
            assert health.status_code == 200
            assert health.json()["pools"]["pool"] == {
                "backends": 2,
                "available": 2,
                "own_in_flight_requests": 0,
            }
            assert (await client.get("/v1/models")).json()["data"][0]["id"] == "fake"
            metrics = (await client.get("/metrics")).text
            for name in (
                "predicted_wait_seconds",
                "in_flight_gpu_seconds",
                "queue_wait_load",
                "backend_up",
                "available_gpus",
            ):
                assert f"simadmit_gateway_{name}" in metrics
            assert 'simadmit_gateway_available_gpus{pool="pool"} 2.0' in metrics

    run(main())


def test_unreachable_gateway_argument_is_one_line(tmp_path: Path) -> None:
    """`simadmit gateway` with no usable backend prints one line per problem and exits 2."""
    from typer.testing import CliRunner

    from simadmit.cli import app

    r = CliRunner().invoke(app, ["gateway", "--backend", "ftp://x", "--backend", "nopool=http://y"])
    assert r.exit_code == 2
    assert "must start with http://" in r.output and "no pool named 'nopool'" in r.output
    assert "Traceback" not in r.output


BAD_BACKENDS = [
    ("ftp://x", "--backend ftp://x: the URL must start with http://, https:// or dns+http://"),
    ("http://", "--backend: 'http://' is not an http(s) URL like http://host:8000"),
    (
        "http://127.0.0.1:99999",
        "--backend: 'http://127.0.0.1:99999': the port must be a number from 1 to 65535",
    ),
    ("dns+http://svc:http", "--backend: 'http://svc:http': the port must be a number from 1 to 65535"),
    ("http://h:8000 http://h:8000/", "--backend http://h:8000/: that backend is already given"),
    ("http://h:8000 http://h:8000/v1/", "--backend http://h:8000/v1/: that backend is already given"),
]


@pytest.mark.parametrize(("backend", "line"), BAD_BACKENDS, ids=[b for b, _ in BAD_BACKENDS])
def test_a_backend_url_that_cannot_be_reached_is_one_line_before_listening(backend: str, line: str) -> None:
    """A backend URL without a host or with a port out of range, or given twice (one server counted as two
    replicas), is refused before the gateway listens; the pool it was meant for is not reported again as
    having none."""
    from typer.testing import CliRunner

    from simadmit.cli import app

    with socket.socket() as busy:  # were the URL accepted, listening there fails rather than serving forever
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        backends = [a for b in backend.split() for a in ("--backend", b)]
        r = CliRunner().invoke(app, ["gateway", *backends, "--host", "127.0.0.1", "--port", port])
    assert r.exit_code == 2, r.output
    assert r.output.strip().splitlines() == [f"error: {line}"], r.output


def test_an_ipv6_host_in_brackets_is_the_address_inside_them() -> None:
    """`--host [::1]`, as an IPv6 address is written in a URL, listens on ::1 (it was looked up as a host
    name: "Name or service not known"); here the port is taken, so the gateway stops on that instead."""
    from typer.testing import CliRunner

    from simadmit.cli import app

    try:
        busy = socket.create_server(("::1", 0), family=socket.AF_INET6)
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with busy:
        port = str(busy.getsockname()[1])
        r = CliRunner().invoke(
            app, ["gateway", "--backend", "http://h:8000", "--host", "[::1]", "--port", port]
        )
    assert r.exit_code == 2, r.output
    assert f"--host ::1 --port {port}: cannot listen there (Address already in use)" in r.output, r.output


@pytest.mark.parametrize(
    ("backend", "root"),
    [("http://h:8000/v1/", "http://h:8000"), ("dns+http://svc:8000/v1", "dns+http://svc:8000")],
)
def test_a_backend_given_as_its_openai_base_url_is_its_server_root(backend: str, root: str) -> None:
    """`--backend http://host:8000/v1`, the base URL an OpenAI client takes, is the server at
    http://host:8000: the gateway adds /v1/completions and /metrics itself (it used to poll /v1/metrics,
    find the backend unavailable and refuse every request with a 429)."""
    from simadmit.config.loading import load_scenario
    from simadmit.config.resources import resolve_scenario
    from simadmit.serve.settings import assign_backends

    spec, _ = load_scenario(resolve_scenario(None), {}, workload_traces=False)  # the default: one pool
    assert assign_backends(spec, [backend]) == ((root,),)


def test_kubernetes_example_scenario_is_valid() -> None:
    """The scenario in deploy/kubernetes/gateway.yaml's ConfigMap loads (its profile mounted beside it)."""
    import yaml

    from simadmit.config.loading import scenario_from_dict

    root = Path(__file__).resolve().parents[1]
    docs = list(yaml.safe_load_all((root / "deploy/kubernetes/gateway.yaml").read_text()))
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap"]
    data = yaml.safe_load(config_map["data"]["scenario.yaml"])
    assert data["pools"][0]["profile"] == "/etc/simadmit/profile.yaml"
    data["pools"][0]["profile"] = "llama-3.1-8b-h100"  # the mounted file stands for a calibrated profile
    spec = scenario_from_dict(data, "gateway.yaml")
    assert spec.gateway.http.on_stale == "unavailable" and spec.gateway.poll_interval_s == 0.2
    deployment = [d for d in docs if d["kind"] == "Deployment"][0]
    assert "dns+http://vllm-pool" in " ".join(deployment["spec"]["template"]["spec"]["containers"][0]["args"])


def test_local_tokenizer_counts_without_a_round_trip(tmp_path: Path) -> None:
    """With gateway.http.tokenizer the prompt is counted in the gateway (here a word-level tokenizer: one
    token per word), chat messages with 4 tokens each for the template, and the backend's /tokenize is never
    called; a text prompt and a token-id prompt of the same length are charged the same."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tokenizer = Tokenizer(WordLevel({"[UNK]": 0, "one": 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()  # type: ignore[assignment]
    tokenizer.save(str(tmp_path / "tokenizer.json"))

    async def main() -> None:
        fake = FakeVllm()
        async with stack(tmp_path, [fake], gateway__http__tokenizer="tokenizer.json") as (server, client):
            assert (await client.post("/v1/completions", json=completion())).status_code == 200
            assert server.pools[0].peak_own_gpu_s == pytest.approx(COST)  # 10 tokens + 100 max_tokens
            chat = {"model": "fake", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 100}
            assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
            assert server.pools[0].peak_own_gpu_s == pytest.approx(COST + 0.004)  # + 4 template tokens
            assert fake.tokenized == 0

    run(main())
