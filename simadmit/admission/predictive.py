"""Predicted-TTFT admission: admit a request when the engine model says its first token comes in time.

The article's rule ("predicted wait = in-flight GPU-seconds / GPUs") counts every decoding request until it
finishes, although with continuous batching a new request starts within a step or two while batch slots and
KV cache are free. This policy instead asks `EngineModel.ttft` what the replica least-work routing sends the
request to would do: finish the step in progress, prefill the prompts ahead and this one, after waiting for
a slot if none is free. It admits when the time already spent since the first attempt plus that prediction
fits the tier's TTFT budget (and the request's deadline), and otherwise answers 429 with the predicted wait
(the `X-Queue-Predict-Wait` value) and a Retry-After of the time the excess needs to drain.

It corrects itself online: the predicted and actual time to first token of what it admitted while a batch
slot was free feed an EWMA ratio per tier (a mis-calibrated profile, or the other gateways' admits it cannot
see, heal within tens of requests; waits for a slot are left out, their error being the renewal estimate's,
not the calibration's). A sheddable tier's ratio is never below the critical tier's, and a tier's ratio
relaxes towards 1 while none of its requests gets in, so a correction can never lock a tier out. The
end-to-end check's decode step has a correction of its own, the actual time per output token of what it
admitted over the step predicted at admission (one per pool for all its tiers, whose sequences share each
step; another pool's engines, another GPU, err otherwise):
a first token's errors (the queue, the prompt's prefill, the API server) say nothing of the decode, and the
step predicted at admission misses the requests that join the batch later, which the ratio learns.

An EWMA of the output lengths, taken in admission order (`AdmissionOrder`: completions come shortest
first), sets the rate at which a full batch frees slots and the expected length of an answer.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace
from typing import ClassVar

from simadmit.admission.estimator import RatioEwma
from simadmit.admission.policies import (
    ADMIT,
    AdmissionPolicy,
    Decision,
    GpuSeconds,
    PoolView,
    Request,
    deadline_lost,
    retry_after,
)
from simadmit.admission.view import least_work
from simadmit.config.defaults import DEFAULT_BUDGET_S, DEFAULT_BUDGETS_S

ALL = "*"  # key of statistics over every tier


def decode_key(pool: int) -> str:
    """The key of a pool's decode-step correction (its tiers' sequences share its engines' steps)."""
    return f"pool {pool}"


class StatefulPolicy(AdmissionPolicy):
    """A policy with state (learned, or counted like a rate limiter's). The gateway reports each admitted
    request's first token and completion; `fresh` gives a copy with no state, so every run starts cold.

    `central`: the state is one counter every gateway replica shares (a rate limiter's, kept in Redis);
    otherwise each replica keeps its own, learned from the answers it proxies."""

    central: ClassVar[bool] = False

    def fresh(self) -> StatefulPolicy:
        raise NotImplementedError

    def split(self, processes: int) -> StatefulPolicy:
        """A fresh copy for one of `processes` live gateways that cannot share a counter: a central policy
        gets 1/`processes` of its limits, so that together they let through what the simulated one does."""
        return self.fresh()

    def observe_first_token(self, request: Request, admitted_s: float, now: float) -> None: ...

    def observe_completion(self, request: Request, output_tokens: int, now: float) -> None: ...

    def observe_abort(self, request: Request, now: float) -> None:
        """An admitted request ended without its answer (aborted, shed): it will never complete."""

    def lost(self, request: Request, view: PoolView, now: float, started: bool) -> bool:
        """Whether an admitted request (queued, or `started` in a batch) should be shed: its deadline is lost."""
        return False

    @property
    def sheds(self) -> bool:
        """Whether `lost` can ever say yes (a gateway keeps no watch on deadlines otherwise)."""
        return False


class OutputEwma:
    """EWMA of output tokens per tier (and over all tiers): follows a shift in output lengths.

    Until `warmup` outputs the estimate is never below `prior`: a cold gateway assumes long outputs, slow
    finishes. (Fed in finishing order the first outputs would be the short ones: see `AdmissionOrder`.)"""

    def __init__(self, alpha: float = 0.02, prior: float = 256.0, warmup: int = 100) -> None:
        self.alpha = alpha
        self.prior = prior
        self.warmup = warmup
        self.count: dict[str, int] = {}
        self.mean: dict[str, float] = {}

    def observe(self, tier: str, output_tokens: int) -> None:
        for key in (tier, ALL):
            n = self.count.get(key, 0) + 1
            self.count[key] = n
            a = max(self.alpha, 1.0 / n)
            self.mean[key] = self.mean.get(key, 0.0) * (1 - a) + output_tokens * a

    def expected(self, tier: str = ALL) -> float:
        key = tier if tier in self.mean else ALL
        mean = self.mean.get(key, self.prior)
        return mean if self.count.get(key, 0) >= self.warmup else max(mean, self.prior)

    def warm(self, tier: str) -> bool:
        """Whether `tier`'s mean rests on `warmup` outputs of its own (not the cautious prior)."""
        return self.count.get(tier, 0) >= self.warmup


class AdmissionOrder:
    """Hands completed requests' output lengths on in the order the requests were admitted, not finished.

    Requests finish in order of length as much as of admission: in the first seconds of a run (or after a
    burst) the completions are the short ones, and once admission stops the last to finish are the long
    ones. An average over completions in finishing order is biased both ways: too short, a full batch is
    predicted to free slots too soon and requests wait past their budget; too long, everything is refused
    and nothing new completes to correct it. Released in admission order, a request's length is known only
    once every request admitted before it (of its tier) has finished, so the sample is the admitted stream
    itself, late by the age of the oldest request in flight. A request aborted or never reported is let go
    after `horizon_s`."""

    def __init__(self, horizon_s: float = 120.0) -> None:
        self.horizon_s = horizon_s
        self.order: dict[str, deque[tuple[int, float]]] = {}  # tier -> (id, admitted at), oldest first
        self.finished: dict[int, int | None] = {}  # finished out of order: id -> output (None: aborted)

    def admitted(self, tier: str, rid: int, now: float) -> None:
        self.order.setdefault(tier, deque()).append((rid, now))

    def finished_at(self, tier: str, rid: int, output_tokens: int | None, now: float) -> list[int]:
        """Record a request's end (`output_tokens` None: aborted); the outputs now released, in order."""
        self.finished[rid] = output_tokens
        queue = self.order.get(tier)
        released: list[int] = []
        while queue:
            head, at = queue[0]
            if head in self.finished:
                out = self.finished.pop(head)
                if out is not None:
                    released.append(out)
            elif now - at <= self.horizon_s:
                break
            queue.popleft()
        return released


@dataclass
class PredictedTtft(StatefulPolicy):
    """Admit when (time since first arrival) + predicted TTFT x learned correction <= the tier's budget,
    the predicted TTFT <= the pool's queue budget, and the predicted completion (TTFT + the tier's mean
    output x the decode step of the batch it joins) fits the tier's end-to-end budget.

    An engine's waiting queue is FCFS: whatever a long-budget tier is let in, every later request waits
    behind. So no tier may push the predicted TTFT past the tightest budget of the pool (`queue_budget`,
    default: the smallest of `budgets_s`), and tiers with a longer budget (sheddable, as the Gateway API
    Inference Extension calls lower-priority traffic) only up to `sheddable_fraction` of it: the
    interactive tier always finds room, and a batch request turned away retries within its own long budget.

    A decode batch that fills every slot is slow (each step carries every sequence), so the end-to-end check
    is what stops a saturated pool from serving everyone too slowly to count.

    Reasons: `pool_exhausted` (no replica serves), `would_exceed_sla` (the first token would not come within
    the budget or the deadline), `would_exceed_e2e` (the answer would not finish within the end-to-end
    budget or by the deadline). `margin` (< 1)
    keeps a fraction of each budget for what the model misses.
    """

    budgets_s: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_BUDGETS_S))
    default_budget_s: float = DEFAULT_BUDGET_S
    e2e_budgets_s: dict[str, float] = field(default_factory=dict)  # tiers absent: no end-to-end check
    margin: float = 0.7
    correct: bool = True  # learn the actual/predicted TTFT ratio per tier, and the decode step's
    alpha: float = 0.05
    queue_budget_s: float | None = None  # None: the smallest of budgets_s
    sheddable_fraction: float = 0.5
    no_capacity_retry_s: float = 5.0
    shed_lost_deadlines: bool = True
    outputs: OutputEwma = field(default_factory=OutputEwma)
    forget_s: float = 10.0  # a tier's correction relaxes towards 1 while none of its requests gets in
    ratio: RatioEwma = field(init=False)
    decode_ratio: RatioEwma = field(init=False)
    pending: dict[int, tuple[str, float]] = field(default_factory=dict, init=False)
    # admitted requests' pool, predicted decode step and, once it came, their first token's time
    decoding: dict[int, tuple[int, float, float | None]] = field(default_factory=dict, init=False)
    order: AdmissionOrder = field(default_factory=AdmissionOrder, init=False)

    def __post_init__(self) -> None:
        self.ratio = RatioEwma(self.alpha, warmup=20, low=0.25, high=4.0, forget_s=self.forget_s)
        self.decode_ratio = RatioEwma(self.alpha, warmup=20, low=0.25, high=4.0, forget_s=self.forget_s)

    def fresh(self) -> PredictedTtft:
        o = self.outputs
        return replace(
            self, outputs=OutputEwma(o.alpha, o.prior, o.warmup)
        )  # nothing learned, nothing pending

    def critical(self) -> str | None:
        """The tier with the tightest TTFT budget: the one every other tier must leave room for."""
        return min(self.budgets_s, key=self.budgets_s.__getitem__) if self.budgets_s else None

    def factor(self, tier: str, now: float) -> float:
        """The learned actual/predicted TTFT ratio of `tier`; a sheddable tier's never below the critical
        tier's, since both wait in the same FCFS queue: otherwise a critical tier whose predictions ran short
        would be refused while sheddable traffic, trusting its own correction, filled the queue."""
        if not self.correct:
            return 1.0
        f = self.ratio.factor(tier, now)
        critical = self.critical()
        if critical is not None and critical != tier:
            f = max(f, self.ratio.factor(critical, now))
        return f

    def budget(self, request: Request, now: float) -> float:
        """Seconds from now the first token may take: the tier's budget less the time already spent since the
        first attempt (backoff included, as TTFT counts it), or less if the deadline is nearer; never more
        than the pool's queue budget (a fraction of it for sheddable tiers)."""
        own = self.budgets_s.get(request.tier, self.default_budget_s)
        queue = self.queue_budget_s
        if queue is None:
            queue = min(self.budgets_s.values(), default=self.default_budget_s)
        if own > queue:
            queue *= self.sheddable_fraction
        b = min(own - (now - request.arrival_s), queue)
        if request.deadline_s is not None:
            b = min(b, request.deadline_s - now)
        return b

    def decide(self, request: Request, estimate_gpu_s: float, view: PoolView, now: float) -> Decision:
        if not view.replicas or view.available_gpus <= 0:
            return Decision(False, "pool_exhausted", retry_after(self.no_capacity_retry_s))
        assert view.engine is not None, "the gateway gives predictive policies the pool's engine model"
        load = view.replicas[least_work(view.replicas)]
        raw = view.engine.ttft(load, request.prompt_tokens, self.outputs.expected(), request.tier)
        factor = self.factor(request.tier, now)
        wait = raw * factor
        budget = self.budget(request, now) * self.margin
        if wait > budget:
            return Decision(False, "would_exceed_sla", retry_after(wait - max(budget, 0.0)), wait)
        raw_step = view.engine.decode_step(load, request.prompt_tokens)
        step = raw_step * (self.decode_ratio.factor(decode_key(view.pool), now) if self.correct else 1.0)
        checks = []  # (output tokens, seconds left for the answer)
        e2e = self.e2e_budgets_s.get(request.tier)
        if e2e is not None:
            output = min(float(request.max_tokens), self.outputs.expected(request.tier))
            checks.append((output, e2e - (now - request.arrival_s)))
        if request.deadline_s is not None:  # the answer, by the deadline
            output = min(float(request.max_tokens), self.outputs.expected(request.tier))
            checks.append((output, request.deadline_s - now))
        critical = self.critical()
        if critical is not None and critical != request.tier and critical in self.e2e_budgets_s:
            # sheddable: only while a critical request arriving now would still finish with room to spare
            output = self.outputs.expected(critical)
            checks.append((output, self.e2e_budgets_s[critical] * self.sheddable_fraction))
        for output, left in checks:
            finish = wait + output * step
            if finish > left * self.margin:
                return Decision(
                    False, "would_exceed_e2e", retry_after(finish - max(left * self.margin, 0.0)), wait
                )
        if load.running + load.waiting < load.max_seqs:  # the correction learns where the model is exact
            self.pending[request.id] = (request.tier, raw)
        self.decoding[request.id] = (view.pool, raw_step, None)
        self.order.admitted(request.tier, request.id, now)
        self.ratio.renew(request.tier, now)  # only a tier that gets nothing in lets its correction relax
        self.decode_ratio.renew(decode_key(view.pool), now)
        return ADMIT._replace(predicted_wait_s=wait)

    @property
    def sheds(self) -> bool:
        return self.shed_lost_deadlines

    def lost(self, request: Request, view: PoolView, now: float, started: bool) -> bool:
        """Shedding after admission. A request still queued whose answer cannot come before its deadline even
        if it started now on an idle replica (its prompt's prefill, then its tier's expected output at the
        fastest decode step) is dropped; one already running is aborted once its deadline has passed (its
        answer is late whatever happens; vLLM aborts it as when a client disconnects). No more GPU time goes
        to answers nobody waits for. The door already refused what was predicted late; this catches what
        became late after admission."""
        if not self.shed_lost_deadlines or view.engine is None:
            return False
        output = min(float(request.max_tokens), self.outputs.expected(request.tier))
        return deadline_lost(request, view.engine.step, now, started, output)

    def observe_first_token(self, request: Request, admitted_s: float, now: float) -> None:
        seen = self.pending.pop(request.id, None)
        if seen is not None:
            self.ratio.observe(seen[0], seen[1], now - admitted_s, now)
        if request.id in self.decoding:
            pool, step, _ = self.decoding[request.id]
            self.decoding[request.id] = (pool, step, now)

    def observe_completion(self, request: Request, output_tokens: int, now: float) -> None:
        self.pending.pop(request.id, None)
        pool, step, first_token_s = self.decoding.pop(request.id, (0, 0.0, None))
        if first_token_s is not None and output_tokens > 1 and step > 0:
            per_token = (now - first_token_s) / (output_tokens - 1)
            self.decode_ratio.observe(decode_key(pool), step, per_token, now)
        for out in self.order.finished_at(request.tier, request.id, output_tokens, now):
            self.outputs.observe(request.tier, out)

    def observe_abort(self, request: Request, now: float) -> None:
        self.pending.pop(request.id, None)
        self.decoding.pop(request.id, None)
        for out in self.order.finished_at(request.tier, request.id, None, now):
            self.outputs.observe(request.tier, out)


@dataclass(frozen=True, slots=True)
class GpuSecondsOnRemaining(GpuSeconds):
    """The article's GPU-seconds rule on remaining work: a request stops counting in full once it is
    underway, its prefill and decoded tokens subtracted as it progresses (the view's `remaining_gpu_s`)."""

    def decide(self, request: Request, estimate_gpu_s: float, view: PoolView, now: float) -> Decision:
        return GpuSeconds.decide(
            self, request, estimate_gpu_s, replace(view, in_flight_gpu_s=view.remaining_gpu_s), now
        )
