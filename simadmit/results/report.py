"""Report: the summary as terminal tables, one row per policy and tier, and the notes that qualify it.

Latency percentiles count every arrival (a request never answered is an infinite latency, shown `inf`);
the `served` columns are over completed requests only.
"""

from __future__ import annotations

import math

from rich import box
from rich.console import Console
from rich.table import Table

from simadmit.results.summary import notes

LATENCY = (
    ("ttft_p50_s", "TTFT p50", "{:.2f}"),
    ("ttft_p99_s", "p99", "{:.2f}"),
    ("served_ttft_p50_s", "served\np50", "{:.2f}"),
    ("served_ttft_p99_s", "served\np99", "{:.2f}"),
    ("e2e_p50_s", "E2E p50", "{:.2f}"),
    ("e2e_p99_s", "p99", "{:.2f}"),
    ("served_e2e_p99_s", "served\np99", "{:.2f}"),
)
LOAD = (
    ("requests", "reqs", "{:.0f}"),
    ("failure_rate", "failed", "{:.1%}"),
    ("rejection_rate", "reject", "{:.1%}"),
    ("queue_wait_mean_s", "wait\nmean s", "{:.2f}"),
    ("queue_wait_p99_s", "wait\np99 s", "{:.2f}"),
    ("utilization", "GPU\nbusy", "{:.0%}"),
    ("work_utilization", "GPU\nwork", "{:.0%}"),
    ("goodput_rps", "good-\nput/s", "{:.1f}"),
)
DEADLINES = (  # shown when some request's deadline went by with GPU time spent on it
    ("wasted_gpu_s", "GPU-s wasted\non missed deadlines", "{:.1f}"),
    ("wasted_share", "share of\nGPU offered", "{:.1%}"),
)


def _cell(measures: dict, key: str, fmt: str) -> str:
    value = measures.get(key, math.nan)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if math.isinf(value):
        return "inf"
    text = fmt.format(value)
    half = measures.get(f"{key}_ci95")
    if half is not None and math.isfinite(half):
        text += "\n±" + fmt.format(half).rstrip("%")  # below the value: columns stay narrow
    elif half is not None and math.isinf(half):
        text += "\n±inf"  # the interval is unbounded: too few observations beyond the percentile
    return text


def summary_table(
    summary: dict[str, dict[str, dict]], title: str, columns: tuple[tuple[str, str, str], ...]
) -> Table:
    # One label column (policy, then its tiers indented) and light rules: fits 80 columns uncut.
    table = Table(
        title=title,
        header_style="bold",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        pad_edge=False,
    )
    table.add_column("policy / tier", no_wrap=True)
    for _, label, _ in columns:
        table.add_column(label, justify="right", overflow="fold")
    for policy, tiers in summary.items():
        table.add_row(policy, style="bold")
        groups = [(g, m) for g, m in tiers.items() if not g.startswith("pool:")]  # pools: in summary.json
        for tier, measures in groups:
            style = "bold" if tier == "all" else None
            cells = (_cell(measures, k, f) for k, _, f in columns)
            table.add_row(f"  {tier}", *cells, style=style)
    return table


def print_summary(summary: dict[str, dict[str, dict]], title: str, console: Console | None = None) -> None:
    """Two tables: latencies (seconds, from first arrival) and load (failures, waits, GPU, goodput), a
    third when GPU time went to requests that missed their deadline (per tier and policy); then the notes on percentiles resting on few observations and on replications that gave no value."""
    console = console or Console()
    heading = "latency, seconds from first arrival; every arrival counts (never answered: inf), served: completed only"
    console.print(summary_table(summary, f"{title}\n{heading}", LATENCY))
    console.print(summary_table(summary, "load", LOAD))
    if any(m.get("wasted_gpu_s", 0.0) > 0 for tiers in summary.values() for m in tiers.values()):
        console.print(summary_table(summary, "deadlines", DEADLINES))
    for line in notes(summary):
        console.print(f"note: {line}", highlight=False, soft_wrap=True)
