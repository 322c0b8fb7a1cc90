"""Faults during a calibration: 5xx, dropped streams and time-outs are retried, counted and logged; the run
goes on; a wrong request (4xx) or an endpoint that keeps failing stops it with what was measured kept.

The server here is an in-process httpx transport that answers like vLLM's completions stream, scripted to
fail in a given order, so each fault happens exactly when the test says.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest

from simadmit.calibrate.client import Endpoint, completion_body, token_arrivals
from simadmit.calibrate.measurements import MeasurementLog, read_measurements
from simadmit.calibrate.overhead import OverheadMonitor
from simadmit.calibrate.phases import Cell, EndpointLost, Runner, RunnerSettings, in_rounds
from simadmit.calibrate.prompts import PromptMaker
from simadmit.config.errors import InputError

ENDPOINT = Endpoint("http://fake", "m", 2048, "test")
SETTINGS = RunnerSettings(max_retries=3, request_timeout_s=0.3, give_up_after_failures=20, backoff_s=0.001)
CELL = Cell("decode", 1, (4,), 3, budget_s=0.0, min_requests=1)


async def _events(tokens: int, complete: bool) -> AsyncIterator[bytes]:
    for i in range(tokens):
        chunk = {"choices": [{"index": 0, "text": f" t{i}\u2028", "finish_reason": None}]}
        yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode()
        await asyncio.sleep(0.001)
    if complete:
        usage = {"prompt_tokens": 4, "completion_tokens": tokens, "total_tokens": 4 + tokens}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode()


def scripted(script: list[str]) -> Callable[[httpx.Request], object]:
    """A handler answering the n-th completion per script[n]: ok, 503, drop, hang or 400."""
    calls = iter(script)

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        kind = next(calls)
        if kind == "503":
            return httpx.Response(503, text="overloaded")
        if kind == "400":
            return httpx.Response(400, text="prompt too long")
        if kind == "hang":
            await asyncio.sleep(5)
        return httpx.Response(200, content=_events(body["max_tokens"], complete=kind == "ok"))

    return handler


async def run(script: list[str], path: Path, cells: list[Cell]) -> Runner:
    """Run the cells against the scripted server, logging to `path`."""
    async with httpx.AsyncClient(transport=httpx.MockTransport(scripted(script))) as client:
        with MeasurementLog(path) as log:
            prompts = PromptMaker(list(range(100, 200)), random.Random(0))
            runner = Runner(client, ENDPOINT, prompts, log, [], OverheadMonitor(), SETTINGS)
            for cell in cells:
                await runner.run_cell(cell)
    return runner


def test_each_fault_is_retried_counted_and_logged(tmp_path: Path) -> None:
    """503, a stream cut before [DONE], a hang past the time-out, then success: four rows for one request,
    the faults counted by kind, and the final row a clean measurement of three tokens."""
    path = tmp_path / "m.csv"
    runner = asyncio.run(run(["503", "drop", "hang", "ok"], path, [CELL]))
    rows = read_measurements(path)
    assert [(r.seq, r.attempt, r.status) for r in rows] == [
        (0, 1, "http_503"),
        (0, 2, "dropped"),
        (0, 3, "timeout"),
        (0, 4, "ok"),
    ]
    assert dict(runner.stats.faults) == {"http_503": 1, "dropped": 1, "timeout": 1}
    assert (runner.stats.completed, runner.stats.gave_up) == (1, 0)
    ok = rows[-1]
    assert (ok.prompt_tokens, ok.output_tokens, ok.n_chunks) == (4, 3, 3)
    assert 0 < ok.ttft_s <= ok.e2e_s
    assert len(ok.token_times_s) == 3 and ok.token_times_s[0] == pytest.approx(ok.ttft_s, abs=1e-4)
    assert list(ok.token_times_s) == sorted(ok.token_times_s)


@pytest.mark.parametrize(
    ("made", "output", "arrivals"),
    [
        ([None, None, None], 3, (0.1, 0.2, 0.3)),  # one token per event: no count needed
        ([1, 3, 4], 4, (0.1, 0.2, 0.2, 0.3)),  # the second event carried two tokens
        ([None, None, None], 4, ()),  # four tokens in three events, no count says where: unknown
        ([1, 3, 5], 4, ()),  # the counts do not add up to the answer's tokens
    ],
)
def test_each_token_arrives_with_the_event_that_carried_it(
    made: list[object], output: int, arrivals: tuple[float, ...]
) -> None:
    assert token_arrivals([0.1, 0.2, 0.3], made, output) == arrivals


def test_calibration_requests_ask_for_a_token_count_in_every_event() -> None:
    options = completion_body("m", [1, 2], 8, usage_per_event=True)["stream_options"]
    assert options == {"include_usage": True, "continuous_usage_stats": True}
    assert completion_body("m", [1, 2], 8)["stream_options"] == {"include_usage": True}


def test_a_request_that_keeps_failing_is_given_up_and_the_run_goes_on(tmp_path: Path) -> None:
    """After 1 + max_retries failed attempts the request is abandoned and the next cell still runs."""
    path = tmp_path / "m.csv"
    runner = asyncio.run(run(["503"] * 4 + ["ok"], path, [CELL, Cell("decode", 2, (4,), 3, 0.0, 1)]))
    assert runner.stats.gave_up == 1 and runner.stats.completed == 1
    assert [r.status for r in read_measurements(path)] == ["http_503"] * 4 + ["ok"]


def test_an_endpoint_that_keeps_failing_stops_the_run(tmp_path: Path) -> None:
    path = tmp_path / "m.csv"
    cells = [Cell("decode", 1, (4,), 3, 0.0, 10)]
    with pytest.raises(EndpointLost):
        asyncio.run(run(["503"] * 25, path, cells))
    assert len(read_measurements(path)) == SETTINGS.give_up_after_failures  # all kept


def test_a_rejected_request_is_the_users_problem(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="HTTP 400: prompt too long"):
        asyncio.run(run(["400"], tmp_path / "m.csv", [CELL]))


def test_rounds_share_each_cell_s_time(tmp_path: Path) -> None:
    """A cell run in two rounds spends its time once, not once per round: the second round finds the first's
    requests done and takes only what is left (the first's overshoot, a request's drain, counts against it),
    and its requests carry on the first's sequence numbers."""
    cell = Cell("decode", 1, (4,), 3, budget_s=0.4, min_requests=2)
    path = tmp_path / "m.csv"
    rounds = in_rounds([cell], rounds=2)
    assert [(c.budget_s, c.min_requests) for c in rounds] == [(0.2, 1), (0.4, 2)]
    asyncio.run(run(["ok"] * 100_000, path, rounds))
    rows = read_measurements(path)
    assert [r.seq for r in rows] == list(range(len(rows)))
    spent = sum(r.e2e_s for r in rows)
    longest = max(r.e2e_s for r in rows)
    # each round's time is the wall clock (requests and the client's gaps between them), so the requests'
    # own time is a little less: more than the first round's share, never past the whole cell's (0.6 s when
    # the second round ran its 0.4 s again)
    assert 0.2 < spent <= 0.4 + longest, (spent, longest)
    # each row names its round: the first round's rows all started within its share of the time (which
    # began at or before the first request), before any of the second's
    starts = {k: [r.start_unix_s for r in rows if r.round == k] for k in (1, 2)}
    assert starts[1] and starts[2] and len(starts[1]) + len(starts[2]) == len(rows)
    assert max(starts[1]) < min(starts[2]) and max(starts[1]) < rows[0].start_unix_s + 0.2
