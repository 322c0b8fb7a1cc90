"""Re-simulate a fidelity benchmark's points with every step cost scaled: is the error a machine speed?

A simulation on a profile is only as right as the machine still runs at the speed it was calibrated at.
On a shared machine other jobs slow the server down by a varying amount; that slows every step alike, so
it shows as one factor on all step costs. This takes a folder written by `benchmarks/fidelity.py`, scales
its profile's step costs by each `--scale`, re-simulates each point's request list (what its first repeat
sent) and prints the errors against the real repeats. If one factor brings the points run close together
in time within the target while the model's shape is unchanged, the error was the machine's speed, not
the model; if no single factor fits, the shape is wrong. Diagnosis only: a profile is never tuned this way.

With `--paired` each real repeat is set against its own request list simulated on the profile scaled by
the speed probe taken just before it (`speed_probe.json`: a lone request's time over its time after
calibrating): what is left of the error once the machine's speed at that moment is known.

    python benchmarks/fidelity_speed.py runs/fidelity --scale 1.0,1.12,1.25
    python benchmarks/fidelity_speed.py runs/fidelity --paired
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.fidelity import simulate_replayed  # noqa: E402
from simadmit.results.compare import compare, load_runs  # noqa: E402

KEY = ("ttft_mean_s", "ttft_p99_s", "e2e_mean_s", "e2e_p99_s")


def resimulate(point: Path, profile: Path, work: Path) -> dict[str, tuple[float, float, float]]:
    """(simulated, real mean, error) per key measure of one point, simulated on `profile`."""
    out = work / point.name
    simulate_replayed(point, out, profile)
    return errors(out, sorted((point / "real").glob("repeat-*")))


def scaled_profile(base: dict, scale: float, path: Path) -> Path:
    """`base` (a profile document) with every step cost times `scale`, written to `path`."""
    profile = dict(base)
    profile["step_time"] = {k: v * scale for k, v in base["step_time"].items()}
    path.write_text(yaml.safe_dump(profile, sort_keys=False))
    return path


def errors(sim: Path, real: list[Path]) -> dict[str, tuple[float, float, float]]:
    """(simulated, real mean, error) per key measure of the run folder `sim` against the `real` ones."""
    table = compare(load_runs(sim, None), [r for folder in real for r in load_runs(folder, None)], 0.0)
    t = table[table["tier"] == "all"].set_index("measure")
    sim_v, real_mean, error = (t[c].astype(float) for c in ("sim", "real_mean", "error"))
    return {m: (sim_v[m], real_mean[m], error[m]) for m in KEY}


def paired(point: Path, base: dict, work: Path) -> tuple[list[float], dict[str, list[float]]]:
    """Each real repeat of `point` against its own requests simulated at its speed probe: the probes and
    the errors per key measure, one per repeat."""
    probes, errs = [], {m: [] for m in KEY}
    for folder in sorted((point / "real").glob("repeat-*"), key=lambda d: int(d.name.split("-")[1])):
        speed = float(json.loads((folder / "speed_probe.json").read_text())["speed"])
        k = int(folder.name.split("-")[1])
        out = work / point.name / folder.name
        out.mkdir(parents=True)
        simulate_replayed(point, out / "sim", scaled_profile(base, speed, out / "profile.yaml"), repeat=k)
        probes.append(speed)
        for m, (_s, _r, e) in errors(out / "sim", [folder]).items():
            errs[m].append(e)
    return probes, errs


def print_paired(points: list[Path], base: dict) -> None:
    print("| point | probes | " + " | ".join(f"{m}: mean error (range)" for m in KEY) + " |")
    print("|---|---|" + "---|" * len(KEY))
    with tempfile.TemporaryDirectory() as tmp:
        for point in points:
            probes, errs = paired(point, base, Path(tmp))
            cells = " | ".join(
                f"{100 * sum(e) / len(e):+.0f}% ({100 * min(e):+.0f} to {100 * max(e):+.0f})"
                for e in errs.values()
            )
            print(f"| {point.name} | {', '.join(f'{p:.2f}' for p in probes)} | {cells} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path, help="a folder written by benchmarks/fidelity.py")
    ap.add_argument("--scale", default="1.0,1.12,1.25", help="factors on every step cost")
    ap.add_argument("--paired", action="store_true", help="each repeat at its own speed probe")
    args = ap.parse_args()
    points = sorted(p for p in args.folder.iterdir() if (p / "real" / "repeat-1" / "replayed.yaml").exists())
    base_profile = yaml.safe_load((args.folder / "profile.yaml").read_text())
    if args.paired:
        print_paired(points, base_profile)
        return
    print("| scale | point | " + " | ".join(KEY) + " |")
    print("|---|---|" + "---|" * len(KEY))
    for scale in (float(s) for s in args.scale.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp) / f"scale-{scale:g}"
            work.mkdir()
            profile = scaled_profile(base_profile, scale, work / "profile.yaml")
            for point in points:
                cells = resimulate(point, profile, work)
                row = " | ".join(f"{s:.2f} / {r:.2f} ({100 * e:+.0f}%)" for s, r, e in cells.values())
                print(f"| {scale:g} | {point.name} | {row} |", flush=True)


if __name__ == "__main__":
    main()
