"""The step-time model on published A100/H100 timings (SplitwiseSim, bundled under calibration/gpu_evidence/).

The data are fixed measurements, so the numbers below are exact for this file; the bounds say what the model
form must achieve there: the held-out largest prompt is predicted better than by the linear model in every
setup, and decode iterations at the held-out largest batch stay close.
"""

from __future__ import annotations

import math

import pytest

from simadmit.calibrate.fit import FitResult, fit_step_model
from simadmit.calibrate.gpu_evidence import evidence, observations, plausible, read_table
from simadmit.config.resources import bundled

TABLE = bundled("calibration", "gpu_evidence/splitwise_perf_model.csv")


@pytest.fixture(scope="module")
def results() -> list:
    assert TABLE is not None
    return evidence(read_table(TABLE))


def test_every_setup_is_fitted(results: list) -> None:
    labels = {e.setup.label for e in results}
    assert len(results) == 12
    assert "Llama-2-70B H100-80GB TP4" in labels and "BLOOM-176B A100-80GB TP8" in labels


def test_the_model_predicts_the_held_out_longest_prompt_better_than_a_linear_one(
    results: list,
) -> None:
    """8,192-token prefill, held out: the linear model without attention is 15-45% short in every setup; the
    fitted model (attention, and the weights' read where it predicts the held-out points better) is within 20%
    in every setup and better than the linear one in each."""
    for e in results:
        fitted = e.held_out_error(e.fit, "prefill", prompt=8192)
        linear = e.held_out_error(e.linear, "prefill", prompt=8192)
        assert linear < -0.10, e.setup.label
        assert abs(fitted) < abs(linear), e.setup.label
        assert abs(fitted) <= 0.20, e.setup.label


def test_the_weights_read_is_kept_only_where_it_predicts_better(results: list) -> None:
    """Where the fit keeps a weights' read, the held-out points (largest prompt, largest batch) are predicted
    better than by the same fit without it; the short prompts' floor then no longer inflates the attention
    coefficient, which stays below the largest of the linear fits (34 ns per pair)."""
    kept = [e for e in results if e.fit.step.weights_read_s > 0]
    assert kept
    for e in kept:
        linear = fit_step_model(e.points, roofline=False)
        held = [o for o in e.points if o.held_out]
        assert rms(e.fit, held) < rms(linear, held), e.setup.label
        assert e.fit.step.per_prefill_attention_s < 34e-9, e.setup.label


def rms(fit: FitResult, points: list) -> float:
    return math.sqrt(sum((fit.predict(o) / o.seconds - 1) ** 2 for o in points) / len(points))


def test_decode_iterations_hold_out_of_sample(results: list) -> None:
    """Decode at the held-out batch of 64 within 18% (the weights' read, where kept, puts the knee below 64 and
    loses a few points there: -16% and -17% on two H100 setups, against -5% to -14% for the linear model),
    and with 8,192-token prompts within 12%."""
    for e in results:
        batch = e.held_out_error(e.fit, "decode", batch=64)
        assert math.isnan(batch) or abs(batch) <= 0.18, e.setup.label
        assert abs(e.held_out_error(e.fit, "decode", prompt=8192)) <= 0.12, e.setup.label


def test_rows_outside_the_engine_are_left_out() -> None:
    """Batched prefills beyond a step's token budget give no prefill point (their decode stays); the TP2 batch-64
    rows, whose 64 x 512 prefill is faster than 8 x 512, are dropped."""
    assert TABLE is not None
    table = read_table(TABLE)
    kept = plausible(table)
    dropped = table.loc[table.index.difference(kept.index)]
    assert set(zip(dropped.tensor_parallel, dropped.batch_size, strict=True)) == {(2, 64)}
    rows = kept[(kept.model == "llama2-70b") & (kept.hardware == "h100-80gb") & (kept.tensor_parallel == 4)]
    obs = observations(rows, 8192, 64)
    assert max(o.prefill_tokens for o in obs if o.phase == "prefill") == 8192
    assert max(o.decode_seqs for o in obs if o.phase == "decode") == 64
