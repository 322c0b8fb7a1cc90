"""Plots: the figures people would rather look at than read, as matplotlib `Figure` objects.

From a sweep table: p99 TTFT and p99 E2E against GPU utilization (the hockey stick, and how admission
control flattens it), rejection rate and goodput against offered load, one curve per policy. From a
single run's tables: latency CDFs and a timeline of queue depth, in-flight GPU-seconds and rejections.
Figures are built without pyplot (no global state, no display needed); `plot_directory` writes each as
PNG and SVG. GPU utilization is work utilization: GPU-seconds of completed work at the profile's
saturation rates over GPU-seconds available, which (unlike a dashboard's busy fraction) keeps rising
with load until the pool is saturated.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure

from simadmit.config.errors import InputError, problem, unreadable
from simadmit.results.curves import curves
from simadmit.results.run_folder import FIGURES, Writer, add_files, read_manifest, read_table

_COLORS = {"unconditional": "#d62728", "queue_depth": "#ff7f0e", "gpu_seconds": "#1f77b4"}
_OTHER = ("#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22")
_DASHES = ("-", "--", ":", "-.")
_MARKERS = ("o", "s", "^", "D")


_NUMBERS = {  # per table plot draws from, the columns its figures read as numbers
    "sweep.parquet": ("arrival_rate_rps", "work_utilization", "ttft_p99_s", "e2e_p99_s", "served_ttft_p99_s",
                      "served_e2e_p99_s", "rejection_rate", "goodput_rps"),
    "requests.parquet": ("seed", "ttft_s", "e2e_s"),
    "timeseries.parquet": ("seed", "t_s", "queued", "in_flight_gpu_s", "rejects"),
}  # fmt: skip


def _color(name: str, index: int) -> str:
    return _COLORS.get(name, _OTHER[index % len(_OTHER)])


def _series(table: pd.DataFrame) -> list[tuple[str, dict[str, object], pd.DataFrame]]:
    """(label, line style, rows) per curve, labelled by the settings that split it.

    Curves of one policy share its colour, darker and with another dash and marker for each setting.
    """
    out: list[tuple[str, dict[str, object], pd.DataFrame]] = []
    seen: dict[str, int] = {}
    for policy, settings, rows in curves(table):
        label = ", ".join(f"{p.split('.')[-1]}={v:g}" if isinstance(v, float) else f"{p.split('.')[-1]}={v}"
                          for p, v in settings.items())  # fmt: skip
        k = seen[policy] = seen.get(policy, -1) + 1
        base = np.array(to_rgb(_color(policy, len(seen) - 1)))
        style: dict[str, object] = {"color": tuple(base * (1 - 0.22 * min(k, 3))), "linestyle": _DASHES[k % 4],
                                     "marker": _MARKERS[k % 4]}  # fmt: skip
        out.append((f"{policy}, {label}" if label else policy, style, rows))
    return out


def _sla_line(ax: Axes, value: float | None, vertical: bool = False) -> None:
    if value is None or not math.isfinite(value):
        return
    line = ax.axvline if vertical else ax.axhline
    line(value, color="black", linestyle="--", linewidth=1, label=f"SLA {value:g} s")


def _curve(
    ax: Axes, x: np.ndarray, y: np.ndarray, err: np.ndarray | None, label: str, style: dict[str, object]
) -> None:
    ax.plot(x, y, markersize=3, label=label, **style)  # type: ignore[arg-type]
    if err is not None and np.isfinite(err).any():
        ok = np.isfinite(y) & np.isfinite(err)  # an infinite p99 (over 1% never answered) has no band
        mid, half = np.where(ok, y, 0.0), np.where(ok, err, 0.0)
        ax.fill_between(x, mid - half, mid + half, where=ok, color=style["color"], alpha=0.15, linewidth=0)


def _ci(rows: pd.DataFrame, measure: str) -> np.ndarray | None:
    col = f"{measure}_ci95"
    return rows[col].to_numpy(dtype=float) if col in rows else None


def latency_vs_utilization(table: pd.DataFrame, tier: str, slo: dict[str, float] | None = None) -> Figure:
    """p99 TTFT and p99 E2E of `tier` against the pool's GPU utilization, one curve per policy: over every
    arrival (a request never answered is a miss, so the curve ends where more than 1% fail), and thin, over
    the served requests only."""
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    axes = fig.subplots(1, 2)
    util = table[table["tier"] == "all"].set_index(["point", "policy"])
    for label, style, rows in _series(table[table["tier"] == tier]):
        pool = util.loc[list(zip(rows["point"], rows["policy"], strict=True))]
        x = 100 * pool["work_utilization"].to_numpy(dtype=float)
        for ax, measure in zip(axes, ("ttft_p99_s", "e2e_p99_s"), strict=True):
            _curve(ax, x, rows[measure].to_numpy(dtype=float), _ci(rows, measure), label, style)
            served = {**style, "linewidth": 0.8, "alpha": 0.6, "marker": None}
            ax.plot(x, rows[f"served_{measure}"].to_numpy(dtype=float), label=f"{label} (served)", **served)
    for ax, (key, name) in zip(
        axes, (("ttft_s", "p99 TTFT"), ("e2e_s", "p99 end-to-end latency")), strict=True
    ):
        _sla_line(ax, (slo or {}).get(key))
        ax.set_xlabel("GPU utilization (work done / GPU capacity, %)")
        ax.set_ylabel(f"{name} (s)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{tier}: p99 latency vs GPU utilization")
    return fig


def _vs_load(table: pd.DataFrame, tier: str, measure: str, scale: float, ylabel: str, title: str) -> Figure:
    fig = Figure(figsize=(6.5, 4.2), layout="constrained")
    ax = fig.subplots()
    for label, style, rows in _series(table[table["tier"] == tier]):
        err = _ci(rows, measure)
        _curve(ax, rows["arrival_rate_rps"].to_numpy(dtype=float), scale * rows[measure].to_numpy(dtype=float),
               None if err is None else scale * err, label, style)  # fmt: skip
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    return fig


def rejection_vs_load(table: pd.DataFrame, tier: str) -> Figure:
    """Share of `tier`'s requests finally rejected, against the offered load."""
    fig = _vs_load(table, tier, "rejection_rate", 100.0, "rejection rate (%)", f"{tier}: rejections vs load")
    fig.axes[0].legend(fontsize=8)
    return fig


def goodput_vs_load(table: pd.DataFrame, tier: str) -> Figure:
    """Requests per second completed within `tier`'s SLA, against the offered load (dotted: all of it)."""
    fig = _vs_load(
        table, tier, "goodput_rps", 1.0, "goodput (requests/s within SLA)", f"{tier}: goodput vs load"
    )
    ax = fig.axes[0]
    top = float(table.loc[table["tier"] == tier, "arrival_rate_rps"].max())
    ax.plot([0, top], [0, top], color="gray", linestyle=":", linewidth=1, label="offered load")
    ax.legend(fontsize=8)
    return fig


def latency_cdfs(requests: pd.DataFrame, slo: dict[str, dict[str, float]] | None = None) -> Figure:
    """CDFs of TTFT and E2E of completed requests, one row per tier, one curve per policy (first seed)."""
    done = requests[(requests["decision"] == "admit") & (requests["outcome"] == "completed")]
    done = done[done["seed"] == done["seed"].min()]
    tiers = [str(t) for t in pd.unique(done["tier"])]
    fig = Figure(figsize=(11, 3.6 * max(len(tiers), 1)), layout="constrained")
    axes = fig.subplots(max(len(tiers), 1), 2, squeeze=False)
    for row, tier in zip(axes, tiers, strict=False):
        for i, (policy, rows) in enumerate(
            done[done["tier"] == tier].groupby("policy", sort=False, observed=True)
        ):
            for ax, measure in zip(row, ("ttft_s", "e2e_s"), strict=True):
                q = np.linspace(0, 1, min(len(rows), 1000))  # quantiles: the curve without 10^5 steps
                x = np.quantile(rows[measure].to_numpy(dtype=float), q)
                ax.plot(x, q, label=str(policy), color=_color(str(policy), i))
        for ax, (key, name) in zip(row, (("ttft_s", "TTFT"), ("e2e_s", "end-to-end latency")), strict=True):
            _sla_line(ax, (slo or {}).get(tier, {}).get(key), vertical=True)
            ax.set_xscale("log")
            ax.set_xlabel(f"{name} (s)")
            ax.set_ylabel("fraction of completed requests")
            ax.set_title(f"{tier}: {name} CDF")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    return fig


def timeline(timeseries: pd.DataFrame, seed: int | None = None) -> Figure:
    """Queued requests, in-flight GPU-seconds and rejections per second over one run, per policy."""
    seed = int(timeseries["seed"].min()) if seed is None else seed
    ts = timeseries[timeseries["seed"] == seed]
    fig = Figure(figsize=(11, 8), layout="constrained")
    axes = fig.subplots(3, 1, sharex=True)
    panels = (("queued", "queued requests"), ("in_flight_gpu_s", "in-flight work (GPU-s)"),
              ("rejects", "rejections (per s)"))  # fmt: skip
    for i, (policy, rows) in enumerate(ts.groupby("policy", sort=False)):
        for ax, (col, _) in zip(axes, panels, strict=True):
            ax.plot(rows["t_s"], rows[col], label=str(policy), color=_color(str(policy), i), linewidth=1)
    for ax, (_, label) in zip(axes, panels, strict=True):
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    axes[-1].set_xlabel("simulated time (s)")
    fig.suptitle(f"timeline of one run (seed {seed})")
    return fig


def _save(fig: Figure, name: str) -> dict[str, Writer]:
    """Writers of `fig` as `name`.png and .svg; `name` is one of `FIGURES`, which a later sweep removes as
    stale."""
    assert any(fnmatch.fnmatchcase(name, pattern) for pattern in FIGURES), name
    return {f"{name}.{ext}": functools.partial(fig.savefig, dpi=130) for ext in ("png", "svg")}


def plot_directory(
    directory: Path, slo: dict[str, dict[str, float]] | None = None, slo_source: Path | None = None
) -> list[Path]:
    """Every figure the directory's tables allow (a sweep's curves, a run's CDFs and timeline), PNG + SVG.

    SLA lines come from `slo` (tier -> {"ttft_s", "e2e_s"}) or, for a sweep, from its sweep.json. A
    folder whose manifest is missing or disagrees with its files (a write cut short) raises `InputError`,
    and so does an `slo` read from `slo_source` that names none of the run's tiers (no line would show).
    The figures are moved in once all are drawn and written (`add_files`): a write that fails (a folder
    that cannot be written, a full disk) is an `InputError` naming the folder, with no figure half-written.
    """
    tables = ("sweep.parquet", "requests.parquet", "timeseries.parquet")
    if any((directory / t).is_file() for t in tables):
        read_manifest(directory)
    if slo and slo_source is not None and (ran := _run_tiers(directory)) and not set(slo) & ran:
        why = (
            f"none of them ({', '.join(slo)}) is a tier of the run in {directory} ({', '.join(sorted(ran))})"
        )
        raise InputError([problem(slo_source, "workload.tiers", f"{why}: no SLA line would be drawn")])
    figures: dict[str, Writer] = {}
    if (directory / "sweep.parquet").is_file():
        slo = slo or _sweep_slo(directory / "sweep.json")
        with _drawn_from(directory / "sweep.parquet") as table:
            tiers = pd.unique(table.dropna(subset=["ttft_p99_s"])["tier"])  # not the per-pool groups
            for tier in [t for t in tiers if t != "all"] + ["all"]:
                latency = latency_vs_utilization(table, tier, slo.get(tier))
                figures |= _save(latency, f"p99_vs_utilization_{tier}")
                figures |= _save(rejection_vs_load(table, tier), f"rejection_vs_load_{tier}")
                figures |= _save(goodput_vs_load(table, tier), f"goodput_vs_load_{tier}")
    if (directory / "requests.parquet").is_file():
        with _drawn_from(directory / "requests.parquet") as table:
            figures |= _save(latency_cdfs(table, slo), "latency_cdf")
    if (directory / "timeseries.parquet").is_file():
        with _drawn_from(directory / "timeseries.parquet") as table:
            figures |= _save(timeline(table), "timeline")
    if figures:
        add_files(directory, figures)
    return [directory / name for name in figures]


@contextmanager
def _drawn_from(path: Path) -> Iterator[pd.DataFrame]:
    """The table at `path`, for the figures drawn from it in the block: a column they need that it lacks
    or that holds no numbers (a table of another kind, or written by an older simadmit), or a file that
    holds no table it can read, is an `InputError` naming the table (and the column, when known)."""
    table = read_table(path, f"a {path.stem} table")
    _check_numbers(path, table)
    try:
        yield table
    except KeyError as e:
        missing = e.args[0] if e.args else "?"
        column = missing[0] if isinstance(missing, list) and missing else missing
        why = (
            f"no column {column!r}, which plot draws from (a table of another kind, or of an older simadmit)"
        )
        raise InputError([problem(path, None, f"{why}: run the command that writes it again")]) from None
    except (ValueError, TypeError) as e:  # text where a latency or a count goes
        why = f"a column plot draws holds no numbers ({str(e).split('. ')[0]})"
        raise InputError([problem(path, None, f"{why}: run the command that writes it again")]) from None


def _check_numbers(path: Path, table: pd.DataFrame) -> None:
    """`InputError` naming the first column of `_NUMBERS` the table holds as anything but numbers: text or
    true/false that matplotlib would draw as categories, a figure of nonsense."""
    for col in _NUMBERS.get(path.name, ()):
        if col in table and (
            not pd.api.types.is_numeric_dtype(table[col]) or pd.api.types.is_bool_dtype(table[col])
        ):
            why = f"holds {table[col].dtype} values, not numbers, where plot draws them"
            raise InputError([problem(path, col, f"{why}: run the command that writes it again")])


def _sweep_slo(meta: Path) -> dict[str, dict[str, float]]:
    """The tiers' SLOs a sweep recorded beside its table (none without the file); one that cannot be read
    as tier -> {measure: seconds} (edited, or overwritten in place at the same size) is an `InputError`
    naming it."""
    if not meta.is_file():
        return {}
    try:
        recorded = json.loads(meta.read_text())["tier_slo"]
        return {
            str(tier): {str(k): float(v) for k, v in measures.items() if v is not None}
            for tier, measures in recorded.items()
        }
    except OSError as e:
        raise InputError([problem(meta, None, unreadable(e))]) from None
    except (ValueError, KeyError, TypeError, AttributeError):
        why = "not a sweep's record of its tiers' SLOs (tier -> {ttft_s, e2e_s})"
        raise InputError([problem(meta, "tier_slo", f"{why}: run the sweep again")]) from None


def _run_tiers(directory: Path) -> set[str]:
    """The tiers of the run in `directory` (a sweep's, else a run's requests'), without `all` and pools."""
    for name in ("sweep.parquet", "requests.parquet"):
        if (directory / name).is_file():
            tiers = read_table(directory / name, f"a {Path(name).stem} table", ["tier"])["tier"].astype(str)
            return {t for t in tiers.unique() if t != "all" and not t.startswith("pool:")}
    return set()
