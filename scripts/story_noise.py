"""Seed noise of the quantities the story tests check, to size their tolerances after a model change.

`python scripts/story_noise.py default 1,2,3,4,5` runs the default scenario's story at seeds 1-5, as
`tests/test_default_scenario.py` runs it, and prints each quantity per seed with its mean and standard
deviation; `mix`, `shared`, `retry`, `gateways`, `copilot`, `azure`, `mooncake` and `autoscale` do the same
for the scenarios of `tests/test_scenarios.py`. The tests' docstrings quote these figures: re-run this
when the engine or the policies change and check the tolerances still leave several deviations to spare.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from simadmit.config.loading import load_scenario
from simadmit.study.runner import ScenarioResult, run_study

SCENARIOS = Path(__file__).resolve().parent.parent / "scenarios"


def study(name: str, seed: int, **overrides: object) -> ScenarioResult:
    spec, base = load_scenario(SCENARIOS / name, {**overrides, "workload.seed": seed})
    return run_study(spec, base)


def default(seed: int) -> dict[str, float]:
    out = {}
    for duration in (60, 120):
        u = study("default.yaml", seed, **{"workload.duration_s": duration}).summary["unconditional"]
        rho = u["all"]["offered_rps"] / u["all"]["throughput_rps"]
        out[f"unconditional p99 TTFT / fluid, {duration} s"] = u["interactive"]["ttft_p99_s"] / (
            (rho - 1) * (10 + 0.99 * (duration - 10))
        )
    r = study("default.yaml", seed, **{"workload.duration_s": 120})
    s = r.summary
    req = r.requests
    mine = req[
        (req["policy"] == "gpu_seconds") & (req["tier"] == "interactive") & (req["decision"] == "admit")
    ]
    u = s["unconditional"]["all"]
    return {
        **out,
        "gpu_seconds first-attempt p99 TTFT": float(mine.loc[mine["attempt"] == 1, "ttft_s"].quantile(0.99)),
        "gpu_seconds served p99 TTFT": s["gpu_seconds"]["interactive"]["served_ttft_p99_s"],
        "gpu_seconds failure rate (all)": s["gpu_seconds"]["all"]["failure_rate"],
        "capacity bound 1 - served / offered": 1 - u["throughput_rps"] / u["offered_rps"],
        **{
            f"{p} goodput": s[p]["all"]["goodput_rps"]
            for p in ("unconditional", "queue_depth", "gpu_seconds")
        },
    }


def mix(seed: int) -> dict[str, float]:
    s = study(
        "mix_shift.yaml", seed, **{"workload.duration_s": 240, "workload.tiers.long_prompt.start_s": 100}
    )
    return {f"{p} {t} served p99 TTFT": s.summary[p][t]["served_ttft_p99_s"]
            for p in ("queue_depth", "gpu_seconds") for t in ("chat", "long_prompt")}  # fmt: skip


def shared(seed: int) -> dict[str, float]:
    s = study("shared_vs_separate.yaml", seed, **{"workload.duration_s": 150}).summary
    sep, sh = s["separate/unconditional"], s["shared/unconditional"]
    rho = sep["batch"]["offered_rps"] / sep["batch"]["throughput_rps"]
    return {
        "separate batch p99 E2E / fluid": sep["batch"]["e2e_p99_s"] / ((rho - 1) * (20 + 0.99 * 130)),
        "shared batch served / offered": sh["batch"]["throughput_rps"] / sh["batch"]["offered_rps"],
        "separate interactive p99 E2E": sep["interactive"]["e2e_p99_s"],
        "shared interactive p99 E2E": sh["interactive"]["e2e_p99_s"],
    }


def retry(seed: int) -> dict[str, float]:
    s = study("retry_storm.yaml", seed, **{"workload.duration_s": 150}).summary
    lock, jit = s["lockstep/gpu_seconds"]["interactive"], s["jittered/gpu_seconds"]["interactive"]
    return {
        "failure rate, lockstep - jittered": lock["failure_rate"] - jit["failure_rate"],
        "served p99 TTFT, jittered / lockstep": jit["served_ttft_p99_s"] / lock["served_ttft_p99_s"],
    }


def gateways(seed: int) -> dict[str, float]:
    s = study("gateways_headroom.yaml", seed, **{"workload.duration_s": 60}).summary
    none = s["no_headroom"]["pool:llama-8b"]["peak_in_flight_gpu_s"]
    return {
        "peak, no headroom": none,
        "peak drop with 0.9": none - s["headroom_0.9"]["pool:llama-8b"]["peak_in_flight_gpu_s"],
    }


def copilot(seed: int) -> dict[str, float]:
    today = study("support_copilot.yaml", seed, **{"workload.rate_multiplier": 1.0}).summary
    s = study("support_copilot.yaml", seed).summary
    u, g = s["unconditional"]["interactive"], s["gpu_seconds"]["interactive"]
    return {
        "today E2E p50": today["unconditional"]["interactive"]["e2e_p50_s"],
        "3x unconditional p50 TTFT": u["ttft_p50_s"],
        "3x unconditional p99 TTFT": u["ttft_p99_s"],
        "3x gpu_seconds served p99 TTFT": g["served_ttft_p99_s"],
        "3x gpu_seconds failure rate": g["failure_rate"],
    }


def azure(seed: int) -> dict[str, float]:
    s = study("azure_replay.yaml", seed).summary
    return {f"{v}/{p} p99 TTFT": s[f"{v}/{p}"]["conversation"][k]
            for v in ("x1", "x3") for p, k in (("unconditional", "ttft_p99_s"), ("gpu_seconds", "served_ttft_p99_s"))}  # fmt: skip


def mooncake(seed: int) -> dict[str, float]:
    r = study("mooncake_long_context.yaml", seed)
    pre = r.requests.groupby("policy")["preemptions"].mean()
    return {
        **{
            f"{v} mean wait": r.summary[f"{v}/unconditional"]["chat"]["queue_wait_mean_s"]
            for v in ("base", "more_kv", "more_compute")
        },  # fmt: skip
        "preemptions base / more_kv": pre["base/unconditional"] / pre["more_kv/unconditional"],
    }


def autoscale(seed: int) -> dict[str, float]:
    s = study("autoscaling_ramp.yaml", seed).summary
    return {f"{v} {k}": s[f"{v}/gpu_seconds"]["pool:llama-8b"][k]
            for v in ("gpu_util", "queue_wait") for k in ("replicas_mean", "paid_replicas_mean", "cold_start_gpu_s")}  # fmt: skip


STORIES: dict[str, Callable[[int], dict[str, float]]] = {
    f.__name__: f for f in (default, mix, shared, retry, gateways, copilot, azure, mooncake, autoscale)
}


def main(story: str, seeds: list[int]) -> None:
    runs = [STORIES[story](seed) for seed in seeds]
    for key in runs[0]:
        values = np.array([r[key] for r in runs], dtype=float)
        per_seed = " ".join(f"{v:.4g}" for v in values)
        spread = f" sd {values.std(ddof=1):.3g}" if len(values) > 1 else ""
        print(f"{key}: {per_seed} | mean {values.mean():.4g}{spread}")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in STORIES:
        sys.exit(f"usage: python scripts/story_noise.py {{{'|'.join(STORIES)}}} 1,2,3,4,5")
    main(sys.argv[1], [int(s) for s in sys.argv[2].split(",")])
