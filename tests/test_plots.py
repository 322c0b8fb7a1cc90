"""Plots: the figure objects carry the expected axes, curves and SLA lines; the command writes the files."""

from __future__ import annotations

import shutil
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
import pytest
from matplotlib.figure import Figure
from typer.testing import CliRunner

from simadmit.cli.main import app
from simadmit.results.plots import (
    goodput_vs_load,
    latency_cdfs,
    latency_vs_utilization,
    rejection_vs_load,
    timeline,
)
from simadmit.study.backends import run_sweep
from simadmit.study.grid import parse_param, plan_sweep
from tests.test_sweep import short_scenario

matplotlib.use("Agg")
runner = CliRunner()
POLICIES = {"unconditional", "queue_depth", "gpu_seconds", "predicted_ttft"}
SLO = {"interactive": {"ttft_s": 3.0, "e2e_s": 15.0}, "batch": {"ttft_s": 60.0, "e2e_s": 120.0}}


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("sweep")
    params = [
        parse_param("workload.rate_multiplier=0.1,0.3,1.0"),
        parse_param("policies.gpu_seconds.headroom=0.8,1.0"),
    ]
    run_sweep(plan_sweep(short_scenario(tmp), params), tmp / "out", jobs=1)
    return tmp / "out"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("run")
    out = tmp / "out"
    result = runner.invoke(app, ["simulate", str(short_scenario(tmp)), "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


def _curves(ax: matplotlib.axes.Axes) -> dict[str, np.ndarray]:
    return {line.get_label(): np.asarray(line.get_ydata(), dtype=float) for line in ax.get_lines()}


def test_p99_vs_utilization(sweep_dir: Path) -> None:
    """Two panels (TTFT, E2E), log latency against utilization in percent, a curve per policy and
    headroom value (headroom splits only gpu_seconds), and the SLA drawn."""
    table = pd.read_parquet(sweep_dir / "sweep.parquet")
    fig = latency_vs_utilization(table, "interactive", SLO["interactive"])
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    ttft, e2e = fig.axes
    assert ttft.get_xlabel() == e2e.get_xlabel() == "GPU utilization (work done / GPU capacity, %)"
    assert ttft.get_ylabel() == "p99 TTFT (s)" and e2e.get_ylabel() == "p99 end-to-end latency (s)"
    assert ttft.get_yscale() == "log"
    curves = _curves(ttft)
    names = {
        "unconditional",
        "queue_depth",
        "predicted_ttft",
        "gpu_seconds, headroom=0.8",
        "gpu_seconds, headroom=1",
    }
    assert set(curves) == names | {f"{n} (served)" for n in names} | {"SLA 3 s"}
    # served p99s are finite; over every arrival a p99 is infinite exactly where more than 1% failed
    interactive = table[table["tier"] == "interactive"]
    assert np.isfinite(interactive["served_ttft_p99_s"]).all()
    assert (np.isinf(interactive["ttft_p99_s"]) == (interactive["failure_rate"] > 0.01)).all()
    assert all(len(y) == 3 for name, y in curves.items() if not name.startswith("SLA"))
    assert list(curves["SLA 3 s"]) == [3.0, 3.0]
    assert "SLA 15 s" in _curves(e2e)
    x = np.concatenate([line.get_xdata() for line in ttft.get_lines()[:-1]])
    # work is priced at the profile's saturation rates (decode at 1,024 tokens of context), so a batch of
    # shorter contexts can do more than 100% of it: the axis is positive and finite, not capped
    assert 0 < x.min() and np.isfinite(x).all()


def test_rejection_and_goodput_vs_load(sweep_dir: Path) -> None:
    """Rejections in percent and goodput in requests/s, against offered load in requests/s."""
    table = pd.read_parquet(sweep_dir / "sweep.parquet")
    rej = rejection_vs_load(table, "interactive").axes[0]
    assert rej.get_xlabel() == "offered load (requests/s)" and rej.get_ylabel() == "rejection rate (%)"
    unconditional = _curves(rej)["unconditional"]
    assert (unconditional == 0).all()  # unconditional admission never rejects
    assert _curves(rej)["gpu_seconds, headroom=0.8"].max() > 0
    good = goodput_vs_load(table, "interactive").axes[0]
    assert good.get_ylabel() == "goodput (requests/s within SLA)"
    assert list(good.get_lines()[0].get_xdata()) == pytest.approx([9.6, 28.8, 96.0])
    assert "offered load" in _curves(good)


def test_run_figures(run_dir: Path) -> None:
    """Latency CDFs per tier and a three-panel timeline, from a `simulate` directory."""
    cdf = latency_cdfs(pd.read_parquet(run_dir / "requests.parquet"), SLO)
    assert len(cdf.axes) == 4
    assert [ax.get_xlabel() for ax in cdf.axes] == ["TTFT (s)", "end-to-end latency (s)"] * 2
    assert cdf.axes[0].get_ylabel() == "fraction of completed requests"
    curves = _curves(cdf.axes[0])
    assert POLICIES <= set(curves) and "SLA 3 s" in curves
    assert all(y[0] == 0 and y[-1] == 1 for name, y in curves.items() if name in POLICIES)
    tl = timeline(pd.read_parquet(run_dir / "timeseries.parquet"))
    assert [ax.get_ylabel() for ax in tl.axes] == [
        "queued requests",
        "in-flight work (GPU-s)",
        "rejections (per s)",
    ]
    assert tl.axes[-1].get_xlabel() == "simulated time (s)"
    assert set(_curves(tl.axes[0])) == POLICIES and _curves(tl.axes[0])["unconditional"].max() > 0


def test_plot_command_writes_png_and_svg(sweep_dir: Path, run_dir: Path, tmp_path: Path) -> None:
    result = runner.invoke(app, ["plot", str(sweep_dir)])
    assert result.exit_code == 0, result.output
    for stem in ("p99_vs_utilization_interactive", "rejection_vs_load_batch", "goodput_vs_load_all"):
        for ext in ("png", "svg"):
            assert (sweep_dir / f"{stem}.{ext}").stat().st_size > 5000
    result = runner.invoke(app, ["plot", str(run_dir), "--scenario", str(short_scenario(tmp_path))])
    assert result.exit_code == 0, result.output
    assert (run_dir / "latency_cdf.png").stat().st_size > 5000 and (run_dir / "timeline.svg").is_file()
    bundled = runner.invoke(app, ["plot", str(run_dir), "--scenario", "default"])  # a bundled scenario's name
    assert bundled.exit_code == 0, bundled.output
    empty = runner.invoke(app, ["plot", str(tmp_path)])
    assert empty.exit_code == 2 and "nothing" not in empty.output and "no sweep.parquet" in empty.output


@pytest.mark.parametrize(
    "record", ["not json", '{"tier_slo": [1, 2]}', '{"slo": {}}', '{"tier_slo": {"a": 3}}']
)
def test_a_sweep_record_overwritten_in_place(sweep_dir: Path, tmp_path: Path, record: str) -> None:
    """sweep.json overwritten at its own size (so the manifest's sizes still match) with something that is
    not the tiers' SLOs: one line naming the file and field, exit 2, no figure (it was a traceback)."""
    folder = tmp_path / "sweep"
    shutil.copytree(sweep_dir, folder, ignore=shutil.ignore_patterns("*.png", "*.svg"))
    meta = folder / "sweep.json"
    meta.write_text(record.ljust(meta.stat().st_size))
    result = runner.invoke(app, ["plot", str(folder)])
    assert result.exit_code == 2, result.output
    assert f"{meta}: tier_slo: not a sweep's record" in " ".join(result.output.split())
    assert not list(folder.glob("*.png"))


def test_a_sweep_over_mappings_is_plotted(tmp_path: Path) -> None:
    """A parameter swept over mappings (`--param 'pools.0.engine.tier_priority={interactive: 1},{...}'`)
    reads back from sweep.parquet as dicts: `plot` was a TypeError traceback (unhashable type: 'dict');
    each mapping is one curve, labelled by its text."""
    params = [parse_param("pools.0.engine.tier_priority={interactive: 1},{interactive: 2}")]
    run_sweep(plan_sweep(short_scenario(tmp_path), params), tmp_path / "out", jobs=1)
    result = runner.invoke(app, ["plot", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "goodput_vs_load_all.png").is_file()
