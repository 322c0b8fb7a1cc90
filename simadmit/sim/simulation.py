"""Simulation: one run of one admission policy over one workload.

Clients arrive open-loop (one chained event per arrival), a gateway replica applies the policy against
its possibly stale `PoolView`, admitted requests enter a `Pool` of engines, rejected ones come back after
a backoff, and every step lands in a `Ledger`. SimPy's environment is used as a bare event scheduler with
callbacks: no per-request processes, no pydantic, no per-token events.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import simpy

from simadmit.fleet.autoscaler import HorizontalAutoscaler
from simadmit.admission.client import RetryBudget, backoff_delay
from simadmit.fleet.engine import StepObserver
from simadmit.admission.estimator import OutputLearner
from simadmit.sim.ledger import ABANDONED, COMPLETED, IN_FLIGHT, PENDING, REJECTED, TOO_LONG, Ledger
from simadmit.admission.policies import AdmissionPolicy, PoolView, Request
from simadmit.fleet.pool import Pool
from simadmit.workload.build import Workload
from simadmit.sim.world import World


@dataclass(frozen=True)
class RunResult:
    """Everything a run leaves behind, for `records` to tabulate."""

    policy: str
    seed: int
    ledger: Ledger
    estimates: list[np.ndarray]  # per pool: predicted GPU-seconds of every request
    busy_periods: list[list[list[tuple[float, float]]]]  # pool -> replica -> (start, end)
    lifetimes: list[list[list[float]]]  # pool -> replica -> [serving since, retired at]
    replica_log: list[list[tuple[float, int, int, int]]]  # pool -> (time, serving, starting, draining)
    peak_in_flight_gpu_s: list[float]  # per pool: the most work ever in flight
    end_s: float
    events: int


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


class Simulation:
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
        self.policy = policy
        self.seed = seed
        self.env = env = simpy.Environment()
        n = len(workload)
        self.n = n
        self.ledger = Ledger(n)
        self.requests = requests if requests is not None else policy_requests(workload)
        self.arrival = workload.arrival.tolist()
        self.deadline = workload.deadline.tolist()
        self.total_tokens = (workload.prompt + workload.max_tokens).tolist()
        self.tier = workload.tier.tolist()
        self.pool_of_tier = [0] * len(workload.tier_names)
        for p, cfg in enumerate(world.pools):
            for t in cfg.tiers:
                self.pool_of_tier[t] = p
        self.pools: list[Pool] = []
        prompt, output = workload.prompt.tolist(), workload.output.tolist()
        self.output = output
        central = world.gateway.dispatch == "central"
        for p, cfg in enumerate(world.pools):
            est = cfg.estimator.estimate_many(workload.prompt, workload.max_tokens)
            service = None
            if cfg.service is not None:
                service = cfg.service.sample(np.random.default_rng([seed, 4, p]), n)
            self.pools.append(
                Pool(
                    env, p, cfg.replicas, cfg.gpus_per_replica, est.tolist(), prompt, output, self.ledger,
                    self._done, world.gateway.routing, central, cfg.profile.step_time, cfg.limits, service,
                    observer,
                )
            )  # fmt: skip
        self.est = [pool.estimate for pool in self.pools]  # the pools' own lists: one estimate per request
        self.learner = OutputLearner() if world.gateway.estimate_output == "learned" else None
        self.estimators = [cfg.estimator for cfg in world.pools]
        self.max_tokens = [cfg.max_request_tokens for cfg in world.pools]
        self.pool_attempts = [0] * len(self.pools)
        self.pool_rejects = [0] * len(self.pools)
        g = world.gateway
        self.views = [[PoolView() for _ in self.pools] for _ in range(g.replicas)]
        self.live = g.poll_interval_s == 0
        self.next_gateway = 0
        self.jitter = np.random.default_rng([seed, 3])
        self.last_wait: dict[int, float] = {}  # backoff part of each retrying request's last wait
        c = world.clients
        self.budget = RetryBudget(c.retry_budget_ratio, c.retry_budget_burst) if c.retry_budget_ratio else None
        self.outstanding = n
        self.next_arrival = 0
        self.progress = progress
        self.events = 0

    # --- arrivals and decisions ------------------------------------------------------------------------

    def run(self, policy_name: str = "") -> RunResult:
        env = self.env
        for gw in range(len(self.views)):
            self._poll(gw)
            if not self.live:
                offset = self.world.gateway.poll_interval_s * gw / len(self.views)
                env.timeout(offset).callbacks.append(lambda _e, gw=gw: self._poll_loop(gw))
        for p, cfg in enumerate(self.world.pools):
            if cfg.autoscaler is not None:
                scaler = HorizontalAutoscaler(cfg.autoscaler)
                rng = np.random.default_rng([self.seed, 5, p])
                env.timeout(cfg.autoscaler.sync_period_s).callbacks.append(
                    lambda _e, p=p, scaler=scaler, rng=rng: self._autoscale(p, scaler, rng, (0.0, 0, 0))
                )
        if self.n:
            env.timeout(self.arrival[0]).callbacks.append(self._arrive)
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
            policy_name, self.seed, led, [np.asarray(e) for e in self.est], busy,
            [[[a, min(b, env.now)] for a, b in pool.lifetimes] for pool in self.pools],
            [pool.replica_log for pool in self.pools],
            [pool.peak_in_flight_gpu_s for pool in self.pools],
            env.now, self.events,
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
        if tries == 1 and self.budget is not None:
            self.budget.deposit()
        g = self.next_gateway
        self.next_gateway = (g + 1) % len(self.views)
        p = self.pool_of_tier[self.tier[rid]]
        led.att_rid.append(rid)
        led.att_time.append(now)
        led.att_gateway.append(g)
        if self.total_tokens[rid] > self.max_tokens[p]:  # vLLM answers 400: longer than the model allows
            led.att_reason.append("too_long")
            led.att_retry_after.append(0.0)
            led.outcome[rid] = TOO_LONG
            self._done(rid)
            return
        self.pool_attempts[p] += 1
        view = self.views[g][p]
        if self.live:
            self._refresh(view, self.pools[p], now)
        if self.learner is not None:  # charge what this tier's requests have really produced so far
            req = self.requests[rid]
            out = self.learner.expected_output(req.tier, req.max_tokens)
            self.est[p][rid] = self.estimators[p].estimate(req.prompt_tokens, out)
        est = self.est[p][rid]
        admit, reason, retry_after = self.policy.decide(self.requests[rid], est, view, now)
        led.att_reason.append(reason)
        led.att_retry_after.append(retry_after)
        if not admit:
            self.pool_rejects[p] += 1
        if admit:
            tier = self.requests[rid].tier
            view.in_flight_gpu_s += est  # this gateway counts its own admits until the next poll
            view.in_flight_by_tier[tier] = view.in_flight_by_tier.get(tier, 0.0) + est
            view.queued += 1
            self.pools[p].admit(rid, tier)
            return
        cfg = self.world.clients
        if tries > cfg.max_retries:
            led.outcome[rid] = REJECTED
            self._done(rid)
            return
        previous = self.last_wait.get(rid, 0.0)
        delay = backoff_delay(tries, retry_after, previous, cfg, float(self.jitter.random()))
        if now + delay > self.deadline[rid] or (self.budget is not None and not self.budget.withdraw()):
            # the answer would come too late to matter, or the client has spent its retry budget
            led.outcome[rid] = REJECTED
            self._done(rid)
            return
        self.last_wait[rid] = delay - (retry_after if cfg.honor_retry_after else 0.0)
        self.env.timeout(delay).callbacks.append(lambda _e: self._attempt(rid))

    def _abandon(self, rid: int) -> None:
        """The client's timeout: give up unless a first token has arrived."""
        led = self.ledger
        if led.outcome[rid] != PENDING or led.first_token[rid] == led.first_token[rid]:
            return
        if led.admit[rid] == led.admit[rid]:
            led.finish[rid] = self.env.now
            self.pools[led.pool[rid]].abort(rid)
        else:
            led.outcome[rid] = ABANDONED
            self._done(rid)

    def _done(self, rid: int) -> None:
        self.outstanding -= 1
        if self.learner is not None and self.ledger.outcome[rid] == COMPLETED:
            self.learner.observe(self.requests[rid].tier, self.output[rid])
        self.last_wait.pop(rid, None)

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
            metric = pool.in_flight_gpu_s / max(pool.available_gpus, 1) / max(1.0 - refused, 0.05)
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

    # --- gateway polling -------------------------------------------------------------------------------

    @staticmethod
    def _refresh(view: PoolView, pool: Pool, now: float) -> None:
        view.in_flight_gpu_s = pool.in_flight_gpu_s
        view.in_flight_by_tier = dict(pool.in_flight_by_tier)
        view.queued = pool.queued
        view.running = pool.running
        view.available_gpus = pool.available_gpus
        view.polled_at = now

    def _poll(self, gw: int) -> None:
        now = self.env.now
        for view, pool in zip(self.views[gw], self.pools, strict=True):
            self._refresh(view, pool, now)

    def _poll_loop(self, gw: int) -> None:
        self._poll(gw)
        if self.next_arrival < self.n or self.outstanding > 0:
            self.env.timeout(self.world.gateway.poll_interval_s).callbacks.append(lambda _e: self._poll_loop(gw))
