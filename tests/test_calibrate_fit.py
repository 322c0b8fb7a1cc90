"""The step-time fit: it recovers known coefficients, respects their signs, and says when it is poor."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from simadmit.calibrate.client import Endpoint
from simadmit.calibrate.fit import (
    decode_observation,
    fit_step_model,
    fit_warnings,
    nonnegative_least_squares,
    observations,
    ttft_observation,
)
from simadmit.calibrate.measurements import Measurement
from simadmit.calibrate.metrics import CacheConfig
from simadmit.calibrate.run import CalibrationConfig, build_profile
from simadmit.config.profile import load_profile, save_profile

TRUE = np.array([0.030, 1.5e-3, 0.4e-3, 1.0e-6, 0.012])  # overhead, prefill, decode seq, context, TTFT offset


def synthetic(rng: np.random.Generator, noise: float) -> list:
    """A calibration-shaped data set: a prefill sweep and a decode sweep at two prompt lengths."""
    obs = []
    for p in (16, 31, 59, 113, 217, 417, 800, 1536):
        for _ in range(3):
            o = ttft_observation(p, 2048)
            obs.append(
                replace(o, seconds=float(np.dot(o.features(), TRUE)) * (1 + noise * rng.standard_normal()))
            )
    for c, prompt in [(1, 128), (2, 128), (4, 128), (8, 128), (16, 128), (16, 512)]:
        for k in range(5):
            o = decode_observation(c, prompt, 64, interfering_prompt_tokens=float(k * prompt), phase="decode")
            obs.append(
                replace(o, seconds=float(np.dot(o.features(), TRUE)) * (1 + noise * rng.standard_normal()))
            )
    return obs


def test_recovers_known_coefficients_exactly_without_noise() -> None:
    fit = fit_step_model(synthetic(np.random.default_rng(1), noise=0.0))
    assert np.allclose(fit.coefficients(), TRUE, rtol=1e-6)
    assert fit.r2 == pytest.approx(1.0)


def test_recovers_known_coefficients_under_noise() -> None:
    """With 5% multiplicative noise the well-determined coefficients come back within 10%."""
    fit = fit_step_model(synthetic(np.random.default_rng(2), noise=0.05))
    got = np.array(fit.coefficients())
    for i in (0, 1, 2):  # the context term is small next to the others and only loosely determined
        assert got[i] == pytest.approx(TRUE[i], rel=0.10), i
    assert fit.r2 > 0.95
    assert fit_warnings(fit, synthetic(np.random.default_rng(2), noise=0.05)) == []


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
    inside A's window. C's stream was held back and flushed at once (a 1 ms window): set aside."""
    a = replace(BASE, seq=0)
    b = replace(BASE, seq=1, start_unix_s=100.2)
    c = replace(BASE, seq=2, start_unix_s=100.9, itl_mean_s=0.0001)
    failed = replace(BASE, seq=3, status="timeout", ttft_s=math.nan)
    obs, discarded = observations([a, b, c, failed], token_budget=2048)
    assert discarded == 1
    window_a, window_b = obs
    assert window_a.seconds == pytest.approx(0.5)
    assert (window_a.prefill_tokens, window_a.steps, window_a.decode_seqs) == (128, 10, 20)
    assert window_b.prefill_tokens == 0


def test_prefill_longer_than_the_token_budget_takes_several_steps() -> None:
    o = ttft_observation(5000, 2048)
    assert (o.steps, o.prefill_tokens, o.context_tokens) == (3, 5000, 2048 + 4096 + 5000)


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
