"""Exchange: one admitted request's trip to its backend, streamed back through a queue.

The backend is read in a task of its own that puts the response's head, its body chunks and its end (or a
failure) on a queue the client's response reads from. Either side can end it: a client that goes away
cancels the task, which closes the backend connection (vLLM aborts a request whose client disconnects); a
backend that stops answering is cut off from outside (`abort`), and the client gets a 503 instead of
waiting; the gateway sheds one whose deadline is lost the same way (`shed`). Whatever ends it, `on_done` runs
exactly once, when the backend no longer works on the request, to release the request's GPU-seconds from the
gateway's books. The server-sent events a stream has brought back are counted as they pass (`events`): vLLM
sends one per decode step, which is how the gateway knows the tokens each request has decoded so far.

When the gateway learns output lengths it asks a streaming backend for a final usage chunk
(`stream_options.include_usage`) and drops that chunk again if the client had not asked for it; otherwise
the stream passes through untouched.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any, NamedTuple

import httpx

from simadmit.calibrate.client import without_credentials


class Head(NamedTuple):
    status: int
    content_type: str


class Failure(NamedTuple):
    """How a request ended without its backend's answer: the status and message the client gets (and the
    error's type and further fields, when the gateway itself ended it)."""

    status: int
    message: str
    kind: str = "BackendError"
    extra: dict[str, Any] | None = None

    def body(self) -> bytes:
        error = {"message": self.message, "type": self.kind, "code": self.status, **(self.extra or {})}
        return json.dumps({"error": error}).encode()

    def stream_event(self) -> bytes:
        return b"data: " + self.body() + b"\n\n"


Item = Head | bytes | Failure | None  # None: the end of a complete response


def _completion_tokens(data: bytes) -> int | None:
    try:
        usage = json.loads(data).get("usage")
        return int(usage["completion_tokens"]) if usage else None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


class Exchange:
    def __init__(
        self,
        client: httpx.AsyncClient,
        url: str,
        body: dict[str, Any],
        stream: bool,
        learn_output: bool,
        on_done: Callable[[Exchange], None],
        on_answer: Callable[[], None] | None = None,
        on_bytes: Callable[[], None] | None = None,
    ) -> None:
        self.url = url
        self.stream = stream
        self.learn_output = learn_output
        self.strip_usage = False
        if stream and learn_output:
            options = body.get("stream_options")
            if not (isinstance(options, dict) and options.get("include_usage")):
                body = {**body, "stream_options": {**(options or {}), "include_usage": True}}
                self.strip_usage = True
        self.body = body
        self.output_tokens: int | None = None
        self.completed = False  # the backend answered in full with a 200
        self.refused = False  # the backend could not be reached
        self.failure: Failure | None = None
        self.client_gone = False  # the client left before the end
        self.shed = False  # the gateway dropped it: its deadline was lost
        self.events = 0  # server-sent events with a JSON body streamed back so far
        self.answering = False  # the backend's answer has begun (a stream's first token): it is in its counts
        self.on_answer = on_answer
        self.on_bytes = on_bytes  # each piece of the answer: the backend is alive, whatever its /metrics says
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self.task = asyncio.create_task(self._pump(client))
        self.task.add_done_callback(lambda _t: on_done(self))

    # --- the backend side -------------------------------------------------------------------------------

    async def _pump(self, client: httpx.AsyncClient) -> None:
        put = self.queue.put_nowait
        try:
            async with client.stream("POST", self.url, json=self.body) as response:
                status = response.status_code
                put(Head(status, response.headers.get("content-type", "application/json")))
                if not self.learn_output or status != 200:
                    async for chunk in response.aiter_raw():
                        self._body(chunk)
                elif self.stream:
                    await self._pump_events(response)
                else:
                    data = await response.aread()
                    self.output_tokens = _completion_tokens(data)
                    self._body(data)
                self.completed = status == 200
                put(None)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            self.refused = True
            self._fail(Failure(503, f"backend {self.shown} could not be reached: {type(e).__name__}"))
        except httpx.TimeoutException:
            self._fail(Failure(502, f"backend {self.shown} stopped answering mid-request (read timeout)"))
        except httpx.HTTPError as e:
            self._fail(Failure(502, f"backend {self.shown} broke off its response: {type(e).__name__}: {e}"))

    async def _pump_events(self, response: httpx.Response) -> None:
        """Pass server-sent events through one by one, reading the usage chunk's token count."""
        put = self._body
        buffer = b""
        async for chunk in response.aiter_raw():
            buffer += chunk
            end = buffer.rfind(b"\n\n")
            if end < 0:
                continue
            complete, buffer = buffer[: end + 2], buffer[end + 2 :]
            if b'"usage":{' not in complete and b'"usage": {' not in complete:
                put(complete)
                continue
            out = []
            for event in complete.split(b"\n\n")[:-1]:
                data = event[6:] if event.startswith(b"data: ") else b""
                if b'"usage"' in data:
                    tokens = _completion_tokens(data)
                    if tokens is not None:
                        self.output_tokens = tokens
                        if self.strip_usage and b'"choices":[]' in data.replace(b" ", b""):
                            continue
                out.append(event + b"\n\n")
            put(b"".join(out))
        if buffer:
            put(buffer)

    def _body(self, chunk: bytes) -> None:
        """A piece of the answer's body, to pass on; the first one says the backend has begun answering."""
        if self.on_bytes is not None:
            self.on_bytes()
        if not self.answering:
            self.answering = True
            if self.on_answer is not None:
                self.on_answer()
        if self.stream:  # an event cut across two chunks goes uncounted: the work left looks larger
            self.events += chunk.count(b"data: {")
        self.queue.put_nowait(chunk)

    @property
    def shown(self) -> str:
        """The URL as a failure's message names it (without a key): worked out only for a failure, not for
        every request."""
        return without_credentials(self.url)

    def _fail(self, failure: Failure) -> None:
        if self.failure is None:
            self.failure = failure
            self.queue.put_nowait(failure)

    # --- ending it from outside -------------------------------------------------------------------------

    def abort(self, message: str) -> None:
        """Cut the request off (its backend is gone): the client gets a 503 with `message`."""
        if not self.task.done():
            self._fail(Failure(503, message))
            self.task.cancel()

    def drop(self, failure: Failure) -> bool:
        """Shed the request (its deadline is lost): the backend stops working on it, the client gets
        `failure` (an error event in a stream that has started). False if it had already ended."""
        if self.task.done() or self.failure is not None:
            return False
        self.shed = True
        self._fail(failure)
        self.task.cancel()
        return True

    def close(self) -> None:
        """The client went away: stop the backend's work on the request (and wake whoever waits on it)."""
        if not self.task.done():
            self.client_gone = True
            self.task.cancel()
            self.queue.put_nowait(Failure(499, "the client closed the request"))

    # --- the client side --------------------------------------------------------------------------------

    async def next(self) -> Item:
        return await self.queue.get()

    async def body_chunks(self, first: bytes = b"") -> AsyncIterator[bytes]:
        """The rest of a streamed response, after `first` (already taken from the queue); a failure becomes
        a final error event. Left early (the client went away), it stops the backend's work."""
        ended = False
        try:
            if first:
                yield first
            while True:
                item = await self.queue.get()
                if item is None or isinstance(item, Failure):
                    ended = True
                    if isinstance(item, Failure):
                        yield item.stream_event()
                    return
                if isinstance(item, bytes):
                    yield item
        finally:
            if not ended:
                self.close()

    async def read_rest(self) -> bytes | Failure:
        """The rest of a non-streamed response, or the failure that ended it."""
        parts: list[bytes] = []
        while True:
            item = await self.queue.get()
            if item is None:
                return b"".join(parts)
            if isinstance(item, Failure):
                return item
            if isinstance(item, bytes):
                parts.append(item)
