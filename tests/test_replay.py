"""Replay on a profile: the engine model alone, as `calibrate check` uses it."""

from __future__ import annotations

import numpy as np
import pytest

from simadmit.config.profile import load_profile, prefill_attention_pairs
from simadmit.fleet.engine_replay import replay_on_profile
from tests.helpers import PROFILE


def test_a_lone_request_takes_one_prefill_step_then_one_step_per_token() -> None:
    profile = load_profile(PROFILE)
    step = profile.step_time
    df = replay_on_profile(profile, np.array([0.0]), np.array([500]), np.array([11]))
    assert df["ttft_s"][0] == pytest.approx(step.step_time(500, 0, 500, prefill_attention_pairs(500, 0)))
    decode = sum(step.step_time(0, 1, 500 + k) for k in range(1, 11))
    assert df["e2e_s"][0] == pytest.approx(df["ttft_s"][0] + decode)
    assert df["itl_s"][0] == pytest.approx(decode / 10)


def test_concurrency_stretches_inter_token_latency_but_raises_throughput() -> None:
    profile = load_profile(PROFILE)
    n = 64
    lone = replay_on_profile(profile, np.arange(n) * 100.0, np.full(n, 200), np.full(n, 100))
    burst = replay_on_profile(profile, np.zeros(n), np.full(n, 200), np.full(n, 100))
    assert burst["itl_s"].mean() > lone["itl_s"].mean()
    assert burst["e2e_s"].max() < lone["e2e_s"].sum() / 4  # batching: far faster than one at a time
