"""The fast engine against the obviously-correct reference, plus exact timelines on tiny cases."""

from __future__ import annotations

import numpy as np
import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from simadmit.config.profile import StepTimeModel
from simadmit.fleet.engine import DECODE, WAITING, BatchingEngine, BatchLimits, EngineListener
from tests.reference_engine import reference_run

STEP = StepTimeModel(
    overhead_s=0.005, per_prefill_token_s=2e-5, per_decode_seq_s=1e-4, per_context_token_s=1e-6
)
OVERHEAD_ONLY = StepTimeModel(0.01, 0.0, 0.0, 0.0)


class Recorder(EngineListener):
    def __init__(self, n: int) -> None:
        self.first = np.full(n, np.nan)
        self.finish = np.full(n, np.nan)
        self.preemptions = 0
        self.preempted: list[int] = []  # in the event being processed

    def on_first_token(self, rid: int, now: float) -> None:
        self.first[rid] = now

    def on_finish(self, rid: int, now: float) -> None:
        self.finish[rid] = now

    def on_preempt(self, rid: int) -> None:
        self.preemptions += 1
        self.preempted.append(rid)


def check_books(engine: BatchingEngine) -> None:
    """KV tokens and blocks the engine keeps incrementally equal those recounted from its sequences.

    Between events a step is always in progress, its KV allocated: a decoder holds one token more than
    its clock says (the clock, and a fast-forward stretch's later steps, are settled when it ends)."""
    tokens = blocks = 0
    for seq in engine.decoders:
        held = seq.kv_join + engine.clock - seq.join_clock + 1
        tokens += held
        blocks += -(-held // engine.block)
        assert seq.state == DECODE
    for seq in engine.prefilling:
        tokens += seq.kv
        blocks += -(-seq.kv // engine.block)
    assert (engine.kv_used, engine.blocks_used) == (tokens, blocks)
    assert engine.blocks_used <= engine.n_blocks


def fast_run(arrival, prompt, output, step, limits, observer=None, books=False, priority=None):
    """Run one replica (by `priority`, one number per request, if given); with `books`, check its books
    after every event and that a request preempted in a step is still waiting when that step runs (no
    admission in a step that preempted)."""
    env = simpy.Environment()
    rec = Recorder(len(arrival))
    replica = BatchingEngine(env, 0, step, limits, rec, observer, by_priority=priority is not None)
    seqs = {}

    def submit(rid: int) -> None:
        level = 0 if priority is None else int(priority[rid])
        seqs[rid] = replica.submit(rid, int(prompt[rid]), int(output[rid]), level)

    for rid, a in enumerate(arrival):
        env.timeout(float(a)).callbacks.append(lambda _e, rid=rid: submit(rid))
    events = 0
    while True:
        try:
            env.step()
        except simpy.core.EmptySchedule:
            break
        events += 1
        if books:
            check_books(replica)
            assert all(seqs[rid].state == WAITING for rid in rec.preempted)
        rec.preempted.clear()
    return rec, events


def timeline(arrival, prompt, output, step, limits, priority=None):
    """Every step as (start time, running, batched tokens, KV tokens), with the recorder."""
    env = simpy.Environment()
    rec = Recorder(len(arrival))
    steps: list[tuple[float, int, int, int]] = []

    def observe(_r: int, running: int, tokens: int, kv: int) -> None:
        steps.append((round(env.now, 9), running, tokens, kv))

    replica = BatchingEngine(env, 0, step, limits, rec, observe, by_priority=priority is not None)
    levels = [0] * len(arrival) if priority is None else [int(p) for p in priority]
    for rid, a in enumerate(arrival):
        env.timeout(float(a)).callbacks.append(
            lambda _e, rid=rid: replica.submit(rid, int(prompt[rid]), int(output[rid]), levels[rid])
        )
    env.run()
    return steps, rec


def assert_same_as_reference(rec, arrival, prompt, output, step, limits, priority=None) -> None:
    first, finish, _ = reference_run(
        np.asarray(arrival), np.asarray(prompt), np.asarray(output), step, limits,
        None if priority is None else np.asarray(priority),
    )  # fmt: skip
    np.testing.assert_allclose(rec.first, first, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(rec.finish, finish, rtol=1e-9, atol=1e-9)


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
    rec, _ = fast_run([0.0], [1000], [1], OVERHEAD_ONLY, BatchLimits(8, 256, 10_000))
    assert rec.first[0] == pytest.approx(0.04)
    assert rec.finish[0] == pytest.approx(0.04)


def test_prefill_attention_adds_the_pairs_each_chunk_attends_over() -> None:
    """TTFT of a lone request = overhead + linear terms + attention over (token, context) pairs.

    One chunk of 300 tokens attends over 300*301/2 = 45,150 pairs. A 600-token prompt with a 256-token
    budget runs chunks of 256, 256 and 88 tokens at offsets 0, 256 and 512: 256*257/2 = 32,896,
    256*256 + 32,896 = 98,432 and 88*512 + 88*89/2 = 48,972 pairs.
    """
    a, lin, ctx, attn = 0.01, 1e-4, 1e-6, 1e-7
    step = StepTimeModel(a, lin, 0.0, ctx, attn)
    rec, _ = fast_run([0.0], [300], [1], step, BatchLimits(8, 512, 10_000))
    assert rec.first[0] == pytest.approx(a + lin * 300 + ctx * 300 + attn * 45_150, rel=1e-12)
    rec, _ = fast_run([0.0], [600], [1], step, BatchLimits(8, 256, 10_000))
    by_hand = (
        (a + lin * 256 + ctx * 256 + attn * 32_896)
        + (a + lin * 256 + ctx * 512 + attn * 98_432)
        + (a + lin * 88 + ctx * 600 + attn * 48_972)
    )
    assert rec.first[0] == pytest.approx(by_hand, rel=1e-12)
    flat = StepTimeModel(a, lin, 0.0, ctx)
    rec0, _ = fast_run([0.0], [600], [1], flat, BatchLimits(8, 256, 10_000))
    assert rec.first[0] - rec0.first[0] == pytest.approx(attn * (32_896 + 98_432 + 48_972), rel=1e-9)


def test_same_instant_arrivals_at_an_idle_replica_share_the_first_step() -> None:
    """Four requests at t = 1.0 on an idle replica: one prefill step for all, first tokens together."""
    steps, rec = timeline([1.0] * 4, [100] * 4, [1] * 4, OVERHEAD_ONLY, BatchLimits(8, 512, 10_000))
    assert steps == [(1.0, 4, 400, 400)]
    np.testing.assert_allclose(rec.first, [1.01] * 4)


def test_an_arrival_at_a_step_boundary_joins_the_step_that_starts_there() -> None:
    """Steps start after every event of their instant: a request arriving exactly when a step ends joins
    the next one, as the reference engine's `arrival <= step start` does."""
    steps, rec = timeline([0.0, 0.01], [10, 10], [3, 1], OVERHEAD_ONLY, BatchLimits(8, 512, 10_000))
    assert steps == [(0.0, 1, 10, 10), (0.01, 2, 11, 21), (0.02, 1, 1, 12)]
    assert rec.first[1] == pytest.approx(0.02)


def test_an_arrival_cuts_a_fast_forward_at_the_step_in_progress() -> None:
    """A long decode is fast-forwarded; a request arriving mid-stretch starts at the next step boundary."""
    rec, events = fast_run([0.0, 0.155], [10, 10], [100, 2], OVERHEAD_ONLY, BatchLimits(8, 512, 10_000))
    assert rec.first[1] == pytest.approx(0.17)  # boundaries every 10 ms: joins the step starting at 0.16
    assert rec.finish[0] == pytest.approx(1.0)  # 100 steps of 10 ms, undisturbed by the newcomer
    assert events < 10  # 100 decode steps did not become 100 events


@pytest.mark.parametrize("offset", [-1e-12, -1e-15, 0.0, 1e-15, 1e-12])
def test_an_arrival_within_rounding_of_a_boundary_inside_a_stretch(offset: float) -> None:
    """An arrival ~1e-12 s from the 13th boundary of a fast-forwarded stretch (steps whose length grows
    with the context, so boundaries are not round numbers) runs without a negative delay and joins a step
    that starts at that boundary, to within the rounding."""
    step = StepTimeModel(0.0123, 0.0, 0.0, 1.7e-5)
    limits = BatchLimits(8, 512, 10_000)
    rec0, _ = fast_run([0.0], [50], [40], step, limits)
    boundary = step.step_time(50, 0, 50) + sum(step.step_time(0, 1, 50 + k) for k in range(1, 13))
    rec, _ = fast_run([0.0, boundary + offset], [50, 50], [40, 1], step, limits)
    assert rec.first[1] == pytest.approx(boundary + step.step_time(50, 1, 50 + 13 + 50), abs=1e-9)
    assert rec.finish[0] > rec0.finish[0]  # the newcomer's step slowed the first one down


def test_kv_is_allocated_in_whole_blocks() -> None:
    """Blocks of 16 and a cache of three, one of them vLLM's null block: a 17-token prompt takes the other
    two, so a 1-token prompt arriving with it waits for it to finish, although 18 tokens would fit in 32."""
    limits = BatchLimits(8, 512, 48, kv_block_size=16)
    arrival, prompt, output = [0.0, 0.0], [17, 1], [1, 1]
    steps, rec = timeline(arrival, prompt, output, OVERHEAD_ONLY, limits)
    assert steps == [(0.0, 1, 17, 17), (0.01, 1, 1, 1)]
    assert_same_as_reference(rec, arrival, prompt, output, OVERHEAD_ONLY, limits)
    steps, _ = timeline(arrival, prompt, output, OVERHEAD_ONLY, BatchLimits(8, 512, 33))
    assert steps == [(0.0, 2, 18, 18)]  # token-granular KV would have taken both at once


def test_a_preempting_step_is_not_fast_forwarded() -> None:
    """Blocks of 4, a cache of 3 beside the null block. Step 1 prefills A and B (4 tokens each: a block each). In step 2 both
    need a second block and one is free: A, first in running order, takes it; B, the newest, is preempted.
    That step admits nobody (vLLM: no waiting request is scheduled in a step that preempted), so B is not
    recomputed at once, and it lasts one step. From step 3 on B waits for two blocks (5 tokens to
    recompute) while A decodes alone, fast-forwarded to its finish; then B is recomputed and finishes.
    """
    limits = BatchLimits(8, 64, 16, kv_block_size=4)
    arrival, prompt, output = [0.0, 0.0], [4, 4], [6, 3]
    steps, rec = timeline(arrival, prompt, output, OVERHEAD_ONLY, limits)
    assert steps == [
        (0.0, 2, 8, 8),  # A and B prefill
        (0.01, 1, 1, 5),  # B preempted; A decodes alone; nobody admitted
        (0.02, 1, 1, 6),  # B needs 2 blocks, 1 is free: A decodes, fast-forwarded to its finish
        (0.06, 1, 5, 5),  # B recomputes its prompt and first token
        (0.07, 1, 1, 6),
    ]
    assert rec.preemptions == 1
    np.testing.assert_allclose(rec.first, [0.01, 0.01])
    np.testing.assert_allclose(rec.finish, [0.06, 0.08])
    assert_same_as_reference(rec, arrival, prompt, output, OVERHEAD_ONLY, limits)


def test_a_preempting_step_does_not_readmit_the_request_it_preempted() -> None:
    """Blocks of 4, a cache of 4 beside the null block, a budget of 8. Step 1 prefills A (4 tokens) and B's first chunk (4 of
    11). In step 2 A, decoding, takes a second block; B's next chunk of 7 needs two more, one is free, and
    B, the newest, is preempted. Its blocks free two, enough for a 7-token chunk, yet B waits for step 3:
    a step that preempted admits nobody. Then B is recomputed while A finishes.
    """
    limits = BatchLimits(4, 8, 20, kv_block_size=4)
    arrival, prompt, output = [0.0, 0.0], [4, 11], [3, 1]
    steps, rec = timeline(arrival, prompt, output, OVERHEAD_ONLY, limits)
    assert steps == [
        (0.0, 2, 8, 8),  # A's prompt, B's first chunk
        (0.01, 1, 1, 5),  # B preempted; A decodes; B not readmitted
        (0.02, 2, 8, 13),  # B readmitted: a chunk of 7 beside A's last decode
        (0.03, 1, 4, 11),  # B's last 4 prompt tokens
    ]
    assert rec.preemptions == 1
    np.testing.assert_allclose(rec.first, [0.01, 0.04])
    np.testing.assert_allclose(rec.finish, [0.03, 0.04])
    assert_same_as_reference(rec, arrival, prompt, output, OVERHEAD_ONLY, limits)


def test_aborting_the_blocked_head_of_the_queue_lets_the_next_one_in() -> None:
    """A decodes alone (fast-forwarded) while B, at the head of the queue, waits for 3 blocks of 4 and
    only 2 are free; C, behind B, would fit. B's client goes away at 0.045: the stretch is cut at the
    step in progress and C starts at 0.05, instead of when A finishes at 0.09."""
    env = simpy.Environment()
    rec = Recorder(3)
    replica = BatchingEngine(env, 0, OVERHEAD_ONLY, BatchLimits(4, 64, 20, kv_block_size=4), rec)
    seqs = {}
    for rid, at, prompt, output in [(0, 0.0, 4, 9), (1, 0.025, 9, 1), (2, 0.035, 2, 1)]:
        env.timeout(at).callbacks.append(
            lambda _e, rid=rid, p=prompt, o=output: seqs.__setitem__(rid, replica.submit(rid, p, o))
        )
    env.timeout(0.045).callbacks.append(lambda _e: replica.abort(seqs[1]))
    env.run()
    assert rec.finish[0] == pytest.approx(0.09)
    assert np.isnan(rec.first[1])
    assert rec.first[2] == pytest.approx(0.06)


def test_the_running_order_decides_who_is_preempted() -> None:
    """A request recomputed after a preemption rejoins the running order at its end, so it is the first
    to go at the next shortage, even though it arrived before the request behind it in the queue.
    Checked against the reference, which keeps vLLM's running list literally."""
    limits = BatchLimits(4, 64, 28, kv_block_size=4)
    arrival = [0.0, 0.0, 0.0, 0.005]
    prompt, output = [4, 4, 4, 3], [12, 10, 9, 6]
    rec, _ = fast_run(arrival, prompt, output, OVERHEAD_ONLY, limits, books=True)
    assert rec.preemptions >= 2
    assert_same_as_reference(rec, arrival, prompt, output, OVERHEAD_ONLY, limits)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40),
    rate=st.floats(1, 200),
    max_seqs=st.integers(1, 16),
    budget=st.integers(16, 512),
    kv_blocks=st.integers(20, 300),
    block=st.sampled_from([1, 4, 16]),
    coarse=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_fast_engine_matches_reference(n, rate, max_seqs, budget, kv_blocks, block, coarse, seed) -> None:
    """Same first-token and finish times as the step-by-step reference, under preemption and chunking,
    with block-granular KV and (coarse) arrival times that often coincide with each other."""
    budget = max(budget, max_seqs)
    kv = kv_blocks * block  # for sequences, beside the null block
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1 / rate, n))
    if coarse:
        arrival = np.round(arrival, 1)
    prompt = np.minimum(rng.integers(1, 400, n), kv - 1)
    output = np.minimum(rng.integers(1, 80, n), kv - prompt + 1)  # every request fits the KV cache alone
    limits = BatchLimits(max_seqs, budget, kv + block, block)
    violations = []

    def observe(_replica: int, running: int, tokens: int, kv_used: int) -> None:
        if running > max_seqs or tokens > budget or kv_used > kv:
            violations.append((running, tokens, kv_used))

    step = StepTimeModel(0.005, 2e-5, 1e-4, 1e-6, 1e-9)
    rec, _ = fast_run(arrival, prompt, output, step, limits, observe, books=True)
    assert not violations
    assert_same_as_reference(rec, arrival, prompt, output, step, limits)


def test_preemption_under_kv_pressure_matches_reference() -> None:
    """With a KV cache a few requests wide, sequences are preempted and recomputed, exactly as the reference."""
    preemptions = 0
    for seed in range(20):
        rng = np.random.default_rng(seed)
        arrival = np.cumsum(rng.exponential(0.01, 40))
        prompt = rng.integers(50, 200, 40)
        output = rng.integers(20, 80, 40)
        limits = BatchLimits(16, 512, 616, 16)
        rec, _ = fast_run(arrival, prompt, output, STEP, limits)
        assert_same_as_reference(rec, arrival, prompt, output, STEP, limits)
        preemptions += rec.preemptions
    assert preemptions > 50


def test_prompts_longer_than_the_token_budget_under_kv_pressure_match_reference() -> None:
    """Prompts of up to 4x the token budget (chunked over several steps) into a cache a few prompts wide:
    running prefills are preempted mid-prompt and recomputed, exactly as the reference does it."""
    preemptions = chunked = 0
    for seed in range(20):
        rng = np.random.default_rng(100 + seed)
        arrival = np.cumsum(rng.exponential(0.02, 30))
        prompt = rng.integers(100, 1000, 30)
        output = rng.integers(5, 60, 30)
        limits = BatchLimits(8, 256, 2064, 16)
        rec, _ = fast_run(arrival, prompt, output, STEP, limits, books=True)
        assert_same_as_reference(rec, arrival, prompt, output, STEP, limits)
        preemptions += rec.preemptions
        chunked += int((prompt > 256).sum())
    assert preemptions > 50 and chunked > 300
