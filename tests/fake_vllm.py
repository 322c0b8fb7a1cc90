"""A fake vLLM OpenAI-compatible server on loopback, for the calibrate tests that need a real socket.

It answers `/v1/models`, `/version`, `/tokenize` and `/metrics` like vLLM, and `/v1/completions` by a
script: the first `ok_first` completions stream their tokens, later ones behave as `then` says: `ok`, `hang`
(send the 200 headers, then nothing: a server stuck mid-request) or `error` (HTTP 500). Hanging handlers
are released when the server stops.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType

MODEL = "fake-model"
METRICS = (
    'vllm:cache_config_info{block_size="16",num_gpu_blocks="2000",engine="0"} 1.0\n'
    'vllm:num_requests_running{engine="0"} 0.0\n'
    'vllm:num_requests_waiting{engine="0"} 0.0\n'
    'vllm:kv_cache_usage_perc{engine="0"} 0.0\n'
)


class FakeVllm:
    """`with FakeVllm(then="hang", ok_first=5) as server:` serves on `server.url` until the block ends."""

    def __init__(
        self, then: str = "ok", ok_first: int = 0, token_s: float = 0.001, prefill_s: float | None = None,
        outside_s: float = 0.0,
    ) -> None:  # fmt: skip
        """`prefill_s`: each completion's engine time before its first token, published as vLLM V1's
        queue and prefill histograms (None: no such histograms); `outside_s` more pass before the first token
        outside those clocks (an API server's way in and out)."""
        self.then = then
        self.ok_first = ok_first
        self.token_s = token_s
        self.prefill_s = prefill_s
        self.outside_s = outside_s
        self.finished = 0  # completions that sent their last token
        self.completions = 0
        self.first_request_at: float | None = None  # time.monotonic() of the first request served
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> FakeVllm:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stopping.set()
        self._server.shutdown()
        self._server.server_close()

    def _behaviour(self) -> str:
        with self._lock:
            self.completions += 1
            return "ok" if self.completions <= self.ok_first else self.then

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                pass

            def _json(self, obj: object, status: int = 200) -> None:
                body = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if fake.first_request_at is None:
                    fake.first_request_at = time.monotonic()
                if self.path == "/v1/models":
                    self._json({"data": [{"id": MODEL, "max_model_len": 2048}]})
                elif self.path == "/version":
                    self._json({"version": "fake"})
                elif self.path == "/metrics":
                    body = (METRICS + fake.engine_histograms()).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                else:
                    self._json({"error": "not found"}, 404)

            def do_POST(self) -> None:
                request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if self.path == "/tokenize":
                    self._json({"tokens": list(range(100, 400))})
                elif self.path == "/v1/completions":
                    self._complete(request)
                else:
                    self._json({"error": "not found"}, 404)

            def _complete(self, request: dict) -> None:
                behaviour = fake._behaviour()
                if behaviour == "error":
                    self._json({"error": "engine dead"}, 500)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.flush()
                if behaviour == "hang":
                    fake.stopping.wait()
                    return
                prompt = request.get("prompt")
                prompt_tokens = len(prompt) if isinstance(prompt, list) else max(1, len(str(prompt)) // 4)
                tokens = int(request.get("max_tokens", 1))
                time.sleep((fake.prefill_s or 0.0) + fake.outside_s)
                for i in range(tokens):
                    chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                    time.sleep(fake.token_s)
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": tokens}
                self.wfile.write(
                    f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode()
                )
                self.wfile.flush()
                with fake._lock:
                    fake.finished += 1
                self.close_connection = True

        return Handler

    def engine_histograms(self) -> str:
        """vLLM V1's engine-clock histograms (sum and count only), if this fake publishes them."""
        if self.prefill_s is None:
            return ""
        n = self.finished
        return (
            f'vllm:request_queue_time_seconds_sum{{engine="0"}} 0.0\n'
            f'vllm:request_queue_time_seconds_count{{engine="0"}} {n}.0\n'
            f'vllm:request_prefill_time_seconds_sum{{engine="0"}} {n * self.prefill_s}\n'
            f'vllm:request_prefill_time_seconds_count{{engine="0"}} {n}.0\n'
        )
