"""Ctrl-C, as a terminal sends it (SIGINT to the whole process group), through the console command:
a clean message, exit code 130, no traceback, and nothing that finished is lost."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pandas as pd
import yaml

from simadmit.results.run_folder import read_manifest
from tests.console import command, env

DEFAULT = Path(__file__).resolve().parent.parent / "scenarios" / "default.yaml"


def _scenario(tmp_path: Path, duration_s: float) -> Path:
    doc = yaml.safe_load(DEFAULT.read_text())
    doc["workload"].update(duration_s=duration_s, warmup_s=2)
    path = tmp_path / "short.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _interrupt_when(args: list[str], ready: re.Pattern[str]) -> tuple[int, str, float]:
    """Start the command, press Ctrl-C once a line of its stderr matches `ready`; (exit code, stderr, seconds
    from Ctrl-C to exit)."""
    proc = subprocess.Popen(
        [*command(), *args], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env(),
        start_new_session=True,
    )  # fmt: skip
    assert proc.stderr is not None
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if ready.search(line):
            break
    else:
        raise AssertionError("finished before it could be interrupted:\n" + "".join(lines))
    os.killpg(proc.pid, signal.SIGINT)
    pressed = time.monotonic()
    stdout, rest = proc.communicate(timeout=120)
    return proc.returncode, "".join(lines) + rest + stdout, time.monotonic() - pressed


def test_simulate_keeps_the_finished_runs_marked_partial(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["simulate", str(_scenario(tmp_path, 40)), "--replications", "4", "--out", str(out)]
    code, output, _ = _interrupt_when(args, re.compile(r"^finished "))
    assert code == 130, output
    assert "Traceback" not in output
    assert "interrupted after" in output and "marked partial in manifest.json" in output
    manifest = read_manifest(out)  # a complete folder: every file matches the manifest
    assert manifest["partial"] is True
    finished = manifest["runs_finished"]
    assert 1 <= sum(finished.values()) < 12
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == set(finished)
    requests = pd.read_parquet(out / "requests.parquet")
    runs = requests.groupby("policy")["seed"].nunique().to_dict()
    assert runs == finished  # the tables hold exactly the runs that finished
    plotted = subprocess.run(
        [*command(), "plot", str(out)], capture_output=True, text=True, env=env(), check=False
    )
    assert plotted.returncode == 0, plotted.stderr
    assert "holds an interrupted run" in plotted.stderr


def test_sweep_stops_promptly_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    args = ["sweep", str(_scenario(tmp_path, 20)), "--param", "workload.rate_multiplier=0.2:1.0:6",
            "--replications", "2", "--jobs", "2", "--out", str(out)]  # fmt: skip
    code, output, seconds = _interrupt_when(args, re.compile(r"\b([1-9]\d*)/12 done"))
    assert code == 130, output
    assert "Traceback" not in output and "InvalidStateError" not in output
    assert seconds < 15  # workers are terminated, not waited for (a loaded machine: generous)
    saved = int(re.search(r"interrupted: (\d+) of 12 runs are saved", output).group(1))  # type: ignore[union-attr]
    files = len(list((out / "points").glob("*.json")))
    assert 1 <= saved <= files <= saved + 1 < 12
    assert not (out / "manifest.json").exists()  # no table was written: nothing looks complete

    again = subprocess.run(
        [*command(), *args], capture_output=True, text=True, env=env(), timeout=300, check=False
    )
    assert again.returncode == 0, again.stderr
    assert f"({files} reused from {out}/points)" in again.stdout
    assert read_manifest(out)["command"] == "sweep"
    assert len(list((out / "points").glob("*.json"))) == 12


def test_optimize_stops_cleanly_and_resumes(tmp_path: Path) -> None:
    """Interrupted, optimize says how many simulations are saved; the same command then runs exactly the
    ones that were not (the search is deterministic, so the full count is known from a fresh run)."""
    from tests.test_optimize import mmc_scenario

    scenario = mmc_scenario(tmp_path, duration_s=300)

    def args(out: Path) -> list[str]:
        return ["optimize", str(scenario), "--slo", "all.queue_wait_mean<=1s", "--objective", "goodput_per_gpu",
                "--search", "pools.0.replicas=6:12", "--rounds", "1", "--jobs", "2", "--out", str(out)]  # fmt: skip

    out = tmp_path / "o"
    code, output, seconds = _interrupt_when(args(out), re.compile(r"simulations: [1-9]\d*/\d+ done"))
    assert code == 130, output
    assert "Traceback" not in output and seconds < 15
    assert re.search(r"interrupted: \d+ simulations are saved in .*; run the same command to resume", output)
    saved = len(list((out / "points").glob("*.json")))
    assert saved >= 1

    def simulations(result: subprocess.CompletedProcess[str]) -> int:
        assert result.returncode == 0, result.stderr
        return int(re.findall(r"(\d+) simulations in", result.stdout)[-1])

    resumed = simulations(subprocess.run([*command(), *args(out)], capture_output=True, text=True, env=env(),
                                         timeout=300, check=False))  # fmt: skip
    fresh = simulations(subprocess.run([*command(), *args(tmp_path / "fresh")], capture_output=True, text=True,
                                       env=env(), timeout=300, check=False))  # fmt: skip
    assert resumed == fresh - saved
