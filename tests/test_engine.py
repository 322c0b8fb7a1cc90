"""The fast engine against the obviously-correct reference, plus exact timelines on tiny cases."""

from __future__ import annotations

import numpy as np
import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from simadmit.config.profile import StepTimeModel
from simadmit.fleet.engine import BatchingEngine, BatchLimits, EngineListener
from tests.reference_engine import reference_run

STEP = StepTimeModel(
    overhead_s=0.005, per_prefill_token_s=2e-5, per_decode_seq_s=1e-4, per_context_token_s=1e-6
)


class Recorder(EngineListener):
    def __init__(self, n: int) -> None:
        self.first = np.full(n, np.nan)
        self.finish = np.full(n, np.nan)
        self.preemptions = 0
        self.kv_peak = 0

    def on_first_token(self, rid: int, now: float) -> None:
        self.first[rid] = now

    def on_finish(self, rid: int, now: float) -> None:
        self.finish[rid] = now

    def on_preempt(self, rid: int) -> None:
        self.preemptions += 1


def fast_run(arrival, prompt, output, step, limits, observer=None):
    env = simpy.Environment()
    rec = Recorder(len(arrival))
    replica = BatchingEngine(env, 0, step, limits, rec, observer)
    for rid, a in enumerate(arrival):
        env.timeout(float(a)).callbacks.append(
            lambda _e, rid=rid: replica.submit(rid, int(prompt[rid]), int(output[rid]))
        )
    events = 0
    while True:
        try:
            env.step()
        except simpy.core.EmptySchedule:
            break
        events += 1
    return rec, events


def test_single_request_timeline() -> None:
    """One request alone: a prefill step, then output-1 decode steps whose context grows by one token."""
    step = StepTimeModel(0.01, 0.001, 0.002, 0.0001)
    rec, _ = fast_run([1.0], [100], [4], step, BatchLimits(8, 512, 10_000))
    prefill = 0.01 + 0.001 * 100 + 0.0001 * 100
    decodes = sum(0.01 + 0.002 + 0.0001 * (100 + k) for k in range(1, 4))
    assert rec.first[0] == pytest.approx(1.0 + prefill)
    assert rec.finish[0] == pytest.approx(1.0 + prefill + decodes)


def test_chunked_prefill_splits_a_long_prompt_over_steps() -> None:
    """A 1000-token prompt with a 256-token budget needs four steps before its first token."""
    step = StepTimeModel(0.01, 0.0, 0.0, 0.0)
    rec, _ = fast_run([0.0], [1000], [1], step, BatchLimits(8, 256, 10_000))
    assert rec.first[0] == pytest.approx(0.04)
    assert rec.finish[0] == pytest.approx(0.04)


def test_an_arrival_cuts_a_fast_forward_at_the_step_in_progress() -> None:
    """A long decode is fast-forwarded; a request arriving mid-stretch starts at the next step boundary."""
    step = StepTimeModel(0.01, 0.0, 0.0, 0.0)
    rec, events = fast_run([0.0, 0.155], [10, 10], [100, 2], step, BatchLimits(8, 512, 10_000))
    assert rec.first[1] == pytest.approx(0.17)  # boundaries every 10 ms: joins the step starting at 0.16
    assert rec.finish[0] == pytest.approx(1.0)  # 100 steps of 10 ms, undisturbed by the newcomer
    assert events < 10  # 100 decode steps did not become 100 events


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40),
    rate=st.floats(1, 200),
    max_seqs=st.integers(1, 16),
    budget=st.integers(16, 512),
    kv=st.integers(300, 3000),
    seed=st.integers(0, 2**31),
)
def test_fast_engine_matches_reference(n, rate, max_seqs, budget, kv, seed) -> None:
    """Same first-token and finish times as the step-by-step reference, under preemption and chunking."""
    budget = max(budget, max_seqs)
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1 / rate, n))
    prompt = rng.integers(1, 200, n)
    output = rng.integers(1, 80, n)
    output = np.minimum(output, kv - prompt)  # every request fits the KV cache on its own
    limits = BatchLimits(max_seqs, budget, kv)
    violations = []

    def observe(_replica: int, running: int, tokens: int, kv_used: int) -> None:
        if running > max_seqs or tokens > budget or kv_used > kv:
            violations.append((running, tokens, kv_used))

    rec, _ = fast_run(arrival, prompt, output, STEP, limits, observe)
    first, finish, _ = reference_run(arrival, prompt, output, STEP, limits)
    assert not violations
    np.testing.assert_allclose(rec.first, first, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(rec.finish, finish, rtol=1e-9, atol=1e-9)


def test_preemption_under_kv_pressure_matches_reference() -> None:
    """With a KV cache a few requests wide, sequences are preempted and recomputed, exactly as the reference."""
    preemptions = 0
    for seed in range(20):
        rng = np.random.default_rng(seed)
        arrival = np.cumsum(rng.exponential(0.01, 40))
        prompt = rng.integers(50, 200, 40)
        output = rng.integers(20, 80, 40)
        limits = BatchLimits(16, 512, 600)
        rec, _ = fast_run(arrival, prompt, output, STEP, limits)
        first, finish, _ = reference_run(arrival, prompt, output, STEP, limits)
        np.testing.assert_allclose(rec.finish, finish, rtol=1e-9)
        np.testing.assert_allclose(rec.first, first, rtol=1e-9)
        preemptions += rec.preemptions
    assert preemptions > 50
