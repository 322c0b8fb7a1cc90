"""Interactive and batch p99 TTFT under FCFS and priority scheduling, per load and policy, over seeds.

`python scripts/priority_ttft.py 1,2,3,4,5` runs `scenarios/priority_tiers.yaml` at 1x, 1.5x and 2x of the
pool's capacity (rate multipliers 0.33, 0.5, 0.67 of the default traffic) for each seed and prints, per
load, variant and policy, the mean and the range over seeds of each tier's p99 TTFT (over every arrival:
a request never answered is a miss) and failure rate. The README quotes these figures.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from simadmit.config.loading import load_scenario
from simadmit.study.runner import run_study

SCENARIO = Path(__file__).resolve().parent.parent / "scenarios" / "priority_tiers.yaml"
LOADS = {"1x": 0.33, "1.5x": 0.5, "2x": 0.67}


def main(seeds: list[int]) -> None:
    for label, multiplier in LOADS.items():
        rows: dict[str, dict[str, list[float]]] = {}
        for seed in seeds:
            spec, base = load_scenario(
                SCENARIO, {"workload.seed": seed, "workload.rate_multiplier": multiplier}
            )
            for group, tiers in run_study(spec, base).summary.items():
                row = rows.setdefault(group, {})
                for tier in ("interactive", "batch"):
                    for key in ("ttft_p99_s", "failure_rate"):
                        row.setdefault(f"{tier} {key}", []).append(tiers[tier][key])
        print(f"load {label} (rate multiplier {multiplier}), seeds {seeds}: mean [min, max]")
        for group, row in rows.items():
            cells = ", ".join(f"{k} {np.mean(v):.2f} [{min(v):.2f}, {max(v):.2f}]" for k, v in row.items())
            print(f"  {group}: {cells}")


if __name__ == "__main__":
    main([int(s) for s in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 2, 3, 4, 5])
