"""A live pool: its vLLM backends, their polled gauges, and the books of the work this gateway sent them.

Each poll reads every backend's `/metrics` gauges (`vllm:num_requests_running`, `vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc`) and turns them, with this gateway's own books, into the `PoolSnapshot` the
simulator's pool publishes. vLLM does not publish predicted GPU-seconds, so the snapshot's in-flight work is
this gateway's own in-flight requests at the estimates it charged, plus the requests a backend holds beyond
them (other gateways' work) at the mean estimate this gateway has been charging. vLLM's running and
waiting gauges can leave out requests that have not produced a first token yet (measured on the CPU
server, whose steps last seconds: `waiting` stayed 0 while up to half of the requests in flight waited for
theirs), so of this gateway's own requests the count is taken to hold those whose answer has begun, and
those not yet answering only as far as vLLM reports requests waiting; other gateways' requests that vLLM
does not count yet stay invisible until it does. Between polls the
`Gateway` object adds its own admits, exactly as in the simulator; work other gateways admitted since the
last poll stays invisible, which is the staleness the headroom exists for.

The snapshot's remaining work (`work: remaining`) is counted as the simulator's pool counts it: each own
request whose answer has begun less its prefill and the tokens it has streamed back (one per server-sent
event; a chat stream opens with an event naming the role), priced by the pool's estimator. A request not
streamed shows no progress until it ends, and other gateways' requests none at all (vLLM publishes no
per-request progress): both count in full, as under `work: admitted`.

For engine-aware policies (`predicted_ttft`) the snapshot also carries one `ReplicaLoad` per available
backend (`replica_load`): vLLM's running gauge, KV usage x the KV capacity its `vllm:cache_config_info`
publishes (else the profile's), its `vllm:prompt_tokens_total` counter, the profile's batch slots, and from
this gateway's books the prompts it sent there that have not produced a first token. vLLM's /metrics does not
publish the prompt tokens waiting, so other gateways' unanswered prompts are known only as vLLM's waiting
count beyond this gateway's own, each priced at the mean prompt this gateway has sent.

A backend is unavailable (no work, no GPUs in the snapshot) while a request to it has just failed to
connect, until a poll answers again; when its `/metrics` has not answered for `stale_after_s`, the scenario's
`on_stale` says whether it is unavailable (and its in-flight requests are cut off with a 503) or kept on its
last known gauges.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from simadmit.admission.estimator import CostEstimator
from simadmit.admission.gateway import PoolSnapshot
from simadmit.admission.policies import Request
from simadmit.admission.view import ReplicaLoad, prompt_attention_pairs
from simadmit.calibrate.metrics import EngineGauges, parse_cache_config, parse_gauges
from simadmit.serve.discovery import is_discovered
from simadmit.serve.upstream import Exchange

# how fast the mean charged estimate follows new admits: about the last 50 requests. Until 50 are charged it
# is their plain mean: a prior (a tier's max_tokens with no prompt) left to fade at this rate would price
# other gateways' requests low for minutes
ESTIMATE_SMOOTHING = 0.02
PROMPT_TOKENS = "vllm:prompt_tokens_total"  # prompt tokens prefilled since the server started


@dataclass(frozen=True, slots=True)
class Poll:
    """What one read of a backend's /metrics gives: its gauges, its KV capacity in tokens (0: not
    published) and its prompt tokens prefilled since it started (0: not published)."""

    gauges: EngineGauges
    kv_capacity: int = 0
    prompt_tokens_total: int = 0


def parse_poll(text: str) -> Poll:
    """A backend's /metrics text as a `Poll` (ValueError when it is not the exposition format)."""
    cache = parse_cache_config(text)
    # a counter, one sample per engine: only its lines go to the parser (the whole page is slow to parse)
    lines = "".join(line + "\n" for line in text.splitlines() if line.startswith(PROMPT_TOKENS))
    prompt_total = sum(
        s.value for f in text_string_to_metric_families(lines) for s in f.samples if s.name == PROMPT_TOKENS
    )
    return Poll(parse_gauges(text), cache.capacity_tokens if cache else 0, int(prompt_total))


@dataclass(eq=False)
class Backend:
    """One vLLM replica: its address, what its last poll said, and this gateway's work on it."""

    url: str
    source: str = ""  # the DNS name it was found through, if any
    gauges: EngineGauges = EngineGauges(0.0, 0.0, 0.0)
    polled_ok_at: float = float("-inf")  # gateway clock of the last poll that answered
    refused_until_poll: bool = False  # a request failed to connect: unavailable until a poll answers
    stale: bool = False  # /metrics unanswered for stale_after_s
    own_requests: int = 0  # admitted by this gateway, sent here, not finished
    own_answering: int = 0  # of them, those whose answer has begun: the ones vLLM's gauges count
    own_gpu_s: float = 0.0
    own_prefill_tokens: int = 0  # prompt tokens of own requests sent here that have no first token yet
    own_prefill_pairs: float = 0.0  # their prefill attention pairs
    others_at_poll: float = 0.0  # requests the backend held at the last poll beyond this gateway's own
    others_waiting: float = 0.0  # of them, those vLLM reported waiting
    kv_capacity: int = 0  # KV-cache tokens its /metrics publishes (0: not published)
    prompt_tokens_total: int = 0  # vllm:prompt_tokens_total at the last poll
    retired: bool = False  # no longer in its DNS name: no new work, leaves once its requests end
    aborters: set[Callable[[str], None]] = field(default_factory=set)  # cut off its requests, saying why


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


class LivePool:
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
    ) -> None:
        self.name = name
        self.estimator = estimator  # prices own requests' progress, for the remaining work
        self.flights: dict[int, Flight] = {}  # own requests in flight, by request id
        self.backends = [Backend(u) for u in urls if not is_discovered(u)]
        self.dns_names = [u for u in urls if is_discovered(u)]
        self.gpus_per_replica = gpus_per_replica
        self.max_num_seqs = max_num_seqs
        self.kv_capacity_tokens = kv_capacity_tokens  # the profile's, for backends that do not publish theirs
        self.mean_estimate = prior_estimate_gpu_s  # moving mean of the GPU-seconds charged per admit
        self.mean_prompt = 0.0  # moving mean of the prompt tokens sent (and of their attention pairs)
        self.mean_pairs = 0.0
        self.charges = 0
        self.keep_stale = on_stale == "last_known"
        self.own_by_tier: dict[str, float] = {}
        self.admits_by_tier: dict[str, int] = {}
        self.peak_own_gpu_s = 0.0
        self.rr = 0

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

    def polled(self, backend: Backend, poll: EngineGauges | Poll, now: float) -> None:
        """A poll of `backend` answered: take its gauges; a refused or stale backend rejoins."""
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
        # own requests in the count: those answering, and those not yet, as far as vLLM has them waiting
        pending = backend.own_requests - backend.own_answering
        counted_own = backend.own_answering + min(pending, gauges.waiting)
        backend.others_at_poll = max(0.0, gauges.running + gauges.waiting - counted_own)
        backend.others_waiting = max(0.0, gauges.waiting - pending)

    def poll_failed(self, backend: Backend, now: float, stale_after_s: float) -> None:
        """A poll of `backend` did not answer: once silent for `stale_after_s` it is stale, and unless the
        scenario keeps stale backends its in-flight requests are cut off."""
        if now - backend.polled_ok_at >= stale_after_s and not backend.stale:
            backend.stale = True
            if not self.keep_stale:
                self.cut_off(backend)

    def refused(self, backend: Backend) -> None:
        """A request to `backend` could not connect: no more work for it until a poll answers."""
        backend.refused_until_poll = True

    @staticmethod
    def cut_off(backend: Backend) -> None:
        for abort in list(backend.aborters):
            abort(f"backend {backend.url} stopped answering; the request was cut off")

    # --- the snapshot -----------------------------------------------------------------------------------

    def snapshot(self, now: float) -> PoolSnapshot:
        """What the simulator's pool would publish, from the last gauges and this gateway's books."""
        live = self.available()
        others = sum(b.others_at_poll for b in live)
        own = sum(b.own_gpu_s for b in live)
        others_gpu_s = others * self.mean_estimate
        by_tier = dict(self.own_by_tier)
        admitted = sum(self.admits_by_tier.values())
        if admitted and others_gpu_s:  # other gateways' work, in the mix of tiers this one admits
            for tier, n in self.admits_by_tier.items():
                by_tier[tier] = by_tier.get(tier, 0.0) + others_gpu_s * n / admitted
        done = 0.0
        if self.estimator is not None:
            for f in self.flights.values():
                if f.exchange.answering and self.takes_work(f.backend):
                    done += self.estimator.done(f.estimate_gpu_s, f.request.prompt_tokens, f.output_tokens)
        running = sum(b.gauges.running for b in live)
        waiting = sum(b.gauges.waiting for b in live)
        free = sum(max(0.0, self.max_num_seqs - b.gauges.running - b.gauges.waiting) for b in live)
        kv = sum(b.gauges.kv_usage for b in live) / len(live) if live else 0.0
        return PoolSnapshot(
            now, own + others_gpu_s, by_tier, int(waiting), int(running), int(free), kv,
            len(live) * self.gpus_per_replica, max(0.0, own - done) + others_gpu_s,
            tuple(self.replica_load(b) for b in live),
        )  # fmt: skip

    def replica_load(self, b: Backend) -> ReplicaLoad:
        """One backend as an engine-aware policy sees it. Every own request without a first token counts as
        waiting with its whole prompt (one vLLM already runs is counted twice, on the cautious side); other
        gateways' are only vLLM's waiting count beyond this gateway's own at the last poll, each with the
        mean prompt this gateway has sent (their prompts are not published), and their prompts being
        prefilled count only as running sequences."""
        pending = b.own_requests - b.own_answering
        capacity = b.kv_capacity or self.kv_capacity_tokens
        return ReplicaLoad(
            int(b.gauges.running), pending + round(b.others_waiting),
            b.own_prefill_tokens + round(b.others_waiting * self.mean_prompt),
            b.own_prefill_pairs + b.others_waiting * self.mean_pairs,
            round(b.gauges.kv_usage * capacity), capacity, self.max_num_seqs,
            b.own_gpu_s + b.others_at_poll * self.mean_estimate, b.prompt_tokens_total,
            polled_at=b.polled_ok_at,  # -inf before the first poll: no prefill rate from it
        )  # fmt: skip

    # --- routing and books ------------------------------------------------------------------------------

    def route(self, routing: str) -> Backend | None:
        """The backend an admitted request goes to (None: none available). least_work: least predicted
        work (own at its estimates, others' at the mean estimate); least_loaded: fewest requests;
        round_robin: in turn."""
        live = self.available()
        if not live:
            return None
        if routing == "round_robin":
            self.rr = (self.rr + 1) % len(live)
            return live[self.rr]
        if routing == "least_loaded":
            return min(live, key=lambda b: b.own_requests + b.others_at_poll)
        mean = self.mean_estimate
        return min(live, key=lambda b: b.own_gpu_s + b.others_at_poll * mean)

    def charge(self, backend: Backend, tier: str, gpu_s: float, prompt_tokens: int = 0) -> None:
        """An admitted request of `prompt_tokens` charged `gpu_s` is sent to `backend`."""
        backend.own_requests += 1
        backend.own_gpu_s += gpu_s
        pairs = prompt_attention_pairs(prompt_tokens)
        backend.own_prefill_tokens += prompt_tokens
        backend.own_prefill_pairs += pairs
        self.own_by_tier[tier] = self.own_by_tier.get(tier, 0.0) + gpu_s
        self.admits_by_tier[tier] = self.admits_by_tier.get(tier, 0) + 1
        self.charges += 1  # a plain mean of the first charges (the prior counts until the first), then moving
        weight = max(ESTIMATE_SMOOTHING, 1 / self.charges)
        self.mean_estimate += weight * (gpu_s - self.mean_estimate)
        self.mean_prompt += weight * (prompt_tokens - self.mean_prompt)
        self.mean_pairs += weight * (pairs - self.mean_pairs)
        self.peak_own_gpu_s = max(self.peak_own_gpu_s, self.own_gpu_s)

    def answering(self, backend: Backend, prompt_tokens: int = 0) -> None:
        """An own request's answer has begun: vLLM counts it from now on, its prompt is prefilled."""
        backend.own_answering += 1
        self._prefilled(backend, prompt_tokens)

    def release(
        self, backend: Backend, tier: str, gpu_s: float, answered: bool = False, prompt_tokens: int = 0
    ) -> None:
        """An own request ended (`answered`: after its first token)."""
        backend.own_requests -= 1
        backend.own_answering -= answered
        if not answered:
            self._prefilled(backend, prompt_tokens)
        backend.own_gpu_s = max(0.0, backend.own_gpu_s - gpu_s) if backend.own_requests else 0.0
        left = self.own_by_tier.get(tier, 0.0) - gpu_s
        self.own_by_tier[tier] = left if left > 1e-12 else 0.0

    @staticmethod
    def _prefilled(backend: Backend, prompt_tokens: int) -> None:
        """An own prompt leaves the prefill books (the pairs reset with the last, against rounding)."""
        backend.own_prefill_tokens -= prompt_tokens
        if backend.own_requests == backend.own_answering:
            backend.own_prefill_pairs = 0.0
        else:
            backend.own_prefill_pairs = max(
                0.0, backend.own_prefill_pairs - prompt_attention_pairs(prompt_tokens)
            )

    @property
    def own_gpu_s(self) -> float:
        """GPU-seconds this gateway admitted to this pool and not yet finished."""
        return sum(b.own_gpu_s for b in self.backends)

    @property
    def own_requests(self) -> int:
        return sum(b.own_requests for b in self.backends)
