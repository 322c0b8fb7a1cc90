"""A live pool: its vLLM backends, their polled gauges, and the books of the work this gateway sent them.

Each poll reads every backend's `/metrics` gauges (`vllm:num_requests_running`, `vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc`, `vllm:prompt_tokens_total`, the KV capacity `vllm:cache_config_info` publishes)
and turns them, with this gateway's own books, into a `PoolSnapshot` by the rules of
`admission.published` (the very code the simulator's gateways run): own requests at the estimates
charged, other gateways' requests as counts priced at this gateway's mean estimate and mean prompt. Between
polls the `Gateway` object adds its own admits, exactly as in the simulator; work other gateways admitted
since the last poll stays invisible, which is the staleness the headroom exists for.

The snapshot's remaining work (`work: remaining`) is counted as the simulator's gateways count it: each own
request whose answer has begun less its prefill and the tokens it has streamed back (one per server-sent
event; a chat stream opens with an event naming the role), priced by the pool's estimator. A request not
streamed shows no progress until it ends, and other gateways' requests none at all (vLLM publishes no
per-request progress): both count in full, as under `work: admitted`.

A backend is unavailable (no work, no GPUs in the snapshot) while a request to it has just failed to
connect, until a poll answers again; when its `/metrics` has not answered for `stale_after_s`, and no answer
has streamed from it either, the scenario's `on_stale` says whether it is unavailable (and its in-flight
requests are cut off with a 503) or kept on its last known gauges.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from simadmit.admission.estimator import CostEstimator
from simadmit.admission.gateway import PoolSnapshot
from simadmit.admission.policies import Request
from simadmit.admission.published import Gauges, PoolBooks, ReplicaBooks
from simadmit.calibrate.client import without_credentials
from simadmit.calibrate.metrics import EngineGauges, parse_cache_config, published_gauges
from simadmit.serve.discovery import is_discovered
from simadmit.serve.upstream import Exchange

PROMPT_TOKENS = "vllm:prompt_tokens_total"  # prompt tokens prefilled since the server started


@dataclass(frozen=True, slots=True)
class Poll:
    """What one read of a backend's /metrics gives: its gauges, its KV capacity in tokens (0: not
    published) and its prompt tokens prefilled since it started (0: not published)."""

    gauges: EngineGauges
    kv_capacity: int = 0
    prompt_tokens_total: int = 0


def parse_poll(text: str) -> Poll:
    """A backend's /metrics text as a `Poll`; ValueError when it is not the exposition format, or not a
    vLLM server's (`published_gauges`): such a poll fails, and the backend goes stale as one that does not
    answer."""
    gauges = published_gauges(text)
    cache = parse_cache_config(text)
    # a counter, one sample per engine: only its lines go to the parser (the whole page is slow to parse)
    lines = "".join(line + "\n" for line in text.splitlines() if line.startswith(PROMPT_TOKENS))
    prompt_total = sum(
        s.value for f in text_string_to_metric_families(lines) for s in f.samples if s.name == PROMPT_TOKENS
    )
    return Poll(gauges, cache.capacity_tokens if cache else 0, int(prompt_total))


@dataclass(eq=False)
class Backend(ReplicaBooks):
    """One vLLM replica: its address, what its last poll said, and this gateway's work on it (the books)."""

    url: str
    source: str = ""  # the DNS name it was found through, if any
    gauges: EngineGauges = EngineGauges(0.0, 0.0, 0.0)
    polled_ok_at: float = float("-inf")  # gateway clock of the last poll that answered
    heard_at: float = float("-inf")  # gateway clock of the last piece of an answer it streamed back
    refused_until_poll: bool = False  # a request failed to connect: unavailable until a poll answers
    stale: bool = False  # /metrics unanswered, and no answer streaming from it, for stale_after_s
    kv_capacity: int = 0  # KV-cache tokens its /metrics publishes (0: not published)
    prompt_tokens_total: int = 0  # vllm:prompt_tokens_total at the last poll
    retired: bool = False  # no longer in its DNS name: no new work, leaves once its requests end
    aborters: set[Callable[[str], None]] = field(default_factory=set)  # cut off its requests, saying why

    @functools.cached_property
    def shown(self) -> str:
        """Its URL as logs, metrics and error bodies name it: without a user and key it may carry. Worked
        out once: the metrics name it at every poll."""
        return without_credentials(self.url)


@dataclass(eq=False)
class Flight:
    """One admitted request in flight on a backend: what the gateway charged it and its trip there."""

    request: Request
    backend: Backend
    estimate_gpu_s: float
    exchange: Exchange
    preamble_events: int = 0  # events its stream sends before the first token's (chat: the role)

    @property
    def started(self) -> bool:
        """Known to be in a batch: its stream's first token is out. A request not streamed shows nothing
        until its end, so it is taken as started (shed only once its deadline has passed)."""
        return self.exchange.answering or not self.exchange.stream

    @property
    def output_tokens(self) -> int:
        """Tokens streamed back so far (0 when not streamed)."""
        return max(0, self.exchange.events - self.preamble_events)


class LivePool(PoolBooks):
    """The backends of one scenario pool and this gateway's books on them."""

    def __init__(
        self,
        name: str,
        urls: list[str],
        gpus_per_replica: int,
        max_num_seqs: int,
        prior_estimate_gpu_s: float,
        on_stale: str,
        kv_capacity_tokens: int = 0,
        estimator: CostEstimator | None = None,
        priorities: Mapping[str, int] | None = None,
    ) -> None:
        super().__init__(prior_estimate_gpu_s, priorities)
        self.name = name
        self.estimator = estimator  # prices own requests' progress, for the remaining work
        self.flights: dict[int, Flight] = {}  # own requests in flight, by request id
        self.backends = [Backend(u) for u in urls if not is_discovered(u)]
        self.dns_names = [u for u in urls if is_discovered(u)]
        self.gpus_per_replica = gpus_per_replica
        self.max_num_seqs = max_num_seqs
        self.kv_capacity_tokens = kv_capacity_tokens  # the profile's, for backends that do not publish theirs
        self.keep_stale = on_stale == "last_known"
        self.peak_own_gpu_s = 0.0

    # --- availability -----------------------------------------------------------------------------------

    def takes_work(self, backend: Backend) -> bool:
        """Answering, or stale but kept on its last gauges as the scenario says."""
        return not (backend.refused_until_poll or backend.retired) and (not backend.stale or self.keep_stale)

    def available(self) -> list[Backend]:
        return [b for b in self.backends if self.takes_work(b)]

    def join(self, urls: list[str], source: str) -> list[Backend]:
        """Make the pool's backends found through `source` exactly `urls`: new ones join, missing ones
        retire. Returns the backends that joined."""
        known = {b.url: b for b in self.backends if b.source == source}
        joined = [Backend(u, source=source) for u in urls if u not in known]
        for url, b in known.items():
            b.retired = url not in urls
        self.backends += joined
        return joined

    def leave(self, backend: Backend) -> bool:
        """Drop a retired backend once this gateway has nothing left on it; True if it left."""
        if backend.retired and backend.own_requests == 0:
            self.backends.remove(backend)
            return True
        return False

    def polled(self, backend: Backend, poll: EngineGauges | Poll, now: float) -> bool:
        """A poll of `backend` answered: take its gauges; a refused or stale backend rejoins. True when it
        was stale."""
        rejoined = backend.stale
        if isinstance(poll, Poll):
            backend.kv_capacity = poll.kv_capacity
            backend.prompt_tokens_total = poll.prompt_tokens_total
            gauges = poll.gauges
        else:
            gauges = poll
        backend.gauges = gauges
        backend.polled_ok_at = now
        backend.refused_until_poll = False
        backend.stale = False
        backend.count_others(gauges.running, gauges.waiting)
        return rejoined

    def poll_failed(self, backend: Backend, now: float, stale_after_s: float) -> bool:
        """A poll of `backend` did not answer: once silent for `stale_after_s` it is stale, and unless the
        scenario keeps stale backends its in-flight requests are cut off. An answer streaming from it breaks
        the silence: its API server may be too busy for `/metrics`, but its engine runs, and cutting it off
        would fail requests that are being served. True when it has just gone stale."""
        if now - max(backend.polled_ok_at, backend.heard_at) < stale_after_s or backend.stale:
            return False
        backend.stale = True
        if not self.keep_stale:
            self.cut_off(backend)
        return True

    def refused(self, backend: Backend) -> None:
        """A request to `backend` could not connect: no more work for it until a poll answers."""
        backend.refused_until_poll = True

    @staticmethod
    def cut_off(backend: Backend) -> None:
        for abort in list(backend.aborters):
            abort(f"backend {backend.shown} stopped answering; the request was cut off")

    # --- the snapshot -----------------------------------------------------------------------------------

    def snapshot(self, now: float) -> PoolSnapshot:
        """The pool as this gateway sees it: the last gauges of its available backends and its books."""
        done = 0.0
        if self.estimator is not None:
            for f in self.flights.values():
                if f.exchange.answering and self.takes_work(f.backend):
                    done += self.estimator.done(f.estimate_gpu_s, f.request.prompt_tokens, f.output_tokens)
        return self.pool_snapshot(
            now, [(b, self.published(b)) for b in self.available()], self.max_num_seqs, self.gpus_per_replica,
            self.kv_capacity_tokens, done,
        )  # fmt: skip

    @staticmethod
    def published(b: Backend) -> Gauges:
        """What `b`'s /metrics said at its last poll that answered."""
        g = b.gauges
        return Gauges(g.running, g.waiting, g.kv_usage, b.kv_capacity, b.prompt_tokens_total, b.polled_ok_at)

    # --- routing and books ------------------------------------------------------------------------------

    def route(self, routing: str) -> Backend | None:
        """The backend an admitted request goes to (None: none available). least_work: least predicted
        work (own at its estimates, others' at the mean estimate); least_loaded: fewest requests;
        round_robin: in turn."""
        live = self.available()
        return live[self.pick(live, routing)] if live else None

    def charge(self, replica: ReplicaBooks, tier: str, gpu_s: float, prompt_tokens: int = 0) -> None:
        """An admitted request of `prompt_tokens` charged `gpu_s` is sent to `replica` (a backend)."""
        super().charge(replica, tier, gpu_s, prompt_tokens)
        self.peak_own_gpu_s = max(self.peak_own_gpu_s, self.own_gpu_s)

    @property
    def own_gpu_s(self) -> float:
        """GPU-seconds this gateway admitted to this pool and not yet finished."""
        return sum(b.own_gpu_s for b in self.backends)

    @property
    def own_requests(self) -> int:
        return sum(b.own_requests for b in self.backends)
