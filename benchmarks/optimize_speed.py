"""How long the README's `optimize` example takes, and how many simulations it runs.

Runs the command through the console entry point (`python -m simadmit.cli`-equivalent: the Typer app in a
fresh process) and prints the wall time and the number of simulations it reports. The number of
simulations does not depend on how busy the machine is; the wall time does, so repeat it and report the
spread (and how loaded the machine was). With `--jobs 1` the CPU time it prints is the whole work and
depends far less on the load: roughly the serial wall time on an idle machine. Extra arguments are passed to `simadmit optimize`, e.g.
`python benchmarks/optimize_speed.py --jobs 1` for the serial time. Each run gets a fresh `--out`, so
nothing saved by an earlier run is reused.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import tempfile
import time

README_EXAMPLE = [
    "scenarios/default.yaml",
    "--set", "workload.rate_multiplier=0.15",
    "--slo", "interactive.ttft_p99<=3s",
    "--slo", "interactive.failure<=2%",
    "--objective", "goodput",
]  # fmt: skip


def main(extra: list[str]) -> None:
    args = os.environ.get("SIMADMIT_OPTIMIZE_ARGS")
    command = args.split() if args else README_EXAMPLE
    if "--out" not in extra:  # a fresh folder: saved simulations would be reused, and nothing timed
        extra = [*extra, "--out", tempfile.mkdtemp(prefix="optimize-speed-")]
    cmd = [sys.executable, "-c", "from simadmit.cli.main import app; app()", "optimize", *command, *extra]
    load = os.getloadavg()[0]
    started, before = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    run = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall, after = time.monotonic() - started, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    sims = re.findall(r"(\d+) simulations", run.stdout)
    print(run.stdout[-3000:])
    if run.returncode != 0:
        print(run.stderr[-3000:], file=sys.stderr)
    print(f"command: simadmit optimize {' '.join(command + extra)}")
    print(
        f"exit code {run.returncode}; wall {wall:.1f} s; CPU {cpu:.1f} s; simulations {sims[-1] if sims else '?'}"
    )
    print(
        "(CPU: the command and the processes it waits for; workers forked by the forkserver are not counted,"
    )
    print(" so only --jobs 1 gives the whole CPU time)")
    print(
        f"load average before the run: {load:.2f} on {os.cpu_count()} CPUs (wall time is noisy when shared)"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
