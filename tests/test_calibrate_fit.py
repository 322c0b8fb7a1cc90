"""The step-time fit: it recovers known coefficients, respects their signs, and says when it is poor."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import simpy

from simadmit.calibrate.client import Endpoint
from simadmit.calibrate.fit import (
    decode_observation,
    decode_step_s,
    fit_step_model,
    fit_warnings,
    nonnegative_least_squares,
    observations,
    prompt_band,
    ttft_observation,
)
from simadmit.calibrate.measurements import Measurement
from simadmit.calibrate.metrics import CacheConfig
from simadmit.calibrate.run import CalibrationConfig, build_profile
from simadmit.config.errors import InputError
from simadmit.config.profile import (
    EngineLimits,
    StepTimeModel,
    load_profile,
    prefill_attention_pairs,
    prefill_chunks,
    save_profile,
    solo_service_s,
    summary_figures,
)
from simadmit.fleet.engine import BatchingEngine, BatchLimits, EngineListener

# overhead, prefill, decode seq, context, attention pair, weights' read, TTFT offset
TRUE = np.array([0.030, 1.5e-3, 0.4e-3, 1.0e-6, 0.12e-6, 0.0, 0.012])
# a small batch's linear layers wait 45 ms on the weights: decode is flat up to batch ~8, prefill up to ~30 tokens
ROOFLINE = np.array([0.010, 1.5e-3, 5e-3, 1.0e-6, 0.12e-6, 0.045, 0.012])


def step_of(coef: np.ndarray) -> StepTimeModel:
    return StepTimeModel(*(float(c) for c in coef[:6]))


def synthetic(rng: np.random.Generator, noise: float, true: np.ndarray = TRUE) -> list:
    """A calibration-shaped data set: a prefill sweep (the longest prompts chunked at a 2,048-token budget) and a
    decode sweep at two prompt lengths, with the prefills of batch-mates inside the windows."""
    step, offset = step_of(true), float(true[6])
    obs = []
    for p in (16, 31, 59, 113, 217, 417, 800, 1536, 3000, 5000):
        for _ in range(3):
            o = ttft_observation(p, 2048)
            obs.append(replace(o, seconds=o.predict(step, offset) * (1 + noise * rng.standard_normal())))
    for c, prompt in [(1, 128), (2, 128), (4, 128), (8, 128), (16, 128), (16, 512)]:
        for k in range(5):
            pairs = k * ttft_observation(prompt, 2048).attention_pairs
            o = decode_observation(
                c, prompt, 64, float(k * prompt), phase="decode", interfering_attention_pairs=pairs,
                interfering_prefills=k,
            )  # fmt: skip
            obs.append(replace(o, seconds=o.predict(step, offset) * (1 + noise * rng.standard_normal())))
    return obs


@pytest.mark.parametrize("true", [TRUE, ROOFLINE], ids=["linear", "roofline"])
def test_recovers_known_coefficients_exactly_without_noise(true: np.ndarray) -> None:
    """Durations made by a known step model, linear or with small steps bound by the weights' read, give back
    its coefficients exactly."""
    fit = fit_step_model(synthetic(np.random.default_rng(1), noise=0.0, true=true))
    assert np.allclose(fit.coefficients(), true, rtol=1e-6, atol=1e-12)
    assert fit.r2 == pytest.approx(1.0)


def test_a_linear_fit_cannot_follow_the_weights_read() -> None:
    """On the roofline's data the linear model (the form profiles had before) cannot follow flat small batches
    and a steep large one: some decode step is off by more than 10%, where the roofline fit is exact."""
    obs = synthetic(np.random.default_rng(1), noise=0.0, true=ROOFLINE)
    linear, roofline = fit_step_model(obs, roofline=False), fit_step_model(obs)
    assert linear.step.weights_read_s == 0.0
    errors = []
    for c in (1, 2, 4, 8, 16):
        true = decode_step_s(step_of(ROOFLINE), c, 128, 64)
        errors.append(abs(decode_step_s(linear.step, c, 128, 64) / true - 1))
        assert decode_step_s(roofline.step, c, 128, 64) == pytest.approx(true, rel=1e-6)
    assert max(errors) > 0.10


def test_recovers_known_costs_under_noise() -> None:
    """With 5% multiplicative noise, what the simulator charges comes back close: the lone prefill of a 1,536-
    and a chunked 5,000-token prompt, and a decode step at batch 1 and 16. Over 40 seeds the largest errors were
    3.8%, 5.8%, 3.4% and 6.5%; the bound is 10%. The per-sequence and attention coefficients alone trade off
    against each other (up to 64% and 44% over those seeds), so they are not checked one by one."""
    obs = synthetic(np.random.default_rng(2), noise=0.05)
    fit = fit_step_model(obs)
    true = step_of(TRUE)
    for p in (1536, 5000):
        assert solo_service_s(fit.step, 2048, p) == pytest.approx(solo_service_s(true, 2048, p), rel=0.10), p
    for c in (1, 16):
        assert decode_step_s(fit.step, c, 128, 64) == pytest.approx(decode_step_s(true, c, 128, 64), rel=0.10)
    got = np.array(fit.coefficients())
    for i in (0, 1):  # overhead and per-token cost: within 4.3% over the 40 seeds
        assert got[i] == pytest.approx(TRUE[i], rel=0.10), i
    assert fit.r2 > 0.95
    assert fit_warnings(fit, obs) == []


def test_quadratic_prefill_cost_is_reproduced_exactly() -> None:
    """TTFTs that follow 58 ms + 472 us x P + 128 ns x P^2 exactly (the shape measured on a CPU server) are
    reproduced to rounding by the fitted step model, as the engine charges it, from 16 to 1,800 tokens; a
    linear model cannot (its best fit is off by more than 5% somewhere)."""
    a, b, c = 0.058, 472e-6, 128e-9
    lengths = (16, 50, 128, 300, 700, 1100, 1536, 1800)
    obs = [replace(ttft_observation(p, 2048), seconds=a + b * p + c * p * p) for p in lengths]
    # decode windows (with batch-mates' prefills) from the step model that has this prefill cost:
    # c P^2 = 2c x P(P+1)/2 - c P, so 2c per (token, context) pair and b - c per token, context included
    overhead, context = 0.030, 1e-6
    true = np.array([overhead, b - c - context, 0.4e-3, context, 2 * c, 0.0, a - overhead])
    obs += [o for o in synthetic(np.random.default_rng(6), 0.0, true) if o.phase == "decode"]
    fit = fit_step_model(obs)
    for p in lengths:
        predicted = solo_service_s(fit.step, 2048, p) + fit.ttft_offset_s
        assert predicted == pytest.approx(a + b * p + c * p * p, rel=1e-6), p
    assert fit.step.per_prefill_attention_s == pytest.approx(2 * c, rel=1e-6)
    linear = nonnegative_least_squares(
        np.array([[1.0, p] for p in lengths]) / np.array([a + b * p + c * p * p for p in lengths])[:, None],
        np.ones(len(lengths)),
    )
    worst = max(abs((linear[0] + linear[1] * p) / (a + b * p + c * p * p) - 1) for p in lengths)
    assert worst > 0.05


def test_held_out_points_are_left_out_and_reported_by_phase_and_band() -> None:
    """Held-out points do not move the fit (wildly wrong ones leave the coefficients exact) and their error is
    reported per phase and prompt-length band."""
    obs = synthetic(np.random.default_rng(7), noise=0.0)
    wrong = [replace(o, seconds=2 * o.seconds, held_out=True) for o in obs if o.phase == "prefill"]
    fit = fit_step_model(obs + wrong)
    assert np.allclose(fit.coefficients(), TRUE, rtol=1e-6)
    assert fit.n == len(obs)
    assert set(fit.held_out) == {("prefill", "<256"), ("prefill", "256-1023"), ("prefill", "1024-4095"),
                                 ("prefill", "4096-16383")}  # fmt: skip
    assert all(q.median_residual == pytest.approx(-0.5) for q in fit.held_out.values())
    report = fit.report()["held_out"]
    assert report["prefill"]["4096-16383"]["points"] == 3  # type: ignore[index]
    warnings = fit_warnings(fit, obs + wrong)
    assert any("held-out prefill points with 4096-16383 prompt tokens off by 50%" in w for w in warnings)


def test_prompt_bands() -> None:
    assert [prompt_band(p) for p in (16, 255, 256, 1023, 1024, 4095, 4096, 131071)] == [
        "<256", "<256", "256-1023", "256-1023", "1024-4095", "1024-4095", "4096-16383", "65536-262143",
    ]  # fmt: skip


def test_every_fifth_request_of_a_cell_is_held_out() -> None:
    rows = [replace(BASE, seq=k, start_unix_s=100.0 + 10 * k) for k in range(10)]
    obs, _ = observations(rows, token_budget=2048)
    assert [o.held_out for o in obs] == [k % 5 == 4 for k in range(10)]


def test_nonnegative_least_squares_matches_bruteforce_kkt() -> None:
    """Where the unconstrained solution goes negative, the constrained one pins that coefficient at 0 and is
    the least-squares solution on the rest; free columns may stay negative."""
    rng = np.random.default_rng(3)
    a = rng.uniform(0, 1, (40, 3))
    b = a @ np.array([1.0, -0.5, 2.0]) + 0.01 * rng.standard_normal(40)
    x = nonnegative_least_squares(a, b)
    assert x[1] == 0.0
    ref, *_ = np.linalg.lstsq(a[:, [0, 2]], b, rcond=None)
    assert np.allclose(x[[0, 2]], ref)
    assert nonnegative_least_squares(a, b, free=[1])[1] < 0


BASE = Measurement(
    phase="decode", concurrency=2, seq=0, attempt=1, model="m", start_unix_s=100.0, prompt_tokens_target=128,
    prompt_tokens=128, output_tokens_target=11, output_tokens=11, ttft_s=0.1, itl_mean_s=0.05, itl_p50_s=0.05,
    itl_p90_s=0.05, itl_max_s=0.05, n_chunks=11, e2e_s=0.6, status="ok",
)  # fmt: skip


def test_observations_count_prefills_inside_a_decode_window_and_drop_burst_artifacts() -> None:
    """Request A decodes from t=100.1 to 100.6; B's first token at 100.3 means B's 128-token prefill ran
    inside A's window, and B decoded beside A for 0.3 s of its 0.5: A's 10 steps carried 1.6 sequences on
    average, not the cell's 2. C's stream was held back and flushed at once (a 1 ms window): set aside."""
    a = replace(BASE, seq=0)
    b = replace(BASE, seq=1, start_unix_s=100.2)
    c = replace(BASE, seq=2, start_unix_s=100.9, itl_mean_s=0.0001)
    failed = replace(BASE, seq=3, status="timeout", ttft_s=math.nan)
    obs, discarded = observations([a, b, c, failed], token_budget=2048)
    assert discarded == 1
    window_a, window_b = obs
    assert window_a.seconds == pytest.approx(0.5)
    assert (window_a.prefill_tokens, window_a.steps) == (128, 10)
    assert window_a.decode_seqs == pytest.approx(10 * 1.6)
    # A's 10 steps hold its prompt and 1..10 tokens made, B's first 6 decode steps its prompt and 1..6; B's
    # prompt joins once, in its prefill's step
    assert window_a.context_tokens == pytest.approx(10 * 128 + 55 + 6 * 128 + 21 + 128)
    assert window_b.prefill_tokens == 0


def _wave(
    step: StepTimeModel, workers: int, start: float, seq: int, prompt: int, output: int
) -> list[Measurement]:
    """`workers` requests of one decode cell sent together to an engine doing nothing else: their first tokens
    after the batch's prefill, then `output` - 1 decode steps of the whole batch (the engine's step model)."""
    context = workers * (prompt + output / 2)
    prefill = step.step_time(workers * prompt, 0, workers * prompt)
    itl = step.step_time(0, workers, context)
    return [
        replace(BASE, concurrency=8, seq=seq + k, start_unix_s=start, prompt_tokens=prompt, prompt_tokens_target=prompt,
                output_tokens=output, output_tokens_target=output, ttft_s=prefill, itl_mean_s=itl)
        for k in range(workers)
    ]  # fmt: skip


def test_the_batch_of_a_decode_window_is_the_decode_windows_overlapping_it() -> None:
    """A cell at concurrency 8 whose last wave had only 3 workers left (the others' time was up): those 3
    requests decoded in a batch of 3, which the cell's nominal 8 would price as a batch of 8. Read from the
    overlapping windows, every window of both waves is predicted exactly by the step model that made it."""
    step = step_of(TRUE)
    rows = _wave(step, 8, 100.0, 0, 128, 33) + _wave(step, 3, 200.0, 8, 128, 33)
    obs, _ = observations(rows, token_budget=2048)
    assert [round(o.decode_seqs / o.steps, 9) for o in obs] == [8.0] * 8 + [3.0] * 3
    for o in obs:
        assert o.predict(step) == pytest.approx(o.seconds, rel=1e-9)


def _two_waves(step: StepTimeModel, prompt: int, output: int) -> list[Measurement]:
    """Four requests sent at t=100 to an engine whose token budget holds two of their prompts: wave A is prefilled in
    step 1, wave B in step 2 while A decodes (a long step), then all decode until A, then B, is done; the steps'
    durations are the step model's, each decoding sequence holding its prompt and the tokens made before."""
    step_ends, decoding = [], []  # per step: its end, and the waves it decodes
    plan = [(2 * prompt, [])] + [(2 * prompt, ["A"])] + [(0, ["A", "B"])] * (output - 2) + [(0, ["B"])]
    t, made = 100.0, {"A": 0, "B": 0}
    for k, (prefill, waves) in enumerate(plan):
        kv = sum(2 * (prompt + made[w]) for w in waves)
        t += step.step_time(
            prefill, 2 * len(waves), kv + prefill, 2 * prefill_attention_pairs(prompt, 0) if prefill else 0
        )
        made.update({w: made[w] + 1 for w in waves} | ({"AB"[k]: 1} if prefill else {}))
        step_ends.append(t)
        decoding.append(waves)
    rows = []
    for seq, wave in enumerate("AABB"):
        ends = [e for e, waves in zip(step_ends, decoding, strict=True) if wave in waves]
        times = [step_ends["AB".index(wave)], *ends]
        rows.append(replace(
            BASE, seq=seq, concurrency=4, prompt_tokens=prompt, prompt_tokens_target=prompt, output_tokens=output,
            output_tokens_target=output, ttft_s=times[0] - 100.0, itl_mean_s=(times[-1] - times[0]) / (output - 1),
            token_times_s=tuple(x - 100.0 for x in times),
        ))  # fmt: skip
    return rows


def test_each_token_counts_in_the_step_that_made_it() -> None:
    """Two waves of a decode cell, the second prefilled while the first decodes: wave A's window holds that
    long step, wave B's does not. From the tokens' recorded arrivals, every window is predicted exactly by
    the step model that made it. Spread evenly over A's window instead (a file without arrivals), A's tokens
    fall too few in B's window, whose batch then reads well short of the 3.9 sequences it decoded."""
    step = StepTimeModel(0.010, 1.5e-3, 10e-3, 1.0e-6, 0.12e-6, 0.0)
    rows = _two_waves(step, 256, 16)
    assert [len(r.token_times_s) for r in rows] == [16] * 4
    obs, _ = observations(rows, token_budget=512)
    assert len(obs) == 4
    for o in obs:
        assert o.predict(step) == pytest.approx(o.seconds, rel=1e-9)
    assert [o.decode_seqs / o.steps for o in obs] == pytest.approx(
        [2 + 2 * 14 / 15] * 2 + [(4 * 14 + 2) / 15] * 2
    )
    spread, _ = observations([replace(r, token_times_s=()) for r in rows], token_budget=512)
    assert spread[3].decode_seqs / spread[3].steps < 3.0
    assert spread[3].predict(step) < 0.9 * spread[3].seconds


def test_prefill_longer_than_the_token_budget_takes_several_steps() -> None:
    """Chunks of 2,048, 2,048 and 904 tokens; each attends to the chunks before it and causally to itself."""
    o = ttft_observation(5000, 2048)
    assert (o.steps, o.prefill_tokens, o.context_tokens) == (3, 5000, 2048 + 4096 + 5000)
    assert o.attention_pairs == 5000 * 5001 / 2  # chunking does not change the pairs a prompt attends over
    assert prefill_chunks(5000, 2048) == [(2048, 0), (2048, 2048), (904, 4096)]


def test_too_few_points_warns() -> None:
    obs = synthetic(np.random.default_rng(4), noise=0.0)[:4]
    warnings = fit_warnings(fit_step_model(obs), obs)
    assert any("only 4 points" in w for w in warnings)
    assert any("0 decode points" in w for w in warnings)


def test_poor_fit_profile_is_written_with_its_warning(tmp_path: Path) -> None:
    """Data the linear model cannot follow (decode steps that shrink as the batch grows) gives a low R^2;
    the profile is still written, with the warning in its `warnings:` list and as a comment on top."""
    rng = np.random.default_rng(5)
    obs = synthetic(rng, noise=0.0)
    obs = [
        replace(o, seconds=o.seconds * (3.0 if o.decode_seqs == o.steps else 0.3))
        if o.phase == "decode"
        else o
        for o in obs
    ]
    obs += [replace(o, seconds=o.seconds * rng.uniform(0.3, 3.0)) for o in obs if o.phase == "prefill"]
    fit = fit_step_model(obs)
    warnings = fit_warnings(fit, obs)
    assert any("poor fit" in w for w in warnings)
    cfg = CalibrationConfig(
        endpoint="http://x:8000", out=tmp_path / "p.yaml", max_num_seqs=128, max_num_batched_tokens=2048
    )
    endpoint = Endpoint("http://x:8000", "m", 2048, "0.32.0")
    profile = build_profile(cfg, endpoint, CacheConfig(128, 728, 1), fit, warnings, {})
    save_profile(profile, cfg.out, "header")
    text = cfg.out.read_text()
    assert "# WARNING: poor fit" in text
    loaded = load_profile(cfg.out)
    assert loaded.warnings == tuple(warnings) and loaded.kv_capacity_tokens == 93184


class _FirstToken(EngineListener):
    def __init__(self) -> None:
        self.at: dict[int, float] = {}

    def on_first_token(self, rid: int, now: float) -> None:
        self.at[rid] = now


@pytest.mark.parametrize("prompt", [16, 1536, 2048, 5000])
def test_the_fitted_prefill_cost_is_what_the_simulated_engine_charges(prompt: int) -> None:
    """A lone prompt's TTFT in the simulated engine (chunked at a 2,048-token budget, attention per chunk)
    equals the fit's own prediction of it, so the coefficients fitted are the coefficients charged."""
    step = step_of(ROOFLINE)
    env = simpy.Environment()
    listener = _FirstToken()
    engine = BatchingEngine(env, 0, step, BatchLimits(128, 2048, 100_000, 16), listener)
    engine.submit(0, prompt, 1)
    env.run()
    fit_view = ttft_observation(prompt, 2048).predict(step)
    assert listener.at[0] == pytest.approx(fit_view, rel=1e-9)
    assert listener.at[0] == pytest.approx(solo_service_s(step, 2048, prompt), rel=1e-9)


def test_a_fit_that_makes_steps_free_is_refused_with_a_clear_error(tmp_path: Path) -> None:
    """A fit that prices no step (every latency outside the engine) gives infinite rates, and the
    calibration refuses it with one line naming its measurements, rather than dividing by zero; a model
    that prices only decode keeps its finite decode rate."""
    limits = EngineLimits(max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=2048)
    free = StepTimeModel(0.0, 0.0, 0.0, 0.0)
    assert summary_figures(free, limits, 100_000, gpus=1) == (math.inf, math.inf)
    prefill, decode = summary_figures(StepTimeModel(0.0, 0.0, 1e-3, 0.0), limits, 100_000, gpus=1)
    assert prefill == math.inf and decode == pytest.approx(1e3)
    fit = fit_step_model(synthetic(np.random.default_rng(5), noise=0.0))
    cfg = CalibrationConfig(endpoint="http://x:8000", out=tmp_path / "p.yaml", max_num_batched_tokens=2048)
    endpoint = Endpoint("http://x:8000", "m", 2048, "0.32.0")
    with pytest.raises(InputError, match="free") as raised:
        build_profile(cfg, endpoint, CacheConfig(128, 728, 1), replace(fit, step=free), [], {})
    assert str(tmp_path / "p.measurements.csv") in str(raised.value)
