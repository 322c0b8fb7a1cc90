"""Ctrl-C, as a terminal sends it (SIGINT to the whole process group), through the console command:
a clean message, exit code 130, no traceback, and nothing that finished is lost."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from multiprocessing.pool import ThreadPool
from pathlib import Path

import pandas as pd
import pytest
import yaml

from simadmit.results.run_folder import read_manifest
from simadmit.study.backends import _between_waits
from tests.console import command, ctrl_c_as_in_a_terminal, env
from tests.fake_openai import fake_server
from tests.test_loadgen import scenario_doc

DEFAULT = Path(__file__).resolve().parent.parent / "scenarios" / "default.yaml"


def _scenario(tmp_path: Path, duration_s: float) -> Path:
    doc = yaml.safe_load(DEFAULT.read_text())
    doc["workload"].update(duration_s=duration_s, warmup_s=2)
    path = tmp_path / "short.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _interrupt_when(args: list[str], ready: re.Pattern[str], wait_s: float = 0.0) -> tuple[int, str, float]:
    """Start the command, press Ctrl-C `wait_s` after a line of its stderr matches `ready`; (exit code,
    stderr, seconds from Ctrl-C to exit)."""
    code, output, seconds, _ = _interrupt_timed(args, ready, wait_s)
    return code, output, seconds


def _interrupt_timed(
    args: list[str], ready: re.Pattern[str], wait_s: float = 0.0
) -> tuple[int, str, float, list[tuple[float, str]]]:
    """`_interrupt_when`, with the time each line before Ctrl-C was read (after the time the command was
    started, with an empty line), and a check that no process of the command (its workers included)
    outlives it."""
    launched = time.monotonic()
    proc = subprocess.Popen(
        [*command(), *args], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env(),
        start_new_session=True, preexec_fn=ctrl_c_as_in_a_terminal,
    )  # fmt: skip
    assert proc.stderr is not None
    lines, read_at = [""], [launched]
    for line in proc.stderr:
        lines.append(line)
        read_at.append(time.monotonic())
        if ready.search(line):
            break
    else:
        raise AssertionError("finished before it could be interrupted:\n" + "".join(lines))
    time.sleep(wait_s)
    os.killpg(proc.pid, signal.SIGINT)
    pressed = time.monotonic()
    stdout, rest = proc.communicate(timeout=120)
    seconds = time.monotonic() - pressed
    left = time.monotonic() + 30  # a worker's exit, once terminated, is the kernel's business: moments
    while _group_alive(proc.pid) and time.monotonic() < left:
        time.sleep(0.2)
    assert not _group_alive(proc.pid), "a process of the command outlived it"
    return proc.returncode, "".join(lines) + rest + stdout, seconds, list(zip(read_at, lines, strict=True))


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


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


def test_replay_interrupted_keeps_what_ended_marked_incomplete(tmp_path: Path) -> None:
    """Ctrl-C mid-replay keeps the requests that had ended (measured data is never thrown away), says so in
    one line, exits 130; the folder says it is incomplete, `compare` refuses it and `replay` will not add a
    run to it (the trace's skipped row makes a note to wait for)."""
    rows = "".join(f"2023-11-16 18:15:{10 + 0.1 * i:06.3f},50,4\n" for i in range(100))
    (tmp_path / "trace.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + rows + "bad,1,1\n")
    doc = scenario_doc()
    doc["workload"] = {"seed": 1, "trace": {"path": "trace.csv", "format": "azure", "on_error": "skip"},
                       "tiers": [{"name": "t"}]}  # fmt: skip
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(doc))
    out = tmp_path / "real"
    with fake_server() as server:
        args = ["replay", str(tmp_path / "s.yaml"), "--endpoint", server.url, "--out", str(out)]
        code, output, _ = _interrupt_when(args, re.compile(r"^note: "), wait_s=2.0)
        sent = server.completions
        again = subprocess.run([*command(), *args], capture_output=True, text=True, env=env(), check=False)
    assert code == 130, output
    assert "Traceback" not in output and 0 < sent < 100
    facts = json.loads((out / "replay.json").read_text())
    assert facts["complete"] is False and facts["requests_planned"] == 100
    kept = pd.read_parquet(out / "requests.parquet")
    assert 0 < kept["request_id"].nunique() == facts["requests"] <= sent
    assert (kept["outcome"] == "completed").all() and kept["finish_s"].notna().all()  # only what had ended
    said = f"interrupted: the {facts['requests']} of 100 requests that had ended are kept in {out}, marked incomplete"
    assert said in output
    assert again.returncode == 2 and "already holds a run" in again.stderr
    compared = subprocess.run(
        [*command(), "compare", str(out), str(out)], capture_output=True, text=True, env=env(), check=False
    )
    assert compared.returncode == 2, compared.stderr
    assert compared.stderr.count("\n") == 1 and "an interrupted replay" in compared.stderr
    assert "replay.json" in compared.stderr


def test_sweep_stops_promptly_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    args = ["sweep", str(_scenario(tmp_path, 20)), "--param", "workload.rate_multiplier=0.2:1.0:6",
            "--replications", "2", "--jobs", "2", "--out", str(out)]  # fmt: skip
    code, output, seconds, timeline = _interrupt_timed(args, re.compile(r"\b([1-9]\d*)/12 done"))
    assert code == 130, output
    assert "Traceback" not in output and "InvalidStateError" not in output
    saved = int(re.search(r"interrupted: (\d+) of 12 runs are saved", output).group(1))  # type: ignore[union-attr]
    # Prompt: the workers are terminated, not waited for. The yardstick is this run's own pace, so a loaded
    # machine slows both sides alike: from the "0/12 done" line to the first finished run is one run (plus
    # the workers' start). Finishing the runs left on 2 workers would take (12 - saved) / 2 of those; the
    # stop must take less than half of that (it takes a fraction of one run: terminate, then exit).
    one_run_s = timeline[-1][0] - next(t for t, line in timeline if " 0/12 done" in line)
    assert seconds < 0.5 * (12 - saved) / 2 * one_run_s, (seconds, one_run_s, saved)
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
    code, output, seconds, timeline = _interrupt_timed(
        args(out), re.compile(r"simulations: [1-9]\d*/\d+ done")
    )
    assert code == 130, output
    assert "Traceback" not in output
    # Prompt on this run's own pace (see the sweep test): less than it took to start and run a simulation.
    assert seconds < timeline[-1][0] - timeline[0][0], (seconds, timeline)
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


def test_ctrl_c_while_a_pool_is_awaited_is_an_interrupt_and_the_handler_comes_back() -> None:
    """Ctrl-C landing while the parent waits on its workers' results raises KeyboardInterrupt from the
    waiting loop (a signal inside the pool's lock code broke the lock: "release unlocked lock", a
    traceback and exit code 1), and Python's own Ctrl-C handler is back once the loop is left."""
    original = signal.getsignal(signal.SIGINT)
    with ThreadPool(1) as pool:
        results = pool.imap_unordered(time.sleep, [30.0])
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            list(_between_waits(results))
        assert time.monotonic() - started < 5
        assert signal.getsignal(signal.SIGINT) is original
        pool.terminate()
