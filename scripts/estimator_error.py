"""How admission quality depends on the estimator's error, per policy.

Estimates of output length: `max_tokens` (what the client asks), `quantile` (90th percentile of the
outputs seen), `learned` (their mean), `ewma` (max_tokens x an EWMA of true over charged cost), `oracle`
(the true length). Profile error: the gateways believe rates 0.5x or 2x the engines' true ones (their step
times 2x or 0.5x), with max_tokens estimates. For each, at the given loads (offered work / capacity, as in
policy_ranking.py), every policy on the same seeds: the critical tier's goodput, rejections, p99 TTFT of the
requests served, SLO violations (requests that arrived and did not complete within their SLO), and the work
utilization given up against unconditional admission at the same load.

    python scripts/estimator_error.py [--scenario default] [--loads 1,3] [--seeds 2] [--out estimator_error.csv]
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pandas as pd
from policy_ranking import POLICIES, load_at_multiplier_one

from simadmit.config.loading import load_scenario
from simadmit.config.profile import Profile, StepTimeModel
from simadmit.config.resources import resolve_scenario
from simadmit.sim.world import World, build_world
from simadmit.study.runner import run_scenario

ESTIMATES = ["max_tokens", "quantile", "learned", "ewma", "oracle"]
PROFILE_ERRORS = [0.5, 2.0]


def believing(profile: Profile, rate_factor: float) -> Profile:
    """The profile a gateway would hold if its calibration overstated every rate by `rate_factor`."""
    s = profile.step_time
    step = StepTimeModel(*(getattr(s, f.name) / rate_factor for f in dataclasses.fields(s)))
    return dataclasses.replace(
        profile,
        step_time=step,
        prefill_tokens_per_gpu_s=profile.prefill_tokens_per_gpu_s * rate_factor,
        decode_tokens_per_gpu_s=profile.decode_tokens_per_gpu_s * rate_factor,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", default="default")
    ap.add_argument("--loads", default="1,3")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    unit = load_at_multiplier_one(args.scenario, {})
    depth, gpu = POLICIES[args.scenario]
    policies = [
        {"kind": "unconditional"},
        {"kind": "gpu_seconds", **gpu},
        {"kind": "gpu_seconds", "name": "gpu_seconds_remaining", "work": "remaining", **gpu},
        {"kind": "predicted_ttft"},
    ]
    settings = [(e, 1.0) for e in ESTIMATES] + [("max_tokens", f) for f in PROFILE_ERRORS]
    rows = []
    for load in [float(x) for x in args.loads.split(",")]:
        for estimate, factor in settings:
            overrides = {"variants": [], "workload.rate_multiplier": load / unit, "policies": policies,
                         "gateway.estimate_output": estimate}  # fmt: skip
            spec, base = load_scenario(resolve_scenario(Path(args.scenario)), overrides)
            world: World = build_world(spec, base)
            if factor != 1.0:
                pools = tuple(
                    dataclasses.replace(p, believed=believing(p.profile, factor)) for p in world.pools
                )
                world = dataclasses.replace(world, pools=pools)
            critical = min(spec.workload.tiers, key=lambda t: t.slo.ttft_s)
            result = run_scenario(spec, world, replications=args.seeds, keep_tables=False)
            label = estimate if factor == 1.0 else f"profile rates x{factor:g}"
            free_util = result.summary["unconditional"]["all"]["work_utilization"]
            for name, s in result.summary.items():
                tier = s[critical.name]
                rows.append({
                    "load": load, "estimator": label, "policy": name, "goodput_rps": tier["goodput_rps"],
                    "rejection_rate": tier["rejection_rate"], "ttft_p99_s": tier["served_ttft_p99_s"],
                    "slo_violations": 1.0 - tier["slo_attainment"],
                    "work_utilization": s["all"]["work_utilization"],
                    "utilization_given_up": free_util - s["all"]["work_utilization"],
                })  # fmt: skip
            print(f"done x{load:g} {label}", flush=True)
    table = pd.DataFrame(rows)
    if args.out:
        table.to_csv(args.out, index=False)
    for load, g in table.groupby("load"):
        print(f"\n{args.scenario}, {load:g}x capacity\n")
        print("| estimator | policy | goodput/s | rejected | TTFT p99 s | SLO violations | util given up |")
        print("|---|---|---|---|---|---|---|")
        for r in g[g.policy != "unconditional"].itertuples():
            print(f"| {r.estimator} | {r.policy} | {r.goodput_rps:.1f} | {r.rejection_rate:.1%} | "
                  f"{r.ttft_p99_s:.2f} | {r.slo_violations:.1%} | {r.utilization_given_up:+.0%} |")  # fmt: skip


if __name__ == "__main__":
    main()
