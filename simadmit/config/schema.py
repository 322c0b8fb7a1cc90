"""Scenario schema: pools, gateway, clients, policies and the scenario itself, validated up front.

Everything is checked before a simulation starts, and every problem is reported on its own line as
`file: field.path: message` (exit code 2 from the CLI); the workload section's models live in
`simadmit.config.workload_schema`. After validation the simulator runs on plain dataclasses built from
these models, never on pydantic objects. `policy_name` is the one rule naming a policy (its `name`, else
its `kind`), used wherever policies are told apart.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Literal

from pydantic import Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator

from simadmit.config.defaults import (
    DEFAULT_BUDGET_S,
    DEFAULT_BUDGETS_S,
    DEFAULT_ENGINE_KIND,
    DEFAULT_HEADROOM,
    RETRY_ELAPSED_HEADER,
)
from simadmit.config.overrides import element_name
from simadmit.config.workload_schema import (
    MAX_GPUS_PER_REPLICA,
    MAX_SECONDS,
    DistSpec,
    EmpiricalSpec,
    ExponentialSpec,
    FixedSpec,
    LogNormalSpec,
    Name,
    Spec,
    WorkloadSpec,
)

# --- pools -------------------------------------------------------------------------------------------


MAX_REPLICAS = 10_000  # a bigger fleet (or gateway tier) is a typo, and would not fit in memory
MIN_PERIOD_S = 0.001  # shortest poll or sync period: shorter ones only multiply events
HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an HTTP field name (RFC 9110's token)


class ContinuousEngineSpec(Spec):
    kind: Literal["continuous"] = "continuous"
    max_num_seqs: int | None = Field(default=None, gt=0, le=2**31, description="overrides the profile")
    max_num_batched_tokens: int | None = Field(
        default=None, gt=0, le=2**31, description="overrides the profile"
    )
    kv_capacity_tokens: int | None = Field(default=None, gt=0, le=2**40, description="overrides the profile")
    scheduling: Literal["fcfs", "priority"] = Field(
        default="fcfs",
        description="vLLM's --scheduling-policy: fcfs, or priority (the waiting queue by each request's "
        "priority, then arrival; when KV runs out, the lowest priority is preempted)",
    )
    tier_priority: dict[str, int] = Field(
        default_factory=dict,
        description="the priority each tier's requests carry, lower first (e.g. {interactive: 0, batch: 1}; "
        "tiers absent: 0); used only under priority scheduling, so a variant can switch it on",
    )


def _seconds(dist: DistSpec) -> DistSpec:
    """A distribution of seconds (service, cold start) must stay within MAX_SECONDS in practice: its
    one-in-a-million draw (clipped to its `min` and `max`) at most that, since each draw becomes a time on
    the timeline."""
    if isinstance(dist, FixedSpec):
        reach = dist.value
    elif isinstance(dist, ExponentialSpec):
        reach = dist.mean * math.log(1e6)
    elif isinstance(dist, LogNormalSpec):
        reach = min(dist.max, max(dist.min, dist.median * math.exp(4.75 * dist.sigma)))
    else:
        assert isinstance(dist, EmpiricalSpec)
        reach = max(dist.values or [0.0])
    if reach > MAX_SECONDS:
        raise ValueError(
            f"one draw in a million reaches {reach:.3g} s: at most {MAX_SECONDS:g} s (set a smaller scale "
            "or min, or a max)"
        )
    return dist


class ClassicalEngineSpec(Spec):
    kind: Literal["classical"]
    service_time: DistSpec = Field(description="service time of one request, seconds (batch of 1)")

    _service_seconds = field_validator("service_time")(_seconds)


def _engine_kind(value: object) -> str:
    """Engines default to continuous batching when `kind` is left out."""
    if isinstance(value, dict):
        return str(value.get("kind", DEFAULT_ENGINE_KIND))
    return str(getattr(value, "kind", DEFAULT_ENGINE_KIND))


EngineSpec = Annotated[
    Annotated[ContinuousEngineSpec, Tag("continuous")] | Annotated[ClassicalEngineSpec, Tag("classical")],
    Discriminator(
        _engine_kind,
        custom_error_type="engine_kind",
        custom_error_message="kind must be 'continuous' (the default) or 'classical'",
    ),
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
    min_replicas: int = Field(default=1, gt=0, le=MAX_REPLICAS)
    max_replicas: int = Field(gt=0, le=MAX_REPLICAS)
    sync_period_s: float = Field(default=15.0, ge=MIN_PERIOD_S, le=MAX_SECONDS)
    tolerance: float = Field(
        default=0.1,
        ge=0,
        lt=1,
        description="ratios within 1 +- this leave the count (at 1: never scales down)",
    )
    scale_up_stabilization_s: float = Field(default=0.0, ge=0, le=MAX_SECONDS)
    scale_down_stabilization_s: float = Field(default=300.0, ge=0, le=MAX_SECONDS)
    cold_start_s: DistSpec = Field(
        default=FixedSpec(kind="fixed", value=90.0), description="time before a new replica serves"
    )

    _cold_start_seconds = field_validator("cold_start_s")(_seconds)

    @field_validator("target")
    @classmethod
    def _fraction(cls, v: float, info: ValidationInfo) -> float:
        if info.data.get("metric") == "gpu_utilization" and v > 1:  # never reached: it would never scale up
            raise ValueError(f"{v:g} for gpu_utilization, a busy fraction: at most 1 (e.g. 0.7)")
        return v

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalerSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must not exceed max_replicas")
        return self


class PoolSpec(Spec):
    name: Name = "pool"
    profile: str = Field(
        min_length=1, description="profile file (relative to the scenario) or a bundled profile name"
    )
    replicas: int = Field(gt=0, le=MAX_REPLICAS)
    gpus_per_replica: int | None = Field(
        default=None, gt=0, le=MAX_GPUS_PER_REPLICA, description="defaults to the profile's"
    )
    engine: EngineSpec = ContinuousEngineSpec()
    tiers: list[str] | None = Field(
        default=None, min_length=1, description="tiers this pool serves (default, left out: all)"
    )
    autoscaler: AutoscalerSpec | None = None

    @model_validator(mode="after")
    def _starts_within_its_autoscaler(self) -> PoolSpec:
        """`replicas` is the count the run starts with: outside the autoscaler's bounds it would hold until
        the first sync (the whole of a run shorter than sync_period_s), a count the autoscaler never allows."""
        a = self.autoscaler
        if a is not None and not a.min_replicas <= self.replicas <= a.max_replicas:
            raise ValueError(
                f"replicas ({self.replicas}) outside autoscaler.min_replicas..max_replicas ({a.min_replicas}.."
                f"{a.max_replicas}): the run starts with replicas, so give a count the autoscaler allows"
            )
        return self


# --- gateway, clients, policies ----------------------------------------------------------------------


class GatewayHttpSpec(Spec):
    """How `simadmit gateway` reads HTTP requests and watches its backends (the simulator ignores it)."""

    tier_header: str = Field(default="x-tier", description="request header naming the tier")
    api_keys: dict[str, str] = Field(
        default_factory=dict, description="API key (Authorization: Bearer KEY) -> tier, when no tier header"
    )
    default_tier: str | None = Field(
        default=None, description="tier of a request that names none (default: the first tier)"
    )
    deadline_header: str = Field(
        default="x-deadline-s", description="request header: seconds from arrival the client can wait"
    )
    elapsed_header: str = Field(
        default=RETRY_ELAPSED_HEADER,
        description="request header: seconds since the client's first attempt at this request (a retry); "
        "they count against the tier's wait budget. Absent: the attempt is taken as the request's first",
    )
    tokenizer: str | None = Field(
        default=None,
        description="a tokenizer.json to count prompt tokens in the gateway (path relative to the scenario); "
        "default: each request's prompt is counted by a backend's /tokenize",
    )
    max_body_bytes: int = Field(default=4_000_000, gt=0, description="larger request bodies get a 413")
    backend_timeout_s: float = Field(
        default=120.0, gt=0, description="longest silence from a backend mid-request before a 502"
    )
    connect_timeout_s: float = Field(default=5.0, gt=0, description="longest wait to connect to a backend")
    stale_after_s: float = Field(
        default=3.0,
        gt=0,
        description="a backend's /metrics unanswered this long, with no answer streaming from it, counts as stale",
    )
    on_stale: Literal["unavailable", "last_known"] = Field(
        default="unavailable",
        description="unavailable: a stale backend gets no work and its requests end with a 503; "
        "last_known: keep routing to it on its last metrics",
    )

    @field_validator("tier_header", "deadline_header", "elapsed_header")
    @classmethod
    def _header_name(cls, v: str) -> str:
        """A name a client can send: anything else would silently never match a request's headers."""
        if not HEADER_NAME.fullmatch(v):
            raise ValueError(f"{v!r} is not an HTTP header name (letters, digits and -, no spaces or colons)")
        return v

    @field_validator("api_keys")
    @classmethod
    def _sendable_keys(cls, v: dict[str, str]) -> dict[str, str]:
        """Keys a client can send after `Bearer ` (the header's value is trimmed, and can hold no control
        character): any other would silently never match. The key itself is a secret: never printed."""
        for n, key in enumerate(v, 1):
            if not key or key != key.strip() or not key.isprintable():
                raise ValueError(
                    f"key {n} of {len(v)} is empty, has spaces at an end or a control character: no "
                    "`Authorization: Bearer KEY` header could carry it"
                )
        return v

    @model_validator(mode="after")
    def _distinct_headers(self) -> GatewayHttpSpec:
        names = [self.tier_header.lower(), self.deadline_header.lower(), self.elapsed_header.lower()]
        if len(set(names)) < len(names):
            raise ValueError("tier_header, deadline_header and elapsed_header must be different headers")
        return self


class GatewaySpec(Spec):
    replicas: int = Field(
        default=1, gt=0, le=MAX_REPLICAS, description="gateway replicas, each with its own stale view"
    )
    poll_interval_s: float = Field(
        default=0.2,
        ge=0,
        le=MAX_SECONDS,
        description=f"0 = every decision sees live state; else at least {MIN_PERIOD_S} s",
    )
    routing: Literal["least_work", "round_robin", "least_loaded"] = "least_work"
    dispatch: Literal["immediate", "central"] = Field(
        default="immediate",
        description="immediate: route at admission to a replica's waiting queue; "
        "central: hold in the gateway's queue until a replica has a free batch slot",
    )
    estimate_output: Literal["max_tokens", "learned", "quantile", "ewma", "oracle"] = Field(
        default="max_tokens",
        description="what a request's decode is charged: its max_tokens, the mean output its tier has "
        "produced so far (learned) or its 90th percentile (quantile), both capped at max_tokens; ewma: "
        "max_tokens x an EWMA of true over charged cost per tier; oracle: the true output (a study's bound)",
    )
    shed_lost_deadlines: bool | None = Field(
        default=None,
        description="drop admitted requests whose deadline is lost (queued: even alone their answer would be "
        "late; running: past it), whatever the policy; default: as the policy says (predicted_ttft's own "
        "setting; other policies never shed)",
    )
    view: Literal["metrics", "exact"] = Field(
        default="metrics",
        description="what a simulated gateway polls: metrics = what a deployed gateway sees, vLLM's gauges "
        "as published at the end of each engine step plus its own books, other gateways' requests priced "
        "at its mean estimate; exact = every engine's current state and all gateways' exact charges",
    )
    latency_s: float = Field(
        default=0.0,
        ge=0,
        le=60.0,
        description="a request's way through the gateway process itself (reading it, counting its tokens, "
        "the proxy hops to the backend and back), beyond the API server's: part of every first token and "
        "end a client sees, and of every first token a gateway predicts; measured as lone requests' time "
        "to first token through the gateway less straight to a backend",
    )
    http: GatewayHttpSpec = Field(
        default_factory=GatewayHttpSpec, description="the live gateway's HTTP settings"
    )

    @field_validator("poll_interval_s")
    @classmethod
    def _poll(cls, v: float) -> float:
        if 0 < v < MIN_PERIOD_S:
            raise ValueError(f"must be 0 (live view) or at least {MIN_PERIOD_S} s")
        return v


class BackoffSpec(Spec):
    base_s: float = Field(default=1.0, gt=0, le=MAX_SECONDS)
    cap_s: float = Field(default=30.0, gt=0, le=MAX_SECONDS)
    jitter: Literal["none", "full", "equal", "decorrelated"] = Field(
        default="full",
        description="none: the exponential span itself; full: U(0, span); equal: span/2 + U(0, span/2); "
        "decorrelated: min(cap, U(base, 3 x previous wait))",
    )

    @model_validator(mode="after")
    def _base_within_cap(self) -> BackoffSpec:
        if self.base_s > self.cap_s:  # every wait would be the cap: surely not what was meant
            raise ValueError(
                f"base_s ({self.base_s:g} s) above cap_s ({self.cap_s:g} s): every wait would be cap_s"
            )
        return self


class RetryBudgetSpec(Spec):
    ratio: float = Field(gt=0, description="retries allowed per first attempt (0.2 = at most 20% extra load)")
    burst: float = Field(default=10.0, ge=1, description="most retries saved up at once")


class ClientSpec(Spec):
    max_retries: int = Field(default=3, ge=0, le=100, description="retries after a 429 (0 = never retry)")
    honor_retry_after: bool = True
    backoff: BackoffSpec = BackoffSpec()
    retry_budget: RetryBudgetSpec | None = Field(
        default=None,
        description="client-side budget: each first attempt earns `ratio` retries, up to `burst`",
    )
    abandon_after_s: float | None = Field(
        default=None,
        gt=0,
        le=MAX_SECONDS,
        description="give up (and abort) without a first token this long after arriving",
    )


class UnconditionalSpec(Spec):
    kind: Literal["unconditional"]
    name: Name | None = None


class QueueDepthSpec(Spec):
    kind: Literal["queue_depth"]
    name: Name | None = None
    max_queued: int = Field(
        ge=0,
        description="reject when this many admitted requests wait unscheduled; 0 = no waiting room (a loss "
        "system): admit only when a batch slot is free",
    )
    retry_after_s: float = Field(default=1.0, gt=0, le=MAX_SECONDS)


class GpuSecondsSpec(Spec):
    kind: Literal["gpu_seconds"]
    name: Name | None = None
    budgets_s: dict[str, Annotated[float, Field(gt=0)]] = Field(
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
    tier_max_gpu_seconds: dict[str, Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict, description="caps on one tier's in-flight GPU-seconds (e.g. {batch: 6})"
    )
    work: Literal["admitted", "remaining"] = Field(
        default="admitted",
        description="in-flight work: everything charged until it finishes (the article's rule), or what "
        "remains of it as requests prefill and decode",
    )


class PredictedTtftSpec(Spec):
    kind: Literal["predicted_ttft"]
    name: Name | None = None
    budgets_s: dict[str, Annotated[float, Field(gt=0)]] | None = Field(
        default=None, description="TTFT budget per tier, seconds from the first attempt (default: its SLO)"
    )
    e2e_budgets_s: dict[str, Annotated[float, Field(gt=0)]] | None = Field(
        default=None, description="end-to-end budget per tier (default: its SLO)"
    )
    default_budget_s: float = Field(default=DEFAULT_BUDGET_S, gt=0, description="budget of other tiers")
    margin: float = Field(
        default=0.7, gt=0, le=1.0, description="fraction of the budget a prediction may fill"
    )
    correct: bool = Field(
        default=True,
        description="learn the actual/predicted TTFT ratio per tier and the decode step's (EWMA)",
    )
    alpha: float = Field(default=0.05, gt=0, le=1.0, description="EWMA weight of each new observation")
    queue_budget_s: float | None = Field(
        default=None,
        gt=0,
        description="no tier may push the predicted TTFT past this (default: the smallest budget)",
    )
    sheddable_fraction: float = Field(
        default=0.5, gt=0, le=1.0, description="tiers with a longer budget may fill only this fraction of it"
    )
    shed_lost_deadlines: bool = Field(
        default=True, description="drop admitted requests still queued once their deadline is lost"
    )

    @model_validator(mode="after")
    def _end_after_first_token(self) -> PredictedTtftSpec:
        """A tier's end-to-end budget under its TTFT budget leaves the TTFT budget nothing to bind: surely
        the two swapped, as `SLOSpec` says of the SLOs."""
        for tier, e2e in (self.e2e_budgets_s or {}).items():
            ttft = (self.budgets_s or {}).get(tier, 0.0)
            if e2e < ttft:
                raise ValueError(
                    f"e2e_budgets_s.{tier} ({e2e:g} s) under budgets_s.{tier} ({ttft:g} s): a request ends after "
                    "its first token, so its TTFT budget could never bind"
                )
        return self


class SaturationSpec(Spec):
    kind: Literal["saturation"]
    name: Name | None = None
    critical: list[str] | None = Field(
        default=None, description="tiers never shed (default: the tier with the tightest TTFT SLO)"
    )
    queue_depth_threshold: float = Field(default=5.0, gt=0)
    kv_cache_threshold: float = Field(
        default=0.8, gt=0, description="fraction of the KV cache in use that counts as saturated"
    )

    @field_validator("kv_cache_threshold")
    @classmethod
    def _fraction(cls, v: float) -> float:
        """A threshold above 1 is never reached (the cache is at most full): a percent written as a number."""
        if v > 1:
            raise ValueError(f"{v:g}: a fraction of the KV cache, at most 1 (for 80% write 0.8)")
        return v

    metrics_staleness_s: float = Field(default=0.2, gt=0, description="older metrics count as saturated")


class BucketSpec(Spec):
    rate: float = Field(gt=0, description="input tokens per second")
    burst: float = Field(gt=0, description="most input tokens saved up")


class TokenBucketSpec(Spec):
    kind: Literal["token_bucket"]
    name: Name | None = None
    tiers: dict[str, BucketSpec] = Field(description="a bucket per tier (tiers absent: not limited)")


class LimitSpec(Spec):
    rpm: float | None = Field(default=None, gt=0, description="requests per minute")
    tpm: float | None = Field(default=None, gt=0, description="tokens (prompt + max_tokens) per minute")

    @field_validator("rpm")
    @classmethod
    def _a_request_a_minute(cls, v: float | None) -> float | None:
        """A fixed one-minute window passes whole requests: under 1 a minute, it would pass none."""
        if v is not None and v < 1:
            raise ValueError(
                f"{v:g} a minute: a one-minute window passes whole requests, so none (at least 1)"
            )
        return v

    @model_validator(mode="after")
    def _limits_something(self) -> LimitSpec:
        """A tier listed with neither limit would be listed as limited and never be."""
        if self.rpm is None and self.tpm is None:
            raise ValueError("give rpm, tpm or both: a tier with neither is not limited (leave it out)")
        return self


class RateLimitSpec(Spec):
    kind: Literal["rate_limit"]
    name: Name | None = None
    tiers: dict[str, LimitSpec] = Field(description="limits per tier over fixed one-minute windows")


class PostHocTokensSpec(Spec):
    kind: Literal["post_hoc_tokens"]
    name: Name | None = None
    tokens_per_minute: dict[str, Annotated[float, Field(gt=0)]] = Field(
        description="per tier: tokens (prompt + output) charged at completion, per one-minute window"
    )


PolicySpec = Annotated[
    UnconditionalSpec
    | QueueDepthSpec
    | GpuSecondsSpec
    | PredictedTtftSpec
    | SaturationSpec
    | TokenBucketSpec
    | RateLimitSpec
    | PostHocTokensSpec,
    Field(discriminator="kind"),
]


class VariantSpec(Spec):
    name: Name
    set: dict[str, object] = Field(description="overrides of this variant, by path, as with --set")

    @field_validator("set")
    @classmethod
    def _not_variants(cls, v: dict[str, object]) -> dict[str, object]:
        """A variant runs the scenario without its variants: variants set inside one would never run."""
        if any(path.split(".")[0] == "variants" for path in v):
            raise ValueError(
                "a variant cannot set variants: list every variant under the scenario's variants"
            )
        return v


class ScenarioSpec(Spec):
    name: Name = "scenario"
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


_TIER_FIELDS: dict[type, tuple[str, ...]] = {  # each policy's settings keyed by (or listing) tier names
    GpuSecondsSpec: ("budgets_s", "tier_max_gpu_seconds"),
    PredictedTtftSpec: ("budgets_s", "e2e_budgets_s"),
    SaturationSpec: ("critical",),
    TokenBucketSpec: ("tiers",),
    RateLimitSpec: ("tiers",),
    PostHocTokensSpec: ("tokens_per_minute",),
}


def scenario_problems(spec: ScenarioSpec) -> list[tuple[str, str]]:
    """Rules across sections, as (field path, message): names that must match, limits that must agree.

    Kept out of the model validators so that each problem names its own field, and all are reported at once.
    """
    tiers = [t.name for t in spec.workload.tiers]
    known = f"tiers: {', '.join(tiers)}"
    out: list[tuple[str, str]] = []
    for i, pool in enumerate(spec.pools):
        out += [(f"pools.{i}.tiers", f"no tier {t!r} ({known})") for t in pool.tiers or [] if t not in tiers]
    served = {t for pool in spec.pools for t in pool.tiers or tiers}
    out += [
        ("pools", f"no pool serves tier {t!r}: list it under a pool's tiers")
        for t in tiers
        if t not in served
    ]
    http = spec.gateway.http
    out += [  # the key itself is a secret: never printed
        ("gateway.http.api_keys", f"an API key maps to no tier {tier!r} ({known})")
        for tier in dict.fromkeys(http.api_keys.values())
        if tier not in tiers
    ]
    if http.default_tier is not None and http.default_tier not in tiers:
        out.append(("gateway.http.default_tier", f"no tier {http.default_tier!r} ({known})"))
    out += [  # the summary's own keys beside the tiers': a tier of that name would be overwritten
        (
            f"workload.tiers.{i}.name",
            f"{name!r} is what the summary calls {'every tier together' if name == 'all' else 'a pool'}: "
            "rename the tier",
        )
        for i, name in enumerate(tiers)
        if name == "all" or name.startswith("pool:")
    ]
    out += _taken("policies", "policy", [policy_name(p) for p in spec.policies])
    out += _taken("pools", "pool", [p.name for p in spec.pools])
    out += _taken("variants", "variant", [v.name for v in spec.variants])
    default_budgets = GpuSecondsSpec.model_fields["budgets_s"].get_default(call_default_factory=True)
    for i, p in enumerate(spec.policies):
        for key in _TIER_FIELDS.get(type(p), ()):
            given = getattr(p, key) or {}
            if isinstance(p, GpuSecondsSpec) and key == "budgets_s" and given == default_budgets:
                continue  # the defaults name the usual tiers; a scenario need not have them all
            pairs = [(t, t) for t in given] if isinstance(given, dict) else list(enumerate(given))
            out += [  # a setting for a tier the workload lacks would silently never apply
                (f"policies.{i}.{key}.{where}", f"no tier {tier!r} ({known})")
                for where, tier in pairs
                if tier not in tiers
            ]
    for i, pool in enumerate(spec.pools):
        engine = pool.engine
        if isinstance(engine, ContinuousEngineSpec):
            for tier in engine.tier_priority:
                if tier not in tiers:
                    out.append(
                        (
                            f"pools.{i}.engine.tier_priority.{tier}",
                            f"no tier {tier!r} (tiers: {', '.join(tiers)})",
                        )
                    )
    owner: dict[str, int] = {}
    for i, pool in enumerate(spec.pools):
        for tier in dict.fromkeys(pool.tiers or tiers):
            if (pool.tiers or []).count(tier) > 1:
                out.append((f"pools.{i}.tiers", f"tier {tier!r} is listed twice"))
            if tier in owner:
                first = spec.pools[owner[tier]].name
                out.append(
                    (
                        f"pools.{i}.tiers",
                        f"tier {tier!r} is already served by pool {first!r} (pools.{owner[tier]}); a tier is "
                        "served by one pool: list each tier under one pool's tiers (a pool without tiers: "
                        "serves them all)",
                    )
                )
            else:
                owner[tier] = i
    return out


def _taken(section: str, what: str, names: list[str]) -> list[tuple[str, str]]:
    """Each element of a section whose name an earlier one has: results and tables are keyed by it, so
    two of them would be mixed into one."""
    return [
        (
            f"{section}.{i}",
            f"{what} name {name!r} is taken by {section}.{names.index(name)}: set name: to tell them apart",
        )
        for i, name in enumerate(names)
        if names.index(name) != i
    ]


def engine_limits_problem(max_num_batched_tokens: int, max_num_seqs: int) -> str | None:
    """The engine invariant vLLM enforces: every sequence of a full batch gets at least one token a step."""
    if max_num_batched_tokens >= max_num_seqs:
        return None
    return (
        f"max_num_batched_tokens ({max_num_batched_tokens}) is below max_num_seqs ({max_num_seqs}): a step "
        "gives each scheduled sequence at least one token, so it must be >= max_num_seqs (as vLLM requires)"
    )


def policy_name(spec: Spec) -> str:
    """A policy's name in results and paths: its `name`, or its `kind` when unnamed (`element_name`)."""
    return str(element_name(spec))
