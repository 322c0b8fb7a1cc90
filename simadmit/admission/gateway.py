"""Gateway: one replica of the admission gateway, as plain Python that a simulator or an HTTP server drives.

It keeps its own view of each pool, refreshed from a `PoolSnapshot` (what a pool's replicas publish on
their metrics endpoints when polled) and, between snapshots, advanced by what this gateway itself admitted:
other gateway replicas' admits stay invisible until the next poll, which is the staleness the policies'
headroom exists for. For each request it answers 400 when prompt plus `max_tokens` exceed what the model
serves (as vLLM would), estimates the request's GPU-seconds (charging the output its tier has been seen to
produce when an `OutputLearner` is given) and asks the policy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from simadmit.admission.estimator import CostEstimator, OutputLearner
from simadmit.admission.policies import AdmissionPolicy, Decision, PoolView, Request

TOO_LONG = Decision(False, "too_long", 0.0)  # HTTP 400: never retried


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """A pool's state as its metrics endpoints publish it, at one instant."""

    time: float
    in_flight_gpu_s: float  # predicted GPU-seconds admitted and not yet finished
    in_flight_by_tier: Mapping[str, float]
    queued: int  # admitted, not yet scheduled on an engine
    running: int  # in an engine batch
    free_batch_slots: (
        int  # over serving replicas: batch slots neither running nor claimed by a waiting request
    )
    kv_used_fraction: float  # KV-cache tokens held / KV capacity, over serving replicas
    available_gpus: int  # GPUs of replicas that are serving


class Gateway:
    """One gateway replica in front of several pools (pool i: `estimators[i]`, `max_request_tokens[i]`)."""

    def __init__(
        self,
        policy: AdmissionPolicy,
        estimators: Sequence[CostEstimator],
        max_request_tokens: Sequence[int],
        learner: OutputLearner | None = None,
    ) -> None:
        self.policy = policy
        self.estimators = tuple(estimators)
        self.max_request_tokens = tuple(max_request_tokens)
        self.learner = learner
        self.views = [PoolView() for _ in self.estimators]

    def refresh(self, pool: int, snapshot: PoolSnapshot) -> None:
        """Replace this gateway's view of `pool` by a fresh snapshot (its own admits are in it from now on)."""
        view = self.views[pool]
        view.in_flight_gpu_s = snapshot.in_flight_gpu_s
        view.in_flight_by_tier = dict(snapshot.in_flight_by_tier)
        view.queued = snapshot.queued
        view.running = snapshot.running
        view.free_batch_slots = snapshot.free_batch_slots
        view.kv_used_fraction = snapshot.kv_used_fraction
        view.available_gpus = snapshot.available_gpus
        view.polled_at = snapshot.time

    def estimate(self, request: Request, pool: int) -> float:
        """Predicted GPU-seconds: output charged at `max_tokens`, or at what the tier has really produced."""
        output: float = request.max_tokens
        if self.learner is not None:
            output = self.learner.expected_output(request.tier, request.max_tokens)
        return self.estimators[pool].estimate(request.prompt_tokens, output)

    def decide(self, request: Request, pool: int, now: float) -> tuple[Decision, float]:
        """The decision on `request` for `pool`, and the GPU-seconds it was charged (0 when too long).

        An admitted request is added to this gateway's view at once, so the next decision sees it.
        """
        if request.prompt_tokens + request.max_tokens > self.max_request_tokens[pool]:
            return TOO_LONG, 0.0
        est = self.estimate(request, pool)
        view = self.views[pool]
        decision = self.policy.decide(request, est, view, now)
        if decision.admit:
            view.in_flight_gpu_s += est
            view.in_flight_by_tier[request.tier] = view.in_flight_by_tier.get(request.tier, 0.0) + est
            view.queued += 1
        return decision, est

    def observe_completion(self, request: Request, output_tokens: int) -> None:
        """A request finished with `output_tokens` tokens: teach the learner, if any."""
        if self.learner is not None:
            self.learner.observe(request.tier, output_tokens)
