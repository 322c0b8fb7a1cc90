"""What one request costs alone is priced in one place, with prefill attention, wherever calibration uses it.

A profile whose attention term dominates a long prompt (1 us per (token, context) pair: a 2,000-token prompt
spends ~2 s on attention against ~0.2 s on its tokens) must give the quadratic time everywhere: in the engine,
in `solo_service_s`, in the summary figures `calibrate` writes, and in the rate `calibrate check` picks.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from simadmit.calibrate.check import CheckConfig, mixed_load
from simadmit.calibrate.client import Endpoint
from simadmit.calibrate.fit import FitResult
from simadmit.calibrate.metrics import CacheConfig
from simadmit.calibrate.report import print_calibration
from simadmit.calibrate.run import Calibration, CalibrationConfig, build_profile
from simadmit.config.profile import (
    EngineLimits,
    Profile,
    StepTimeModel,
    solo_service_s,
    summary_figures,
)
from simadmit.fleet.engine_replay import replay_on_profile

A, PREFILL, DECODE, CONTEXT, ATTENTION = 0.02, 1e-4, 2e-3, 1e-6, 1e-6
STEP = StepTimeModel(A, PREFILL, DECODE, CONTEXT, ATTENTION)
LINEAR = StepTimeModel(A, PREFILL, DECODE, CONTEXT, 0.0)
BUDGET = 8192  # every prompt below fits one chunk, so the hand formula has no chunking in it


ROOFLINE = StepTimeModel(A, PREFILL, DECODE, CONTEXT, ATTENTION, weights_read_s=0.03)  # binds prompts < 300


def by_hand(step: StepTimeModel, prompt: int, output: int) -> float:
    """One prefill step that holds the prompt and attends over P(P+1)/2 pairs, then output - 1 decode steps
    of one sequence holding the prompt and the j tokens produced so far; each step's linear layers take at
    least the weights' read."""
    prefill = step.overhead_s + max(step.weights_read_s, step.per_prefill_token_s * prompt)
    prefill += step.per_context_token_s * prompt + step.per_prefill_attention_s * prompt * (prompt + 1) / 2
    decode = sum(
        step.overhead_s
        + max(step.weights_read_s, step.per_decode_seq_s)
        + step.per_context_token_s * (prompt + j)
        for j in range(1, output)
    )
    return prefill + decode


def profile(step: StepTimeModel, budget: int = BUDGET) -> Profile:
    return Profile("m", "g", step, 1_000_000, EngineLimits(8, budget, 4096), 1.0, 1.0, kv_block_size=16)


@pytest.mark.parametrize("step", [STEP, ROOFLINE], ids=["linear", "roofline"])
@pytest.mark.parametrize(("prompt", "output"), [(16, 1), (2000, 1), (2000, 50), (300, 200)])
def test_solo_service_time_is_quadratic_in_the_prompt_and_is_what_the_engine_takes(
    step: StepTimeModel, prompt: int, output: int
) -> None:
    """The formula by hand, and a lone request's end-to-end time in the simulated engine, agree exactly."""
    expected = by_hand(step, prompt, output)
    assert solo_service_s(step, BUDGET, prompt, output) == pytest.approx(expected, rel=1e-12)
    e2e = replay_on_profile(profile(step), np.array([0.0]), np.array([prompt]), np.array([output]))["e2e_s"][
        0
    ]
    assert e2e == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("prompt", [2048, 5000])
def test_a_chunked_prompt_costs_what_the_engine_charges(prompt: int) -> None:
    """Beyond the token budget the prompt is prefilled in chunks, each attending to those before it: the
    engine's time and `solo_service_s` still agree, and the attention pairs add up to P(P+1)/2 as unchunked."""
    e2e = replay_on_profile(profile(STEP, 1024), np.array([0.0]), np.array([prompt]), np.array([8]))["e2e_s"][
        0
    ]
    assert solo_service_s(STEP, 1024, prompt, 8) == pytest.approx(e2e, rel=1e-9)
    chunks = -(-prompt // 1024)
    extra_steps = (chunks - 1) * STEP.overhead_s  # one step per chunk instead of one
    held = sum(min(1024 * (k + 1), prompt) for k in range(chunks)) - prompt  # context re-held by later chunks
    assert solo_service_s(STEP, 1024, prompt) == pytest.approx(
        by_hand(STEP, prompt, 1) + extra_steps + STEP.per_context_token_s * held, rel=1e-12
    )


def test_summary_prefill_figure_pays_the_attention_of_a_full_budget_prompt() -> None:
    """Prefill tokens per GPU-second = a budget-filling prompt over its solo time, attention included."""
    limits = EngineLimits(8, 2048, 8192)
    prefill, _ = summary_figures(STEP, limits, 1_000_000, gpus=2)
    assert prefill == pytest.approx(2048 / by_hand(STEP, 2048, 1) / 2, rel=1e-12)
    linear, _ = summary_figures(LINEAR, limits, 1_000_000, gpus=2)
    assert linear / prefill == pytest.approx(by_hand(STEP, 2048, 1) / by_hand(LINEAR, 2048, 1), rel=1e-12)
    assert linear / prefill > 5  # the attention term dominates here


def test_calibrate_writes_and_prints_the_quadratic_prefill_figure() -> None:
    """The profile `calibrate` builds from a fit carries that figure, and its report prints it."""
    fit = FitResult(STEP, 0.0, 100, 0.99, {}, {})
    cfg = CalibrationConfig(
        endpoint="http://x:8000", out=Path("p.yaml"), max_num_seqs=8, max_num_batched_tokens=2048
    )
    endpoint = Endpoint("http://x:8000", "m", 8192, "0.11")
    built = build_profile(cfg, endpoint, CacheConfig(16, 1000, 1), fit, [], {})
    assert built.prefill_tokens_per_gpu_s == pytest.approx(2048 / by_hand(STEP, 2048, 1), abs=0.01)
    console = Console(record=True, width=400)
    overhead = dict.fromkeys(
        ("cpu_share_of_one_core", "handling_ms_per_request", "loop_lag_p50_ms", "loop_lag_p99_ms"), 0.0
    )
    print_calibration(Calibration(built, fit, Path("p.csv"), {}, 0, overhead), console)
    assert (
        f"prefill {built.prefill_tokens_per_gpu_s:g} tok/s (a budget-filling prompt alone"
        in console.export_text()
    )


def test_calibrate_check_paces_its_load_by_the_quadratic_solo_time() -> None:
    """`calibrate check` aims at two requests in flight: its rate is two over the mean solo time of the
    requests it draws. The same seed draws the same lengths and exponential gaps whatever the profile, so
    the arrival times scale exactly with the mean solo time, attention included."""
    cfg = CheckConfig(requests=40, seed=3)
    with_attention = mixed_load(profile(STEP), cfg)
    without = mixed_load(profile(LINEAR), cfg)
    assert (with_attention.prompt_tokens == without.prompt_tokens).all()
    drawn = list(zip(with_attention.prompt_tokens, with_attention.output_tokens, strict=True))
    ratio = np.mean([by_hand(STEP, p, o) for p, o in drawn]) / np.mean(
        [by_hand(LINEAR, p, o) for p, o in drawn]
    )
    assert with_attention.arrival_s[-1] / without.arrival_s[-1] == pytest.approx(ratio, rel=1e-9)
    assert int(with_attention.prompt_tokens.max()) > 1000  # a long prompt is in the draw: attention matters
