"""Simulation: one run of one admission policy over one workload.

Clients arrive open-loop (one chained event per arrival); each attempt goes to the next `Gateway` replica
(round-robin), which decides against its possibly stale view (the engines' published gauges and its own
books, `gateway_view`; with `gateway.view: exact` the pools' exact state); admitted requests enter a
`Pool` of engines, rejected ones come back when the `Client` state machine says, and everything lands in a
`Ledger`. The gateways, the client and the policies are the admission layer's plain objects: this module
only wires events to them. SimPy's environment is used as a bare event scheduler with callbacks: no
per-request processes, no pydantic, no per-token events.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import simpy

from simadmit.admission.client import Client
from simadmit.admission.estimator import CostEstimator, output_learning
from simadmit.admission.gateway import TOO_LONG, Gateway, PoolSnapshot
from simadmit.admission.policies import AdmissionPolicy, Request
from simadmit.admission.predictive import StatefulPolicy
from simadmit.admission.published import prior_price
from simadmit.admission.view import EngineModel
from simadmit.fleet.autoscaler import HorizontalAutoscaler, queue_wait_load
from simadmit.fleet.engine import StepObserver
from simadmit.fleet.pool import Pool, RequestListener
from simadmit.sim.gateway_view import GatewayView
from simadmit.sim.ledger import ABANDONED, ABORTED, COMPLETED, IN_FLIGHT, PENDING, REJECTED, Ledger
from simadmit.sim.ledger import TOO_LONG as TOO_LONG_OUTCOME
from simadmit.sim.world import World
from simadmit.workload.build import Workload


@dataclass(frozen=True)
class RunResult:
    """Everything a run leaves behind, for `records` to tabulate."""

    policy: str
    seed: int
    ledger: Ledger
    estimates: list[np.ndarray]  # per pool: the GPU-seconds the gateways charged each request
    busy_periods: list[list[list[tuple[float, float]]]]  # pool -> replica -> (start, end)
    lifetimes: list[list[list[float]]]  # pool -> replica -> [serving since, retired at]
    replica_log: list[list[tuple[float, int, int, int]]]  # pool -> (time, serving, starting, draining)
    peak_in_flight_gpu_s: list[float]  # per pool: the most work ever in flight
    end_s: float
    events: int
    shed: list[int] = field(default_factory=list)  # admitted requests dropped once their deadline was lost
    # per pool: each request's service time on a classical server (None: a batching engine's pool)
    service_s: list[np.ndarray | None] = field(default_factory=list)

    def service_times(self, pool: int) -> np.ndarray | None:
        """Each request's service time on pool `pool` when it is a classical server, else None."""
        return self.service_s[pool] if pool < len(self.service_s) else None


def policy_requests(workload: Workload) -> list[Request]:
    """The gateway-visible view of every request, built once and shared by all policies."""
    names = workload.tier_names
    return [
        Request(i, names[t], p, m, a, None if math.isinf(d) else d)
        for i, (t, p, m, a, d) in enumerate(
            zip(
                workload.tier.tolist(),
                workload.prompt.tolist(),
                workload.max_tokens.tolist(),
                workload.arrival.tolist(),
                workload.deadline.tolist(),
                strict=True,
            )
        )
    ]


def tier_max_tokens(workload: Workload, tiers: tuple[int, ...]) -> list[int]:
    """The largest max_tokens each of `tiers` asks for in the workload (tiers with no request left out)."""
    asked = [workload.max_tokens[workload.tier == t] for t in tiers]
    return [int(m.max()) for m in asked if len(m)]


class Simulation(RequestListener):
    def __init__(
        self,
        world: World,
        workload: Workload,
        policy: AdmissionPolicy,
        seed: int,
        requests: list[Request] | None = None,
        observer: StepObserver | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        self.world = world
        self.workload = workload
        self.seed = seed
        self.env = env = simpy.Environment()
        n = len(workload)
        self.n = n
        self.ledger = Ledger(n)
        self.requests = requests if requests is not None else policy_requests(workload)
        self.arrival = workload.arrival.tolist()
        self.deadline = workload.deadline.tolist()
        self.pool_of_tier = world.pool_of_tier
        self.tier = workload.tier.tolist()
        self.output = workload.output.tolist()
        prompt = workload.prompt.tolist()
        central = world.gateway.dispatch == "central"
        self.pools: list[Pool] = []
        for p, cfg in enumerate(world.pools):
            service = None
            if cfg.service is not None:
                service = cfg.service.sample(np.random.default_rng([seed, 4, p]), n)
            self.pools.append(
                Pool(
                    env, p, cfg.replicas, cfg.gpus_per_replica, prompt, self.output, self, world.gateway.routing,
                    central, cfg.profile.step_time, cfg.limits, service, observer,
                    CostEstimator.from_profile(cfg.gateway_profile), cfg.priorities,
                )
            )  # fmt: skip
        self.seen_latency = [world.seen_latency_s(p) for p in range(len(world.pools))]  # engine -> client
        # what the gateways charged each request, per pool (every request starts at its max_tokens estimate)
        self.charged = [
            CostEstimator.from_profile(cfg.gateway_profile).estimate_many(
                workload.prompt, workload.max_tokens
            )
            for cfg in world.pools
        ]
        g = world.gateway
        self.oracle = g.estimate_output == "oracle"  # a study's bound: the gateway charges the true output
        estimators = [CostEstimator.from_profile(cfg.gateway_profile) for cfg in world.pools]
        limits = [cfg.max_request_tokens for cfg in world.pools]
        engines = world.engine_models()
        if isinstance(policy, StatefulPolicy) and policy.central:  # one counter for all, new every run
            policy = policy.fresh()
        self.gateways = [self._gateway(policy, estimators, limits, engines) for _ in range(g.replicas)]
        self.live = g.poll_interval_s == 0
        # each gateway's books, for its view from the engines' published gauges (None: the pools' exact state)
        self.views: list[GatewayView] | None = None
        if g.view == "metrics":
            priors = [
                prior_price(est, tier_max_tokens(workload, cfg.tiers))
                for cfg, est in zip(world.pools, estimators, strict=True)
            ]
            levels = [cfg.priorities for cfg in world.pools]
            self.views = [GatewayView(priors, estimators, levels) for _ in self.gateways]
        self.sender = [0] * n  # the gateway that admitted each request
        self.next_gateway = 0
        self.client = Client(world.clients, np.random.default_rng([seed, 3]).random)
        self.pool_attempts = [0] * len(self.pools)
        self.pool_rejects = [0] * len(self.pools)
        self.outstanding = n
        self.next_arrival = 0
        self.progress = progress
        self.events = 0
        # post-queue shedding: admitted requests with a deadline, not finished -> their pool
        self.sheds = self.gateways[0].sheds and bool(np.isfinite(workload.deadline).any())
        self.waiting_with_deadline: dict[int, int] = {}
        self.shed: list[int] = []

    def _gateway(
        self,
        policy: AdmissionPolicy,
        estimators: list[CostEstimator],
        limits: list[int],
        engines: list[EngineModel],
    ) -> Gateway:
        """One gateway replica: what it learns, it learns from the answers it streams back only (as a
        separate gateway process does), starting each run with nothing learned; a central policy's
        counters it shares with the others."""
        g = self.world.gateway
        learner, correction = output_learning(g.estimate_output)
        if isinstance(policy, StatefulPolicy) and not policy.central:
            policy = policy.fresh()
        return Gateway(policy, estimators, limits, learner, engines, correction, g.shed_lost_deadlines)

    # --- arrivals and decisions ------------------------------------------------------------------------

    def run(self, policy_name: str = "") -> RunResult:
        env = self.env
        for gw in range(len(self.gateways)):
            self._poll(gw)
            if not self.live:
                offset = self.world.gateway.poll_interval_s * gw / len(self.gateways)
                env.timeout(offset).callbacks.append(lambda _e, gw=gw: self._poll_loop(gw))  # type: ignore[misc]
        for p, cfg in enumerate(self.world.pools):
            if cfg.autoscaler is not None:
                scaler = HorizontalAutoscaler(cfg.autoscaler)
                rng = np.random.default_rng([self.seed, 5, p])
                env.timeout(cfg.autoscaler.sync_period_s).callbacks.append(
                    lambda _e, p=p, scaler=scaler, rng=rng: self._autoscale(p, scaler, rng, (0.0, 0, 0))  # type: ignore[misc]
                )
        if self.n:
            env.timeout(self.arrival[0]).callbacks.append(self._arrive)
        if self.sheds:
            env.timeout(self.shed_interval_s).callbacks.append(self._shed_loop)
        while True:
            try:
                env.step()
            except simpy.core.EmptySchedule:
                break
            self.events += 1
        led = self.ledger
        for rid in range(self.n):
            if led.outcome[rid] == PENDING and led.admit[rid] == led.admit[rid]:
                led.outcome[rid] = IN_FLIGHT
        busy = []
        for pool in self.pools:
            periods = []
            for r in pool.replicas:
                if r.busy:
                    r.busy_periods.append((r.busy_since, env.now))
                periods.append(r.busy_periods)
            busy.append(periods)
        return RunResult(
            policy_name, self.seed, led, self.charged, busy,
            [[[a, min(b, env.now)] for a, b in pool.lifetimes] for pool in self.pools],
            [pool.replica_log for pool in self.pools],
            [pool.peak_in_flight_gpu_s for pool in self.pools],
            env.now, self.events, self.shed, [pool.service_s for pool in self.pools],
        )  # fmt: skip

    def _arrive(self, _ev: simpy.Event) -> None:
        i = self.next_arrival
        self.next_arrival = i + 1
        if i + 1 < self.n:
            self.env.timeout(self.arrival[i + 1] - self.arrival[i]).callbacks.append(self._arrive)
        if self.progress is not None and i & 4095 == 0:
            self.progress(i)
        abandon = self.world.clients.abandon_after_s
        if abandon is not None:
            self.env.timeout(abandon).callbacks.append(lambda _e: self._abandon(i))
        self._attempt(i)

    def _attempt(self, rid: int) -> None:
        led = self.ledger
        if led.outcome[rid] != PENDING:  # the client gave up while backing off
            return
        now = self.env.now
        tries = led.attempts[rid] + 1
        led.attempts[rid] = tries
        self.client.attempt(tries)
        g = self.next_gateway
        self.next_gateway = (g + 1) % len(self.gateways)
        gateway = self.gateways[g]
        p = self.pool_of_tier[self.tier[rid]]
        if self.live:
            gateway.refresh(p, self.snapshot(g, p))
        request = self.requests[rid]
        decision, est = gateway.decide(request, p, now, self.output[rid] if self.oracle else None)
        led.att_rid.append(rid)
        led.att_time.append(now)
        led.att_gateway.append(g)
        led.att_reason.append(decision.reason)
        led.att_retry_after.append(decision.retry_after_s)
        led.att_predicted_wait.append(decision.predicted_wait_s)
        if decision is TOO_LONG:  # vLLM answers 400: longer than the model allows; never retried
            led.outcome[rid] = TOO_LONG_OUTCOME
            self._done(rid)
            return
        self.pool_attempts[p] += 1
        self.charged[p][rid] = est
        if self.views is not None:
            self.views[g].priced(p, est, request.prompt_tokens)
        if decision.admit:
            led.admit[rid] = now
            led.pool[rid] = p
            if self.sheds and request.deadline_s is not None:
                self.waiting_with_deadline[rid] = p
            self.sender[rid] = g
            pool, replica = self.pools[p], None
            if self.views is not None:
                self.views[g].admitted(p, request.tier, est, request.prompt_tokens)
                if not pool.central:
                    replica = self.views[g].route(p, pool, self.world.gateway.routing)
            pool.admit(rid, request.tier, est, replica)
            return
        self.pool_rejects[p] += 1
        delay = self.client.after_rejection(rid, tries, decision.retry_after_s, now, self.deadline[rid])
        if delay is None:
            led.outcome[rid] = REJECTED
            self._done(rid)
            return
        self.env.timeout(delay).callbacks.append(lambda _e: self._attempt(rid))

    def _abandon(self, rid: int) -> None:
        """The client's timeout: give up unless a first token has reached it. One the engine produced but
        still on its way through the API server and the gateway (`seen_latency_s`) comes too late: it is
        never seen."""
        led = self.ledger
        if led.outcome[rid] != PENDING or led.first_token[rid] <= self.env.now:
            return
        led.first_token[rid] = math.nan
        if led.admit[rid] == led.admit[rid]:
            self.pools[led.pool[rid]].abort(rid)
        else:
            led.outcome[rid] = ABANDONED
            self._done(rid)

    def _done(self, rid: int) -> None:
        self.outstanding -= 1
        self.client.forget(rid)

    # --- what the pools report (RequestListener) ---------------------------------------------------------

    def on_routed(self, rid: int, replica: int) -> None:
        self.ledger.replica[rid] = replica
        if self.views is not None:
            p = self.ledger.pool[rid]
            prompt = self.requests[rid].prompt_tokens
            tier = self.requests[rid].tier
            self.views[self.sender[rid]].routed(p, replica, rid, tier, self.pools[p].estimate[rid], prompt)

    def on_scheduled(self, rid: int, now: float) -> None:
        self.ledger.scheduled[rid] = now

    def on_first_token(self, rid: int, now: float) -> None:
        led = self.ledger
        seen = now + self.seen_latency[led.pool[rid]]  # as the client (and a gateway streaming it) sees it
        led.first_token[rid] = seen
        if self.views is not None:
            view = self.views[self.sender[rid]]
            request = self.requests[rid]
            view.answering(led.pool[rid], led.replica[rid], rid, request.tier, request.prompt_tokens)
        self.gateways[self.sender[rid]].observe_first_token(self.requests[rid], led.admit[rid], seen)

    def on_finish(self, rid: int, now: float) -> None:
        self.waiting_with_deadline.pop(rid, None)
        led = self.ledger
        seen = now + self.seen_latency[led.pool[rid]]
        led.finish[rid] = seen
        led.outcome[rid] = COMPLETED
        self._release(rid)
        self.gateways[self.sender[rid]].observe_completion(
            self.requests[rid], self.output[rid], seen, led.pool[rid]
        )
        self._done(rid)

    def on_aborted(self, rid: int, now: float) -> None:
        self.waiting_with_deadline.pop(rid, None)
        led = self.ledger
        led.finish[rid] = now
        led.outcome[rid] = ABORTED
        self._release(rid)
        self.gateways[self.sender[rid]].observe_abort(self.requests[rid], now)
        self._done(rid)

    def _release(self, rid: int) -> None:
        """A request admitted by a gateway ended: out of that gateway's books."""
        if self.views is not None:
            led, request = self.ledger, self.requests[rid]
            p = led.pool[rid]
            est = float(self.charged[p][rid])
            self.views[self.sender[rid]].released(
                p, led.replica[rid], rid, request.tier, est, request.prompt_tokens
            )

    def on_abort_progress(self, rid: int, prompt_tokens: int, output_tokens: int) -> None:
        self.ledger.aborted_prompt_done[rid] = prompt_tokens
        self.ledger.aborted_output_done[rid] = output_tokens

    def on_preempt(self, rid: int) -> None:
        self.ledger.preemptions[rid] += 1

    # --- autoscaling ------------------------------------------------------------------------------------

    def _autoscale(
        self, p: int, scaler: HorizontalAutoscaler, rng: np.random.Generator, last: tuple[float, int, int]
    ) -> None:
        """One HPA sync: measure the pool over the last period, ask for a replica count, act on it."""
        pool, cfg = self.pools[p], self.world.pools[p]
        now = self.env.now
        busy = sum(pool.replicas[i].busy_time(now) for i in pool.serving)
        attempts, rejects = self.pool_attempts[p], self.pool_rejects[p]
        period = scaler.cfg.sync_period_s
        if scaler.cfg.metric == "gpu_utilization":
            metric = (busy - last[0]) / (period * len(pool.serving)) if pool.serving else 0.0
        else:
            tried = attempts - last[1]
            refused = (rejects - last[2]) / tried if tried else 0.0
            metric = self._queue_wait_load(p, refused)
        current = len(pool.serving) + pool.starting
        desired = scaler.recommend(now, current, metric)
        for _ in range(desired - current):
            assert cfg.cold_start is not None
            pool.scale_up(float(cfg.cold_start.sample(rng, 1)[0]))
        for _ in range(current - desired):
            pool.scale_down()
        if self.next_arrival < self.n or self.outstanding > 0:
            # the busy time of the replicas serving from now on is the baseline of the next period
            base = (sum(pool.replicas[i].busy_time(now) for i in pool.serving), attempts, rejects)
            self.env.timeout(period).callbacks.append(lambda _e: self._autoscale(p, scaler, rng, base))

    def _queue_wait_load(self, p: int, refused: float) -> float:
        """The queue-wait load the autoscaler reads for pool `p`: with the exact view the pool's own; else
        the largest of what the gateways export from their views (the deployed metrics adapter takes the
        maximum over gateways, `deploy/kubernetes/prometheus-adapter-rules.yaml`)."""
        if self.views is None:
            pool = self.pools[p]
            return queue_wait_load(pool.in_flight_gpu_s, pool.available_gpus, refused)
        return max(
            queue_wait_load(g.views[p].in_flight_gpu_s, g.views[p].available_gpus, refused)
            for g in self.gateways
        )

    # --- post-queue shedding ----------------------------------------------------------------------------

    @property
    def shed_interval_s(self) -> float:
        """Admitted requests are swept for lost deadlines as often as gateways poll (every 0.1 s when they
        read live); the gateway that admitted each says whether to drop it."""
        return self.world.gateway.poll_interval_s or 0.1

    def _shed_loop(self, _ev: simpy.Event) -> None:
        now = self.env.now
        scheduled = self.ledger.scheduled
        for rid, p in list(self.waiting_with_deadline.items()):
            gateway = self.gateways[self.sender[rid]]  # the one that admitted it, with what it has learned
            if gateway.lost(self.requests[rid], p, now, scheduled[rid] == scheduled[rid]):
                self.shed.append(rid)
                self.pools[p].abort(rid)  # reported back as aborted: the ledger's outcome
        if self.next_arrival < self.n or self.waiting_with_deadline:
            self.env.timeout(self.shed_interval_s).callbacks.append(self._shed_loop)

    # --- gateway polling -------------------------------------------------------------------------------

    def snapshot(self, gw: int, p: int) -> PoolSnapshot:
        """Pool `p` as gateway `gw` sees it now: from the published gauges and its own books, or, with the
        exact view, the pool's own books."""
        if self.views is None:
            return self.pools[p].snapshot(self.oracle)
        return self.views[gw].snapshot(p, self.pools[p], self.oracle)

    def _poll(self, gw: int) -> None:
        gateway = self.gateways[gw]
        for p in range(len(self.pools)):
            gateway.refresh(p, self.snapshot(gw, p))

    def _poll_loop(self, gw: int) -> None:
        self._poll(gw)
        if self.next_arrival < self.n or self.outstanding > 0:
            self.env.timeout(self.world.gateway.poll_interval_s).callbacks.append(
                lambda _e: self._poll_loop(gw)
            )
