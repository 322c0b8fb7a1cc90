"""Deadlines: rejection at the door, shedding after admission, and the GPU-seconds spent on late answers."""

from __future__ import annotations

import dataclasses

import pytest

from simadmit.admission.estimator import CostEstimator
from simadmit.admission.gateway import Gateway
from simadmit.admission.policies import PoolView, Request, Unconditional, deadline_lost
from simadmit.admission.predictive import PredictedTtft
from simadmit.admission.view import EngineModel, ReplicaLoad
from simadmit.config.loading import load_scenario
from simadmit.config.profile import Profile, StepTimeModel
from simadmit.config.resources import default_scenario
from simadmit.results.deadlines import deadline_report
from simadmit.sim.simulation import Simulation
from simadmit.sim.world import build_policies, build_world
from simadmit.workload.build import generate


def test_a_queued_request_is_shed_when_even_an_idle_replica_would_answer_late() -> None:
    """Step 10 ms + 1 ms per decoding sequence, 1e-4 s per prompt token: alone, 1000 prompt tokens and an
    expected 101-token answer take 0.01 + 0.1 + 100 x 0.011 = 1.21 s. Deadline 10 s: lost after t = 8.79.
    A running request is aborted only once its deadline has passed."""
    p = PredictedTtft(budgets_s={"chat": 3.0})
    for _ in range(200):
        p.outputs.observe("chat", 101)
    view = PoolView(available_gpus=1, replicas=[ReplicaLoad(max_seqs=8)],
                    engine=EngineModel(StepTimeModel(0.01, 1e-4, 0.001, 0.0), 8192))  # fmt: skip
    r = Request(1, "chat", 1000, 512, arrival_s=0.0, deadline_s=10.0)
    assert not p.lost(r, view, 8.78, started=False)
    assert p.lost(r, view, 8.80, started=False)
    assert not p.lost(r, view, 9.99, started=True)
    assert p.lost(r, view, 10.01, started=True)
    assert not p.lost(Request(2, "chat", 1000, 512, 0.0), view, 1e6, started=True)  # no deadline
    off = PredictedTtft(budgets_s={"chat": 3.0}, shed_lost_deadlines=False)
    assert not off.lost(r, view, 20.0, started=True)


def test_the_door_refuses_an_answer_predicted_past_the_deadline() -> None:
    """The first token would come in time (3 s budget), but 101 tokens at ~11 ms per step end after the
    2 s deadline: rejected as would_exceed_e2e; with a 5 s deadline admitted."""
    p = PredictedTtft(budgets_s={"chat": 3.0}, margin=1.0, correct=False)
    for _ in range(200):
        p.outputs.observe("chat", 101)
    view = PoolView(available_gpus=1, replicas=[ReplicaLoad(max_seqs=8, kv_capacity=10**6)],
                    engine=EngineModel(StepTimeModel(0.01, 1e-4, 0.001, 0.0), 8192))  # fmt: skip
    d = p.decide(Request(1, "chat", 100, 512, 0.0, deadline_s=1.0), 0.0, view, 0.0)
    assert (d.admit, d.reason) == (False, "would_exceed_e2e")
    assert p.decide(Request(2, "chat", 100, 512, 0.0, deadline_s=5.0), 0.0, view, 0.0).admit


def twice_as_fast(profile: Profile) -> Profile:
    """The profile a gateway holds when its calibration overstated every rate twice."""
    s = profile.step_time
    step = StepTimeModel(*(getattr(s, f.name) / 2 for f in dataclasses.fields(s)))
    return dataclasses.replace(
        profile, step_time=step, prefill_tokens_per_gpu_s=2 * profile.prefill_tokens_per_gpu_s,
        decode_tokens_per_gpu_s=2 * profile.decode_tokens_per_gpu_s,
    )  # fmt: skip


def test_shedding_lost_deadlines_stops_wasting_gpu_time_on_late_answers() -> None:
    """3x overload, deadlines of 8 s (interactive) and 30 s (batch), a predictive policy with loose budgets
    whose door is wrong: it believes the engines twice as fast as they are and does not correct itself, so
    it lets in answers that will be late (a door that predicts well refuses them, leaving little to shed).
    Without shedding most answers it serves arrive after their deadline; with it, fewer than 1% do, the
    GPU-seconds spent on late answers fall over tenfold and more answers arrive in time. Unconditional
    admission wastes the most."""
    loose = {"kind": "predicted_ttft", "budgets_s": {"interactive": 30.0, "batch": 60.0}, "e2e_budgets_s": {},
             "sheddable_fraction": 1.0, "correct": False}  # fmt: skip
    spec, base = load_scenario(
        default_scenario(),
        {"workload.duration_s": 30, "workload.tiers.interactive.deadline_s": 8,
         "workload.tiers.batch.deadline_s": 30,
         "policies": [{"kind": "unconditional"}, {**loose, "name": "shed"},
                      {**loose, "name": "keep", "shed_lost_deadlines": False}]},
    )  # fmt: skip
    world = build_world(spec, base)
    world = dataclasses.replace(
        world, pools=tuple(dataclasses.replace(p, believed=twice_as_fast(p.profile)) for p in world.pools)
    )
    workload = generate(spec.workload, spec.workload.seed)
    out = {}
    for name, policy in build_policies(spec).items():
        result = Simulation(world, workload, policy, spec.workload.seed).run(name)
        out[name] = deadline_report(result, workload, world)
    shed, keep, free = out["shed"], out["keep"], out["unconditional"]
    assert keep["completed_late"] > keep["completed_in_time"]
    assert shed["completed_late"] < 0.01 * shed["with_deadline"]
    assert shed["wasted_gpu_s"] < keep["wasted_gpu_s"] / 10
    assert shed["completed_in_time"] > keep["completed_in_time"]
    assert free["wasted_gpu_s"] > keep["wasted_gpu_s"]
    assert keep["shed_queued"] == keep["shed_running"] == 0


def test_the_gateway_sheds_lost_deadlines_for_any_policy() -> None:
    """`shed_lost_deadlines` on the gateway: None leaves it to the policy (unconditional never sheds, the
    predictive policy by its own switch); True sheds for any policy; False for none. Without a learned output
    length the gateway counts one token: a 1000-token prompt takes 0.01 + 0.1 s alone, so with a 10 s
    deadline a queued request is lost after t = 9.89 (the predictive policy, expecting 101 tokens, at 8.79)."""
    step = StepTimeModel(0.01, 1e-4, 0.001, 0.0)
    r = Request(1, "chat", 1000, 512, arrival_s=0.0, deadline_s=10.0)
    assert not deadline_lost(r, step, 9.88, False, 1.0)
    assert deadline_lost(r, step, 9.90, False, 1.0)
    assert not deadline_lost(r, step, 9.99, True, 1.0) and deadline_lost(r, step, 10.01, True, 1.0)
    assert not deadline_lost(Request(2, "chat", 1000, 512, 0.0), step, 1e6, True, 1.0)

    def gateway(policy, shed):
        g = Gateway(policy, [CostEstimator(1000.0, 100.0)], [10**6], engines=[EngineModel(step, 8192)],
                    shed_lost_deadlines=shed)  # fmt: skip
        g.views[0].replicas = [ReplicaLoad(max_seqs=8)]
        g.views[0].available_gpus = 1
        return g

    assert not gateway(Unconditional(), None).sheds
    assert not gateway(Unconditional(), None).lost(r, 0, 20.0, True)
    assert gateway(Unconditional(), True).lost(r, 0, 9.90, False)
    assert not gateway(Unconditional(), False).lost(r, 0, 20.0, True)
    learned = PredictedTtft(budgets_s={"chat": 3.0}, shed_lost_deadlines=False)
    for _ in range(200):
        learned.outputs.observe("chat", 101)
    assert not gateway(learned, None).lost(r, 0, 20.0, True)  # the policy's own switch: off
    assert not gateway(learned, None).sheds and gateway(PredictedTtft(budgets_s={"chat": 3.0}), None).sheds
    assert gateway(learned, True).lost(r, 0, 8.80, False)  # on, with what the policy learned of outputs
    assert not gateway(learned, True).lost(r, 0, 8.78, False)


def test_shedding_on_the_gateway_cuts_the_waste_of_unconditional_admission() -> None:
    """3x overload with 8 s / 30 s deadlines, every request admitted: with the gateway shedding lost
    deadlines the GPU-seconds spent on late answers fall over fourfold and more answers come in time than
    without. One seed; the effect is far larger than the run-to-run spread of either figure."""
    out = {}
    for shed in (False, True):
        spec, base = load_scenario(
            default_scenario(),
            {"workload.duration_s": 30, "workload.tiers.interactive.deadline_s": 8,
             "workload.tiers.batch.deadline_s": 30, "policies": [{"kind": "unconditional"}],
             "gateway.shed_lost_deadlines": shed},
        )  # fmt: skip
        world = build_world(spec, base)
        workload = generate(spec.workload, spec.workload.seed)
        ((name, policy),) = build_policies(spec).items()
        result = Simulation(world, workload, policy, spec.workload.seed).run(name)
        out[shed] = deadline_report(result, workload, world)
    assert out[False]["shed_queued"] == out[False]["shed_running"] == 0
    assert out[True]["shed_queued"] > 0
    assert out[True]["wasted_gpu_s"] < out[False]["wasted_gpu_s"] / 4, out
    assert out[True]["completed_in_time"] > out[False]["completed_in_time"], out
    # the work done on requests aborted past their deadline is wasted too: some, at most their full cost
    aborted = out[True]["wasted_total_gpu_s"] - out[True]["wasted_gpu_s"]
    assert 0 < aborted <= out[True]["shed_running_gpu_s_at_most"]
    assert out[False]["wasted_total_gpu_s"] == pytest.approx(out[False]["wasted_gpu_s"])
