"""One attempt of one request: a streamed completion, timed at the three instants the tables need.

The body is encoded before the run starts, so sending costs the event loop nothing but the write. The byte
stream is split on b"\\n" by hand (httpx's `aiter_lines` also splits on Unicode line separators that vLLM
leaves raw inside its JSON) and only the first data line and the `usage` record are parsed: a token costs a
`find`, not a JSON decode. Token counts come from `usage`, since several tokens can share a chunk under load.
A 429 is an answer, not a failure: its Retry-After (seconds, as the header says) goes back to the caller,
whose `Client` decides whether and when to try again.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass

import httpx

from simadmit.calibrate.client import EventStream, completion_body, stream_event
from simadmit.config.defaults import RETRY_ELAPSED_HEADER

# what an attempt came to; "ok" and "rejected" are answers, the rest are failures
OK, REJECTED, TOO_LONG, ABANDONED = "ok", "rejected", "too_long", "abandoned"


@dataclass(frozen=True, slots=True)
class AttemptResult:
    """Times are the event loop's clock (seconds); NaN for what the attempt did not reach."""

    status: str  # ok | rejected | too_long | abandoned | timeout | connect | dropped | http_<code>
    sent: float
    answered: float  # response headers received
    first_token: float
    finish: float
    prompt_tokens: int  # as the server counted them (0 when it did not say)
    output_tokens: int
    retry_after_s: float  # a 429's Retry-After, NaN otherwise
    reason: str  # "admitted", or what the server gave as the cause of a rejection or failure
    predicted_wait_s: float = math.nan  # a gateway's X-Queue-Predict-Wait: its view's in-flight work per GPU


def encode_body(model: str, prompt: list[int] | str, max_tokens: int, priority: int | None = None) -> bytes:
    """The request body: exact prompt, exactly `max_tokens` generated (ignore_eos), streamed with usage; with
    `priority`, vLLM's scheduling priority (for a server run with `--scheduling-policy priority`)."""
    body = completion_body(model, prompt, max_tokens) | ({} if priority is None else {"priority": priority})
    return json.dumps(body, separators=(",", ":")).encode()


def header_seconds(value: str | None) -> float:
    """A header holding seconds as a decimal number (NaN when absent or not a number)."""
    try:
        return float(value) if value is not None else math.nan
    except ValueError:
        return math.nan


def retry_after_seconds(value: str | None) -> float:
    """A Retry-After header in seconds (0 when absent or an HTTP date, which a gateway would not send)."""
    try:
        return max(0.0, float(value)) if value is not None else 0.0
    except ValueError:
        return 0.0


def rejection_reason(body: bytes) -> str:
    """The cause a gateway gives in a 429's JSON body: `error.reason` (simadmit's gateway, beside the OpenAI
    fields), a top-level `reason`, or `error.type`; else `http_429`."""
    try:
        doc = json.loads(body)
    except ValueError:
        return "http_429"
    if not isinstance(doc, dict):
        return "http_429"
    err = doc.get("error")
    err = err if isinstance(err, dict) else {}
    for cause in (err.get("reason"), doc.get("reason"), err.get("type")):
        if isinstance(cause, str):
            return cause
    return "http_429"


async def send(
    client: httpx.AsyncClient,
    url: str,
    body: bytes,
    timeout_s: float,
    abandon_at: float | None = None,
    elapsed_s: float | None = None,
) -> AttemptResult:
    """Send one attempt and stream its answer; never raises for what the server or the network does.

    `elapsed_s` (a retry): the seconds since the first attempt, sent in `RETRY_ELAPSED_HEADER` so that a
    gateway counts them against the request's wait budget.

    `abandon_at` (event-loop time) gives up when no token has come by then: the connection is closed,
    which makes vLLM abort the request, as a client that walks away does.
    """
    loop = asyncio.get_running_loop()
    nan = math.nan
    sent = loop.time()
    answered = first = last = view = nan
    usage: dict[str, int] | None = None

    def result(status: str, reason: str | None = None, retry_after: float = nan) -> AttemptResult:
        p = int(usage.get("prompt_tokens", 0)) if usage else 0
        o = int(usage.get("completion_tokens", 0)) if usage else 0
        finish = last if status == OK else nan
        return AttemptResult(status, sent, answered, first, finish, p, o, retry_after, reason or status, view)

    until = min(sent + timeout_s, abandon_at if abandon_at is not None else math.inf)
    headers = {"content-type": "application/json"}
    if elapsed_s is not None:
        headers[RETRY_ELAPSED_HEADER] = f"{elapsed_s:.3f}"
    try:
        async with asyncio.timeout_at(until) as deadline:
            async with client.stream("POST", url, content=body, headers=headers) as response:
                answered = loop.time()
                view = header_seconds(response.headers.get("x-queue-predict-wait"))
                if response.status_code != 200:
                    detail = await response.aread()
                    code = response.status_code
                    if code == 429:
                        wait = retry_after_seconds(response.headers.get("retry-after"))
                        return result(REJECTED, rejection_reason(detail), wait)
                    if code == 400 and b"context length" in detail.lower():
                        return result(TOO_LONG)
                    return result(f"http_{code}")
                stream = EventStream(response, loop.time)
                async for now, payloads in stream.reads():
                    last = now
                    for payload in payloads:
                        # parse only the lines that matter: the first token's, the usage, an error
                        if first == first and b'"prompt_tokens"' not in payload and b'"error"' not in payload:
                            continue
                        event = stream_event(payload)
                        if "error" in event:
                            return result("dropped", "stream_error")
                        if first != first and event.get("choices"):
                            first = now
                            deadline.reschedule(sent + timeout_s)  # no abandoning once tokens flow
                        usage = event.get("usage") or usage
                done = stream.done
    except TimeoutError:
        if abandon_at is not None and first != first and loop.time() >= abandon_at - 1e-3:
            return result(ABANDONED)
        return result("timeout")
    except httpx.TimeoutException:
        return result("timeout")
    except httpx.ConnectError:
        return result("connect")
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, ValueError):
        return result("dropped")  # ValueError: an unreadable event
    if not done or usage is None or first != first:
        return result("dropped")
    return result(OK, "admitted")
