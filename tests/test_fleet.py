"""Fleet dynamics: the HPA algorithm, cold starts, client backoff, retry budgets, stale gateway views."""

from __future__ import annotations

import numpy as np
import pytest

from simadmit.admission.client import ClientConfig, RetryBudget, backoff_delay
from simadmit.config.loading import load_scenario
from simadmit.config.resources import default_scenario
from simadmit.fleet.autoscaler import AutoscalerConfig, HorizontalAutoscaler, queue_wait_load
from simadmit.sim.simulation import Simulation
from simadmit.sim.world import build_policies, build_world
from simadmit.study.runner import run_scenario
from simadmit.workload.build import generate


def hpa(**kw) -> HorizontalAutoscaler:
    cfg = {"metric": "gpu_utilization", "target": 0.5, "min_replicas": 1, "max_replicas": 20, **kw}
    return HorizontalAutoscaler(AutoscalerConfig(**cfg))


def test_hpa_formula_from_the_kubernetes_docs() -> None:
    """desiredReplicas = ceil(currentReplicas * currentMetricValue / desiredMetricValue)."""
    assert hpa().recommend(0, 1, 1.0) == 2  # 200m used, 100m wanted: double
    assert hpa().recommend(0, 4, 0.25) == 2  # half the target: halve (no window history yet)
    assert hpa().recommend(0, 3, 0.8) == 5  # ceil(3 * 1.6) = 5


def test_hpa_tolerance_skips_small_changes() -> None:
    """Within 10% of the target the HPA does nothing."""
    assert hpa().recommend(0, 10, 0.54) == 10
    assert hpa().recommend(0, 10, 0.46) == 10
    assert hpa().recommend(0, 10, 0.56) == 12


def test_hpa_scale_down_stabilization_keeps_the_highest_recent_recommendation() -> None:
    """Scale-down uses the highest recommendation of the last 300 s; scale-up acts at once."""
    scaler = hpa(scale_down_stabilization_s=300)
    assert scaler.recommend(0, 4, 1.0) == 8  # scale up immediately
    assert scaler.recommend(15, 8, 0.1) == 8  # wants 2, but 8 was recommended 15 s ago
    assert scaler.recommend(200, 8, 0.1) == 8
    assert scaler.recommend(301, 8, 0.1) == 2  # the high recommendation left the window


def test_hpa_clamps_to_min_and_max() -> None:
    assert hpa(max_replicas=6).recommend(0, 4, 2.0) == 6
    assert hpa(min_replicas=3, scale_down_stabilization_s=0).recommend(0, 4, 0.01) == 3


def _cfg(jitter: str, honor: bool = True) -> ClientConfig:
    return ClientConfig(5, honor, 1.0, 30.0, jitter, None)


def test_backoff_kinds_stay_within_their_bounds() -> None:
    rng = np.random.default_rng(0)
    for retry in range(1, 8):
        span = min(30.0, 2.0 ** (retry - 1))
        for u in rng.random(50):
            assert backoff_delay(retry, 3.0, 0.0, _cfg("none"), u) == pytest.approx(3.0 + span)
            assert 3.0 <= backoff_delay(retry, 3.0, 0.0, _cfg("full"), u) <= 3.0 + span
            assert 3.0 + span / 2 <= backoff_delay(retry, 3.0, 0.0, _cfg("equal"), u) <= 3.0 + span
            d = backoff_delay(retry, 0.0, 4.0, _cfg("decorrelated", honor=False), u)
            assert 1.0 <= d <= 12.0
    assert backoff_delay(1, 7.0, 0.0, _cfg("none", honor=False), 0.5) == 1.0


def test_retry_budget_caps_retries_at_a_share_of_first_attempts() -> None:
    budget = RetryBudget(ratio=0.2, burst=1.0)
    budget.tokens = 0.0
    granted = 0
    for _ in range(1000):
        budget.deposit()
        granted += budget.withdraw() + budget.withdraw()  # each request wants two retries
    assert granted == 200


def _scenario(**overrides):
    spec, base = load_scenario(default_scenario(), overrides)
    return spec, build_world(spec, base)


def test_retries_respect_the_budget_in_a_storm() -> None:
    """At 3x overload with eager clients, a 10% retry budget holds carried load near 1.1x offered."""
    spec, world = _scenario(**{
        "workload.duration_s": 30,
        "clients.max_retries": 5,
        "clients.retry_budget": {"ratio": 0.1, "burst": 5},
        "policies": [{"kind": "queue_depth", "max_queued": 16}],
    })  # fmt: skip
    s = run_scenario(spec, world).summary["queue_depth"]["all"]
    assert s["retries_per_request"] <= 0.1 + 5 / s["requests"]
    spec, world = _scenario(**{
        "workload.duration_s": 30, "clients.max_retries": 5, "policies": [{"kind": "queue_depth", "max_queued": 16}]
    })  # fmt: skip
    assert run_scenario(spec, world).summary["queue_depth"]["all"]["retries_per_request"] > 1.0


def test_a_new_replica_serves_nothing_before_its_cold_start_ends() -> None:
    spec, world = _scenario(**{
        "workload.duration_s": 300,
        "workload.rate_multiplier": 0.5,
        "pools.0.replicas": 1,
        "pools.0.autoscaler": {"metric": "queue_wait", "target": 1.0, "max_replicas": 6, "sync_period_s": 15,
                               "cold_start_s": {"kind": "fixed", "value": 90}},
        "policies": [{"kind": "unconditional"}],
    })  # fmt: skip
    workload = generate(spec.workload)
    policy = build_policies(spec)["unconditional"]
    sim = Simulation(world, workload, policy, spec.workload.seed)
    result = sim.run("unconditional")
    log = result.replica_log[0]
    decided = [t for (t, _s, starting, _d), prev in zip(log[1:], log, strict=False) if starting > prev[2]]
    born = [a for a, _b in result.lifetimes[0][1:]]
    assert len(born) >= 2, "the autoscaler should have added replicas under this load"
    # each new replica became ready exactly 90 s after a scale-up decision
    for ready in born:
        assert any(ready == pytest.approx(t + 90) for t in decided)
    led = result.ledger
    scheduled = np.asarray(led.scheduled)
    replica = np.asarray(led.replica)
    for r, (ready, _retired) in enumerate(result.lifetimes[0]):
        mine = scheduled[replica == r]
        assert np.all(mine[~np.isnan(mine)] >= ready)
        assert len(mine) > 0


def test_under_the_metrics_view_the_autoscaler_scales_on_the_largest_load_a_gateway_exports(
    monkeypatch,
) -> None:
    """A deployed HPA reads the gateways' exported queue-wait load (the adapter takes the maximum over
    gateways), each computed from that gateway's view: so does the simulated one, not the pool's exact
    in-flight work."""
    seen: list[tuple[float, float, float]] = []  # (metric, largest gateway load, exact load)
    holder: dict[str, Simulation] = {}

    class Spy(HorizontalAutoscaler):
        def recommend(self, now: float, current: int, metric: float) -> int:
            sim = holder["sim"]
            loads = [
                queue_wait_load(g.views[0].in_flight_gpu_s, g.views[0].available_gpus, 0.0)
                for g in sim.gateways
            ]
            pool = sim.pools[0]
            seen.append((metric, max(loads), queue_wait_load(pool.in_flight_gpu_s, pool.available_gpus, 0.0)))
            return super().recommend(now, current, metric)

    monkeypatch.setattr("simadmit.sim.simulation.HorizontalAutoscaler", Spy)
    spec, world = _scenario(**{
        "workload.duration_s": 120, "workload.rate_multiplier": 0.5, "pools.0.replicas": 1,
        "gateway.replicas": 2, "gateway.poll_interval_s": 2.0, "gateway.view": "metrics",
        "pools.0.autoscaler": {"metric": "queue_wait", "target": 1.0, "max_replicas": 6, "sync_period_s": 5,
                               "cold_start_s": {"kind": "fixed", "value": 10}},
        "policies": [{"kind": "unconditional"}],
    })  # fmt: skip
    sim = Simulation(
        world, generate(spec.workload), build_policies(spec)["unconditional"], spec.workload.seed
    )
    holder["sim"] = sim
    sim.run("unconditional")
    assert len(seen) >= 20
    assert all(metric == pytest.approx(largest) for metric, largest, _exact in seen)
    assert any(abs(largest - exact) > 1e-6 * max(exact, 1.0) for _m, largest, exact in seen), (
        "the views never differed from the exact state: this run tells the two apart nowhere"
    )


def _overshoot(gateways: int, headroom: float) -> float:
    spec, world = _scenario(**{
        "gateway.replicas": gateways,
        "gateway.poll_interval_s": 1.0,
        "workload.duration_s": 60,
        "clients.max_retries": 0,
        "policies": [{"kind": "gpu_seconds", "budgets_s": {"interactive": 1e3, "batch": 1e3}, "headroom": headroom,
                      "max_pool_gpu_seconds": 12}],
    })  # fmt: skip
    peak = run_scenario(spec, world).summary["gpu_seconds"]["pool:llama-8b"]["peak_in_flight_gpu_s"]
    return peak / 12 - 1


def test_stale_views_overshoot_the_pool_budget_more_with_more_gateways_and_headroom_absorbs_it() -> None:
    """One gateway counting its own admits never overshoots; N gateways each admit up to the limit on a
    view up to a poll interval old, so the pool overshoots more as N grows, and less with headroom."""
    full = [_overshoot(n, 1.0) for n in (1, 2, 4)]
    assert full[0] <= 1e-9
    assert full[0] < full[1] < full[2]
    tight = [_overshoot(n, 0.7) for n in (2, 4)]
    assert tight[0] < full[1] and tight[1] < full[2]


def test_scaling_down_cancels_a_replica_still_starting_before_draining_a_serving_one() -> None:
    import simpy

    from simadmit.fleet.pool import Pool
    from simadmit.sim.ledger import Ledger

    env = simpy.Environment()
    service = np.ones(1)
    pool = Pool(env, 0, 2, 1, [1.0], [1], [1], Ledger(1), lambda rid: None, "least_work", False,
                service_s=service)  # fmt: skip
    pool.scale_up(90.0)
    pool.scale_up(90.0)
    env.run(until=30)
    pool.scale_down()  # one of the two starting replicas is cancelled, nobody serving is drained
    env.run(until=200)
    assert len(pool.serving) == 3 and not pool.draining and pool.starting == 0
    assert [round(a) for a, _ in pool.lifetimes] == [0, 0, 90]
    pool.scale_down()  # now a serving replica is drained (idle: retired at once)
    assert len(pool.serving) == 2
    assert sorted(b for _, b in pool.lifetimes) == [200.0, float("inf"), float("inf")]
