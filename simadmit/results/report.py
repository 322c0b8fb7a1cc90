"""Report: the summary as terminal tables, one row per policy and tier."""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table

LATENCY = (
    ("ttft_p50_s", "TTFT p50", "{:.2f}"),
    ("ttft_p90_s", "p90", "{:.2f}"),
    ("ttft_p99_s", "p99", "{:.2f}"),
    ("e2e_p50_s", "E2E p50", "{:.2f}"),
    ("e2e_p90_s", "p90", "{:.2f}"),
    ("e2e_p99_s", "p99", "{:.2f}"),
)
LOAD = (
    ("requests", "requests", "{:.0f}"),
    ("rejection_rate", "rejected", "{:.1%}"),
    ("queue_wait_mean_s", "wait mean s", "{:.2f}"),
    ("queue_wait_p99_s", "wait p99 s", "{:.2f}"),
    ("utilization", "GPU busy", "{:.0%}"),
    ("work_utilization", "GPU work", "{:.0%}"),
    ("goodput_rps", "goodput/s", "{:.1f}"),
)


def _cell(measures: dict, key: str, fmt: str) -> str:
    value = measures.get(key, math.nan)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    text = fmt.format(value)
    half = measures.get(f"{key}_ci95")
    if half is not None and not math.isnan(half):
        text += "±" + fmt.format(half).rstrip("%")
    return text


def summary_table(
    summary: dict[str, dict[str, dict]], title: str, columns: tuple[tuple[str, str, str], ...]
) -> Table:
    table = Table(title=title, header_style="bold", title_justify="left")
    table.add_column("policy", no_wrap=True)
    table.add_column("tier", no_wrap=True)
    for _, label, _ in columns:
        table.add_column(label, justify="right")
    for policy, tiers in summary.items():
        groups = [(g, m) for g, m in tiers.items() if not g.startswith("pool:")]  # pools: in summary.json
        for i, (tier, measures) in enumerate(groups):
            style = "bold" if tier == "all" else None
            cells = (_cell(measures, k, f) for k, _, f in columns)
            table.add_row(policy if i == 0 else "", tier, *cells, style=style)
        table.add_section()
    return table


def print_summary(summary: dict[str, dict[str, dict]], title: str, console: Console | None = None) -> None:
    """Two tables: latencies (seconds, from first arrival) and load (rejections, waits, GPU, goodput)."""
    console = console or Console()
    console.print(summary_table(summary, f"{title}\nlatency, seconds from first arrival", LATENCY))
    console.print(summary_table(summary, "load", LOAD))
