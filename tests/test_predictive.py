"""Predicted-TTFT admission: the engine model against the simulated engine, the online corrections, and the
policy's promises (never hurts at moderate load, an oracle with a tight budget keeps every admitted wait)."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import simpy

from simadmit.admission.estimator import CostCorrection, CostEstimator, RatioEwma
from simadmit.admission.policies import PoolView, Request
from simadmit.admission.predictive import AdmissionOrder, OutputEwma, PredictedTtft, decode_key
from simadmit.admission.view import EngineModel, ReplicaLoad
from simadmit.config.loading import load_scenario
from simadmit.config.profile import StepTimeModel, load_profile
from simadmit.config.resources import default_scenario, resolve_profile
from simadmit.fleet.engine import BatchingEngine, BatchLimits
from simadmit.fleet.pool import Pool, RequestListener
from simadmit.sim.world import build_world
from simadmit.study.runner import run_scenario

PROFILE = load_profile(resolve_profile("llama-3.1-8b-h100", Path.cwd()) or "")
LIMITS = BatchLimits(256, 8192, 400_000)


class FirstTokens(RequestListener):
    def __init__(self) -> None:
        self.first: dict[int, float] = {}

    def on_first_token(self, rid: int, now: float) -> None:
        self.first[rid] = now


def predicted_and_simulated(seed: int) -> tuple[float, float]:
    """A replica fed up to 120 random requests over 5 s (up to ~100 running, ~70k prompt tokens queued),
    observed at a random instant; then one more request arrives: (predicted TTFT, simulated TTFT)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 120))
    prompts = [int(x) for x in rng.integers(50, 4000, n + 1)]
    outputs = [int(x) for x in rng.integers(20, 600, n + 1)]
    env = simpy.Environment()
    seen = FirstTokens()
    est = CostEstimator.from_profile(PROFILE)
    pool = Pool(env, 0, 1, 1, prompts, outputs, seen, "least_work", False, PROFILE.step_time, LIMITS,
                estimator=est)  # fmt: skip
    for i, a in enumerate(np.sort(rng.uniform(0, 5, n))):
        env.timeout(a).callbacks.append(lambda _e, i=i: pool.admit(i, "t", 1.0))  # type: ignore[misc]
    now = 5.0 + float(rng.uniform(0, 0.1))
    env.run(until=now)
    load = pool.snapshot().replicas[0]
    predicted = EngineModel(PROFILE.step_time, LIMITS.max_num_batched_tokens).ttft(
        load, prompts[n], float(np.mean(outputs))
    )
    pool.admit(n, "t", 1.0)
    env.run()
    return predicted, seen.first[n] - now


def test_predicted_ttft_matches_the_simulated_engine_at_moderate_load() -> None:
    """Over 40 random replica states with free batch slots (the moderate-load regime), the closed-form
    prediction is within 0.15 s + 10% of the TTFT the simulated engine then gives, and unbiased on average.
    The 0.15 s is about half of the longest step (a full 8192-token prefill chunk takes ~0.22 s): the
    gateway cannot see how far the step in progress has got, so it counts it half done."""
    pairs = np.array([predicted_and_simulated(s) for s in range(40)])
    pred, actual = pairs[:, 0], pairs[:, 1]
    assert actual.max() > 1.0  # the states include long prompt queues, not only idle replicas
    assert np.all(np.abs(pred - actual) <= 0.15 + 0.1 * actual)
    assert abs(float(np.mean(pred - actual))) < 0.05


def test_a_full_batch_waits_for_finishes_at_the_renewal_rate() -> None:
    """No free slot: the request waits for one finish, which a batch of d sequences of mean output m gives
    after m / d decode steps; with a free slot the same replica predicts only the prefill."""
    step = StepTimeModel(0.01, 0.0, 0.0, 0.0)
    model = EngineModel(step, 8192)
    full = ReplicaLoad(running=4, waiting=0, kv_used=0, kv_capacity=10**6, max_seqs=4)
    free = ReplicaLoad(running=3, waiting=0, kv_used=0, kv_capacity=10**6, max_seqs=4)
    # half the step in progress + one prefill step, and for the full batch 100 / 4 decode steps more
    assert model.ttft(free, 100, 100.0) == pytest.approx(0.005 + 0.01)
    assert model.ttft(full, 100, 100.0) == pytest.approx(0.005 + 0.01 + 25 * 0.01)


def test_ewma_correction_converges_after_a_step_change_in_output_lengths() -> None:
    """Outputs of 100 tokens, then of 300: the output EWMA and the cost correction reach the new regime
    within (1 - alpha)^n of the jump: after 200 observations at alpha = 0.05, within 0.01% of it."""
    outputs = OutputEwma(alpha=0.05)
    corr = CostCorrection(alpha=0.05, warmup=20)
    est = CostEstimator(1000.0, 100.0)
    for out in [100] * 300 + [300] * 200:
        outputs.observe("chat", out)
        corr.observe("chat", est.estimate(500, 512), est.estimate(500, out))
    assert outputs.expected("chat") == pytest.approx(300, rel=1e-3)
    assert corr.charge("chat", est.estimate(500, 512)) == pytest.approx(est.estimate(500, 300), rel=1e-3)
    # halfway (14 observations, 0.95^14 = 0.49 of the gap left) it is about halfway
    halfway = OutputEwma(alpha=0.05)
    for out in [100] * 300 + [300] * 14:
        halfway.observe("chat", out)
    assert halfway.expected("chat") == pytest.approx(300 - 200 * 0.95**14, rel=1e-6)


def test_ratio_ewma_is_neutral_until_warm_and_clamped() -> None:
    r = RatioEwma(alpha=0.1, warmup=5, low=0.5, high=2.0)
    for _ in range(4):
        r.observe("a", 1.0, 10.0)
    assert r.factor("a") == 1.0
    r.observe("a", 1.0, 10.0)
    assert r.factor("a") == 2.0  # 10x observed, clamped
    assert r.factor("b") == 1.0


def engine_view(load: ReplicaLoad) -> PoolView:
    return PoolView(
        available_gpus=1, replicas=[load], engine=EngineModel(StepTimeModel(0.01, 1e-4, 0, 0), 1000)
    )


def test_decisions_reasons_and_the_predict_wait_header() -> None:
    """Idle replica: admitted, with the predicted wait as X-Queue-Predict-Wait. 50,000 prompt tokens queued
    (50 steps of 1000 tokens, each 0.01 + 0.1 s: 5.5 s): rejected, Retry-After the excess over the budget
    in whole seconds. A retry that already spent its budget backing off is rejected even on an idle pool."""
    p = PredictedTtft(budgets_s={"chat": 3.0}, margin=1.0, correct=False)
    idle = engine_view(ReplicaLoad(max_seqs=8, kv_capacity=10**6))
    d = p.decide(Request(1, "chat", 100, 64, 0.0), 0.0, idle, 0.0)
    assert d.admit and d.predicted_wait_s == pytest.approx(0.01 + 100 * 1e-4)
    busy = engine_view(ReplicaLoad(running=1, prefill_tokens=50_000, max_seqs=8, kv_capacity=10**6))
    d = p.decide(Request(2, "chat", 100, 64, 0.0), 0.0, busy, 0.0)
    assert (d.admit, d.reason) == (False, "would_exceed_sla")
    assert d.retry_after_s == math.ceil(d.predicted_wait_s - 3.0)
    late = p.decide(Request(3, "chat", 100, 64, arrival_s=0.0), 0.0, idle, now=3.5)
    assert (late.admit, late.reason) == (False, "would_exceed_sla")
    assert p.decide(Request(4, "chat", 100, 64, 0.0), 0.0, PoolView(), 0.0).reason == "pool_exhausted"


def test_sheddable_tiers_leave_room_for_the_critical_one() -> None:
    """A wait of ~1.9 s: the interactive tier (3 s budget) is admitted, batch (60 s) is not, since it may
    only fill half of the tightest budget."""
    p = PredictedTtft(budgets_s={"interactive": 3.0, "batch": 60.0}, margin=1.0, correct=False)
    view = engine_view(ReplicaLoad(running=1, prefill_tokens=16_000, max_seqs=8, kv_capacity=10**6))
    assert p.decide(Request(1, "interactive", 100, 64, 0.0), 0.0, view, 0.0).admit
    assert not p.decide(Request(2, "batch", 100, 64, 0.0), 0.0, view, 0.0).admit


def run(overrides: dict) -> dict:
    spec, base = load_scenario(default_scenario(), overrides)
    return run_scenario(spec, build_world(spec, base)).summary


def test_never_hurts_at_moderate_load() -> None:
    """At ~60% of the default pool's capacity (rate x0.2) unconditional admission meets the SLO; the
    predictive policy rejects (almost) nothing and its interactive p99 TTFT stays within 10% of
    unconditional's on two seeds of the full 120 s (40 s runs see up to 0.6%: a handful of requests), where the GPU-seconds rule rejects over 5% (the article's rule hurts)."""
    for seed in (1, 2):
        s = run({"workload.seed": seed, "workload.rate_multiplier": 0.2})
        free, mine, article = s["unconditional"], s["predicted_ttft"], s["gpu_seconds"]
        assert mine["interactive"]["rejection_rate"] <= 0.005
        assert mine["interactive"]["ttft_p99_s"] <= 1.1 * free["interactive"]["ttft_p99_s"]
        assert article["interactive"]["rejection_rate"] > 0.05


def test_oracle_and_tight_budget_keep_admitted_waits() -> None:
    """One gateway polling every 0.2 s, the true output lengths as estimates (so it also knows how many
    decode steps each running sequence has left), a 1 s budget at 3x overload: no admitted interactive
    request waits in the queue longer than the budget plus one poll interval, on three seeds."""
    for seed in (1, 2, 3):
        spec, base = load_scenario(
            default_scenario(),
            {"workload.duration_s": 40, "workload.seed": seed, "gateway.replicas": 1,
             "gateway.estimate_output": "oracle",
             "policies": [{"kind": "predicted_ttft", "budgets_s": {"interactive": 1.0, "batch": 60.0}}]},
        )  # fmt: skip
        result = run_scenario(spec, build_world(spec, base))
        req = result.requests
        waits = req[(req["tier"] == "interactive") & req["queue_wait_s"].notna()]["queue_wait_s"]
        assert len(waits) > 500
        assert waits.max() <= 1.0 + spec.gateway.poll_interval_s


def test_known_remaining_lengths_set_the_wait_for_a_slot() -> None:
    """A full batch of 4 whose sequences have 5, 40, 60 and 90 decode steps left: one more request waits
    for the shortest (5 steps), two more waiting ahead of it for the third shortest (60); beyond the batch
    the renewal rate takes over (mean output 100 over 4 decoders: 25 steps per finish)."""
    model = EngineModel(StepTimeModel(0.01, 0.0, 0.0, 0.0), 8192)
    known = (5, 40, 60, 90)
    full = ReplicaLoad(running=4, kv_capacity=10**6, max_seqs=4, remaining_steps=known)
    base = 0.005 + 0.01  # half the step in progress, then one prefill step
    assert model.ttft(full, 100, 100.0) == pytest.approx(base + 5 * 0.01)
    queued = ReplicaLoad(running=4, waiting=2, kv_capacity=10**6, max_seqs=4, remaining_steps=known)
    assert model.ttft(queued, 100, 100.0) >= base + 60 * 0.01
    deep = ReplicaLoad(running=4, waiting=5, kv_capacity=10**6, max_seqs=4, remaining_steps=known)
    blind = ReplicaLoad(running=4, waiting=5, kv_capacity=10**6, max_seqs=4)
    assert model.ttft(deep, 100, 100.0) - model.ttft(queued, 100, 100.0) == pytest.approx(
        (90 + 2 * 25 - 60) * 0.01
    )
    assert model.ttft(blind, 100, 100.0) > model.ttft(full, 100, 100.0)  # 6 finishes at 25 steps each


def test_a_pool_publishes_each_running_sequences_remaining_steps() -> None:
    """With known outputs a snapshot lists, per replica, the decode steps each running sequence has left,
    shortest first: the shortest is the number of decode steps until the replica's next finish."""
    rng = np.random.default_rng(7)
    n = 40
    prompts = [int(x) for x in rng.integers(50, 2000, n)]
    outputs = [int(x) for x in rng.integers(20, 400, n)]
    env = simpy.Environment()
    finishes = Finishes()
    pool = Pool(env, 0, 1, 1, prompts, outputs, finishes, "least_work", False, PROFILE.step_time, LIMITS,
                estimator=CostEstimator.from_profile(PROFILE))  # fmt: skip
    for i in range(n):
        pool.admit(i, "t", 1.0)
    env.run(until=2.0)
    engine = pool.replicas[0]
    assert isinstance(engine, BatchingEngine)
    steps = pool.snapshot(known_outputs=True).replicas[0].remaining_steps
    assert pool.snapshot().replicas[0].remaining_steps == ()  # a gateway without the oracle sees none
    assert len(steps) == engine.n_running and list(steps) == sorted(steps) and steps[0] > 0
    clock = engine.clock
    finishes.engine = engine
    env.run()
    assert finishes.clocks[0] - clock == steps[0]


class Finishes(RequestListener):
    def __init__(self) -> None:
        self.engine: BatchingEngine | None = None
        self.clocks: list[int] = []

    def on_finish(self, rid: int, now: float) -> None:
        if self.engine is not None:
            self.clocks.append(self.engine.clock)


def test_a_sheddable_tier_never_trusts_a_smaller_correction_than_the_critical_tier() -> None:
    """Interactive first tokens came 3x later than predicted, batch ones as predicted: batch (which waits in
    the same FCFS queue) is predicted with the interactive factor, so it cannot fill the queue while
    interactive requests are refused. A tier that gets nothing in for longer than 10 s sees its factor relax
    towards 1 (another 10 s: 1 - 1/e of the way), so a factor that makes a tier refuse everything cannot
    last; what was forgotten stays forgotten, and a tier whose requests get in keeps its factor."""
    p = PredictedTtft(budgets_s={"interactive": 3.0, "batch": 60.0}, forget_s=10.0)
    for _ in range(30):
        p.ratio.observe("interactive", 1.0, 3.0, now=0.0)
        p.ratio.observe("batch", 1.0, 1.0, now=0.0)
    assert p.factor("interactive", 0.0) == pytest.approx(3.0)
    assert p.factor("batch", 0.0) == pytest.approx(3.0)
    assert p.factor("interactive", 10.0) == pytest.approx(3.0)
    assert p.factor("interactive", 20.0) == pytest.approx(1.0 + 2.0 / math.e)
    assert p.factor("interactive", 100.0) == pytest.approx(1.0, abs=1e-3)
    view = engine_view(ReplicaLoad(max_seqs=8, kv_capacity=10**6))
    assert p.decide(Request(1, "interactive", 100, 64, 100.0), 0.0, view, 100.0).admit
    assert p.factor("interactive", 105.0) == pytest.approx(1.0, abs=1e-3)  # what it forgot stays forgotten
    p.ratio.observe("interactive", 1.0, 3.0, now=105.0)
    for t in range(105, 200, 5):  # admitted every 5 s: the factor it learned holds
        assert p.decide(Request(t, "interactive", 100, 64, t), 0.0, view, t).admit
    assert p.factor("interactive", 200.0) == pytest.approx(1.0 + 2.0 * 0.05, rel=1e-3)
    assert PredictedTtft(correct=False).factor("interactive", 0.0) == 1.0


def test_output_lengths_are_learned_in_admission_order() -> None:
    """Requests finish shortest first. Ten admitted requests of 10..100 tokens whose short half finishes
    first: nothing is learned until the first admitted one finishes, then the outputs come in admission
    order; an aborted request releases the ones behind it; one never reported is let go after the horizon."""
    order = AdmissionOrder(horizon_s=60.0)
    for rid in range(10):
        order.admitted("chat", rid, 0.0)
    lengths = {rid: 10 * (10 - rid) for rid in range(10)}  # the first admitted is the longest
    released = []
    for rid in range(9, 0, -1):  # shortest first, the first admitted still running
        released += order.finished_at("chat", rid, lengths[rid], 1.0)
    assert released == []
    assert order.finished_at("chat", 0, lengths[0], 2.0) == [lengths[r] for r in range(10)]
    order.admitted("chat", 10, 3.0)
    order.admitted("chat", 11, 3.0)
    assert order.finished_at("chat", 11, 7, 4.0) == []
    assert order.finished_at("chat", 10, None, 5.0) == [7]  # aborted: releases what waited behind it
    order.admitted("chat", 12, 6.0)
    order.admitted("chat", 13, 6.0)
    assert order.finished_at("chat", 13, 9, 7.0) == []
    assert order.finished_at("chat", 14, 5, 70.0) == [9]  # 12 never reported: let go after 60 s


def test_a_policy_learns_the_admitted_mean_not_the_finishing_order_one() -> None:
    """At overload the first 100 completions are the short requests. Fed through the policy as they finish,
    the output EWMA still sees the admitted stream: 300 admitted, alternating 20 and 380 tokens, the 150
    short ones finish first; the learned mean is 200 (the finishing-order mean of the first 100 would be 20,
    and a full batch would be predicted to free its slots 10x too soon)."""
    p = PredictedTtft(budgets_s={"chat": 3.0}, margin=1.0, correct=False)
    view = engine_view(ReplicaLoad(max_seqs=1000, kv_capacity=10**7))
    requests = [Request(rid, "chat", 100, 512, 0.0) for rid in range(300)]
    for r in requests:
        assert p.decide(r, 0.0, view, 0.0).admit
    lengths = [20 if r.id % 2 == 0 else 380 for r in requests]
    for r in sorted(requests, key=lambda r: lengths[r.id]):
        p.observe_completion(r, lengths[r.id], 1.0)
    assert p.outputs.count["chat"] == 300
    assert p.outputs.expected("chat") == pytest.approx(200, rel=0.15)


def test_the_end_to_end_check_learns_the_decode_step_from_the_answers() -> None:
    """The end-to-end check's decode step is corrected by what the answers took per token, not by the first
    tokens' error. On an idle replica (predicted TTFT 0.011 s, step 0.01 s, 256 tokens expected: 2.6 s to
    the end, within a 5 s budget), 20 admitted requests whose first tokens come 3x late but decode as
    predicted leave the next one admitted (a first-token factor of 3 would predict 7.7 s); 20 whose first
    tokens are on time but decode at 3x the step get the next one refused as would_exceed_e2e."""

    def learn(ttft_x: float, itl_x: float) -> PredictedTtft:
        p = PredictedTtft(budgets_s={"chat": 3.0}, e2e_budgets_s={"chat": 5.0}, margin=1.0)
        view = engine_view(ReplicaLoad(max_seqs=8, kv_capacity=10**6))
        for rid in range(20):  # the corrections warm up on 20 observations
            now = float(rid)
            request = Request(rid, "chat", 100, 512, now)
            d = p.decide(request, 0.0, view, now)
            assert d.admit
            first = now + ttft_x * (0.01 + 100 * 1e-4)
            p.observe_first_token(request, now, first)
            p.observe_completion(request, 256, first + 255 * itl_x * 0.01)
        return p

    view = engine_view(ReplicaLoad(max_seqs=8, kv_capacity=10**6))
    late_first_tokens = learn(ttft_x=3.0, itl_x=1.0)
    assert late_first_tokens.factor("chat", 20.0) == pytest.approx(3.0)
    assert late_first_tokens.decode_ratio.factor(decode_key(0), 20.0) == pytest.approx(1.0)
    assert late_first_tokens.decide(Request(99, "chat", 100, 512, 20.0), 0.0, view, 20.0).admit
    slow_decode = learn(ttft_x=1.0, itl_x=3.0)
    assert slow_decode.factor("chat", 20.0) == pytest.approx(1.0)
    d = slow_decode.decide(Request(99, "chat", 100, 512, 20.0), 0.0, view, 20.0)
    assert (d.admit, d.reason) == (False, "would_exceed_e2e")
    assert not slow_decode.decoding  # nothing kept of the finished, nor of the refused


def test_each_pool_has_its_own_decode_correction() -> None:
    """Two pools whose engines err differently (pool 0 decodes at 3x the step its profile predicts, pool 1
    as predicted), their requests in turn through one gateway: each pool's correction learns its own, so
    pool 0's next answer is predicted too slow for the 5 s budget and pool 1's still fits (one correction
    for both, near 2x, would refuse both or neither)."""
    p = PredictedTtft(budgets_s={"chat": 3.0}, e2e_budgets_s={"chat": 5.0}, margin=1.0)
    base = engine_view(ReplicaLoad(max_seqs=8, kv_capacity=10**6))
    views = [replace(base, pool=0), replace(base, pool=1)]
    for rid in range(40):  # 20 answers from each pool warm its correction up
        now, pool = float(rid), rid % 2
        request = Request(rid, "chat", 100, 512, now)
        assert p.decide(request, 0.0, views[pool], now).admit
        first = now + 0.01 + 100 * 1e-4
        p.observe_first_token(request, now, first)
        p.observe_completion(request, 256, first + 255 * (3.0 if pool == 0 else 1.0) * 0.01)
    assert p.decode_ratio.factor(decode_key(0), 40.0) == pytest.approx(3.0)
    assert p.decode_ratio.factor(decode_key(1), 40.0) == pytest.approx(1.0)
    slow = p.decide(Request(98, "chat", 100, 512, 40.0), 0.0, views[0], 40.0)
    assert (slow.admit, slow.reason) == (False, "would_exceed_e2e")
    assert p.decide(Request(99, "chat", 100, 512, 40.0), 0.0, views[1], 40.0).admit
