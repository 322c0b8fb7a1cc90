"""Rank admission policies by interactive goodput at the SLO, at offered loads relative to capacity.

For each scenario, load x means offered work (each request's true GPU-seconds at the profile's saturation
rates) = x times the GPU-seconds the pool offers; the rate multiplier giving it is found from the seed's
workload at multiplier 1. Every policy runs on the same seeds (replication r: seed + r). Prints one markdown
table per scenario and load, and the target check of predicted-TTFT admission:
(a) where unconditional admission meets the interactive SLO (p99 TTFT), predicted_ttft rejects <= 0.5% and
its p99 TTFT (every arrival, a rejected request counting as a miss) is within 10% of unconditional's; (b)
past saturation the p99 TTFT of the requests it admitted (and served) stays within the SLO and its goodput
(all tiers) is at least the best of gpu_seconds and queue_depth. Tables show the served p99 TTFT: past
saturation every policy that refuses more than 1% has an infinite every-arrival p99 (the failed column).

Rate limiters (token bucket, RPM/TPM, post-hoc tokens) are sized to what each tier sends at 1x capacity
(the bucket's burst: 5 s of it), as an operator would size them from a capacity test.

    python scripts/policy_ranking.py [--loads 0.5,1,2,3] [--seeds 3] [--scenarios default,azure_replay,mix_shift]
        [--out ranking.csv] [--set path=value ...]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pandas as pd

from simadmit.config.loading import load_scenario
from simadmit.config.overrides import parse_assignments
from simadmit.config.resources import resolve_scenario
from simadmit.sim.world import build_world
from simadmit.study.runner import run_scenario
from simadmit.workload.build import generate

POLICIES = {  # scenario -> queue_depth and gpu_seconds as the scenario (or the default) sets them
    "default": (
        {"max_queued": 64},
        {"budgets_s": {"interactive": 3.0, "batch": 60.0}, "max_pool_gpu_seconds": 12},
    ),
    "azure_replay": ({"max_queued": 32}, {"budgets_s": {"conversation": 3.0}, "max_pool_gpu_seconds": 4.0}),
    "mix_shift": (
        {"max_queued": 32},
        {"budgets_s": {"chat": 2.0, "long_prompt": 5.0}, "max_pool_gpu_seconds": 8},
    ),
}


def policies(scenario: str, at_capacity: dict[str, dict[str, float]] | None = None) -> list[dict]:
    """The policies to rank; the rate limiters are sized to what each tier sends at 1x capacity."""
    depth, gpu = POLICIES[scenario]
    out = [
        {"kind": "unconditional"},
        {"kind": "queue_depth", **depth},
        {"kind": "gpu_seconds", **gpu},
        {"kind": "gpu_seconds", "name": "gpu_seconds_remaining", "work": "remaining", **gpu},
        {"kind": "predicted_ttft"},
        {"kind": "saturation"},
    ]
    if at_capacity:
        out += [
            {"kind": "token_bucket",
             "tiers": {t: {"rate": c["prompt_tps"], "burst": 5 * c["prompt_tps"]} for t, c in at_capacity.items()}},
            {"kind": "rate_limit",
             "tiers": {t: {"rpm": 60 * c["rps"], "tpm": 60 * c["asked_tps"]} for t, c in at_capacity.items()}},
            {"kind": "post_hoc_tokens", "tokens_per_minute": {t: 60 * c["used_tps"] for t, c in at_capacity.items()}},
        ]  # fmt: skip
    return out


def load_at_multiplier_one(scenario: str, overrides: dict) -> float:
    """Offered work / offered GPU-seconds at rate multiplier 1."""
    return _traffic(scenario, overrides)[0]


def _traffic(scenario: str, overrides: dict) -> tuple[float, dict[str, dict[str, float]]]:
    """At rate multiplier 1: offered work / offered GPU-seconds, and per tier what it sends per second
    (requests, prompt tokens, prompt + max_tokens, prompt + output)."""
    spec, base = load_scenario(
        resolve_scenario(Path(scenario)), {**overrides, "variants": [], "workload.rate_multiplier": 1.0}
    )
    world = build_world(spec, base)
    w = generate(spec.workload, spec.workload.seed)
    pool = world.pools[0]
    work = float(pool.estimator.estimate_many(w.prompt, w.output).sum())
    span = float(w.arrival[-1] - w.arrival[0])
    gpus = sum(p.replicas * p.gpus_per_replica for p in world.pools)
    sends = {}
    for t, name in enumerate(w.tier_names):
        mine = w.tier == t
        sends[name] = {
            "rps": float(mine.sum()) / span,
            "prompt_tps": float(w.prompt[mine].sum()) / span,
            "asked_tps": float((w.prompt[mine] + w.max_tokens[mine]).sum()) / span,
            "used_tps": float((w.prompt[mine] + w.output[mine]).sum()) / span,
        }
    return work / (span * gpus), sends


def at_capacity(scenario: str, overrides: dict) -> tuple[float, dict[str, dict[str, float]]]:
    """Load at multiplier 1, and what each tier sends per second at 1x capacity."""
    unit, sends = _traffic(scenario, overrides)
    return unit, {t: {k: v / unit for k, v in c.items()} for t, c in sends.items()}


def print_summary(table: pd.DataFrame) -> None:
    """One table per scenario, as the README shows it: policies ranked by the critical tier's goodput at the
    highest load; a cell per load: goodput/s, rejected, failed, work utilization, served p99 TTFT."""
    top = table["load"].max()
    for scenario, g in table.groupby("scenario", sort=False):
        tier, slo = g["tier"].iloc[0], g["slo_ttft_s"].iloc[0]
        loads = sorted(g["load"].unique())
        print(f"\n`{scenario}` ({tier} tier, TTFT SLO {slo:g} s); each cell: {tier} goodput/s, rejected, failed, "
              f"work utilization (all tiers), {tier} p99 TTFT of the requests served\n")  # fmt: skip
        print(f"| rank at {top:g}x | policy | " + " | ".join(f"{x:g}x" for x in loads) + " |")
        print("|---|---|" + "---|" * len(loads))
        ranked = g[g["load"] == top].sort_values("goodput_rps", ascending=False)["policy"]
        for rank, policy in enumerate(ranked, 1):
            rows = g[g["policy"] == policy].set_index("load")
            cells = [
                f"{r.goodput_rps:.1f} · {r.rejection_rate:.0%} · {r.failure_rate:.0%} · {r.work_utilization:.0%} · "
                f"{r.served_ttft_p99_s:.3g} s"
                for r in (rows.loc[x] for x in loads)
            ]  # fmt: skip
            print(f"| {rank} | {policy} | " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loads", default="0.5,1,2,3")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--scenarios", default="default,azure_replay,mix_shift")
    ap.add_argument("--out", default=None)
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args()
    extra = parse_assignments(args.set)
    rows = []
    for scenario in args.scenarios.split(","):
        unit, capacity = at_capacity(scenario, extra)
        for load in [float(x) for x in args.loads.split(",")]:
            overrides = {
                **extra,
                "variants": [],
                "workload.rate_multiplier": load / unit,
                "policies": policies(scenario, capacity),
            }
            spec, base = load_scenario(resolve_scenario(Path(scenario)), overrides)
            world = build_world(spec, base)
            critical = min(spec.workload.tiers, key=lambda t: t.slo.ttft_s)
            result = run_scenario(spec, world, replications=args.seeds, keep_tables=False)
            for name, s in result.summary.items():
                tier, everything = s[critical.name], s["all"]
                failed = sum(tier[k] for k in ("rejected", "abandoned", "aborted", "too_long", "in_flight"))
                rows.append({
                    "scenario": scenario, "load": load, "policy": name, "tier": critical.name,
                    "slo_ttft_s": critical.slo.ttft_s,
                    "goodput_rps": tier["goodput_rps"], "goodput_ci95": tier.get("goodput_rps_ci95", math.nan),
                    "all_goodput_rps": everything["goodput_rps"],
                    "rejection_rate": tier["rejection_rate"], "failure_rate": failed / tier["requests"],
                    "ttft_p99_s": tier["ttft_p99_s"], "served_ttft_p99_s": tier["served_ttft_p99_s"],
                    "e2e_p99_s": tier["e2e_p99_s"],
                    "work_utilization": everything["work_utilization"],
                })  # fmt: skip
            print(f"done {scenario} x{load}", flush=True)
    table = pd.DataFrame(rows)
    if args.out:
        table.to_csv(args.out, index=False)
    for (scenario, load), g in table.groupby(["scenario", "load"], sort=False):
        g = g.sort_values("goodput_rps", ascending=False)
        print(
            f"\n{scenario}, {load:g}x capacity ({g['tier'].iloc[0]} tier, TTFT SLO {g['slo_ttft_s'].iloc[0]:g} s)\n"
        )
        print("| policy | goodput/s | rejected | failed | served TTFT p99 s | work util |")
        print("|---|---|---|---|---|---|")
        for r in g.itertuples():
            print(f"| {r.policy} | {r.goodput_rps:.1f} ± {r.goodput_ci95:.1f} | {r.rejection_rate:.1%} | "
                  f"{r.failure_rate:.1%} | {r.served_ttft_p99_s:.2f} | {r.work_utilization:.0%} |")  # fmt: skip
    print_summary(table)
    print("\ntarget check (predicted_ttft)")
    for (scenario, load), g in table.groupby(["scenario", "load"], sort=False):
        by = g.set_index("policy")
        free, mine = by.loc["unconditional"], by.loc["predicted_ttft"]
        slo = mine["slo_ttft_s"]
        if free["ttft_p99_s"] <= slo:
            ok = mine["rejection_rate"] <= 0.005 and mine["ttft_p99_s"] <= 1.1 * free["ttft_p99_s"]
            what = f"(a) rejects {mine['rejection_rate']:.2%}, p99 {mine['ttft_p99_s']:.2f} vs {free['ttft_p99_s']:.2f}"
        else:
            best = max(by.loc["gpu_seconds", "all_goodput_rps"], by.loc["queue_depth", "all_goodput_rps"])
            ok = mine["served_ttft_p99_s"] <= slo and mine["all_goodput_rps"] >= best
            what = (f"(b) served p99 {mine['served_ttft_p99_s']:.2f} vs SLO {slo:g}, "
                    f"goodput {mine['all_goodput_rps']:.1f} "
                    f"vs best baseline {best:.1f}")  # fmt: skip
        print(f"{scenario} x{load:g}: {'ok ' if ok else 'MISS'} {what}")


if __name__ == "__main__":
    main()
