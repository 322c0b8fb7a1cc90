"""GatewayServer: the admission layer the simulator drives, as an HTTP gateway in front of vLLM replicas.

For each OpenAI-compatible request it reads the tier, the deadline and `max_tokens` (`inbound`), counts the
prompt's tokens with a backend's `/tokenize`, and asks the very `Gateway` object (estimator, policy, view)
the simulator uses; an admitted request is routed as the scenario says and streamed through (`upstream`),
a rejected one gets 429 with `Retry-After` and `X-Queue-Predict-Wait`. Every backend's `/metrics` is polled
each poll interval into the gateway's view (`backends`). Several gateway processes can stand in front of the
same backends, each with its own view.

When the `Gateway` sheds (`gateway.shed_lost_deadlines`, or the predictive policy's own setting) it is asked,
each poll interval as the simulator asks it, which admitted requests with a deadline have lost it: one
still waiting for its first token is dropped when even alone on an idle replica its answer would come too
late, one answering once its deadline has passed. Its backend request is closed (vLLM aborts it), it leaves
the books, and the client gets 503 `deadline_lost` (an error event, `deadline_passed`, in a stream already
answering): the simulator's outcome is an abort, which the client does not retry, so no Retry-After. A
stream's 200 is sent only with its first event, so that a request dropped before it gets its status.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from simadmit.admission.estimator import output_learning
from simadmit.admission.gateway import TOO_LONG, Gateway
from simadmit.admission.policies import Decision, Request, retry_after
from simadmit.admission.predictive import StatefulPolicy
from simadmit.admission.published import prior_price
from simadmit.calibrate.client import plain_http
from simadmit.serve.backends import Backend, Flight, LivePool, parse_poll
from simadmit.serve.discovery import DISCOVERY_INTERVAL_S, Resolver, backend_urls, resolve
from simadmit.serve.inbound import (
    CHAT,
    COMPLETIONS,
    ClientError,
    OpenAIRequest,
    deadline_of,
    elapsed_of,
    parse_body,
    tier_of,
    tokenize_payload,
)
from simadmit.serve.settings import ServeSettings
from simadmit.serve.telemetry import GatewayMetrics
from simadmit.serve.upstream import Exchange, Failure, Head

log = logging.getLogger("simadmit.gateway")  # backends leaving and rejoining, for the operator
NO_BACKEND_RETRY_S = 5.0  # Retry-After when a pool has no backend taking work
MIN_POLL_S = 0.05  # poll_interval_s 0 (live views) polls this often and refreshes before every decision
PATHS = {COMPLETIONS: "/v1/completions", CHAT: "/v1/chat/completions"}
ERROR_TYPES = {429: "rate_limit_exceeded", 503: "service_unavailable"}


def error_body(status: int, message: str, **extra: Any) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "backend_error"),
            "code": status,
            **extra,
        }
    }


class GatewayServer:
    def __init__(self, settings: ServeSettings) -> None:
        self.settings = s = settings
        world = s.world
        g = world.gateway
        learner, correction = output_learning(g.estimate_output)
        engines = world.engine_models()  # what an engine-aware policy predicts with, as in the simulator
        self.gateway = Gateway(
            s.policy,
            [p.estimator for p in world.pools],
            [p.max_request_tokens for p in world.pools],
            learner,
            engines,
            correction,
            g.shed_lost_deadlines,
        )
        # read each answer's length (asking a stream for its usage) when something learns from it: an output
        # learner, or a policy with state (predicted_ttft's output lengths and decode step)
        self.learn = learner is not None or correction is not None or isinstance(s.policy, StatefulPolicy)
        self.routing = g.routing
        self.live = g.poll_interval_s == 0
        self.poll_s = max(g.poll_interval_s, MIN_POLL_S)
        self.pools = []
        for p, urls in zip(world.pools, s.backends, strict=True):
            served = [world.tier_names[t] for t in p.tiers]
            prior = prior_price(p.estimator, [s.tier_max_tokens[t] for t in served])
            self.pools.append(
                LivePool(
                    p.name,
                    list(urls),
                    p.gpus_per_replica,
                    p.limits.max_num_seqs,
                    prior,
                    s.http.on_stale,
                    p.limits.kv_capacity_tokens,
                    p.estimator,
                    p.priorities,
                )  # fmt: skip
            )
        self.pool_of_tier = {world.tier_names[t]: p for t, p in enumerate(world.pool_of_tier)}
        self.known_tiers = set(world.tier_names)
        self.metrics = GatewayMetrics()
        self.ids = itertools.count()
        self.started = time.monotonic()
        self.client: httpx.AsyncClient | None = None
        self.poll_client: httpx.AsyncClient | None = None
        self.pollers: list[asyncio.Task[None]] = []
        self.resolve: Resolver = resolve
        self.discovery_interval_s = DISCOVERY_INTERVAL_S
        self.app = Starlette(
            routes=[
                Route("/v1/completions", partial(self.serve, route=COMPLETIONS), methods=["POST"]),
                Route("/v1/chat/completions", partial(self.serve, route=CHAT), methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.prometheus, methods=["GET"]),
            ],
            lifespan=self.lifespan,
        )

    def now(self) -> float:
        return time.monotonic() - self.started

    # --- start, stop, polling ---------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        http = self.settings.http
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(http.backend_timeout_s, connect=http.connect_timeout_s, pool=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=512),
        )
        self.poll_client = httpx.AsyncClient(timeout=http.stale_after_s)
        for p, pool in enumerate(self.pools):
            self.refresh(p)
            for b in pool.backends:
                self.pollers.append(asyncio.create_task(self.poll_loop(p, pool, b)))
            for name in pool.dns_names:
                self.pollers.append(asyncio.create_task(self.discovery_loop(p, pool, name)))
        if self.gateway.sheds:
            self.pollers.append(asyncio.create_task(self.shed_loop()))
        try:
            yield
        finally:
            for task in self.pollers:
                task.cancel()
            await asyncio.gather(*self.pollers, return_exceptions=True)
            await self.client.aclose()
            await self.poll_client.aclose()

    async def poll_loop(self, p: int, pool: LivePool, backend: Backend) -> None:
        assert self.poll_client is not None
        stale_after = self.settings.http.stale_after_s
        while not pool.leave(backend):
            started = time.monotonic()
            try:
                response = await self.poll_client.get(f"{backend.url}/metrics")
                response.raise_for_status()
                if pool.polled(backend, parse_poll(response.text), self.now()):
                    log.warning(
                        "backend %s of pool %s answers /metrics again: back in service",
                        backend.shown,
                        pool.name,
                    )
            except (httpx.HTTPError, ValueError) as e:
                if pool.poll_failed(backend, self.now(), stale_after):
                    then = (
                        "kept on its last gauges" if pool.keep_stale else "unavailable, its requests cut off"
                    )
                    why = plain_http(backend.url, e) or (
                        str(e).splitlines()[0] if str(e) else type(e).__name__
                    )
                    log.warning(
                        "backend %s of pool %s: /metrics not answering (%s): %s",
                        backend.shown,
                        pool.name,
                        why,
                        then,
                    )
            self.refresh(p)
            await asyncio.sleep(max(0.0, self.poll_s - (time.monotonic() - started)))

    async def discovery_loop(self, p: int, pool: LivePool, name: str) -> None:
        """Re-resolve a DNS name now and then: its new addresses join the pool, vanished ones retire."""
        while True:
            urls = await backend_urls(name, self.resolve)
            self.pollers = [t for t in self.pollers if not t.done()]
            for backend in pool.join(urls, name):
                self.pollers.append(asyncio.create_task(self.poll_loop(p, pool, backend)))
            self.refresh(p)
            await asyncio.sleep(self.discovery_interval_s)

    async def shed_loop(self) -> None:
        """Every poll interval, drop the admitted requests whose deadline is lost."""
        while True:
            await asyncio.sleep(self.poll_s)
            self.shed_lost(self.now())

    def shed_lost(self, now: float) -> None:
        """Ask the gateway's rule about every own request with a deadline; drop those it says are lost."""
        for p, pool in enumerate(self.pools):
            for f in list(pool.flights.values()):
                req = f.request
                if req.deadline_s is None or not self.gateway.lost(req, p, now, f.started):
                    continue
                reason = "deadline_passed" if f.started else "deadline_lost"
                message = (
                    f"{req.tier} request shed: its deadline passed before its answer ended"
                    if f.started
                    else f"{req.tier} request shed: its answer can no longer come before its deadline"
                )
                failure = Failure(503, message, "service_unavailable", {"reason": reason, "tier": req.tier})
                if f.exchange.drop(failure):
                    self.metrics.shed.labels(pool.name, req.tier, reason).inc()

    def refresh(self, p: int) -> None:
        """Replace the gateway's view of pool `p` by a snapshot of the latest gauges and the books."""
        now = self.now()
        pool = self.pools[p]
        self.gateway.refresh(p, pool.snapshot(now))
        self.metrics.view(pool, self.gateway.views[p], now)

    # --- the request path -------------------------------------------------------------------------------

    async def serve(self, request: HttpRequest, route: str) -> Response:
        received = self.now()
        http = self.settings.http
        try:
            raw = await self.read_body(request)
            tier = tier_of(
                request.headers, http.tier_header, http.api_keys, self.settings.default_tier, self.known_tiers
            )
            deadline = deadline_of(request.headers, http.deadline_header, received)
            arrival = received - elapsed_of(request.headers, http.elapsed_header)  # a retry's first attempt
            body = parse_body(raw, route, self.settings.tier_max_tokens[tier])
            p = self.pool_of_tier[tier]
            pool = self.pools[p]
            if (priority := pool.priority(tier)) is not None:  # the tier's, whatever the client asked
                body.body["priority"] = priority
            if not pool.available():
                return self.reject(
                    pool, p, tier, Decision(False, "pool_exhausted", retry_after(NO_BACKEND_RETRY_S))
                )
            prompt_tokens = body.token_ids or await self.count_tokens(pool, body)
        except ClientError as e:
            self.metrics.invalid.labels(e.kind).inc()
            return JSONResponse(error_body(e.status, e.message), status_code=e.status)
        req = Request(next(self.ids), tier, prompt_tokens, body.max_tokens, arrival, deadline)
        now = self.now()
        if self.live:
            self.refresh(p)
        decision, estimate = self.gateway.decide(req, p, now)
        if decision is TOO_LONG:
            limit = self.gateway.max_request_tokens[p]
            self.metrics.invalid.labels("too_long").inc()
            message = (
                f"prompt ({prompt_tokens} tokens) + max_tokens ({body.max_tokens}) exceeds the model's "
                f"context of {limit} tokens"
            )
            return JSONResponse(error_body(400, message), status_code=400)
        pool.priced(estimate, prompt_tokens)
        if not decision.admit:
            return self.reject(pool, p, tier, decision)
        backend = pool.route(self.routing)
        if backend is None:  # every backend went away while the prompt was being counted
            refused = Decision(
                False, "pool_exhausted", retry_after(NO_BACKEND_RETRY_S), decision.predicted_wait_s
            )
            return self.reject(pool, p, tier, refused)
        wait = decision.predicted_wait_s
        self.metrics.decided(pool.name, tier, decision.reason, True, now, wait)
        return await self.forward(request, body, pool, backend, req, estimate, wait, now)

    def reject(self, pool: LivePool, p: int, tier: str, decision: Decision) -> Response:
        wait = decision.predicted_wait_s
        self.metrics.decided(pool.name, tier, decision.reason, False, self.now(), wait)
        shown = wait if math.isfinite(wait) else decision.retry_after_s
        headers = {"Retry-After": str(int(decision.retry_after_s)), "X-Queue-Predict-Wait": f"{shown:.3f}"}
        message = f"{tier} request rejected: {decision.reason}; retry after {int(decision.retry_after_s)} s"
        body = error_body(429, message, reason=decision.reason, tier=tier, predicted_wait_s=round(shown, 3))
        return JSONResponse(body, status_code=429, headers=headers)

    async def read_body(self, request: HttpRequest) -> bytes:
        limit = self.settings.http.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise ClientError(
                413, f"request body of {declared} bytes exceeds the limit of {limit}", "too_large"
            )
        parts, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ClientError(413, f"request body exceeds the limit of {limit} bytes", "too_large")
            parts.append(chunk)
        return b"".join(parts)

    async def count_tokens(self, pool: LivePool, body: OpenAIRequest) -> int:
        """The prompt's length: counted locally when a tokenizer is configured, else by a backend's
        /tokenize (the next backend if one fails)."""
        if self.settings.tokenizer is not None:
            return self.settings.tokenizer.count(body)
        assert self.client is not None
        payload = tokenize_payload(body)
        for backend in pool.available():
            try:
                response = await self.client.post(f"{backend.url}/tokenize", json=payload, timeout=10.0)
            except httpx.HTTPError:
                continue
            if response.status_code == 200:
                try:
                    return int(response.json()["count"])
                except (ValueError, KeyError, TypeError):
                    continue
            if 400 <= response.status_code < 500:
                raise ClientError(400, f"the backend could not tokenize the prompt: {response.text[:300]}")
        raise ClientError(503, "no backend could count the prompt's tokens", "tokenize_failed")

    async def forward(
        self,
        request: HttpRequest,
        body: OpenAIRequest,
        pool: LivePool,
        backend: Backend,
        req: Request,
        estimate: float,
        wait: float,
        admitted_s: float,
    ) -> Response:
        assert self.client is not None
        pool.charge(backend, req.tier, estimate, req.prompt_tokens)
        exchange = Exchange(
            self.client, backend.url + PATHS[body.route], body.body, body.stream, self.learn,
            partial(self.finished, pool, backend, req, estimate),
            partial(self.answering, pool, backend, req, admitted_s, body.stream),
            partial(self.heard_from, backend),
        )  # fmt: skip
        backend.aborters.add(exchange.abort)
        pool.flights[req.id] = Flight(req, backend, estimate, exchange, int(body.route == CHAT))
        headers = {"X-Queue-Predict-Wait": f"{wait:.3f}"}
        watcher = asyncio.create_task(self.watch_disconnect(request, exchange))
        try:
            head = await exchange.next()
            if isinstance(head, Head) and head.status == 200 and body.stream:
                first = await exchange.next()  # the 200 goes out with the first event, not before
                if isinstance(first, bytes):
                    watcher.cancel()  # from here the streaming response watches the client itself
                    return StreamingResponse(
                        exchange.body_chunks(first), media_type=head.content_type, headers=headers
                    )
                rest: bytes | Failure = first if isinstance(first, Failure) else b""  # or an empty body
            elif isinstance(head, Failure):
                rest = head
            else:
                rest = await exchange.read_rest()
        finally:
            watcher.cancel()
        if isinstance(rest, Failure):
            return Response(rest.body(), status_code=rest.status, media_type="application/json")
        assert isinstance(head, Head)
        return Response(rest, status_code=head.status, media_type=head.content_type, headers=headers)

    @staticmethod
    async def watch_disconnect(request: HttpRequest, exchange: Exchange) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                exchange.close()
                return

    def answering(
        self, pool: LivePool, backend: Backend, req: Request, admitted_s: float, streamed: bool
    ) -> None:
        """The answer of an admitted request began: its prompt leaves the books, and, when it streams (its
        first token, then), a learning policy compares the time it took with what it predicted. A whole
        answer arrives at its end: taken for a first token, it would teach a first token as late as the
        answer and a decode of no time at all."""
        pool.answering(backend, req.prompt_tokens, req.tier)
        if streamed:
            self.gateway.observe_first_token(req, admitted_s, self.now())

    def heard_from(self, backend: Backend) -> None:
        backend.heard_at = self.now()

    def finished(
        self, pool: LivePool, backend: Backend, req: Request, estimate: float, exchange: Exchange
    ) -> None:
        """The backend is done with an admitted request, however it ended: release it from the books."""
        pool.release(backend, req.tier, estimate, exchange.answering, req.prompt_tokens)
        pool.flights.pop(req.id, None)
        backend.aborters.discard(exchange.abort)
        if exchange.refused:
            pool.refused(backend)
        if exchange.client_gone:
            self.metrics.client_gone.inc()
        elif exchange.failure is not None and not exchange.shed:
            self.metrics.upstream_failures.labels(backend.shown, str(exchange.failure.status)).inc()
        if exchange.completed and exchange.output_tokens is not None:
            self.gateway.observe_completion(req, exchange.output_tokens, self.now(), self.pools.index(pool))
        else:  # a learning policy stops waiting for its length
            self.gateway.observe_abort(req, self.now())

    # --- the gateway's own endpoints --------------------------------------------------------------------

    async def models(self, _request: HttpRequest) -> Response:
        assert self.client is not None
        for pool in self.pools:
            for backend in pool.available():
                try:
                    r = await self.client.get(f"{backend.url}/v1/models", timeout=5.0)
                except httpx.HTTPError:
                    continue
                return Response(r.content, status_code=r.status_code, media_type="application/json")
        return JSONResponse(error_body(503, "no backend is taking work"), status_code=503)

    async def health(self, _request: HttpRequest) -> Response:
        pools = {
            pool.name: {
                "backends": len(pool.backends),
                "available": len(pool.available()),
                "own_in_flight_requests": pool.own_requests,
            }
            for pool in self.pools
        }
        ok = all(v["available"] for v in pools.values())
        return Response(
            json.dumps(
                {"status": "ok" if ok else "degraded", "policy": self.settings.policy_name, "pools": pools}
            ),
            status_code=200 if ok else 503,
            media_type="application/json",
        )

    async def prometheus(self, _request: HttpRequest) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)
