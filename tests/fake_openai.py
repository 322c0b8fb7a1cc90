"""A tiny OpenAI-compatible streaming server with known timings, for testing the load generator.

Plain asyncio streams on a background thread, no framework: each completion answers after `ttft_s` with one
SSE chunk per token every `itl_s`, then a `usage` record and `[DONE]`, as vLLM streams. Prompts whose token
count is a multiple of `reject_every` are turned away once with 429 + Retry-After (the body names the
reason, as a gateway would); prompts longer than the context get vLLM's 400.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class FakeServer:
    ttft_s: float = 0.05
    itl_s: float = 0.005
    reject_every: int = 0  # 0: never reject
    retry_after_s: float = 0.2
    max_model_len: int = 4096
    seen: set[bytes] = field(default_factory=set)
    completions: int = 0
    running: int = 0
    url: str = ""
    elapsed: list[str | None] = field(default_factory=list)  # each completion's x-retry-elapsed-s header

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            method, path, _ = lines[0].split(" ")
            headers = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            if path == "/v1/completions":
                self.elapsed.append(headers.get("x-retry-elapsed-s"))
            await self.route(method, path, body, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @staticmethod
    def reply(writer: asyncio.StreamWriter, status: str, doc: object, extra: str = "") -> None:
        data = doc.encode() if isinstance(doc, str) else json.dumps(doc).encode()
        writer.write(f"HTTP/1.1 {status}\r\nContent-Length: {len(data)}\r\nConnection: close\r\n{extra}\r\n".encode()
                     + data)  # fmt: skip

    async def route(self, method: str, path: str, body: bytes, writer: asyncio.StreamWriter) -> None:
        if path == "/v1/models":
            self.reply(writer, "200 OK", {"data": [{"id": "fake", "max_model_len": self.max_model_len}]})
        elif path == "/version":
            self.reply(writer, "200 OK", {"version": "fake"})
        elif path == "/tokenize":
            self.reply(writer, "200 OK", {"tokens": list(range(1, 200))})
        elif path == "/metrics":
            text = (f"vllm:num_requests_running{{engine=\"0\"}} {self.running}\n"
                    "vllm:num_requests_waiting{engine=\"0\"} 0\nvllm:kv_cache_usage_perc{engine=\"0\"} 0.1\n"
                    f"vllm:request_queue_time_seconds_sum{{engine=\"0\"}} {0.001 * self.completions}\n"
                    f"vllm:request_queue_time_seconds_count{{engine=\"0\"}} {self.completions}\n")  # fmt: skip
            self.reply(writer, "200 OK", text)
        elif path == "/v1/completions" and method == "POST":
            await self.complete(json.loads(body), body, writer)
        else:
            self.reply(writer, "404 Not Found", {"error": "no route"})
        await writer.drain()

    async def complete(self, req: dict, body: bytes, writer: asyncio.StreamWriter) -> None:
        prompt, out = len(req["prompt"]), int(req["max_tokens"])
        if prompt + out > self.max_model_len:
            self.reply(
                writer, "400 Bad Request", {"message": "This model's maximum context length is exceeded"}
            )
            return
        if self.reject_every and prompt % self.reject_every == 0 and body not in self.seen:
            self.seen.add(body)
            self.reply(writer, "429 Too Many Requests", {"reason": "would_exceed_sla"},
                       f"Retry-After: {self.retry_after_s}\r\n")  # fmt: skip
            return
        self.running += 1
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(self.ttft_s)
        for k in range(out):
            if k:
                await asyncio.sleep(self.itl_s)
            writer.write(b'data: {"choices":[{"index":0,"text":"x"}],"usage":null}\n\n')
            await writer.drain()
        usage = {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out}
        writer.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        await writer.drain()
        self.running -= 1
        self.completions += 1


@contextmanager
def fake_server(**settings: float) -> Iterator[FakeServer]:
    """Serve a `FakeServer` on a free loopback port for the length of the block."""
    server = FakeServer(**settings)  # type: ignore[arg-type]
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict[str, asyncio.Server] = {}

    async def start() -> None:
        holder["s"] = await asyncio.start_server(server.handle, "127.0.0.1", 0)
        server.url = f"http://127.0.0.1:{holder['s'].sockets[0].getsockname()[1]}"
        ready.set()

    thread = threading.Thread(
        target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True
    )
    thread.start()
    ready.wait(10)
    try:
        yield server
    finally:

        async def shutdown() -> None:  # cancel the handlers still streaming, with the loop still alive
            holder["s"].close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
