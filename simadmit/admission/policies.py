"""Admission policies: decide at the front door, before queueing, whether a request may enter.

Plain Python with no simulator imports, so a real gateway can run the very same objects: it fills a
`PoolView` from its last poll of the pool (plus what it admitted since), asks `decide`, and answers a
rejection with HTTP 429 and the decision's Retry-After.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from simadmit.admission.view import EngineModel, ReplicaLoad
from simadmit.config.defaults import (
    DEFAULT_BUDGET_S,
    DEFAULT_BUDGETS_S,
    DEFAULT_HEADROOM,
    default_max_pool_gpu_s,
)
from simadmit.config.profile import StepTimeModel


@dataclass(frozen=True, slots=True)
class Request:
    """What the gateway knows of a request: never its true output length."""

    id: int
    tier: str
    prompt_tokens: int
    max_tokens: int
    arrival_s: float
    deadline_s: float | None = None  # absolute time by which the client needs its answer


@dataclass(slots=True)
class PoolView:
    """A gateway's picture of a pool at decision time: stale by up to one poll interval."""

    in_flight_gpu_s: float = 0.0  # predicted GPU-seconds admitted and not yet finished
    in_flight_by_tier: dict[str, float] = field(default_factory=dict)  # the same, per tier
    queued: int = 0  # admitted requests not yet scheduled on an engine
    running: int = 0  # requests in an engine batch
    free_batch_slots: int = 0  # batch slots free on serving replicas
    kv_used_fraction: float = 0.0  # KV cache in use, over serving replicas
    available_gpus: int = 0  # GPUs of replicas that are serving
    polled_at: float = 0.0
    remaining_gpu_s: float = 0.0  # in-flight work still to do: charged GPU-seconds minus progress made
    replicas: list[ReplicaLoad] = field(default_factory=list)  # per serving replica
    engine: EngineModel | None = None  # the pool's step-time model, for policies that predict TTFT
    pool: int = 0  # which of the gateway's pools: what a policy learns of a pool's engines is kept per pool


class Decision(NamedTuple):
    admit: bool
    reason: str
    retry_after_s: float = 0.0
    predicted_wait_s: float = math.nan  # the X-Queue-Predict-Wait header, when the policy predicts one


ADMIT = Decision(True, "admitted")


def deadline_lost(
    request: Request, step: StepTimeModel, now: float, started: bool, output_tokens: float
) -> bool:
    """Post-queue shedding for any policy. A queued request is lost when even alone on an idle replica (its
    prompt's prefill, then `output_tokens` at the fastest decode step) its answer would come after its
    deadline; a running one once its deadline has passed (its answer is late whatever happens). Without a
    learned output length the gateway counts one token: it sheds only what cannot make it."""
    if request.deadline_s is None:
        return False
    if started:
        return now > request.deadline_s
    return now + step.fastest_s(request.prompt_tokens, output_tokens) > request.deadline_s


def retry_after(seconds: float) -> float:
    """Retry-After as an HTTP header carries it: whole seconds, at least one."""
    return float(max(1, math.ceil(seconds)))


class AdmissionPolicy:
    """Base class: one method, `decide`. Policies must not mutate the view."""

    def decide(self, request: Request, estimate_gpu_s: float, view: PoolView, now: float) -> Decision:
        raise NotImplementedError


class Unconditional(AdmissionPolicy):
    """Admit everything into an unbounded FIFO queue: p99 explodes past saturation."""

    def decide(self, request: Request, estimate_gpu_s: float, view: PoolView, now: float) -> Decision:
        return ADMIT


@dataclass(frozen=True, slots=True)
class QueueDepth(AdmissionPolicy):
    """Reject when `max_queued` admitted requests wait unscheduled: counts requests, not their cost.

    `max_queued = 0` is a loss system (M/M/c/c): no waiting room, so a request is admitted only while the
    admitted requests not yet scheduled are fewer than the free batch slots (one is left for it).
    """

    max_queued: int
    retry_after_s: float = 1.0

    def decide(self, request: Request, estimate_gpu_s: float, view: PoolView, now: float) -> Decision:
        full = (
            view.queued >= view.free_batch_slots if self.max_queued == 0 else view.queued >= self.max_queued
        )
        if full:
            return Decision(False, "queue_full", retry_after(self.retry_after_s))
        return ADMIT


@dataclass(frozen=True, slots=True)
class GpuSeconds(AdmissionPolicy):
    """Admit by predicted GPU-seconds: predicted wait = in-flight GPU-seconds / available GPUs.

    Rejects `pool_exhausted` when no GPU serves or the pool is already at its maximum, `would_exceed_sla`
    when the predicted wait exceeds the tier's budget (tightened by the request's deadline), and
    `pool_headroom_exhausted` when admitting would push in-flight work past max x headroom. The headroom
    absorbs what other gateway replicas admitted since this one last polled. Optional per-tier caps
    (`tier_max_gpu_s`, reason `tier_share_exhausted`) keep a tier with a long budget from filling the pool
    above the threshold a short-budget tier needs.
    """

    budgets_s: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_BUDGETS_S))
    default_budget_s: float = DEFAULT_BUDGET_S
    headroom: float = DEFAULT_HEADROOM
    max_pool_gpu_s: float | None = None  # None: available GPUs x the largest budget
    tier_max_gpu_s: dict[str, float] = field(default_factory=dict)  # per-tier caps on in-flight work
    no_capacity_retry_s: float = 5.0

    def wait_budget(self, request: Request, now: float) -> float:
        """Seconds of wait this request can afford: its tier's budget, or less if its deadline is near."""
        b = self.budgets_s.get(request.tier, self.default_budget_s)
        if request.deadline_s is not None:
            b = min(b, request.deadline_s - now)
        return b

    def decide(self, request: Request, estimate_gpu_s: float, view: PoolView, now: float) -> Decision:
        gpus = view.available_gpus
        if gpus <= 0:
            return Decision(False, "pool_exhausted", retry_after(self.no_capacity_retry_s))
        max_pool = self.max_pool_gpu_s
        if max_pool is None:
            max_pool = default_max_pool_gpu_s(gpus, self.budgets_s, self.default_budget_s)
        in_flight = view.in_flight_gpu_s
        limit = max_pool * self.headroom
        wait = in_flight / gpus  # the prediction: what a gateway sends as X-Queue-Predict-Wait
        if in_flight >= max_pool:
            excess = (in_flight + estimate_gpu_s - limit) / gpus
            return Decision(False, "pool_exhausted", retry_after(excess), wait)
        budget = self.wait_budget(request, now)
        if wait > budget:
            return Decision(False, "would_exceed_sla", retry_after(wait - max(budget, 0.0)), wait)
        if in_flight + estimate_gpu_s > limit:
            excess = (in_flight + estimate_gpu_s - limit) / gpus
            return Decision(False, "pool_headroom_exhausted", retry_after(excess), wait)
        cap = self.tier_max_gpu_s.get(request.tier)
        if cap is not None:
            mine = view.in_flight_by_tier.get(request.tier, 0.0) + estimate_gpu_s
            if mine > cap:
                return Decision(False, "tier_share_exhausted", retry_after((mine - cap) / gpus), wait)
        return ADMIT._replace(predicted_wait_s=wait)
