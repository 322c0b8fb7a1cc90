"""Re-simulate a fidelity benchmark's points with every step cost scaled: is the error a machine speed?

A simulation on a profile is only as right as the machine still runs at the speed it was calibrated at.
On a shared machine other jobs slow the server down by a varying amount; that slows every step alike, so
it shows as one factor on all step costs. This takes a folder written by `benchmarks/fidelity.py` or
`benchmarks/gateway_fidelity.py`, scales the engines' step costs by each `--scale` (the gateways still
believe the profile, as the real ones did), re-simulates each point's request list (what its first repeat
sent) and prints the errors against the real repeats. If one factor brings the points run close together
in time within the target while the model's shape is unchanged, the error was the machine's speed, not
the model; if no single factor fits, the shape is wrong. Diagnosis only: a profile is never tuned this way.

With `--paired` each real repeat is set against its own request list simulated at the speed probe taken
just before it (`speed_probe.json`): what is left of the error once the machine's speed at that moment is
known. Where the probe measured each phase against the profile (a lone prompt's prefill, a decode batch's
steps), the prefill and decode costs are scaled apart, as the machine drifts; an older probe holds one
speed, a lone request's time over the run's reference reading taken right after calibrating, and a run
on an earlier calibration (`--profile`) took that reference later: `--reference` gives that reading over
the one taken after the calibration.

    python benchmarks/fidelity_speed.py runs/fidelity --scale 1.0,1.12,1.25
    python benchmarks/fidelity_speed.py runs/gateway-fidelity --paired [--reference 1.1]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.fidelity import Slowdown, read_slowdown, simulate_replayed  # noqa: E402
from simadmit.results.compare import compare, load_runs  # noqa: E402

KEY = ("ttft_mean_s", "ttft_p99_s", "e2e_mean_s", "e2e_p99_s", "rejection_rate")


def errors(sim: Path, real: list[Path]) -> dict[str, tuple[float, float, float]]:
    """(simulated, real mean, error) per key measure of the run folder `sim` against the `real` ones; the
    rejection rate's error in points, not relative."""
    table = compare(load_runs(sim, None), [r for folder in real for r in load_runs(folder, None)], 0.0)
    t = table[table["tier"] == "all"].set_index("measure")
    sim_v, real_mean, error = (t[c].astype(float) for c in ("sim", "real_mean", "error"))
    error["rejection_rate"] = sim_v["rejection_rate"] - real_mean["rejection_rate"]
    return {m: (sim_v[m], real_mean[m], error[m]) for m in KEY}


def draws(point: Path) -> int:
    """How many draws of the clients' jitter the benchmark simulated `point` over (its own `sim` folder's
    seeds): a gateway point's retries make one draw too noisy to set against the real repeats."""
    table = point / "sim" / "requests.parquet"
    return int(pd.read_parquet(table, columns=["seed"])["seed"].nunique()) if table.exists() else 1


def cell(measure: str, value: float) -> str:
    """An error as printed: points for the rejection rate, percent for the rest."""
    return f"{100 * value:+.1f} pt" if measure == "rejection_rate" else f"{100 * value:+.0f}%"


def paired(point: Path, reference: float, work: Path) -> tuple[list[Slowdown], dict[str, list[float]]]:
    """Each real repeat of `point` against its own requests simulated at its speed probe (`read_slowdown`):
    the slowdowns and the errors per key measure, one per repeat."""
    speeds, errs = [], {m: [] for m in KEY}
    for folder in sorted((point / "real").glob("repeat-*"), key=lambda d: int(d.name.split("-")[1])):
        speed = read_slowdown(folder, reference)
        out = work / point.name / folder.name
        simulate_replayed(point, out, repeat=int(folder.name.split("-")[1]), slower=speed)
        speeds.append(speed)
        for m, (_s, _r, e) in errors(out, [folder]).items():
            errs[m].append(e)
    return speeds, errs


def print_paired(points: list[Path], reference: float) -> None:
    print(
        "| point | prefill / decode slowdowns | " + " | ".join(f"{m}: mean error (range)" for m in KEY) + " |"
    )
    print("|---|---|" + "---|" * len(KEY))
    with tempfile.TemporaryDirectory() as tmp:
        for point in points:
            speeds, errs = paired(point, reference, Path(tmp))
            cells = " | ".join(
                f"{cell(m, sum(e) / len(e))} ({cell(m, min(e))} to {cell(m, max(e))})"
                for m, e in errs.items()
            )
            shown = ", ".join(f"{s.prefill:.2f} / {s.decode:.2f}" for s in speeds)
            print(f"| {point.name} | {shown} | {cells} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "folder", type=Path, help="a folder written by benchmarks/fidelity.py or gateway_fidelity.py"
    )
    ap.add_argument("--scale", default="1.0,1.12,1.25", help="factors on every step cost")
    ap.add_argument("--paired", action="store_true", help="each repeat at its own speed probe")
    ap.add_argument("--reference", type=float, default=1.0,
                    help="the run's reference probe over the one right after its profile was calibrated")  # fmt: skip
    args = ap.parse_args()
    points = sorted(p for p in args.folder.iterdir() if (p / "real" / "repeat-1" / "replayed.yaml").exists())
    if args.paired:
        print_paired(points, args.reference)
        return
    print("| scale | point | " + " | ".join(KEY) + " |")
    print("|---|---|" + "---|" * len(KEY))
    for scale in (float(s) for s in args.scale.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            for point in points:
                simulate_replayed(point, Path(tmp) / point.name, slower=scale, replications=draws(point))
                cells = errors(Path(tmp) / point.name, sorted((point / "real").glob("repeat-*")))
                row = " | ".join(f"{s:.3g} / {r:.3g} ({cell(m, e)})" for m, (s, r, e) in cells.items())
                print(f"| {scale:g} | {point.name} | {row} |", flush=True)


if __name__ == "__main__":
    main()
