"""Cost estimates: the max_tokens upper bound, and output lengths learned from completed requests."""

from __future__ import annotations

import pytest

from simadmit.admission.estimator import CostEstimator, OutputLearner
from simadmit.config.loading import load_scenario
from simadmit.config.resources import default_scenario
from simadmit.sim.world import build_world
from simadmit.study.runner import run_scenario


def test_estimate_is_prefill_plus_decode_time_at_saturation_rates() -> None:
    est = CostEstimator(prefill_tokens_per_gpu_s=40_000, decode_tokens_per_gpu_s=4_000)
    assert est.estimate(4_000, 400) == pytest.approx(0.1 + 0.1)


def test_learner_is_cautious_until_warm_then_charges_the_mean_capped_at_max_tokens() -> None:
    learner = OutputLearner(warmup=3)
    assert learner.expected_output("chat", 512) == 512
    for n in (100, 200, 300):
        learner.observe("chat", n)
    assert learner.expected_output("chat", 512) == pytest.approx(200)
    assert learner.expected_output("chat", 150) == 150  # never above what the client asked for
    assert learner.expected_output("batch", 1024) == 1024  # tiers learn separately


def test_learned_estimates_admit_more_work_at_the_same_latency() -> None:
    """At 3x overload, charging the learned mean output instead of max_tokens brings the estimate close to the
    true cost, so the same GPU-seconds budget admits more work: more goodput, same interactive p99 TTFT.
    Two gateways on the metrics view, each pricing the other's requests at the mean of the estimates it makes:
    a gateway that priced them at the mean of what it admitted only could stay at its cold learner's
    max_tokens charges once it stopped admitting, and starve."""

    def run(mode: str) -> dict:
        spec, base = load_scenario(default_scenario(), {"gateway.estimate_output": mode, "workload.duration_s": 60,
                                                        "policies": [{"kind": "gpu_seconds",
                                                                      "max_pool_gpu_seconds": 12}]})  # fmt: skip
        return run_scenario(spec, build_world(spec, base)).summary["gpu_seconds"]

    plain, learned = run("max_tokens"), run("learned")
    assert plain["all"]["estimate_over_true_cost"] > 1.8
    assert learned["all"]["estimate_over_true_cost"] < 1.3
    assert learned["all"]["goodput_rps"] > 1.2 * plain["all"]["goodput_rps"]
    assert learned["interactive"]["served_ttft_p99_s"] < plain["interactive"]["served_ttft_p99_s"] + 1.0
