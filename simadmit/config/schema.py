"""Scenario schema: pools, gateway, clients, policies and the scenario itself, validated up front.

Everything is checked before a simulation starts, and every problem is reported on its own line as
`file: field.path: message` (exit code 2 from the CLI); the workload section's models live in
`simadmit.config.workload_schema`. After validation the simulator runs on plain dataclasses built from
these models, never on pydantic objects. `policy_name` is the one rule naming a policy (its `name`, else
its `kind`), used wherever policies are told apart.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Discriminator, Field, Tag, model_validator

from simadmit.config.defaults import DEFAULT_BUDGET_S, DEFAULT_BUDGETS_S, DEFAULT_HEADROOM
from simadmit.config.overrides import element_name
from simadmit.config.workload_schema import DistSpec, FixedSpec, Spec, WorkloadSpec

# --- pools -------------------------------------------------------------------------------------------


class ContinuousEngineSpec(Spec):
    kind: Literal["continuous"] = "continuous"
    max_num_seqs: int | None = Field(default=None, gt=0, description="overrides the profile")
    max_num_batched_tokens: int | None = Field(default=None, gt=0, description="overrides the profile")
    kv_capacity_tokens: int | None = Field(default=None, gt=0, description="overrides the profile")


class ClassicalEngineSpec(Spec):
    kind: Literal["classical"]
    service_time: DistSpec = Field(description="service time of one request, seconds (batch of 1)")


def _engine_kind(value: object) -> str:
    """Engines default to continuous batching when `kind` is left out."""
    if isinstance(value, dict):
        return str(value.get("kind", "continuous"))
    return str(getattr(value, "kind", "continuous"))


EngineSpec = Annotated[
    Annotated[ContinuousEngineSpec, Tag("continuous")] | Annotated[ClassicalEngineSpec, Tag("classical")],
    Discriminator(_engine_kind),
]


class AutoscalerSpec(Spec):
    metric: Literal["gpu_utilization", "queue_wait"] = Field(
        description="gpu_utilization: busy fraction of ready replicas over the sync period; queue_wait: "
        "in-flight GPU-seconds per ready GPU, divided by (1 - rejection rate): demand the gateway turned away "
        "still counts"
    )
    target: float = Field(
        gt=0, description="0.7 for gpu_utilization; seconds of in-flight work per GPU for queue_wait"
    )
    min_replicas: int = Field(default=1, gt=0)
    max_replicas: int = Field(gt=0)
    sync_period_s: float = Field(default=15.0, gt=0)
    tolerance: float = Field(default=0.1, ge=0)
    scale_up_stabilization_s: float = Field(default=0.0, ge=0)
    scale_down_stabilization_s: float = Field(default=300.0, ge=0)
    cold_start_s: DistSpec = Field(
        default=FixedSpec(kind="fixed", value=90.0), description="time before a new replica serves"
    )

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalerSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must not exceed max_replicas")
        return self


class PoolSpec(Spec):
    name: str = "pool"
    profile: str = Field(description="profile file (relative to the scenario) or a bundled profile name")
    replicas: int = Field(gt=0)
    gpus_per_replica: int | None = Field(default=None, gt=0, description="defaults to the profile's")
    engine: EngineSpec = ContinuousEngineSpec()
    tiers: list[str] | None = Field(default=None, description="tiers this pool serves (default: all)")
    autoscaler: AutoscalerSpec | None = None


# --- gateway, clients, policies ----------------------------------------------------------------------


class GatewaySpec(Spec):
    replicas: int = Field(default=1, gt=0, description="gateway replicas, each with its own stale view")
    poll_interval_s: float = Field(default=0.2, ge=0, description="0 = every decision sees live state")
    routing: Literal["least_work", "round_robin", "least_loaded"] = "least_work"
    dispatch: Literal["immediate", "central"] = Field(
        default="immediate",
        description="immediate: route at admission to a replica's waiting queue; "
        "central: hold in the gateway's queue until a replica has a free batch slot",
    )
    estimate_output: Literal["max_tokens", "learned"] = Field(
        default="max_tokens",
        description="what a request's decode is charged: its max_tokens, or the mean output its tier has "
        "produced so far (capped at max_tokens)",
    )


class BackoffSpec(Spec):
    base_s: float = Field(default=1.0, gt=0)
    cap_s: float = Field(default=30.0, gt=0)
    jitter: Literal["none", "full", "equal", "decorrelated"] = Field(
        default="full",
        description="none: the exponential span itself; full: U(0, span); equal: span/2 + U(0, span/2); "
        "decorrelated: min(cap, U(base, 3 x previous wait))",
    )


class RetryBudgetSpec(Spec):
    ratio: float = Field(gt=0, description="retries allowed per first attempt (0.2 = at most 20% extra load)")
    burst: float = Field(default=10.0, ge=1, description="most retries saved up at once")


class ClientSpec(Spec):
    max_retries: int = Field(default=3, ge=0, description="retries after a 429 (0 = never retry)")
    honor_retry_after: bool = True
    backoff: BackoffSpec = BackoffSpec()
    retry_budget: RetryBudgetSpec | None = Field(
        default=None,
        description="client-side budget: each first attempt earns `ratio` retries, up to `burst`",
    )
    abandon_after_s: float | None = Field(
        default=None, gt=0, description="give up (and abort) without a first token this long after arriving"
    )


class UnconditionalSpec(Spec):
    kind: Literal["unconditional"]
    name: str | None = None


class QueueDepthSpec(Spec):
    kind: Literal["queue_depth"]
    name: str | None = None
    max_queued: int = Field(ge=0, description="reject when this many admitted requests wait unscheduled")
    retry_after_s: float = Field(default=1.0, gt=0)


class GpuSecondsSpec(Spec):
    kind: Literal["gpu_seconds"]
    name: str | None = None
    budgets_s: dict[str, float] = Field(
        default_factory=lambda: dict(DEFAULT_BUDGETS_S),
        description="wait budget per tier, seconds of predicted wait",
    )
    default_budget_s: float = Field(
        default=DEFAULT_BUDGET_S, gt=0, description="budget of tiers not in budgets_s"
    )
    headroom: float = Field(default=DEFAULT_HEADROOM, gt=0, le=1.0)
    max_pool_gpu_seconds: float | None = Field(
        default=None, gt=0, description="default: available GPUs x the largest budget"
    )
    tier_max_gpu_seconds: dict[str, float] = Field(
        default_factory=dict, description="caps on one tier's in-flight GPU-seconds (e.g. {batch: 6})"
    )


PolicySpec = Annotated[UnconditionalSpec | QueueDepthSpec | GpuSecondsSpec, Field(discriminator="kind")]


class VariantSpec(Spec):
    name: str
    set: dict[str, object] = Field(description="overrides of this variant, by path, as with --set")


class ScenarioSpec(Spec):
    name: str = "scenario"
    description: str = ""
    variants: list[VariantSpec] = Field(
        default_factory=list,
        description="settings other than the policy to compare (pool layout, clients, autoscaler...): every "
        "policy runs in every variant, all on the same seeds",
    )
    workload: WorkloadSpec
    pools: list[PoolSpec] = Field(min_length=1)
    gateway: GatewaySpec = GatewaySpec()
    clients: ClientSpec = ClientSpec()
    policies: list[PolicySpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _cross_checks(self) -> ScenarioSpec:
        tiers = {t.name for t in self.workload.tiers}
        served: set[str] = set()
        for pool in self.pools:
            unknown = set(pool.tiers or []) - tiers
            if unknown:
                raise ValueError(f"pool {pool.name!r} serves unknown tiers {sorted(unknown)}")
            served |= set(pool.tiers or tiers)
        if tiers - served:
            raise ValueError(f"no pool serves tiers {sorted(tiers - served)}")
        names = [policy_name(p) for p in self.policies]
        if len(set(names)) != len(names):
            raise ValueError(f"policy names must be unique (set name:), got {names}")
        return self


def policy_name(spec: UnconditionalSpec | QueueDepthSpec | GpuSecondsSpec) -> str:
    """A policy's name in results and paths: its `name`, or its `kind` when unnamed (`element_name`)."""
    return str(element_name(spec))
