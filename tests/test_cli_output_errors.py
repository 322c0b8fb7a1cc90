"""Unusable output destinations and bundled scenario names, through the console command: one line naming
the path, exit code 2, no traceback, and nothing simulated first."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.console import command as console_command
from tests.console import env, run
from tests.fake_openai import fake_server
from tests.fake_vllm import FakeVllm
from tests.test_loadgen import PROFILE, scenario_doc

SHORT = ("--set", "workload.duration_s=5", "--set", "workload.warmup_s=1")


def _clean_failure(result, fragment: str) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert fragment in output, output
    assert "Traceback" not in output
    assert "simulated requests" not in output  # refused before running


@pytest.mark.parametrize("command", ["simulate", "sweep", "optimize"])
def test_out_is_a_file(tmp_path: Path, command: str) -> None:
    target = tmp_path / "results.txt"
    target.write_text("mine")
    extra = ("--slo", "interactive.ttft_p99<=3s") if command == "optimize" else ()
    result = run(command, "--out", str(target), *extra)
    _clean_failure(result, f"{target}: is a file, not a folder")
    assert target.read_text() == "mine"


def test_out_below_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    _clean_failure(run("simulate", "--out", str(tmp_path / "f" / "run"), *SHORT), "is a file, not a folder")


def _bound_by_permissions() -> list[str]:
    """A prefix that makes the command obey file permissions: none for a user; for root, `setpriv` without
    the capabilities that let root write anywhere (root still reads its own files, such as the Python it
    runs from, which a switch to `nobody` could not)."""
    if os.geteuid() != 0:
        return []
    prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]
    try:
        probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=30, check=False)
    except FileNotFoundError:
        probe = None
    if probe is None or probe.returncode != 0:
        pytest.skip("running as root, and setpriv cannot drop the capability to write anywhere")
    return prefix


@pytest.mark.parametrize("command", ["simulate", "sweep", "optimize", "calibrate"])
def test_out_without_permission(tmp_path: Path, command: str) -> None:
    """Permission denied, for real (a folder of mode 555), before anything runs or is measured."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    prefix = _bound_by_permissions()
    with FakeVllm() as server:
        args = {
            "simulate": ("simulate", "--out", str(locked / "run"), *SHORT),
            "sweep": ("sweep", "--param", "workload.rate_multiplier=1", "--out", str(locked / "run")),
            "optimize": ("optimize", "--slo", "interactive.ttft_p99<=3s", "--out", str(locked / "run")),
            "calibrate": ("calibrate", "--endpoint", server.url, "--out", str(locked / "p.yaml")),
        }[command]
        result = subprocess.run([*prefix, *console_command(), *args], capture_output=True, text=True, env=env(),
                                timeout=300, check=False)  # fmt: skip
    out = args[args.index("--out") + 1]
    _clean_failure(result, f"{out}: cannot write in {locked} (Permission denied)")
    assert server.completions == 0  # nothing measured, nothing lost
    assert [line for line in result.stderr.splitlines() if line.strip()] == [
        result.stderr.strip()
    ]  # one line
    assert list(locked.iterdir()) == []


def _denied(args: tuple[str, ...], line: str) -> None:
    """Run the command obeying file permissions: exit 2 and this one line, no traceback."""
    result = subprocess.run([*_bound_by_permissions(), *console_command(), *args], capture_output=True, text=True,
                            env=env(), timeout=300, check=False)  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in output, output
    assert result.stderr.strip() == f"error: {line}", output


@pytest.mark.parametrize(("command", "locked"), [("compare", "manifest.json"), ("plot", "requests.parquet")])
def test_a_run_file_without_permission(tmp_path: Path, command: str, locked: str) -> None:
    """A run's file of mode 000 is one line naming it (`compare` named requests.parquet for its manifest,
    `plot` was a traceback)."""
    scenario, folder = tmp_path / "s.yaml", tmp_path / "run"
    scenario.write_text(yaml.safe_dump(scenario_doc()))
    assert run("simulate", str(scenario), "--out", str(folder)).returncode == 0
    (folder / locked).chmod(0)
    args = ("compare", str(folder), str(folder)) if command == "compare" else ("plot", str(folder))
    _denied(args, f"{folder / locked}: cannot read it (Permission denied)")


def test_a_scenario_in_a_folder_without_permission(tmp_path: Path) -> None:
    """A scenario in a folder of mode 000: the line of a file that cannot be read, not a PermissionError."""
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / "s.yaml").write_text(yaml.safe_dump(scenario_doc()))
    locked.chmod(0)
    try:
        _denied(("simulate", str(locked / "s.yaml"), "--out", str(tmp_path / "run")),
                f"{locked / 's.yaml'}: cannot read it (Permission denied)")  # fmt: skip
    finally:
        locked.chmod(0o755)


def test_a_sweep_whose_points_cannot_be_written(tmp_path: Path) -> None:
    """A sweep's points folder of mode 555: one line naming it (it was a PermissionError traceback once the
    first new point finished), and the points saved before are kept."""
    scenario, out = tmp_path / "s.yaml", tmp_path / "sweep"
    scenario.write_text(yaml.safe_dump(scenario_doc()))
    sweep = ("sweep", str(scenario), "--jobs", "1", "--out", str(out), "--param")
    assert run(*sweep, "workload.rate_rps=10").returncode == 0
    saved = {p.name: p.read_bytes() for p in (out / "points").iterdir()}
    (out / "points").chmod(0o555)
    result = subprocess.run([*_bound_by_permissions(), *console_command(), *sweep, "workload.rate_rps=10,20"],
                            capture_output=True, text=True, env=env(), timeout=300, check=False)  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in output, output
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
        f"error: {out / 'points'}: could not write the outputs (Permission denied); the runs saved so far are "
        "kept: run the same command to resume"
    ], output
    assert {p.name: p.read_bytes() for p in (out / "points").iterdir()} == saved


def _on_a_full_disk(tmp_path: Path, kilobytes: int, script: str) -> subprocess.CompletedProcess[str]:
    """Run a shell script with `$FULL` a folder on a tmpfs of this size (in a mount namespace of its own,
    gone when the script ends); skip where mounting is not allowed."""
    full = tmp_path / "full"
    full.mkdir()
    mount = f"mount -t tmpfs -o size={kilobytes}k tmpfs {full} || exit 99; FULL={full}; {script}"
    try:
        result = subprocess.run(["unshare", "-m", "sh", "-c", mount], capture_output=True, text=True, env=env(),
                                timeout=300, check=False)  # fmt: skip
    except FileNotFoundError:
        pytest.skip("no unshare to mount a small file system")
    if result.returncode == 99:
        pytest.skip("not allowed to mount a small file system")
    return result


def test_a_full_disk_leaves_the_run_folder_as_it_was(tmp_path: Path) -> None:
    """No space left while writing the tables: one line naming the folder, and no half-written folder."""
    cmd = " ".join(console_command())
    result = _on_a_full_disk(
        tmp_path, 16, f"{cmd} simulate --out $FULL/run {' '.join(SHORT)}; echo exit=$?; ls -A $FULL"
    )
    lines = result.stdout.strip().splitlines()
    assert "exit=2" in lines, result.stdout + result.stderr
    assert lines[-1] == "exit=2"  # and `ls -A` printed nothing: no temporary folder left behind
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert (
        len(errors) == 1 and "No space left on device" in errors[0] and "the folder is as it was" in errors[0]
    )


def test_a_full_disk_stops_a_calibration_keeping_its_rows(tmp_path: Path) -> None:
    """The measurements file fills the disk mid-run: one line, exit 2, and the rows written so far stay."""
    cmd = " ".join(console_command())
    kept = tmp_path / "kept.csv"
    with FakeVllm() as server:
        result = _on_a_full_disk(
            tmp_path, 4, f"{cmd} calibrate --endpoint {server.url} --out $FULL/p.yaml --budget 30s "
            f"--max-concurrency 2 >/dev/null; echo exit=$?; cp $FULL/p.measurements.csv {kept}",
        )  # fmt: skip
    assert result.stdout.strip() == "exit=2", result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'full' / 'p.measurements.csv'}: cannot write it (No space left on device); the rows "
        "written so far are kept: rerun with --resume"
    ]
    rows = kept.read_text().splitlines()
    assert rows[0].startswith("phase,concurrency,seq,")
    assert len(rows) > 2  # the header and the measurements that fitted


def test_a_full_disk_leaves_no_partial_replay(tmp_path: Path) -> None:
    """No space left for a replay's tables: one line naming the folder, and nothing that looks like a run
    (a truncated requests.parquet would block the rerun and read as damaged in `compare`)."""
    cmd = " ".join(console_command())
    scenario = tmp_path / "s.yaml"
    scenario.write_text(yaml.safe_dump(scenario_doc(12)))
    with fake_server() as server:
        result = _on_a_full_disk(
            tmp_path, 12, f"{cmd} replay {scenario} --endpoint {server.url} --out $FULL/r >/dev/null; "
            "echo exit=$?; ls -A $FULL",
        )  # fmt: skip
    assert result.stdout.strip() == "exit=2", result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'full' / 'r'}: could not write the outputs (No space left on device); the folder "
        "is as it was"
    ]


def test_a_full_disk_leaves_no_partial_compare_report(tmp_path: Path) -> None:
    """No space left for the report's table and plots: one line naming the folder, nothing half written."""
    cmd = " ".join(console_command())
    sim, scenario = tmp_path / "sim", tmp_path / "s.yaml"
    scenario.write_text(yaml.safe_dump(scenario_doc(40)))
    assert run("simulate", str(scenario), "--out", str(sim)).returncode == 0
    result = _on_a_full_disk(
        tmp_path,
        16,
        f"{cmd} compare {sim} {sim} --out $FULL/report >/dev/null; echo exit=$?; ls -A $FULL",
    )
    assert result.stdout.strip() == "exit=2", result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'full' / 'report'}: could not write the outputs (No space left on device); the "
        "folder is as it was"
    ]


def test_out_holding_other_files_is_not_replaced(tmp_path: Path) -> None:
    (tmp_path / "notes.md").write_text("keep me")
    _clean_failure(
        run("simulate", "--out", str(tmp_path), *SHORT), "holds files simadmit did not write (notes.md)"
    )
    assert (tmp_path / "notes.md").read_text() == "keep me"


def test_sweep_and_optimize_take_bundled_scenario_names(tmp_path: Path) -> None:
    """A bundled name is found (the errors are about the scenario's own fields and tiers, not a missing file)."""
    sweep = run(
        "sweep", "retry_storm", "--param", "workload.rate_multiplierr=1", "--out", str(tmp_path / "s")
    )
    _clean_failure(sweep, "rate_multiplierr")
    assert "not found" not in sweep.stderr
    optimize = run("optimize", "retry_storm", "--slo", "gold.ttft_p99<=3s", "--out", str(tmp_path / "o"))
    _clean_failure(optimize, "unknown tier 'gold'; tiers: all, interactive")


def test_a_new_sweep_leaves_no_figure_of_the_previous_one(tmp_path: Path) -> None:
    """The figures `plot` drew show the tables they were drawn from: a sweep writing new tables into the
    folder removes them (they showed the old curves beside the new sweep.parquet), not a file of the user's."""
    scenario = tmp_path / "s.yaml"
    scenario.write_text(yaml.safe_dump(scenario_doc()))
    out = tmp_path / "sweep"
    for rates in ("1,2", "3,4"):
        assert (
            run("sweep", str(scenario), "--param", f"workload.rate_rps={rates}", "--out", str(out)).returncode
            == 0
        )
        if rates == "1,2":
            assert run("plot", str(out)).returncode == 0
            assert (out / "goodput_vs_load_all.png").is_file()
            (out / "mine.png").write_text("keep me")
    assert not list(out.glob("*_vs_*")), sorted(p.name for p in out.iterdir())
    assert (out / "mine.png").read_text() == "keep me"


def test_a_run_folder_plots_wherever_it_is(tmp_path: Path) -> None:
    """`plot` draws a run whose scenario named its profile relative to itself (`simulate s.yaml` from the
    scenario's folder), and a run folder moved where that profile is not: it reads only the SLOs."""
    source = tmp_path / "src"
    source.mkdir()
    (source / "prof.yaml").write_bytes(Path(PROFILE).read_bytes())
    doc = scenario_doc()
    doc["pools"][0]["profile"] = "prof.yaml"
    (source / "s.yaml").write_text(yaml.safe_dump(doc))
    assert run("simulate", "s.yaml", "--out", "../run", cwd=source).returncode == 0
    scenario = yaml.safe_load((tmp_path / "run" / "scenario.yaml").read_text())
    assert scenario["pools"][0]["profile"] == str(source / "prof.yaml")  # not "prof.yaml", from ../run
    (source / "prof.yaml").unlink()  # the folder copied to a machine without the profile
    result = run("plot", str(tmp_path / "run"))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "run" / "latency_cdf.png").is_file()


def test_plot_in_a_folder_it_cannot_write(tmp_path: Path) -> None:
    """A run folder `plot` may not write in (mode 555): one line naming it, no traceback, no figure."""
    scenario = tmp_path / "s.yaml"
    scenario.write_text(yaml.safe_dump(scenario_doc()))
    runs = tmp_path / "runs"  # the figures are drawn beside the folder, then moved in
    assert run("simulate", str(scenario), "--out", str(runs / "run")).returncode == 0
    (runs / "run").chmod(0o555)
    result = subprocess.run([*_bound_by_permissions(), *console_command(), "plot", str(runs / "run")],
                            capture_output=True, text=True, env=env(), timeout=300, check=False)  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in output, output
    assert result.stderr.strip() == f"error: {runs / 'run'}: could not write the outputs (Permission denied); " \
        "the folder is as it was"  # fmt: skip
    assert not list((runs / "run").glob("*.png")) and sorted(p.name for p in runs.iterdir()) == ["run"]


def test_a_damaged_saved_point_is_run_again(tmp_path: Path) -> None:
    """A sweep's saved point that holds no result (emptied, cut short by a copy, edited) was a JSONDecodeError
    or TypeError traceback on every later run of the sweep (a measure edited to text, a ValueError); it is
    run again and its file replaced."""
    scenario = tmp_path / "s.yaml"
    scenario.write_text(yaml.safe_dump(scenario_doc()))
    sweep = ("sweep", str(scenario), "--param", "workload.rate_rps=10,20", "--out", str(tmp_path / "o"))
    assert run(*sweep).returncode == 0
    text_measure = (
        '{"summary": {"unconditional": {"all": {"goodput_rps": "x"}}}, "arrival_rate_rps": {"all": 1}}'
    )
    for damage in ('{"summ', "", "[]", '{"summary": 3}', text_measure):
        point = sorted((tmp_path / "o" / "points").glob("*.json"))[0]
        point.write_text(damage)
        result = run(*sweep)
        assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
        assert "(1 reused from" in result.stdout, result.stdout
        assert "summary" in json.loads(point.read_text())
