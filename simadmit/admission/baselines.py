"""Admission rules production systems use, each written as the system documents it, to compare against.

- `SaturationShedding`: the Kubernetes Gateway API Inference Extension's saturation detector. A replica's
  saturation is max(waiting requests / 5, KV-cache use / 0.8); one whose metrics are older than 200 ms
  counts as saturated; the pool is saturated when the mean over replicas reaches 1, and then only sheddable
  (lower-priority) requests are rejected: critical ones always go through.
- `TokenBucket`: a token bucket on input (prompt) tokens per tier, refilled at `rate` up to `burst`, as
  rate-limiting gateways (Envoy's local rate limit, Kong) meter requests.
- `RateLimits`: requests-per-minute and tokens-per-minute per tier over fixed one-minute windows, as LLM
  API gateways do; a request counts its prompt plus `max_tokens` against TPM when it is let in, as
  OpenAI-style limits charge the tokens a request may use.
- `PostHocTokens`: tokens charged after completion (prompt + actual output) against a per-minute budget
  per tier, as AI gateways that meter usage from responses do; what is in flight is not counted yet.

Each is a plain object, like every policy. The stateful ones are `central`: shared by a pool's gateway
replicas, as a central limiter (a Redis counter) would be.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

from simadmit.admission.policies import ADMIT, AdmissionPolicy, Decision, PoolView, Request, retry_after
from simadmit.admission.predictive import StatefulPolicy


@dataclass(frozen=True, slots=True)
class SaturationShedding(AdmissionPolicy):
    """Gateway API Inference Extension saturation detection: shed sheddable requests while the pool is
    saturated (see module docstring). `critical`: tiers never shed; every other tier is sheddable."""

    critical: frozenset[str] = frozenset({"interactive"})
    queue_depth_threshold: float = 5.0
    kv_cache_threshold: float = 0.8
    metrics_staleness_s: float = 0.2
    retry_after_s: float = 1.0

    def saturation(self, view: PoolView, now: float) -> float:
        """Mean over replicas of max(queue / threshold, KV use / threshold); stale replicas count as 1."""
        if not view.replicas:
            return math.inf
        total = 0.0
        for r in view.replicas:
            score = max(r.waiting / self.queue_depth_threshold, r.kv_used_fraction / self.kv_cache_threshold)
            if now - r.polled_at > self.metrics_staleness_s:
                score = max(score, 1.0)
            total += score
        return total / len(view.replicas)

    def decide(self, request: Request, estimate_gpu_s: float, view: PoolView, now: float) -> Decision:
        if request.tier in self.critical:
            return ADMIT
        if self.saturation(view, now) >= 1.0:
            return Decision(False, "pool_saturated", retry_after(self.retry_after_s))
        return ADMIT


@dataclass
class TokenBucket(StatefulPolicy):
    """Per tier: a bucket of `burst` input tokens refilled at `rate` tokens/s; a request takes its prompt
    tokens, or is rejected (`rate_limited`) with a Retry-After of the time the bucket needs to hold them.
    Tiers without a bucket are not limited. A prompt larger than the burst can never pass."""

    central: ClassVar[bool] = True

    buckets: dict[str, tuple[float, float]] = field(default_factory=dict)  # tier -> (rate, burst)
    level: dict[str, float] = field(default_factory=dict, init=False)
    updated: dict[str, float] = field(default_factory=dict, init=False)

    def fresh(self) -> TokenBucket:
        return TokenBucket(dict(self.buckets))

    def split(self, processes: int) -> TokenBucket:
        """Each bucket refills at 1/`processes` of the rate and keeps the whole burst: a prompt the shared
        bucket passes still passes one process, and over time they pass the shared rate."""
        return TokenBucket({t: (rate / processes, burst) for t, (rate, burst) in self.buckets.items()})

    def decide(self, request: Request, estimate_gpu_s: float, view: PoolView, now: float) -> Decision:
        bucket = self.buckets.get(request.tier)
        if bucket is None:
            return ADMIT
        rate, burst = bucket
        tier = request.tier
        level = min(burst, self.level.get(tier, burst) + (now - self.updated.get(tier, now)) * rate)
        self.updated[tier] = now
        need = request.prompt_tokens
        if need > level:
            self.level[tier] = level
            wait = (need - level) / rate if need <= burst else math.inf
            return Decision(False, "rate_limited", retry_after(min(wait, 3600.0)))
        self.level[tier] = level - need
        return ADMIT


@dataclass
class RateLimits(StatefulPolicy):
    """Per tier: at most `rpm` requests and `tpm` tokens (prompt + max_tokens) per fixed one-minute window
    ([0, 60), [60, 120), ...); over either, `rate_limited` with a Retry-After to the next window."""

    central: ClassVar[bool] = True

    limits: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)  # tier -> (rpm, tpm)
    window_s: float = 60.0
    window: dict[str, int] = field(default_factory=dict, init=False)
    requests: dict[str, int] = field(default_factory=dict, init=False)
    tokens: dict[str, int] = field(default_factory=dict, init=False)

    def fresh(self) -> RateLimits:
        return RateLimits(dict(self.limits), self.window_s)

    def split(self, processes: int) -> RateLimits:
        """1/`processes` of each tier's requests and tokens per window."""
        limits = {
            t: (None if rpm is None else rpm / processes, None if tpm is None else tpm / processes)
            for t, (rpm, tpm) in self.limits.items()
        }
        return RateLimits(limits, self.window_s)

    def decide(self, request: Request, estimate_gpu_s: float, view: PoolView, now: float) -> Decision:
        limit = self.limits.get(request.tier)
        if limit is None:
            return ADMIT
        rpm, tpm = limit
        tier = request.tier
        w = int(now // self.window_s)
        if self.window.get(tier) != w:
            self.window[tier], self.requests[tier], self.tokens[tier] = w, 0, 0
        tokens = request.prompt_tokens + request.max_tokens
        if (rpm is not None and self.requests[tier] + 1 > rpm) or (
            tpm is not None and self.tokens[tier] + tokens > tpm
        ):
            return Decision(False, "rate_limited", retry_after((w + 1) * self.window_s - now))
        self.requests[tier] += 1
        self.tokens[tier] += tokens
        return ADMIT


@dataclass
class PostHocTokens(StatefulPolicy):
    """Per tier: a budget of tokens per fixed window, charged when a request completes (prompt + actual
    output). Requests are let in while the window's charged tokens are under the budget, so everything in
    flight when the budget runs out still lands on it: the overshoot post-hoc metering allows."""

    central: ClassVar[bool] = True

    budgets: dict[str, float] = field(default_factory=dict)  # tier -> tokens per window
    window_s: float = 60.0
    window: dict[str, int] = field(default_factory=dict, init=False)
    used: dict[str, float] = field(default_factory=dict, init=False)

    def fresh(self) -> PostHocTokens:
        return PostHocTokens(dict(self.budgets), self.window_s)

    def split(self, processes: int) -> PostHocTokens:
        """1/`processes` of each tier's token budget per window."""
        return PostHocTokens({t: b / processes for t, b in self.budgets.items()}, self.window_s)

    def _used(self, tier: str, now: float) -> float:
        w = int(now // self.window_s)
        if self.window.get(tier) != w:
            self.window[tier], self.used[tier] = w, 0.0
        return self.used[tier]

    def decide(self, request: Request, estimate_gpu_s: float, view: PoolView, now: float) -> Decision:
        budget = self.budgets.get(request.tier)
        if budget is None or self._used(request.tier, now) < budget:
            return ADMIT
        w = self.window[request.tier]
        return Decision(False, "token_budget_spent", retry_after((w + 1) * self.window_s - now))

    def observe_completion(self, request: Request, output_tokens: int, now: float) -> None:
        if request.tier in self.budgets:
            self.used[request.tier] = self._used(request.tier, now) + request.prompt_tokens + output_tokens
