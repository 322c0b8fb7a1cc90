"""The open-loop load generator against a fake streaming server whose timings and 429s are known."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import httpx
import numpy as np
import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

from simadmit.cli import app
from simadmit.config.loading import load_scenario, scenario_from_dict
from simadmit.loadgen.plan import make_plan, request_bodies
from simadmit.loadgen.run import ReplayConfig, replay
from simadmit.loadgen.sender import rejection_reason
from simadmit.loadgen.tables import write_run
from simadmit.serve.app import error_body
from simadmit.workload.build import generate
from tests.fake_openai import fake_server
from tests.fake_vllm import FakeVllm
from tests.helpers import ROOT

PROFILE = str(ROOT / "calibration" / "smollm2-135m-cpu.yaml")


def scenario_doc(requests: int = 24, rate: float = 20.0, clients: dict | None = None) -> dict:
    return {
        "name": "small",
        "workload": {
            "seed": 5,
            "rate_rps": rate,
            "requests": requests,
            "tiers": [
                {
                    "name": "chat",
                    "share": 2,
                    "prompt_tokens": {"kind": "lognormal", "median": 40, "sigma": 0.5},
                    "output_tokens": {"kind": "fixed", "value": 6},
                    "max_tokens": 6,
                },
                {
                    "name": "bulk",
                    "share": 1,
                    "prompt_tokens": {"kind": "fixed", "value": 90},
                    "output_tokens": {"kind": "fixed", "value": 12},
                    "max_tokens": 12,
                },
            ],
        },  # fmt: skip
        "pools": [{"name": "cpu", "profile": PROFILE, "replicas": 1}],
        "clients": clients or {"max_retries": 0},
        "policies": [{"kind": "unconditional"}],
    }


def write_scenario(tmp_path: Path, doc: dict) -> Path:
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_replay_sends_every_request_on_schedule_and_writes_simulates_schema(tmp_path: Path) -> None:
    """Each request leaves at its scheduled time (never early; a slow server does not hold the next one
    back), asks for exactly its target output, and the table has every column `simulate` writes."""
    spec = scenario_from_dict(scenario_doc(), tmp_path / "s.yaml")
    plan = make_plan(spec, tmp_path)
    with fake_server(ttft_s=0.3, itl_s=0.01) as server:  # each request outlives several arrivals
        run = replay(plan, ReplayConfig(server.url), random.Random(1))
    write_run(run, spec, tmp_path, tmp_path / "out", "real")
    req = pd.read_parquet(tmp_path / "out" / "requests.parquet")
    sim_out = tmp_path / "sim"
    assert (
        CliRunner()
        .invoke(app, ["simulate", str(write_scenario(tmp_path, scenario_doc())), "--out", str(sim_out)])
        .exit_code
        == 0
    )
    simulated = pd.read_parquet(sim_out / "requests.parquet")
    assert list(simulated.columns) == [c for c in req.columns if c in simulated.columns]
    assert set(simulated.columns) <= set(req.columns)
    assert len(req) == len(plan.workload) and (req["outcome"] == "completed").all()
    assert (req["output_tokens"] == plan.target_output).all()
    lag = req["arrival_s"] - req["scheduled_send_s"]
    assert (lag >= 0).all()  # never early
    # Open loop: requests leave while earlier ones still wait for their 0.3 s answers (a closed loop would
    # hold each send back until the previous answer); the send lag itself depends on how busy the machine
    # is, so it is bounded only loosely, far below the 0.3 s per request a closed loop would pile up.
    sent, done = req["arrival_s"].to_numpy(), req["finish_s"].to_numpy()
    in_flight = [int(((sent < t) & (done > t)).sum()) for t in sent]
    assert max(in_flight) >= 2, in_flight
    assert lag.max() < 0.25 * 0.3 * len(req) + 0.2, lag.max()
    assert np.allclose(req["scheduled_send_s"], plan.scheduled_s)
    assert (req["ttft_s"] >= 0.3).all() and (req["e2e_s"] > req["ttft_s"]).all()
    itl = (req["finish_s"] - req["first_token_s"]) / (req["output_tokens"] - 1)
    assert 0.009 < itl.median() < 0.1  # the server's 10 ms per token; a loaded machine delays some reads
    series = pd.read_parquet(tmp_path / "out" / "timeseries.parquet")
    assert series["arrivals"].sum() == len(req) and {"queued", "running", "kv_usage"} <= set(series.columns)


@pytest.mark.parametrize("scheduling", ["fcfs", "priority"])
def test_each_request_carries_its_tiers_priority_to_a_priority_scheduling_pool(
    tmp_path: Path, scheduling: str
) -> None:
    """Under `scheduling: priority` every body sent carries its tier's `priority` (0 for a tier not listed),
    as the simulated engine ranks it; under FCFS none does (vLLM refuses a priority there)."""
    doc = scenario_doc()
    doc["pools"][0]["engine"] = {"scheduling": scheduling, "tier_priority": {"bulk": 2}}
    plan = make_plan(scenario_from_dict(doc, tmp_path / "s.yaml"), tmp_path)
    bodies = [json.loads(b) for b in request_bodies(plan, "m", None, random.Random(0))]
    tiers = [plan.workload.tier_names[t] for t in plan.workload.tier]
    assert {"chat", "bulk"} <= set(tiers)
    expected = [{"chat": 0, "bulk": 2}[t] if scheduling == "priority" else None for t in tiers]
    assert [b.get("priority") for b in bodies] == expected


@pytest.mark.parametrize("reason", ["would_exceed_e2e", "pool_exhausted"])
def test_the_replay_reads_the_reason_simadmits_gateway_gives(reason: str) -> None:
    """The gateway's 429 body is OpenAI's error object with `reason` beside its `type`: the replay's table
    must record the reason (what `compare` and the fidelity benchmarks break rejections down by), not the
    generic type every 429 carries."""
    body = json.dumps(error_body(429, "chat request rejected", reason=reason, tier="chat")).encode()
    assert rejection_reason(body) == reason
    assert rejection_reason(json.dumps({"reason": reason}).encode()) == reason
    assert rejection_reason(json.dumps(error_body(429, "no reason given")).encode()) == "rate_limit_exceeded"
    assert rejection_reason(b"<html>busy</html>") == "http_429"


def test_a_429_is_retried_after_retry_after_plus_backoff_as_the_client_says(tmp_path: Path) -> None:
    """Requests the server turns away once come back after Retry-After (0.2 s) + the backoff (0.1 s, no
    jitter), then complete, saying how long they have been trying (x-retry-elapsed-s, at least those 0.3 s;
    first attempts say nothing); with no retries allowed they end rejected, with the gateway's reason."""
    clients = {"max_retries": 2, "backoff": {"base_s": 0.1, "jitter": "none"}}
    spec = scenario_from_dict(scenario_doc(16, clients=clients), tmp_path / "s.yaml")
    with fake_server(reject_every=2) as server:
        run = replay(make_plan(spec, tmp_path), ReplayConfig(server.url), random.Random(2))
    req = write_run(run, spec, tmp_path, tmp_path / "a", "real") and pd.read_parquet(
        tmp_path / "a" / "requests.parquet"
    )
    retried = req[req["attempt"] == 2]
    assert len(retried) > 0
    first = req[req["attempt"] == 1].set_index("request_id")
    rejected = first.loc[retried["request_id"]]
    assert (rejected["decision"] == "reject").all() and (rejected["reason"] == "would_exceed_sla").all()
    assert (rejected["retry_after_s"] == 0.2).all()
    gap = retried.set_index("request_id")["attempt_s"] - rejected["admit_s"].fillna(rejected["attempt_s"])
    assert (gap >= 0.3 - 1e-3).all()
    assert (req.groupby("request_id")["outcome"].first() == "completed").all()
    said = [float(e) for e in server.elapsed if e is not None]
    assert server.elapsed.count(None) == 16 and len(said) == len(retried)
    assert all(0.3 - 1e-3 <= s < 0.3 + 1.0 for s in said)

    strict = scenario_from_dict(scenario_doc(16), tmp_path / "s.yaml")
    with fake_server(reject_every=2) as server:
        run = replay(make_plan(strict, tmp_path), ReplayConfig(server.url), random.Random(3))
    req = write_run(run, strict, tmp_path, tmp_path / "b", "real") and pd.read_parquet(
        tmp_path / "b" / "requests.parquet"
    )
    even = req["prompt_tokens"] % 2 == 0
    assert (req.loc[even, "outcome"] == "rejected").all() and (req.loc[~even, "outcome"] == "completed").all()
    assert req["attempt"].max() == 1


def test_the_sent_trace_replays_exactly_the_requests_sent(tmp_path: Path) -> None:
    """`replayed.yaml` is a valid scenario whose workload is the request list as sent: same lengths,
    same tiers, arrival times those the client really sent at (from the first one)."""
    spec = scenario_from_dict(scenario_doc(), tmp_path / "s.yaml")
    with fake_server() as server:
        run = replay(make_plan(spec, tmp_path), ReplayConfig(server.url), random.Random(4))
    write_run(run, spec, tmp_path, tmp_path / "out", "real")
    req = pd.read_parquet(tmp_path / "out" / "requests.parquet")
    again, _ = load_scenario(tmp_path / "out" / "replayed.yaml")
    w = generate(again.workload)
    assert w.tier_names == ("chat", "bulk")
    assert np.allclose(w.arrival, req["arrival_s"] - req["arrival_s"].min(), atol=1e-6)
    assert (w.prompt == req["prompt_tokens"]).all() and (w.output == req["max_tokens"]).all()
    assert (w.max_tokens == w.output).all()
    assert [w.tier_names[t] for t in w.tier] == req["tier"].astype(str).tolist()


def test_cli_refuses_a_folder_that_holds_a_run_and_an_unreachable_endpoint(tmp_path: Path) -> None:
    scenario = write_scenario(tmp_path, scenario_doc(4))
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "requests.parquet").write_bytes(b"old")
    runner = CliRunner()
    used = runner.invoke(
        app, ["replay", str(scenario), "--endpoint", "http://127.0.0.1:9", "--out", str(tmp_path / "used")]
    )
    assert used.exit_code == 2 and "already holds a run" in used.output
    assert (tmp_path / "used" / "requests.parquet").read_bytes() == b"old"
    down = runner.invoke(
        app, ["replay", str(scenario), "--endpoint", "http://127.0.0.1:9", "--out", str(tmp_path / "new")]
    )
    assert down.exit_code == 2 and "connection refused" in down.output, down.output
    assert not (tmp_path / "new" / "requests.parquet").exists()


@pytest.mark.parametrize("repeat", [2])
def test_cli_repeats_into_numbered_folders_with_the_same_request_list(tmp_path: Path, repeat: int) -> None:
    scenario = write_scenario(tmp_path, scenario_doc(8))
    with fake_server() as server:
        result = CliRunner().invoke(
            app,
            [
                "replay",
                str(scenario),
                "--endpoint",
                server.url,
                "--out",
                str(tmp_path / "r"),
                "--repeat",
                str(repeat),
            ],
        )
    assert result.exit_code == 0, result.output
    tables = [pd.read_parquet(tmp_path / "r" / f"repeat-{k}" / "requests.parquet") for k in (1, 2)]
    for col in ("scheduled_send_s", "prompt_tokens", "max_tokens"):
        assert tables[0][col].tolist() == tables[1][col].tolist()
    assert "send lag p50" in result.output


def test_a_client_that_waits_too_long_for_its_first_token_abandons(tmp_path: Path) -> None:
    """With `abandon_after_s` shorter than the server's time to first token, every request is abandoned
    (the connection is closed, which makes vLLM abort it) and none has a latency."""
    spec = scenario_from_dict(
        scenario_doc(6, clients={"max_retries": 0, "abandon_after_s": 0.2}), tmp_path / "s.yaml"
    )
    with fake_server(ttft_s=1.0) as server:
        run = replay(make_plan(spec, tmp_path), ReplayConfig(server.url), random.Random(5))
    assert {a.result.status for a in run.attempts} == {"abandoned"}
    write_run(run, spec, tmp_path, tmp_path / "out", "real")
    req = pd.read_parquet(tmp_path / "out" / "requests.parquet")
    assert (req["outcome"] == "abandoned").all() and req["ttft_s"].isna().all()


def test_metrics_counters_are_summed_over_engines_and_missing_ones_are_nan() -> None:
    from simadmit.loadgen.metrics import counter_totals

    text = (
        "# TYPE vllm:request_queue_time_seconds histogram\n"
        'vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 1.5\n'
        'vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 3\n'
        'vllm:request_queue_time_seconds_sum{engine="1",model_name="m"} 0.5\n'
        'vllm:request_queue_time_seconds_count{engine="1",model_name="m"} 1\n'
        'vllm:num_preemptions_total{engine="0",model_name="m"} 2\n'
    )
    totals = counter_totals(text)
    assert totals["queue_time_sum_s"] == 2.0 and totals["queue_time_count"] == 4
    assert totals["preemptions_total"] == 2 and np.isnan(totals["generation_tokens_total"])


def test_a_metrics_page_that_is_not_vllms_leaves_the_replay_series_empty() -> None:
    """Replaying through a gateway without --server polls the gateway's own /metrics: its samples are not an
    idle engine's zeros in timeseries.parquet but failed polls (the series stays empty, as for no /metrics)."""
    from simadmit.loadgen.metrics import MetricsPoller

    page = "# TYPE simadmit_gateway_decisions counter\nsimadmit_gateway_decisions_total 3.0\n"
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text=page))

    async def poll_once() -> MetricsPoller:
        async with httpx.AsyncClient(transport=transport) as client:
            poller = MetricsPoller(client, "http://gateway:9000", asyncio.get_running_loop().time())
            await poller.poll()
            return poller

    poller = asyncio.run(poll_once())
    assert poller.rows == [] and poller.failed == 1


def test_stream_lines_split_on_newline_bytes_only() -> None:
    """A JSON payload holding a raw Unicode line separator stays whole; an unfinished line waits for more bytes."""
    from simadmit.calibrate.client import sse_payloads

    text = '{"choices": [{"text": "a\u2028b"}]}'.encode()
    payloads, rest = sse_payloads(b"data: " + text + b'\n\n: keep-alive\ndata: [DONE]\ndata: {"us')
    assert payloads == [text, b"[DONE]"] and rest == b'data: {"us'


def test_attempts_go_to_several_endpoints_in_turn(tmp_path: Path) -> None:
    """With two endpoints (gateway replicas behind a round-robin balancer) the attempts alternate between
    them, and the table's `gateway` column says which one took each."""
    scenario = write_scenario(tmp_path, scenario_doc(20))
    with fake_server() as a, fake_server() as b:
        args = ["replay", str(scenario), "--endpoint", a.url, "--endpoint", b.url, "--server", b.url]
        result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "out")])
        served = (a.completions, b.completions)
    assert result.exit_code == 0, result.output
    req = pd.read_parquet(tmp_path / "out" / "requests.parquet")
    assert served == (10, 10)
    assert sorted(req["gateway"].value_counts().to_dict().items()) == [(0, 10), (1, 10)]
    assert (req["outcome"] == "completed").all() and req["predicted_wait_s"].isna().all()


@pytest.mark.parametrize("option", ["--endpoint", "--server"])
def test_a_second_url_that_refuses_connections_stops_the_replay_before_it_sends(
    tmp_path: Path, option: str
) -> None:
    """A mistyped second gateway replica, or server behind the gateways, is one line naming its option and
    exit 2 before any request leaves: not a run in which every other attempt failed to connect, nor one
    without the server's metrics."""
    scenario = write_scenario(tmp_path, scenario_doc(8))
    with fake_server() as a:
        args = ["replay", str(scenario), "--endpoint", a.url, option, "http://127.0.0.1:9"]
        result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "out")])
        sent = a.completions
    assert result.exit_code == 2, result.output
    assert f"{option}: http://127.0.0.1:9: connection refused" in result.output
    assert sent == 0 and not (tmp_path / "out").exists()


def test_a_replay_that_no_request_got_an_answer_from_exits_1_keeping_the_run(tmp_path: Path) -> None:
    """An endpoint that lists a model but fails every completion (here HTTP 500): one line saying nothing
    was answered and why, exit 1 and no further repeats, and the failed run kept as it was measured."""
    scenario = write_scenario(tmp_path, scenario_doc(4))
    with FakeVllm(then="error") as server:
        args = ["replay", str(scenario), "--endpoint", server.url, "--repeat", "2"]
        result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "out")])
    assert result.exit_code == 1, result.output
    assert (
        f"repeat-1: no request was answered (4 http_500): is {server.url} an OpenAI-compatible"
        in " ".join(result.output.split())
    )
    assert len(pd.read_parquet(tmp_path / "out" / "repeat-1" / "requests.parquet")) == 4
    assert not (tmp_path / "out" / "repeat-2").exists()


ODD_STREAMS = [
    b"data: 42\n\ndata: [DONE]\n\n",
    b'data: ["error"]\n\ndata: [DONE]\n\n',
    b'data: {"choices": [{"text": "x"}], "usage": [1]}\n\ndata: [DONE]\n\n',
    b'data: {"choices": [{"text": "x"}]}\n\ndata: {"usage": {"prompt_tokens": "many"}}\n\ndata: [DONE]\n\n',
]


@pytest.mark.parametrize("stream", ODD_STREAMS, ids=["number", "list", "usage-list", "usage-text"])
def test_a_server_streaming_what_vllm_never_sends_fails_the_attempt_not_the_run(stream: bytes) -> None:
    """JSON that is not an event object, or token counts that are not numbers: the attempt is `dropped`,
    as a cut stream is, instead of an exception that would end the replay and lose what it measured."""
    from simadmit.loadgen.sender import encode_body, send

    async def attempt() -> str:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=stream))
        async with httpx.AsyncClient(transport=transport) as client:
            return (await send(client, "http://fake/v1/completions", encode_body("m", [1], 1), 5.0)).status

    assert asyncio.run(attempt()) == "dropped"


def test_a_models_list_beside_odd_version_and_tokenize_answers_is_still_an_endpoint() -> None:
    """`/version` answering a list and `/tokenize` answering words are a server unlike vLLM: its version is
    unknown and it has no tokenizer to use, rather than a traceback."""
    from simadmit.calibrate.client import discover, tokenize

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m", "max_model_len": 64}]})
        return httpx.Response(200, json=[1] if request.url.path == "/version" else {"tokens": ["a"]})

    async def ask() -> tuple[str, list[int] | None]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            endpoint = await discover(client, "http://fake", None)
            return endpoint.vllm_version, await tokenize(client, endpoint, "hello")

    assert asyncio.run(ask()) == ("unknown", None)


def test_a_key_in_the_endpoint_url_is_not_written_down(tmp_path: Path) -> None:
    """An endpoint given as `http://user:key@host` sends its credentials, but the run's folder names the
    endpoint without them: a key does not travel with results that are shared."""
    spec = scenario_from_dict(scenario_doc(), tmp_path / "s.yaml")
    with fake_server(ttft_s=0.01, itl_s=0.001) as server:
        url = server.url.replace("http://", "http://user:sk-secret-3@")
        run = replay(make_plan(spec, tmp_path), ReplayConfig(url), random.Random(6))
    write_run(run, spec, tmp_path, tmp_path / "out", "real")
    facts = json.loads((tmp_path / "out" / "replay.json").read_text())
    assert facts["endpoint"] == server.url
    for path in (tmp_path / "out").iterdir():
        assert b"sk-secret-3" not in path.read_bytes(), path.name
