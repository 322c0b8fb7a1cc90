"""CDFs of simulated against real latencies, one figure per tier: TTFT, inter-token latency and E2E.

The simulation is one thick line; each real run is a thin line, so the band they draw is the real system's
own noise and the simulated curve can be read against it. TTFT and E2E are shares of every arrival, as the
summary's percentiles are: a request never answered never arrives, so a side that failed some stops short
of 1. Inter-token latency exists only for completed requests. Built without pyplot, like `results.plots`.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

from simadmit.results.compare import LATENCIES, Run
from simadmit.results.run_folder import Writer

_TITLES = {"ttft": "TTFT", "itl": "inter-token latency", "e2e": "E2E"}


def _cdf(values: np.ndarray, total: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Sorted finite values and the share of `total` (default: of the values) at or below each."""
    v = np.sort(values[np.isfinite(values)])
    return v, np.arange(1, len(v) + 1) / max(len(v) if total is None else total, 1)


def cdf_figure(sim: list[Run], real: list[Run], tier: str, warmup_s: float) -> Figure:
    """Three panels (TTFT, inter-token latency, E2E) of empirical CDFs for one tier ("all": every request)."""
    fig = Figure(figsize=(13, 4), layout="constrained")
    axes = fig.subplots(1, len(LATENCIES))

    def curve(run: Run, m: str) -> tuple[np.ndarray, np.ndarray]:
        r = run.requests[run.requests["arrival_s"] >= warmup_s]
        r = r if tier == "all" else r[r["tier"] == tier]
        values = r[f"{m}_s"].where(r["outcome"] == "completed").to_numpy(dtype=float)
        return _cdf(values, None if m == "itl" else len(r))

    for ax, m in zip(axes, LATENCIES, strict=True):
        for i, run in enumerate(real):
            ax.step(*curve(run, m), where="post", color="#7f7f7f", linewidth=0.9, alpha=0.8,
                    label="real runs" if i == 0 else None)  # fmt: skip
        for i, run in enumerate(sim):
            ax.step(*curve(run, m), where="post", color="#1f77b4", linewidth=2.0,
                    label="simulated" if i == 0 else None)  # fmt: skip
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels of a log axis overlap
        ax.set_xlabel(f"{_TITLES[m]}, s")
        ax.set_ylabel("fraction of completed requests" if m == "itl" else "fraction of requests")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.suptitle(f"simulated vs real, tier {tier}")
    return fig


def cdf_files(sim: list[Run], real: list[Run], tiers: list[str], warmup_s: float) -> dict[str, Writer]:
    """A writer of `cdf_<tier>.png` per tier, by file name (for `run_folder.add_files`)."""
    return {f"cdf_{tier}.png": functools.partial(_save_cdf, sim, real, tier, warmup_s) for tier in tiers}


def write_cdfs(sim: list[Run], real: list[Run], tiers: list[str], warmup_s: float, out: Path) -> list[Path]:
    """`cdf_<tier>.png` per tier in `out`; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    files = cdf_files(sim, real, tiers, warmup_s)
    for name, write in files.items():
        write(out / name)
    return [out / name for name in files]


def _save_cdf(sim: list[Run], real: list[Run], tier: str, warmup_s: float, path: Path) -> None:
    cdf_figure(sim, real, tier, warmup_s).savefig(path, dpi=110)
