"""Async streaming client for vLLM's OpenAI-compatible completions API, timing every streamed token.

It stays light because it shares the machine with what it measures: one `httpx.AsyncClient`, a timestamp
per received chunk and nothing else per token. The byte stream is split on b"\\n" by hand (httpx's
`aiter_lines` also splits on Unicode line separators that vLLM leaves raw inside its JSON), token counts come
from the `usage` record (several tokens can share a chunk under load), and output length is pinned with
`max_tokens` + `ignore_eos`. Server faults are returned as a status, never raised, so the caller can retry.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import numpy as np

from simadmit.config.errors import InputError, problem


@dataclass(frozen=True, slots=True)
class Attempt:
    """What one streamed request measured (NaN for values it did not get to)."""

    status: str  # "ok", "timeout", "dropped", "connect", "http_<code>", "stream_error"
    start_unix_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    itl_mean_s: float
    itl_p50_s: float
    itl_p90_s: float
    itl_max_s: float
    n_chunks: int
    e2e_s: float
    client_busy_s: float  # time this client spent handling the response's bytes
    token_times_s: tuple[float, ...] = ()  # each output token's arrival after the start; () if unknown


class InFlight:
    """The streamed requests now open and when each last heard from the server: stalls made visible.

    A server that accepts a request and then sends nothing leaves the client waiting until its time-out;
    `stalled(after_s)` tells how many requests have had no byte for that long, so a progress display can
    say so instead of looking busy, and `last_heard` (when any answer last arrived) tells a hung server
    from a slow one. `longest_answered_s`, the longest a request has waited for a byte that then came, is
    how silent this server can be while working: one step of a long prompt on a slow CPU takes seconds.
    """

    def __init__(self) -> None:
        self._last_heard: dict[int, float] = {}
        self._next = 0
        self.last_heard = -math.inf  # time.perf_counter() of the latest headers or bytes, any request
        self.longest_answered_s = 0.0

    def open(self) -> int:
        self._next += 1
        self._last_heard[self._next] = time.perf_counter()
        return self._next

    def heard(self, key: int) -> None:
        now = time.perf_counter()
        self.longest_answered_s = max(self.longest_answered_s, now - self._last_heard[key])
        self._last_heard[key] = self.last_heard = now

    def close(self, key: int) -> None:
        self._last_heard.pop(key, None)

    def __len__(self) -> int:
        return len(self._last_heard)

    def silent_too_long_s(self, floor_s: float) -> float:
        """A silence past which this server is not merely slow: `floor_s`, or twice the longest it has kept
        a request waiting for a byte that then came, whichever is longer."""
        return max(floor_s, 2 * self.longest_answered_s)

    def stalled(self, after_s: float) -> tuple[int, float]:
        """(requests silent for at least `after_s`, the longest silence in seconds)."""
        now = time.perf_counter()
        silences = [now - t for t in self._last_heard.values() if now - t >= after_s]
        return len(silences), max(silences, default=0.0)


IN_FLIGHT = InFlight()  # one process runs one calibration at a time: its open requests


class RequestRejected(Exception):
    """The server answered 4xx: the request itself is wrong, so retrying cannot help."""

    def __init__(self, status_code: int, detail: str) -> None:
        self.status_code = status_code
        self.detail = detail
        super().__init__(f"HTTP {status_code}: {detail}")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A live endpoint and what it told about itself."""

    base_url: str
    model: str
    max_model_len: int
    vllm_version: str

    @property
    def shown_url(self) -> str:
        """`base_url` as messages and written files name it: without a key (`without_credentials`)."""
        return without_credentials(self.base_url)


def normalize_base_url(url: str, option: str = "--endpoint") -> str:
    """`http://host:8000/v1/` -> `http://host:8000`; anything that is not an http(s) URL with a host and a
    port from 1 to 65535, or that httpx cannot send to, is an `InputError` naming `option`."""
    try:
        parts = urlsplit(url.strip())
    except ValueError:  # an IPv6 address without its closing bracket
        parts = None
    shown = url if parts is None else without_credentials(url.strip())  # a key is never printed
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise InputError([problem(None, option, f"{shown!r} is not an http(s) URL like http://host:8000")])
    try:
        port = parts.port  # a port that is not a number, or out of range, is a ValueError
    except ValueError:
        port = 0
    if port == 0:
        raise InputError([problem(None, option, f"{shown!r}: the port must be a number from 1 to 65535")])
    path = parts.path.rstrip("/")
    path = path.removesuffix("/v1")
    base_url = f"{parts.scheme}://{parts.netloc}{path}"
    try:  # what urlsplit lets through and httpx refuses: a host IDNA cannot encode, a control character
        httpx.URL(base_url)
    except httpx.InvalidURL as e:
        raise InputError(
            [problem(None, option, f"{shown!r} is not an http(s) URL like http://host:8000 ({e})")]
        ) from None
    return base_url


def _causes(error: BaseException) -> list[BaseException]:
    """`error` and the exceptions it was raised from, outermost first."""
    causes = []
    e: BaseException | None = error
    while e is not None:
        causes.append(e)
        e = e.__cause__ or e.__context__
    return causes


def plain_http(base_url: str, error: BaseException) -> str | None:
    """What to write instead of an https:// URL whose server answered the TLS handshake in plain HTTP (OpenSSL's
    "wrong version number"), or None when that is not what `error` says."""
    if not any(getattr(c, "reason", None) == "WRONG_VERSION_NUMBER" for c in _causes(error)):
        return None
    return "the server speaks plain http, not https: write " + without_credentials(
        base_url.replace("https://", "http://", 1)
    )


def _connection_problem(base_url: str, error: httpx.HTTPError, option: str) -> InputError:
    """Name the cause a user can act on: refused (nothing listens), unknown host, plain http, or time-out."""
    causes = _causes(error)
    if any(isinstance(c, ConnectionRefusedError) for c in causes):
        cause = "connection refused (is the server running on that port?)"
    elif http := plain_http(base_url, error):
        cause = http
    elif any(isinstance(c, socket.gaierror) for c in causes):
        cause = "unknown host"
    elif isinstance(error, httpx.TimeoutException):
        cause = "no answer (timed out)"
    else:
        cause = f"cannot connect ({error or type(error).__name__})"
    return InputError([problem(None, option, f"{without_credentials(base_url)}: {cause}")])


def without_credentials(url: str) -> str:
    """The URL as shown in a message: `http://user:key@host` -> `http://host` (a key is never printed)."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2])) if "@" in parts.netloc else url


def completion_body(
    model: str, prompt: list[int] | str, max_tokens: int, usage_per_event: bool = False
) -> dict[str, object]:
    """A completion request that generates exactly `max_tokens` (ignore_eos), streamed with usage: at the end,
    or with `usage_per_event` in every event too (vLLM's `continuous_usage_stats`), which says how many
    tokens each event carries when the server sends several at once."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True}
        | ({"continuous_usage_stats": True} if usage_per_event else {}),
    }


def sse_payloads(buffer: bytes) -> tuple[list[bytes], bytes]:
    """The `data:` payloads of the complete lines in a streamed response, and the unfinished rest.

    Split on b"\\n" only: vLLM emits raw Unicode line separators inside its JSON, which a text splitter cuts.
    """
    *lines, rest = buffer.split(b"\n")
    return [line.strip()[5:].strip() for line in lines if line.strip().startswith(b"data:")], rest


class EventStream:
    """A streamed response read by read: when each read arrived (`clock()`; every line in one read arrived
    together) and the `data:` payloads it completed, `[DONE]` left out and remembered in `done`."""

    def __init__(self, response: httpx.Response, clock: Callable[[], float]) -> None:
        self.response = response
        self.clock = clock
        self.done = False

    async def reads(self) -> AsyncIterator[tuple[float, list[bytes]]]:
        buffer = b""
        async for data in self.response.aiter_bytes():
            now = self.clock()
            payloads, buffer = sse_payloads(buffer + data)
            if b"[DONE]" in payloads:
                self.done = True
                payloads = [p for p in payloads if p != b"[DONE]"]
            yield now, payloads


def json_object(response: httpx.Response) -> dict[str, Any]:
    """A response's body as a JSON object; an empty one when it is anything else (a server not like vLLM)."""
    try:
        doc = response.json()
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def stream_event(payload: bytes) -> dict[str, Any]:
    """One streamed `data:` payload as vLLM sends it: a JSON object whose `usage`, when given, counts tokens
    in whole numbers; anything else raises `ValueError`, the attempt's answer being unreadable."""
    event = json.loads(payload)
    if not isinstance(event, dict):
        raise ValueError(f"a streamed event is not a JSON object: {payload[:40]!r}")
    usage = event.get("usage")
    if usage is not None and not (
        isinstance(usage, dict)
        and all(isinstance(usage.get(k, 0), int) for k in ("prompt_tokens", "completion_tokens"))
    ):
        raise ValueError(f"a streamed event's usage is not token counts: {payload[:40]!r}")
    return event


async def discover(
    client: httpx.AsyncClient, base_url: str, model: str | None, option: str = "--endpoint"
) -> Endpoint:
    """Ask `/v1/models` for the served model and its context length; connection trouble is the user's, told
    against `option` (the command-line option that gave `base_url`), naming it without its key."""
    shown = without_credentials(base_url)
    try:
        response = await client.get(f"{base_url}/v1/models", timeout=10.0)
    except httpx.HTTPError as e:
        raise _connection_problem(base_url, e, option) from None
    if response.status_code != 200:
        raise InputError(
            [
                problem(
                    None,
                    option,
                    f"{shown}/v1/models answered HTTP {response.status_code}: not a vLLM endpoint?",
                )
            ]
        )
    try:
        served = {m["id"]: m for m in response.json()["data"]}
    except (ValueError, KeyError, TypeError):
        raise InputError([problem(None, option, f"{shown}/v1/models did not return a model list")]) from None
    if not served:
        raise InputError([problem(None, option, f"{shown} serves no model")])
    if model is None:
        model = next(iter(served))
    elif model not in served:
        field = "--model" if option == "--endpoint" else option  # else the model came from another endpoint
        raise InputError(
            [problem(None, field, f"{model!r} is not served by {shown} (it serves: {', '.join(served)})")]
        )
    max_len = served[model].get("max_model_len")
    if not isinstance(max_len, int) or max_len <= 0:
        raise InputError([problem(None, option, f"{shown}/v1/models gives no max_model_len for {model!r}")])
    version = "unknown"
    try:
        v = await client.get(f"{base_url}/version", timeout=10.0)
        if v.status_code == 200:
            version = str(json_object(v).get("version", "unknown"))
    except httpx.HTTPError:
        pass
    return Endpoint(base_url=base_url, model=model, max_model_len=max_len, vllm_version=version)


async def tokenize(client: httpx.AsyncClient, endpoint: Endpoint, text: str) -> list[int] | None:
    """Token ids of `text` from the server's own tokenizer, or None when it has no `/tokenize`."""
    try:
        r = await client.post(
            f"{endpoint.base_url}/tokenize",
            json={"model": endpoint.model, "prompt": text, "add_special_tokens": False},
            timeout=30.0,
        )
        if r.status_code != 200:
            return None
        tokens = json_object(r).get("tokens")
    except httpx.HTTPError:
        return None
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, int) for t in tokens):
        return None
    return [int(t) for t in tokens]


def _failed(status: str, start_unix: float, t0: float, busy: float) -> Attempt:
    nan = math.nan
    return Attempt(status, start_unix, 0, 0, nan, nan, nan, nan, nan, 0, time.perf_counter() - t0, busy)


async def stream_completion(
    client: httpx.AsyncClient,
    endpoint: Endpoint,
    prompt: list[int] | str,
    max_tokens: int,
    timeout_s: float,
) -> Attempt:
    """Send one streamed completion and time its tokens. Raises only `RequestRejected` (HTTP 4xx)."""
    body = completion_body(endpoint.model, prompt, max_tokens, usage_per_event=True)
    start_unix, t0 = time.time(), time.perf_counter()
    busy = 0.0
    times: list[float] = []
    made: list[object] = []  # tokens out so far, as each event with text says
    usage: dict[str, int] | None = None
    done = False
    key = IN_FLIGHT.open()
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", f"{endpoint.base_url}/v1/completions", json=body) as response:
                IN_FLIGHT.heard(key)
                if response.status_code != 200:
                    detail = (await response.aread()).decode(errors="replace")[:300]
                    if response.status_code >= 500:
                        return _failed(f"http_{response.status_code}", start_unix, t0, busy)
                    raise RequestRejected(response.status_code, detail)
                stream = EventStream(response, time.perf_counter)
                async for now, payloads in stream.reads():
                    IN_FLIGHT.heard(key)
                    for payload in payloads:
                        event = stream_event(payload)
                        if "error" in event:
                            return _failed("stream_error", start_unix, t0, busy)
                        if event.get("choices"):
                            times.append(now)
                            made.append((event.get("usage") or {}).get("completion_tokens"))
                        if event.get("usage"):
                            usage = event["usage"]
                    busy += time.perf_counter() - now
                done = stream.done
    except (TimeoutError, httpx.TimeoutException):
        return _failed("timeout", start_unix, t0, busy)
    except httpx.ConnectError:
        return _failed("connect", start_unix, t0, busy)
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError, ValueError):
        return _failed("dropped", start_unix, t0, busy)  # ValueError: an unreadable event
    finally:
        IN_FLIGHT.close(key)
    end = time.perf_counter()
    if not done or usage is None or not times:
        return _failed("dropped", start_unix, t0, busy)
    tick = time.perf_counter()
    output_tokens = int(usage.get("completion_tokens", 0))
    gaps = np.diff(times)
    if len(gaps):
        p50, p90, gmax = (float(v) for v in (*np.percentile(gaps, [50, 90]), gaps.max()))
    else:
        p50 = p90 = gmax = math.nan
    itl_mean = (times[-1] - times[0]) / (output_tokens - 1) if output_tokens > 1 else math.nan
    busy += time.perf_counter() - tick
    return Attempt(
        status="ok",
        start_unix_s=start_unix,
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        output_tokens=output_tokens,
        ttft_s=times[0] - t0,
        itl_mean_s=itl_mean,
        itl_p50_s=p50,
        itl_p90_s=p90,
        itl_max_s=gmax,
        n_chunks=len(times),
        e2e_s=end - t0,
        client_busy_s=busy,
        token_times_s=token_arrivals([t - t0 for t in times], made, output_tokens),
    )


def token_arrivals(event_times: list[float], made: list[object], output_tokens: int) -> tuple[float, ...]:
    """Each output token's arrival: an event's time once per token it carries, read from the running count
    each event gives (`made`), or one token per event when there are as many events as tokens; () when
    neither tells (a server that sends several tokens at once without saying how many)."""
    if len(event_times) == output_tokens:
        return tuple(event_times)
    running = [m for m in made if isinstance(m, int)]
    counts = np.diff([0, *running])
    if len(running) != len(event_times) or counts.sum() != output_tokens or (counts < 0).any():
        return ()
    return tuple(float(t) for t in np.repeat(event_times, counts))
