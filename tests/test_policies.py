"""Admission policies as plain objects: each decision and its Retry-After, and what tier caps fix."""

from __future__ import annotations

from simadmit.admission.policies import GpuSeconds, PoolView, QueueDepth, Request, Unconditional
from simadmit.config.loading import load_scenario
from simadmit.config.resources import default_scenario
from simadmit.sim.world import build_world
from simadmit.study.runner import run_scenario


def req(tier: str = "interactive", deadline: float | None = None) -> Request:
    return Request(1, tier, 1000, 256, 0.0, deadline)


def test_unconditional_and_queue_depth() -> None:
    assert Unconditional().decide(req(), 1.0, PoolView(queued=10**6), 0.0).admit
    q = QueueDepth(max_queued=8, retry_after_s=2.5)
    assert q.decide(req(), 1.0, PoolView(queued=7), 0.0).admit
    d = q.decide(req(), 1.0, PoolView(queued=8), 0.0)
    assert (d.admit, d.reason, d.retry_after_s) == (False, "queue_full", 3.0)  # whole seconds, as HTTP sends


def test_gpu_seconds_reasons_in_order() -> None:
    p = GpuSeconds(budgets_s={"interactive": 3.0, "batch": 60.0}, headroom=0.9, max_pool_gpu_s=40.0)
    view = PoolView(in_flight_gpu_s=0.0, available_gpus=4)
    assert p.decide(req(), 1.0, view, 0.0).admit
    assert p.decide(req(), 1.0, PoolView(available_gpus=0), 0.0).reason == "pool_exhausted"
    assert (
        p.decide(req(), 1.0, PoolView(in_flight_gpu_s=40.0, available_gpus=4), 0.0).reason == "pool_exhausted"
    )
    # predicted wait 13 / 4 = 3.25 s > 3 s budget: retry when 0.25 s of it has drained -> 1 s
    d = p.decide(req(), 1.0, PoolView(in_flight_gpu_s=13.0, available_gpus=4), 0.0)
    assert (d.reason, d.retry_after_s) == ("would_exceed_sla", 1.0)
    # batch may wait 60 s, but 35 + 2 > 40 x 0.9: the headroom refuses it
    d = p.decide(req("batch"), 2.0, PoolView(in_flight_gpu_s=35.0, available_gpus=4), 0.0)
    assert d.reason == "pool_headroom_exhausted" and d.retry_after_s >= 1.0


def test_a_deadline_tightens_the_budget() -> None:
    p = GpuSeconds(budgets_s={"batch": 60.0}, max_pool_gpu_s=1000.0)
    view = PoolView(in_flight_gpu_s=40.0, available_gpus=4)  # 10 s of predicted wait
    assert p.decide(req("batch"), 1.0, view, now=0.0).admit
    assert p.decide(req("batch", deadline=8.0), 1.0, view, now=0.0).reason == "would_exceed_sla"


def test_tier_cap() -> None:
    p = GpuSeconds(budgets_s={"batch": 60.0}, max_pool_gpu_s=1000.0, tier_max_gpu_s={"batch": 6.0})
    view = PoolView(in_flight_gpu_s=5.5, in_flight_by_tier={"batch": 5.5}, available_gpus=4)
    assert p.decide(req("batch"), 0.4, view, 0.0).admit
    assert p.decide(req("batch"), 1.0, view, 0.0).reason == "tier_share_exhausted"
    assert p.decide(req("interactive"), 1.0, view, 0.0).admit


def test_a_batch_cap_stops_batch_from_starving_interactive_in_a_shared_pool() -> None:
    """With the default pool limit (GPUs x 60 s), batch fills in-flight work far above the interactive
    tier's 3 s threshold and interactive goodput collapses; capping batch at 6 GPU-seconds restores it."""

    def interactive(cap: dict) -> dict:
        policy = {
            "kind": "gpu_seconds",
            "budgets_s": {"interactive": 3, "batch": 60},
            "tier_max_gpu_seconds": cap,
        }
        spec, base = load_scenario(default_scenario(), {"policies": [policy], "workload.duration_s": 60})
        return run_scenario(spec, build_world(spec, base)).summary["gpu_seconds"]["interactive"]

    starved, capped = interactive({}), interactive({"batch": 6})
    assert starved["goodput_rps"] < 1.0
    assert capped["goodput_rps"] > 10.0
    assert capped["served_ttft_p99_s"] < 6.0 < starved["served_ttft_p99_s"]  # of the requests it serves
