"""Sweep scaling: wall time of a 100-point sweep of the default scenario against the number of processes.

The grid is 10 traffic levels (0.1x to 1.0x) x 10 gpu_seconds headrooms (0.55 to 1.0), one seed each,
every point running all three policies on the default scenario shortened to `--duration` seconds. Each
job count runs the whole sweep from scratch in a fresh directory, `--repeat` times, alternating job counts;
the best (least disturbed) wall time of each is reported, with points per second, speed-up and parallel
efficiency against one process, and the machine's load average around the runs (other work on the machine
takes the cores the parallel runs need first).
Run: `python benchmarks/sweep_scaling.py [--jobs 1,2,4] [--duration 60] [--repeat 3]`.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import yaml

from simadmit.config.resources import default_scenario
from simadmit.study.backends import run_sweep
from simadmit.study.grid import parse_param, plan_sweep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", default=",".join(str(j) for j in sorted({1, 2, os.cpu_count() or 1})))
    parser.add_argument("--duration", type=float, default=60.0, help="simulated seconds of traffic per run")
    parser.add_argument("--repeat", type=int, default=3, help="runs per job count; the best is reported")
    args = parser.parse_args()
    counts = [int(j) for j in args.jobs.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        doc = yaml.safe_load(default_scenario().read_text())
        doc["workload"]["duration_s"] = args.duration
        doc["pools"][0]["profile"] = "llama-3.1-8b-h100"
        scenario = Path(tmp) / "scenario.yaml"
        scenario.write_text(yaml.safe_dump(doc))
        grid = ["workload.rate_multiplier=0.1:1.0:10", "policies.gpu_seconds.headroom=0.55:1.0:10"]
        plan = plan_sweep(scenario, [parse_param(p) for p in grid])
        walls: dict[int, list[float]] = {j: [] for j in counts}
        load = os.getloadavg()[0]
        for r in range(args.repeat):
            for jobs in counts:
                started = time.perf_counter()
                run_sweep(plan, Path(tmp) / f"jobs{jobs}-{r}", jobs=jobs)
                walls[jobs].append(time.perf_counter() - started)
    print(
        f"{len(plan.points)} points x 3 policies, {args.duration:g} s of traffic each; {os.cpu_count()} CPUs"
    )
    print(f"load average {load:.2f} before, {os.getloadavg()[0]:.2f} after; best of {args.repeat} runs each")
    print(f"{'jobs':>4} {'wall s':>8} {'points/s':>9} {'speed-up':>9} {'efficiency':>10}")
    one = min(walls[counts[0]]) * counts[0]
    for jobs in counts:
        wall = min(walls[jobs])
        speedup = one / wall
        print(
            f"{jobs:>4} {wall:>8.1f} {len(plan.points) / wall:>9.2f} {speedup:>8.2f}x {speedup / jobs:>10.0%}"
        )


if __name__ == "__main__":
    main()
