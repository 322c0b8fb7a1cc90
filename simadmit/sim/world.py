"""World: the runtime configuration of a simulation, built once from a validated scenario.

Plain frozen dataclasses (no pydantic in the inner loop): pools with their resolved profiles and engine
limits, gateway and client settings, and one `AdmissionPolicy` object per policy to compare.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from simadmit.admission import baselines, policies
from simadmit.admission.client import ClientConfig
from simadmit.admission.estimator import CostEstimator
from simadmit.admission.predictive import GpuSecondsOnRemaining, PredictedTtft
from simadmit.admission.view import EngineModel
from simadmit.config.defaults import DEFAULT_BUDGETS_S
from simadmit.config.profile import Profile, load_profile
from simadmit.config.resources import resolve_profile
from simadmit.config.schema import (
    ClassicalEngineSpec,
    GpuSecondsSpec,
    PolicySpec,
    PoolSpec,
    PostHocTokensSpec,
    PredictedTtftSpec,
    QueueDepthSpec,
    RateLimitSpec,
    SaturationSpec,
    ScenarioSpec,
    TokenBucketSpec,
    policy_name,
)
from simadmit.fleet.autoscaler import AutoscalerConfig
from simadmit.fleet.engine import BatchLimits
from simadmit.workload.build import distribution
from simadmit.workload.distributions import Distribution


@dataclass(frozen=True)
class PoolConfig:
    name: str
    profile: Profile
    replicas: int
    gpus_per_replica: int
    tiers: tuple[int, ...]  # indices of the tiers it serves
    limits: BatchLimits
    max_request_tokens: int  # longer prompt + max_tokens gets a 400, as vLLM answers
    service: Distribution | None = None  # set: a classical server with this service time
    autoscaler: AutoscalerConfig | None = None
    cold_start: Distribution | None = None
    believed: Profile | None = None  # the profile the gateways use, if not the engines' (a calibration error)
    priorities: dict[str, int] | None = None  # tier -> priority under priority scheduling; None: FCFS

    @property
    def estimator(self) -> CostEstimator:
        """Prices at the engines' true profile: what work really costs."""
        return CostEstimator.from_profile(self.profile)

    @property
    def gateway_profile(self) -> Profile:
        return self.believed or self.profile

    @property
    def api_latency_s(self) -> float:
        """What a client sees beyond the engine's times (an API server's way in and out; a classical
        server has none), before the gateway's own latency."""
        return self.profile.api_latency_s if self.service is None else 0.0


@dataclass(frozen=True)
class GatewayConfig:
    replicas: int
    poll_interval_s: float
    routing: str
    dispatch: str
    estimate_output: str = "max_tokens"
    shed_lost_deadlines: bool | None = None  # None: as the policy says
    view: str = "metrics"  # what each gateway polls: the published gauges and its books, or the exact state
    latency_s: float = 0.0  # a request's way through the gateway process and its proxy hops


@dataclass(frozen=True)
class World:
    pools: tuple[PoolConfig, ...]
    gateway: GatewayConfig
    clients: ClientConfig
    tier_names: tuple[str, ...]
    pool_of_tier: tuple[int, ...]  # the pool each tier is routed to (the last pool listing it)
    tier_ttft_slo: tuple[float, ...]
    tier_e2e_slo: tuple[float, ...]
    warmup_s: float

    def seen_latency_s(self, p: int) -> float:
        """What a client of pool `p` (and the gateway streaming its answer) sees beyond the engine's times:
        the API server's way in and out, and the gateway's own."""
        return self.pools[p].api_latency_s + self.gateway.latency_s

    def engine_models(self) -> list[EngineModel]:
        """What an engine-aware policy predicts each pool's engines with, simulated and live alike: the
        profile the gateways believe, its first tokens as late as the gateway's own latency makes them."""
        models = [
            EngineModel.of(p.gateway_profile, p.limits.max_num_batched_tokens, p.priorities)
            for p in self.pools
        ]
        return [replace(m, api_latency_s=m.api_latency_s + self.gateway.latency_s) for m in models]


def build_policy(
    spec: PolicySpec, slos: dict[str, tuple[float, float]] | None = None
) -> policies.AdmissionPolicy:
    """The policy object of a spec; `slos` (tier -> TTFT, E2E SLO) set defaults: the predictive policy's
    budgets, the tier saturation shedding never sheds."""
    slos = slos or {}
    if isinstance(spec, QueueDepthSpec):
        return policies.QueueDepth(spec.max_queued, spec.retry_after_s)
    if isinstance(spec, GpuSecondsSpec):
        kind = GpuSecondsOnRemaining if spec.work == "remaining" else policies.GpuSeconds
        return kind(
            dict(spec.budgets_s),
            spec.default_budget_s,
            spec.headroom,
            spec.max_pool_gpu_seconds,
            dict(spec.tier_max_gpu_seconds),
        )
    if isinstance(spec, PredictedTtftSpec):
        ttft = spec.budgets_s if spec.budgets_s is not None else {t: v[0] for t, v in slos.items()}
        e2e = spec.e2e_budgets_s if spec.e2e_budgets_s is not None else {t: v[1] for t, v in slos.items()}
        return PredictedTtft(
            dict(ttft) or dict(DEFAULT_BUDGETS_S), spec.default_budget_s,
            {t: v for t, v in e2e.items() if math.isfinite(v)}, spec.margin, spec.correct, spec.alpha,
            spec.queue_budget_s, spec.sheddable_fraction, shed_lost_deadlines=spec.shed_lost_deadlines,
        )  # fmt: skip
    if isinstance(spec, SaturationSpec):
        critical = spec.critical
        if critical is None:
            critical = [min(slos, key=lambda t: slos[t][0])] if slos else []
        return baselines.SaturationShedding(
            frozenset(critical), spec.queue_depth_threshold, spec.kv_cache_threshold, spec.metrics_staleness_s
        )
    if isinstance(spec, TokenBucketSpec):
        return baselines.TokenBucket({t: (b.rate, b.burst) for t, b in spec.tiers.items()})
    if isinstance(spec, RateLimitSpec):
        return baselines.RateLimits({t: (lim.rpm, lim.tpm) for t, lim in spec.tiers.items()})
    if isinstance(spec, PostHocTokensSpec):
        return baselines.PostHocTokens(dict(spec.tokens_per_minute))
    return policies.Unconditional()


def build_policies(spec: ScenarioSpec) -> dict[str, policies.AdmissionPolicy]:
    slos = {t.name: (t.slo.ttft_s, t.slo.e2e_s) for t in spec.workload.tiers}
    return {policy_name(p): build_policy(p, slos) for p in spec.policies}


def _autoscaler(pool: PoolSpec) -> AutoscalerConfig | None:
    a = pool.autoscaler
    if a is None:
        return None
    return AutoscalerConfig(
        a.metric, a.target, a.min_replicas, a.max_replicas, a.sync_period_s, a.tolerance,
        a.scale_up_stabilization_s, a.scale_down_stabilization_s,
    )  # fmt: skip


def build_world(spec: ScenarioSpec, base: Path) -> World:
    tier_names = tuple(t.name for t in spec.workload.tiers)
    pools = []
    for p in spec.pools:
        path = resolve_profile(p.profile, base)
        assert path is not None, "checked when the scenario was loaded"
        profile = load_profile(path)
        e = p.engine
        if isinstance(e, ClassicalEngineSpec):
            limits = BatchLimits(1, profile.engine.max_num_batched_tokens, profile.kv_capacity_tokens)
            service: Distribution | None = distribution(e.service_time)
            priorities: dict[str, int] | None = None
        else:
            limits = BatchLimits(
                e.max_num_seqs or profile.engine.max_num_seqs,
                e.max_num_batched_tokens or profile.engine.max_num_batched_tokens,
                e.kv_capacity_tokens or profile.kv_capacity_tokens,
                profile.kv_block_size,
            )
            service = None
            priorities = dict(e.tier_priority) if e.scheduling == "priority" else None
        served = p.tiers or list(tier_names)
        pools.append(
            PoolConfig(
                name=p.name,
                profile=profile,
                replicas=p.replicas,
                gpus_per_replica=p.gpus_per_replica or profile.gpus_per_replica,
                tiers=tuple(tier_names.index(t) for t in served),
                limits=limits,
                max_request_tokens=min(profile.engine.max_model_len, limits.kv_blocks * limits.kv_block_size),
                service=service,
                autoscaler=_autoscaler(p),
                cold_start=distribution(p.autoscaler.cold_start_s) if p.autoscaler else None,
                priorities=priorities,
            )
        )
    g, c = spec.gateway, spec.clients
    pool_of_tier = [0] * len(tier_names)
    for i, cfg in enumerate(pools):
        for t in cfg.tiers:
            pool_of_tier[t] = i
    return World(
        pools=tuple(pools),
        gateway=GatewayConfig(
            g.replicas,
            g.poll_interval_s,
            g.routing,
            g.dispatch,
            g.estimate_output,
            g.shed_lost_deadlines,
            g.view,
            g.latency_s,
        ),
        clients=ClientConfig(
            c.max_retries,
            c.honor_retry_after,
            c.backoff.base_s,
            c.backoff.cap_s,
            c.backoff.jitter,
            c.abandon_after_s,
            c.retry_budget.ratio if c.retry_budget else None,
            c.retry_budget.burst if c.retry_budget else 10.0,
        ),
        tier_names=tier_names,
        pool_of_tier=tuple(pool_of_tier),
        tier_ttft_slo=tuple(t.slo.ttft_s for t in spec.workload.tiers),
        tier_e2e_slo=tuple(t.slo.e2e_s for t in spec.workload.tiers),
        warmup_s=spec.workload.warmup_s,
    )
