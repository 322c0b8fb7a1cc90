"""Re-simulate a fidelity benchmark's points with every step cost scaled: is the error a machine speed?

A simulation on a profile is only as right as the machine still runs at the speed it was calibrated at.
On a shared machine other jobs slow the server down by a varying amount; that slows every step alike, so
it shows as one factor on all step costs. This takes a folder written by `benchmarks/fidelity.py`, scales
its profile's step costs by each `--scale`, re-simulates each point's request list (what its first repeat
sent) and prints the errors against the real repeats. If one factor brings the points run close together
in time within the target while the model's shape is unchanged, the error was the machine's speed, not
the model; if no single factor fits, the shape is wrong. Diagnosis only: a profile is never tuned this way.

    python benchmarks/fidelity_speed.py runs/fidelity --scale 1.0,1.12,1.25
"""

from __future__ import annotations

import argparse
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
    repeats = sorted((point / "real").glob("repeat-*"))
    real = [r for folder in repeats for r in load_runs(folder, None)]
    table = compare(load_runs(out, None), real, 0.0)
    t = table[table["tier"] == "all"].set_index("measure")
    sim, real_mean, error = (t[c].astype(float) for c in ("sim", "real_mean", "error"))
    return {m: (sim[m], real_mean[m], error[m]) for m in KEY}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path, help="a folder written by benchmarks/fidelity.py")
    ap.add_argument("--scale", default="1.0,1.12,1.25", help="factors on every step cost")
    args = ap.parse_args()
    points = sorted(p for p in args.folder.iterdir() if (p / "real" / "repeat-1" / "replayed.yaml").exists())
    base_profile = yaml.safe_load((args.folder / "profile.yaml").read_text())
    print("| scale | point | " + " | ".join(KEY) + " |")
    print("|---|---|" + "---|" * len(KEY))
    for scale in (float(s) for s in args.scale.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp) / f"scale-{scale:g}"
            work.mkdir()
            profile = dict(base_profile)
            profile["step_time"] = {k: v * scale for k, v in base_profile["step_time"].items()}
            (work / "profile.yaml").write_text(yaml.safe_dump(profile, sort_keys=False))
            for point in points:
                cells = resimulate(point, work / "profile.yaml", work)
                row = " | ".join(f"{s:.2f} / {r:.2f} ({100 * e:+.0f}%)" for s, r, e in cells.values())
                print(f"| {scale:g} | {point.name} | {row} |", flush=True)


if __name__ == "__main__":
    main()
