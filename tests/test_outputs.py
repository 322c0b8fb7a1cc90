"""Output folders: a write that fails part-way leaves the previous run's folder untouched and nothing that
looks complete; readers refuse a folder whose manifest is missing or disagrees with its files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from simadmit.cli.main import app
from simadmit.config.errors import InputError
from simadmit.results import run_folder
from simadmit.results.run_folder import check_destination, read_manifest, write_folder

runner = CliRunner()
SHORT = ["--set", "workload.duration_s=8", "--set", "workload.warmup_s=1"]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_failed_write_leaves_the_previous_run_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Disk full while writing requests.parquet: the previous folder is byte for byte as it was, no hidden
    temporary folder is left beside it, and the command exits 2 with one line naming the folder."""
    out = tmp_path / "run"
    first = runner.invoke(app, ["simulate", "--out", str(out), *SHORT])
    assert first.exit_code == 0, first.output
    before = _snapshot(out)
    assert read_manifest(out)["partial"] is False

    real = pd.DataFrame.to_parquet

    def full_disk(self: pd.DataFrame, path: Path, *args: object, **kwargs: object) -> None:
        if Path(path).name == "requests.parquet":
            Path(path).write_bytes(b"PAR1 truncated")  # part of the file reached the disk
            raise OSError(28, "No space left on device")
        real(self, path, *args, **kwargs)

    monkeypatch.setattr(pd.DataFrame, "to_parquet", full_disk)
    second = runner.invoke(app, ["simulate", "--out", str(out), "--seed", "7", *SHORT])
    assert second.exit_code == 2
    assert "Traceback" not in second.output
    assert f"{out}: could not write the outputs (No space left on device)" in second.output
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no half-written folder beside it


def test_a_failed_first_write_leaves_no_folder(tmp_path: Path) -> None:
    """Nothing that looks like a run folder exists after a failure, even without a previous run."""
    out = tmp_path / "new"

    def boom(path: Path) -> None:
        path.write_text("half")
        raise OSError(5, "Input/output error")

    with pytest.raises(InputError, match="Input/output error"):
        write_folder(out, {"a.json": lambda p: p.write_text("{}"), "b.parquet": boom}, {"partial": False})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_a_run_folder_has_the_mode_any_new_folder_gets(tmp_path: Path, umask: int) -> None:
    """Written through a private temporary folder, the run folder still ends with the permissions the
    user's umask gives a new folder (shared under 022, private under 077), and the umask is left as it was."""
    before = os.umask(umask)
    try:
        write_folder(tmp_path / "run", {"a.json": lambda p: p.write_text("{}")}, {"partial": False})
        assert os.umask(umask) == umask
    finally:
        os.umask(before)
    assert (tmp_path / "run").stat().st_mode & 0o777 == 0o777 & ~umask


def test_plot_refuses_an_incomplete_folder(tmp_path: Path) -> None:
    """A folder without a manifest (a write cut short, or by hand) or whose files disagree with it is
    refused with one line, exit 2; the complete folder plots."""
    out = tmp_path / "run"
    assert runner.invoke(app, ["simulate", "--out", str(out), *SHORT]).exit_code == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["files"]) == {
        "scenario.yaml",
        "requests.parquet",
        "timeseries.parquet",
        "summary.json",
    }
    data = (out / "requests.parquet").read_bytes()
    (out / "requests.parquet").write_bytes(data[: len(data) // 2])
    cut = runner.invoke(app, ["plot", str(out)])
    assert cut.exit_code == 2 and "Traceback" not in cut.output
    assert "incomplete folder: requests.parquet is" in cut.output
    (out / "requests.parquet").write_bytes(data)
    (out / "manifest.json").unlink()
    missing = runner.invoke(app, ["plot", str(out)])
    assert missing.exit_code == 2 and "incomplete folder: no manifest.json" in missing.output


def test_destination_problems_are_found_before_anything_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file in place of the folder or of a parent, a read-only disk, or a folder of someone else's files."""
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(InputError, match="is a file, not a folder"):
        check_destination(a_file, replace=True)
    with pytest.raises(InputError, match="is a file, not a folder"):
        check_destination(a_file / "sub" / "out", replace=True)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "thesis.tex").write_text("x")
    with pytest.raises(InputError, match=r"holds files simadmit did not write \(thesis.tex\)"):
        check_destination(theirs, replace=True)
    check_destination(theirs, replace=False)  # a sweep adds its files beside them
    with pytest.raises(InputError, match="is the current folder"):
        check_destination(Path("."), replace=True)

    def read_only(*args: object, **kwargs: object) -> str:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(run_folder.tempfile, "mkdtemp", read_only)
    with pytest.raises(InputError, match=r"cannot write in .* \(Read-only file system\)"):
        check_destination(tmp_path / "out", replace=True)
    assert not (tmp_path / "out").exists()


def test_summary_tables_fit_80_columns_uncut() -> None:
    """With confidence half-widths, three policies and realistic magnitudes (5 digits of requests, waits
    and latencies to tens of seconds), no cell is cut or folded and no line passes 80 columns."""
    from rich.console import Console

    from simadmit.results.report import LATENCY, LOAD, print_summary

    measures: dict[str, float] = {}
    for key, _, _ in LATENCY + LOAD:
        rate = key.endswith(("rate", "utilization"))
        measures[key] = 0.7123 if rate else 14400.0 if key == "requests" else 12.345
        measures[f"{key}_ci95"] = 0.0456 if rate else 123.0 if key == "requests" else 1.234
    summary = {p: {"interactive": measures, "batch": measures, "all": measures}
               for p in ("unconditional", "queue_depth", "gpu_seconds")}  # fmt: skip
    console = Console(width=80, record=True)
    print_summary(summary, "default: a title", console)
    text = console.export_text()
    assert "…" not in text
    assert all(len(line) <= 80 for line in text.splitlines())
    assert "put/s" in text  # headers break at their own line breaks, not inside a word
    rows = [line for line in text.splitlines() if line.strip().startswith("interactive")]
    assert len(rows) == 6  # three policies, two tables
    assert "71.2%" in rows[-1] and "14400" in rows[-1] and "12.35" in rows[0] and "12.35" in rows[-1]
