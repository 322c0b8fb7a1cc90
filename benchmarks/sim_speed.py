"""Simulator speed: simulated requests per wall-second on one core, SimPy events per request, peak memory.

Cases: the bundled default scenario (three policies, ~3x overload), and a 16-replica pool with ~10^5
requests at 80% and at 20% of its capacity. Capacity is measured first, as the completion rate of the
same pool under unconditional admission at heavy overload. Each case runs in a fresh process so its peak
memory (max RSS) is its own. Run: `python benchmarks/sim_speed.py`.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

from simadmit.config.loading import load_scenario
from simadmit.config.resources import default_scenario
from simadmit.sim.simulation import Simulation, policy_requests
from simadmit.sim.world import build_policies, build_world
from simadmit.study.runner import run_scenario
from simadmit.workload.build import generate


def pool16(rate: float, requests: int, policy: str) -> dict[str, object]:
    return {
        "pools.0.replicas": 16,
        "workload.rate_rps": rate,
        "workload.rate_multiplier": 1.0,
        "workload.duration_s": None,
        "workload.requests": requests,
        "workload.warmup_s": 0,
        "policies": [
            {"kind": policy, "max_pool_gpu_seconds": 48} if policy == "gpu_seconds" else {"kind": policy}
        ],
    }


def measure(overrides: dict[str, object]) -> dict[str, float]:
    """Simulate every policy of the scenario; time only the simulation, not the tables built afterwards."""
    spec, base = load_scenario(default_scenario(), overrides)
    world = build_world(spec, base)
    workload = generate(spec.workload)
    shared = policy_requests(workload)
    wall = events = simulated = 0.0
    for name, policy in build_policies(spec).items():
        sim = Simulation(world, workload, policy, spec.workload.seed, shared)
        start = time.perf_counter()
        result = sim.run(name)
        wall += time.perf_counter() - start
        events += result.events
        simulated += len(workload)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"requests": simulated, "wall_s": wall, "requests_per_s": simulated / wall,
            "events_per_request": events / simulated, "peak_rss_mb": peak_mb}  # fmt: skip


def capacity_16() -> float:
    """Completions per second of the 16-replica pool when unconditional admission is far past saturation."""
    spec, base = load_scenario(default_scenario(), pool16(400, 60_000, "unconditional"))
    result = run_scenario(spec, build_world(spec, base))
    return result.summary["unconditional"]["all"]["throughput_rps"]


def in_subprocess(overrides: dict[str, object]) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--case", json.dumps(overrides)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout)


def main() -> None:
    cap = capacity_16()
    print(f"16-replica pool capacity (unconditional, saturated): {cap:.0f} req/s")
    cases = [("default scenario, 3 policies", {})]
    for load in (0.8, 0.2):
        for policy in ("unconditional", "gpu_seconds"):
            cases.append((f"16 replicas, {load:.0%} load, {policy}", pool16(load * cap, 100_000, policy)))
    print(f"{'case':42s} {'requests':>9s} {'wall s':>7s} {'req/s':>8s} {'events/req':>10s} {'peak MB':>8s}")
    for label, overrides in cases:
        m = in_subprocess(overrides)
        print(f"{label:42s} {m['requests']:9.0f} {m['wall_s']:7.2f} {m['requests_per_s']:8.0f} "
              f"{m['events_per_request']:10.2f} {m['peak_rss_mb']:8.0f}")  # fmt: skip
    print("memory growth (16 replicas, 80% load, unconditional):")
    for n in (50_000, 100_000, 200_000):
        m = in_subprocess(pool16(0.8 * cap, n, "unconditional"))
        print(f"  {n:7d} requests: peak {m['peak_rss_mb']:.0f} MB")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--case":
        print(json.dumps(measure(json.loads(sys.argv[2]))))
    else:
        main()
