"""Production admission baselines: each reproduces its documented rule on hand-built views, decision by
decision, reason by reason, Retry-After by Retry-After."""

from __future__ import annotations

from simadmit.admission.baselines import PostHocTokens, RateLimits, SaturationShedding, TokenBucket
from simadmit.admission.policies import PoolView, Request
from simadmit.admission.view import ReplicaLoad
from simadmit.config.loading import load_scenario
from simadmit.config.resources import default_scenario
from simadmit.sim.world import build_world
from simadmit.study.runner import run_scenario


def req(tier: str, prompt: int = 100, max_tokens: int = 50, rid: int = 1) -> Request:
    return Request(rid, tier, prompt, max_tokens, 0.0)


def replica(waiting: int, kv: float, polled_at: float = 0.0) -> ReplicaLoad:
    return ReplicaLoad(waiting=waiting, kv_used=int(kv * 1000), kv_capacity=1000, polled_at=polled_at)


def test_saturation_is_the_mean_of_max_queue_over_5_and_kv_over_0_8() -> None:
    """Two replicas: (queue 5, KV 0) scores 1, (queue 0, KV 0.4) scores 0.5: mean 0.75, not saturated;
    KV 0.8 on the second makes it 1: saturated, and only the sheddable tier is refused."""
    p = SaturationShedding(critical=frozenset({"interactive"}))
    calm = PoolView(replicas=[replica(5, 0.0), replica(0, 0.4)])
    assert p.saturation(calm, 0.1) == 0.75
    assert p.decide(req("batch"), 0.0, calm, 0.1).admit
    full = PoolView(replicas=[replica(5, 0.0), replica(0, 0.8)])
    assert p.saturation(full, 0.1) == 1.0
    d = p.decide(req("batch"), 0.0, full, 0.1)
    assert (d.admit, d.reason, d.retry_after_s) == (False, "pool_saturated", 1.0)
    assert p.decide(req("interactive"), 0.0, full, 0.1).admit  # critical traffic is never shed


def test_a_replica_with_metrics_older_than_200_ms_counts_as_saturated() -> None:
    """An idle pair: 0 at 0.2 s after the poll (not older than 200 ms); at 0.25 s both are stale and the pool
    is saturated; one fresh idle replica and one stale one average 0.5."""
    p = SaturationShedding()
    idle = PoolView(replicas=[replica(0, 0.0), replica(0, 0.0)])
    assert p.saturation(idle, 0.2) == 0.0
    assert p.saturation(idle, 0.25) == 1.0
    assert not p.decide(req("batch"), 0.0, idle, 0.25).admit
    mixed = PoolView(replicas=[replica(0, 0.0, polled_at=0.2), replica(0, 0.0)])
    assert p.saturation(mixed, 0.25) == 0.5


def test_token_bucket_on_input_tokens() -> None:
    """Rate 100 tokens/s, burst 300: three 100-token prompts pass at t=0, the fourth waits 1 s (Retry-After
    1); at t=0.5 the bucket holds 50, a 100-token prompt needs 0.5 s more (Retry-After rounds up to 1); at
    t=1 it holds 100 and passes; other tiers are not limited; a prompt above the burst never passes."""
    p = TokenBucket({"chat": (100.0, 300.0)})
    assert all(p.decide(req("chat", 100), 0.0, PoolView(), 0.0).admit for _ in range(3))
    d = p.decide(req("chat", 100), 0.0, PoolView(), 0.0)
    assert (d.admit, d.reason, d.retry_after_s) == (False, "rate_limited", 1.0)
    d = p.decide(req("chat", 100), 0.0, PoolView(), 0.5)
    assert (d.admit, d.retry_after_s) == (False, 1.0)
    assert p.decide(req("chat", 100), 0.0, PoolView(), 1.0).admit
    assert p.decide(req("batch", 10**6), 0.0, PoolView(), 1.0).admit
    assert p.fresh().decide(req("chat", 301), 0.0, PoolView(), 0.0).retry_after_s == 3600.0


def test_rpm_and_tpm_over_fixed_minute_windows() -> None:
    """RPM 2: the third request in [0, 60) is refused with Retry-After to t=60; TPM 400 with 150-token
    requests (100 prompt + 50 max_tokens): the third would make 450; a new window starts afresh."""
    rpm = RateLimits({"chat": (2, None)})
    assert rpm.decide(req("chat"), 0.0, PoolView(), 1.0).admit
    assert rpm.decide(req("chat"), 0.0, PoolView(), 2.0).admit
    d = rpm.decide(req("chat"), 0.0, PoolView(), 50.5)
    assert (d.admit, d.reason, d.retry_after_s) == (False, "rate_limited", 10.0)
    assert rpm.decide(req("chat"), 0.0, PoolView(), 60.0).admit
    tpm = RateLimits({"chat": (None, 400)})
    assert tpm.decide(req("chat"), 0.0, PoolView(), 0.0).admit
    assert tpm.decide(req("chat"), 0.0, PoolView(), 0.0).admit
    assert not tpm.decide(req("chat"), 0.0, PoolView(), 0.0).admit
    assert tpm.decide(req("chat", 100, 0), 0.0, PoolView(), 0.0).admit  # 400 exactly still fits
    assert tpm.decide(req("other"), 0.0, PoolView(), 0.0).admit


def test_post_hoc_tokens_charge_at_completion_and_let_in_flight_work_overshoot() -> None:
    """Budget 1000 tokens a minute: nothing is charged at admission, so any number of requests pass until
    completions have charged 1000; then the tier is refused until the next window."""
    p = PostHocTokens({"chat": 1000.0})
    for rid in range(10):  # ten admitted before any completes: 10 x (100 + 200) = 3000 will land
        assert p.decide(req("chat", rid=rid), 0.0, PoolView(), 1.0).admit
    for rid in range(3):
        p.observe_completion(req("chat", rid=rid), 200, 5.0)
    assert p.decide(req("chat"), 0.0, PoolView(), 6.0).admit  # 900 < 1000
    p.observe_completion(req("chat", rid=3), 200, 7.0)
    d = p.decide(req("chat"), 0.0, PoolView(), 7.5)
    assert (d.admit, d.reason, d.retry_after_s) == (False, "token_budget_spent", 53.0)
    assert p.decide(req("chat"), 0.0, PoolView(), 60.0).admit


def test_baselines_run_from_a_scenario() -> None:
    """Every baseline builds from the scenario schema and runs; saturation shedding at 3x overload refuses
    batch only, the default critical tier being the one with the tightest TTFT SLO."""
    spec, base = load_scenario(
        default_scenario(),
        {"workload.duration_s": 20,
         "policies": [{"kind": "saturation"},
                      {"kind": "token_bucket", "tiers": {"interactive": {"rate": 20000, "burst": 40000}}},
                      {"kind": "rate_limit", "tiers": {"batch": {"rpm": 300, "tpm": 2000000}}},
                      {"kind": "post_hoc_tokens", "tokens_per_minute": {"batch": 1000000}}]},
    )  # fmt: skip
    s = run_scenario(spec, build_world(spec, base)).summary
    assert s["saturation"]["interactive"]["rejected"] == 0
    assert s["saturation"]["batch"]["rejection_rate"] > 0.5
    assert s["token_bucket"]["interactive"]["rejection_rate"] > 0.1
    assert s["token_bucket"]["batch"]["rejected"] == 0
    assert s["rate_limit"]["batch"]["attempt_rejection_rate"] > 0.2
    assert s["post_hoc_tokens"]["interactive"]["rejected"] == 0
