"""A fake vLLM server for the gateway's tests: the routes, the /metrics gauges and the streaming format of
vLLM's OpenAI server, with knobs to hold requests, hang, and count what the gateway did to it.

A prompt's token count is its number of words (chat: the words of every message plus 3 per message); each
request produces `output_tokens` tokens (capped at its max_tokens), one per stream chunk, with a final usage
chunk when the client asks for it. `serving` runs any ASGI app on a loopback port in the running event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route


class FakeVllm:
    def __init__(self, output_tokens: int = 5, max_model_len: int = 4096) -> None:
        self.output_tokens = output_tokens
        self.max_model_len = max_model_len
        self.gate: asyncio.Event | None = None  # set: requests wait for it before producing tokens
        self.hanging = False  # requests and /metrics never answer
        self.metrics_silent = False  # only /metrics never answers
        self.stall_after: int | None = None  # streams stop after this many tokens, until cancelled
        self.token_interval_s = 0.0  # a stream's pause between tokens
        self.reported: tuple[float, float] | None = None  # set: /metrics reports this (running, waiting)
        self.kv_blocks = 1000  # vllm:cache_config_info: 1,000 blocks of 16 tokens
        self.prompt_tokens = 0  # vllm:prompt_tokens_total: prompt tokens of every request received
        self.running = 0
        self.completed = 0
        self.cancelled = 0  # requests whose connection went away before their end
        self.bodies: list[dict[str, Any]] = []
        self.tokenized = 0  # /tokenize calls
        self.app = Starlette(
            routes=[
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/metrics", self.metrics, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/completions", self.generate, methods=["POST"]),
                Route("/v1/chat/completions", self.generate, methods=["POST"]),
            ]
        )

    def hold(self) -> None:
        self.gate = asyncio.Event()

    def release(self) -> None:
        if self.gate is not None:
            self.gate.set()
        self.gate = None

    async def _hang_if_asked(self) -> None:
        while self.hanging:
            await asyncio.sleep(0.01)

    async def tokenize(self, request: Request) -> Response:
        body = await request.json()
        self.tokenized += 1
        if "messages" in body:
            count = sum(len(str(m.get("content", "")).split()) + 3 for m in body["messages"])
        else:
            count = len(body["prompt"].split())
        return JSONResponse(
            {"count": count, "max_model_len": self.max_model_len, "tokens": list(range(count))}
        )

    async def metrics(self, _request: Request) -> Response:
        await self._hang_if_asked()
        while self.metrics_silent:
            await asyncio.sleep(0.01)
        waiting = self.running if self.gate is not None else 0
        running = self.running - waiting
        if self.reported is not None:
            running, waiting = self.reported
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f'vllm:num_requests_running{{engine="0",model_name="fake"}} {float(running)}',
            "# TYPE vllm:num_requests_waiting gauge",
            f'vllm:num_requests_waiting{{engine="0",model_name="fake"}} {float(waiting)}',
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="fake"}} {min(1.0, self.running / 100)}',
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="{self.kv_blocks}"}} 1.0',
            "# TYPE vllm:prompt_tokens counter",
            f'vllm:prompt_tokens_total{{engine="0",model_name="fake"}} {float(self.prompt_tokens)}',
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    async def models(self, _request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def generate(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        prompt = body.get("prompt", "")
        self.prompt_tokens += len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        n = min(self.output_tokens, body.get("max_tokens", self.output_tokens))
        chat = "messages" in body
        usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
        if not body.get("stream"):
            self.running += 1
            try:
                if not await self._wait_unless_gone(request):  # as vLLM, abort when the client leaves
                    self.cancelled += 1
                    return Response(status_code=499)
                self.completed += 1
            finally:
                self.running -= 1
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": "x " * n}}
                if chat
                else {"index": 0, "text": "x " * n}
            )
            return JSONResponse({"id": "cmpl-1", "choices": [choice], "usage": usage})
        include_usage = (body.get("stream_options") or {}).get("include_usage", False)
        return StreamingResponse(self._stream(n, chat, usage, include_usage), media_type="text/event-stream")

    async def _wait_unless_gone(self, request: Request) -> bool:
        """Wait as `_wait` does; False if the client disconnected first."""

        async def gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        waiting, watching = asyncio.create_task(self._wait()), asyncio.create_task(gone())
        done, _ = await asyncio.wait((waiting, watching), return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        watching.cancel()
        return waiting in done

    async def _wait(self) -> None:
        await self._hang_if_asked()
        if self.gate is not None:
            await self.gate.wait()

    async def _stream(
        self, n: int, chat: bool, usage: dict[str, int], include_usage: bool
    ) -> AsyncIterator[bytes]:
        self.running += 1
        done = False
        try:
            await self._wait()
            for i in range(n):
                if i == self.stall_after:
                    await asyncio.Event().wait()
                delta = {"delta": {"content": f"t{i} "}} if chat else {"text": f"t{i} "}
                chunk = {
                    "id": "cmpl-1",
                    "choices": [{"index": 0, **delta, "finish_reason": None}],
                    "usage": None,
                }
                yield b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
                await asyncio.sleep(self.token_interval_s)
            if include_usage:
                final = {"id": "cmpl-1", "choices": [], "usage": usage}
                yield b"data: " + json.dumps(final, separators=(",", ":")).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
            done = True
            self.completed += 1
        finally:
            self.running -= 1
            if not done:
                self.cancelled += 1


@contextlib.asynccontextmanager
async def serving(app: Any, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[str]:
    """Serve `app` on a loopback port (default: a free one) for the duration of the block; yields its URL."""
    config = uvicorn.Config(app, host=host, port=port, log_level="error", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.005)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        await task
