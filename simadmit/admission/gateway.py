"""Gateway: one replica of the admission gateway, as plain Python that a simulator or an HTTP server drives.

It keeps its own view of each pool, refreshed from a `PoolSnapshot` (what a pool's replicas publish on
their metrics endpoints when polled) and, between snapshots, advanced by what this gateway itself admitted:
other gateway replicas' admits stay invisible until the next poll, which is the staleness the policies'
headroom exists for. For each request it answers 400 when prompt plus `max_tokens` exceed what the model
serves (as vLLM would), estimates the request's GPU-seconds (charging the output its tier has been seen to
produce when an `OutputLearner` is given, or correcting it by a `CostCorrection`) and asks the policy. It
passes the first token and the completion (or abort) of each request it admitted on to a
`StatefulPolicy`.

Shedding of admitted requests whose deadline is lost (`shed_lost_deadlines`) is the gateway's: None leaves
it to the policy (the predictive policy's own switch; other policies never shed); True sheds for every
policy, by `deadline_lost`; False never sheds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from simadmit.admission.estimator import CostCorrection, CostEstimator, OutputLearner, OutputQuantile
from simadmit.admission.policies import AdmissionPolicy, Decision, PoolView, Request, deadline_lost
from simadmit.admission.predictive import OutputEwma, StatefulPolicy
from simadmit.admission.view import EngineModel, ReplicaLoad, least_work

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
    remaining_gpu_s: float = 0.0  # in-flight work still to do (charged minus prefill and decode done)
    replicas: tuple[ReplicaLoad, ...] = ()  # per serving replica


class Gateway:
    """One gateway replica in front of several pools (pool i: `estimators[i]`, `max_request_tokens[i]`)."""

    def __init__(
        self,
        policy: AdmissionPolicy,
        estimators: Sequence[CostEstimator],
        max_request_tokens: Sequence[int],
        learner: OutputLearner | OutputQuantile | None = None,
        engines: Sequence[EngineModel | None] | None = None,
        correction: CostCorrection | None = None,
        shed_lost_deadlines: bool | None = None,
    ) -> None:
        self.policy = policy
        self.shed_lost_deadlines = shed_lost_deadlines
        self.estimators = tuple(estimators)
        self.max_request_tokens = tuple(max_request_tokens)
        self.learner = learner
        self.correction = correction
        self.views = [PoolView(pool=i) for i in range(len(self.estimators))]
        for view, engine in zip(self.views, engines or [None] * len(self.views), strict=True):
            view.engine = engine
        self.rate_window_s = 5.0  # smoothing of the replicas' prefill rates

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
        view.remaining_gpu_s = snapshot.remaining_gpu_s
        previous = view.replicas
        view.replicas = [
            ReplicaLoad(
                r.running, r.waiting, r.prefill_tokens, r.prefill_pairs, r.kv_used, r.kv_capacity, r.max_seqs,
                r.work_gpu_s, r.prompt_tokens_total, polled_at=r.polled_at,
                waiting_by_priority=dict(r.waiting_by_priority), remaining_steps=r.remaining_steps,
            )
            for r in snapshot.replicas
        ]  # fmt: skip
        for old, new in zip(previous, view.replicas, strict=False):  # replicas keep their order
            dt = new.polled_at - old.polled_at
            if dt > 0:
                rate = max(0.0, (new.prompt_tokens_total - old.prompt_tokens_total) / dt)
                keep = math.exp(-dt / self.rate_window_s)
                new.prefill_rate_tps = keep * old.prefill_rate_tps + (1 - keep) * rate
            else:
                new.prefill_rate_tps = old.prefill_rate_tps

    def estimate(self, request: Request, pool: int, true_output: int | None = None) -> float:
        """Predicted GPU-seconds: output charged at `max_tokens`, at what the tier has really produced (a
        learner), corrected by the observed cost ratio, or at `true_output` (an oracle, for studies)."""
        output: float = request.max_tokens
        if true_output is not None:
            output = true_output
        elif self.learner is not None:
            output = self.learner.expected_output(request.tier, request.max_tokens)
        est = self.estimators[pool].estimate(request.prompt_tokens, output)
        if self.correction is not None and true_output is None:
            est = self.correction.charge(request.tier, est)
        return est

    def decide(
        self, request: Request, pool: int, now: float, true_output: int | None = None
    ) -> tuple[Decision, float]:
        """The decision on `request` for `pool`, and the GPU-seconds it was charged (0 when too long).

        The decision carries the wait it was made on (what `X-Queue-Predict-Wait` says): the policy's
        prediction, or for a policy that predicts none the in-flight work per GPU before the request. An
        admitted request is added to this gateway's view at once, so the next decision sees it.
        """
        if request.prompt_tokens + request.max_tokens > self.max_request_tokens[pool]:
            return TOO_LONG, 0.0
        est = self.estimate(request, pool, true_output)
        view = self.views[pool]
        decision = self.policy.decide(request, est, view, now)
        if decision.predicted_wait_s != decision.predicted_wait_s:  # NaN: the policy predicts no wait
            gpus = view.available_gpus
            decision = decision._replace(predicted_wait_s=view.in_flight_gpu_s / gpus if gpus else math.inf)
        if decision.admit:
            view.in_flight_gpu_s += est
            view.remaining_gpu_s += est
            view.in_flight_by_tier[request.tier] = view.in_flight_by_tier.get(request.tier, 0.0) + est
            view.queued += 1
            if view.replicas:
                level = None if view.engine is None else view.engine.priority(request.tier)
                view.replicas[least_work(view.replicas)].add(request.prompt_tokens, est, level)
        return decision, est

    @property
    def sheds(self) -> bool:
        """Whether this gateway ever sheds admitted requests whose deadline is lost."""
        shed = self.shed_lost_deadlines
        return shed is True or (
            shed is None and isinstance(self.policy, StatefulPolicy) and self.policy.sheds
        )

    def lost(self, request: Request, pool: int, now: float, started: bool) -> bool:
        """Whether to shed this admitted request (queued, or `started`): its deadline is lost."""
        policy, view, shed = self.policy, self.views[pool], self.shed_lost_deadlines
        if shed is None:
            return isinstance(policy, StatefulPolicy) and policy.lost(request, view, now, started)
        if not shed or request.deadline_s is None or view.engine is None:
            return False
        outputs = getattr(policy, "outputs", None)  # what a predictive policy learned of output lengths
        output = 1.0
        if isinstance(outputs, OutputEwma) and outputs.warm(request.tier):
            output = min(float(request.max_tokens), outputs.expected(request.tier))
        return deadline_lost(request, view.engine.step, now, started, output)

    def observe_first_token(self, request: Request, admitted_s: float, now: float) -> None:
        """The first token of a request admitted at `admitted_s` streamed back at `now`."""
        if isinstance(self.policy, StatefulPolicy):
            self.policy.observe_first_token(request, admitted_s, now)

    def observe_abort(self, request: Request, now: float) -> None:
        """An admitted request ended without its answer (aborted, shed, its client gone)."""
        if isinstance(self.policy, StatefulPolicy):
            self.policy.observe_abort(request, now)

    def observe_completion(
        self, request: Request, output_tokens: int, now: float = 0.0, pool: int = 0
    ) -> None:
        """A request finished with `output_tokens` tokens: teach the learner, the correction, the policy."""
        if self.learner is not None:
            self.learner.observe(request.tier, output_tokens)
        if self.correction is not None:
            est = self.estimators[pool]
            self.correction.observe(
                request.tier,
                est.estimate(request.prompt_tokens, request.max_tokens),
                est.estimate(request.prompt_tokens, output_tokens),
            )
        if isinstance(self.policy, StatefulPolicy):
            self.policy.observe_completion(request, output_tokens, now)
