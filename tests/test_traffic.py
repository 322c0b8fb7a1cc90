"""Workloads built from traces and from time-varying arrival specs."""

from __future__ import annotations

import numpy as np
import pytest

from simadmit.config.errors import InputError
from simadmit.config.loading import scenario_from_dict
from simadmit.workload.build import generate
from simadmit.workload.traces import load_azure
from tests.helpers import PROFILE, ROOT

AZURE = ROOT / "data" / "traces" / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"


def _doc(workload: dict) -> dict:
    return {
        "workload": workload,
        "pools": [{"profile": PROFILE, "replicas": 1}],
        "policies": [{"kind": "unconditional"}],
    }


def test_trace_replay_is_exact_and_scaled_by_rate_multiplier() -> None:
    trace = {"path": str(AZURE), "format": "azure", "end_s": 600,
             "tiers": {"by": "length", "rules": [{"tier": "long", "above": 4000}], "default": "short"},
             "max_tokens": {"kind": "scaled", "factor": 1.5}}  # fmt: skip
    workload = {"trace": trace, "rate_multiplier": 2.0, "tiers": [{"name": "short"}, {"name": "long"}]}
    spec = scenario_from_dict(_doc(workload), ROOT / "tests" / "t.yaml")
    w = generate(spec.workload)
    raw = load_azure(AZURE).frame
    raw = raw[raw["arrival_s"] < 600]
    assert len(w) == len(raw)
    np.testing.assert_array_equal(w.arrival, raw["arrival_s"].to_numpy() / 2.0)
    np.testing.assert_array_equal(w.prompt, raw["prompt_tokens"].to_numpy())
    np.testing.assert_array_equal(w.output, raw["output_tokens"].to_numpy())
    assert np.all(w.max_tokens >= w.output) and np.all(w.max_tokens == np.ceil(w.output * 1.5))
    assert set(np.flatnonzero(w.tier == 1)) == set(np.flatnonzero(w.prompt > 4000))


def test_a_trace_tier_missing_from_the_scenario_is_a_clear_error() -> None:
    trace = {"path": str(AZURE), "format": "azure", "end_s": 60,
             "tiers": {"by": "length", "rules": [{"tier": "huge", "above": 10}], "default": "short"}}  # fmt: skip
    spec = scenario_from_dict(_doc({"trace": trace, "tiers": [{"name": "short"}]}), ROOT / "tests" / "t.yaml")
    with pytest.raises(InputError, match="huge"):
        generate(spec.workload)


def test_missing_trace_file_names_the_field() -> None:
    doc = _doc({"trace": {"path": "nowhere.csv", "format": "azure"}, "tiers": [{"name": "a"}]})
    with pytest.raises(InputError, match=r"workload\.trace\.path: trace 'nowhere.csv' not found"):
        scenario_from_dict(doc, ROOT / "tests" / "t.yaml")


def test_profile_arrivals_follow_the_ramp() -> None:
    tier = {"name": "a", "prompt_tokens": {"kind": "fixed", "value": 10},
            "output_tokens": {"kind": "fixed", "value": 5}, "max_tokens": 5}  # fmt: skip
    workload = {"rate_rps": 100, "duration_s": 200, "tiers": [tier],
                "arrival": {"kind": "profile", "points": [[0, 0.1], [100, 1.0], [200, 1.0]]}}  # fmt: skip
    w = generate(scenario_from_dict(_doc(workload), ROOT / "tests" / "t.yaml").workload)
    first, second = np.sum(w.arrival < 100), np.sum(w.arrival >= 100)
    assert first == pytest.approx(100 * 100 * 0.55, rel=0.05)  # mean factor 0.55 over the ramp
    assert second == pytest.approx(100 * 100, rel=0.05)


def test_empirical_lengths_from_a_trace() -> None:
    tier = {"name": "a",
            "prompt_tokens": {"kind": "empirical", "trace": {"path": str(AZURE), "format": "azure"}},
            "output_tokens": {"kind": "empirical", "column": "output_tokens",
                              "trace": {"path": str(AZURE), "format": "azure"}},
            "max_tokens": 2000}  # fmt: skip
    w = generate(scenario_from_dict(_doc({"rate_rps": 50, "requests": 20_000, "tiers": [tier]}),
                                    ROOT / "tests" / "t.yaml").workload)  # fmt: skip
    assert np.median(w.prompt) == pytest.approx(1020, rel=0.05)  # the trace's p50 (README of the traces)
    assert np.percentile(w.output, 90) == pytest.approx(424, rel=0.05)
