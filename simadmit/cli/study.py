"""The `sweep`, `optimize` and `plot` commands of the `simadmit` CLI.

`register(app)` adds them to the main Typer app. As everywhere in the CLI, user mistakes print one line
per problem and exit with code 2, and nothing runs until the whole input has been checked.
"""

from __future__ import annotations

import math
import os
import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import pandas as pd
import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from simadmit.cli.common import fail
from simadmit.config.errors import InputError
from simadmit.config.loading import load_scenario
from simadmit.config.resources import default_scenario
from simadmit.results.plots import plot_directory
from simadmit.study.backends import Backend, process_map, run_sweep
from simadmit.study.dimensions import parse_dimension
from simadmit.study.grid import parse_param, plan_sweep
from simadmit.study.search import PolicyResult, SearchConfig, optimize
from simadmit.study.slo import parse_slo
from simadmit.study.targets import utilization_targets


class BackendName(StrEnum):
    process = "process"
    ray = "ray"


def _backend(name: BackendName, address: str | None) -> Backend:
    if name is BackendName.ray:
        from simadmit.study.ray_backend import ray_backend

        return ray_backend(address)
    return process_map


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("elapsed"),
        TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=Console(stderr=True),
    )  # fmt: skip


def _fmt(measure: str, value: float) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "-"
    if measure.endswith("_rate") or measure in ("utilization", "work_utilization", "slo_attainment"):
        return f"{100 * value:.1f}%"
    if measure.endswith("_s"):
        return f"{value:.3g} s"
    return f"{value:.4g}"


def sweep(
    scenario: Annotated[
        Path | None, typer.Argument(help="scenario YAML (default: the bundled default)")
    ] = None,
    param: Annotated[list[str], typer.Option(help="path=lo:hi:n or path=a,b,c (repeat for a grid)")] = [],  # noqa: B006
    replications: Annotated[int, typer.Option(min=1, help="seeds per point, for confidence intervals")] = 1,
    seed: Annotated[
        int | None, typer.Option(help="first seed of every point (default: the scenario's)")
    ] = None,
    jobs: Annotated[int, typer.Option(min=1, help="parallel worker processes")] = os.cpu_count() or 1,
    out: Annotated[Path, typer.Option(help="directory for sweep.parquet, sweep.csv and saved points")] = Path(
        "runs/sweep"
    ),
    backend: Annotated[BackendName, typer.Option(help="process (this machine) or ray")] = BackendName.process,
    address: Annotated[
        str | None, typer.Option(help="Ray cluster address (default: start a local Ray)")
    ] = None,
) -> None:
    """Run every combination of parameter values through every policy; resume where a previous run stopped."""
    try:
        path = scenario or default_scenario()
        plan = plan_sweep(path, [parse_param(p) for p in param], replications, seed)
    except InputError as e:
        fail(e.problems)
        return
    started = time.monotonic()
    units = len(plan.units())
    with _progress() as bar:
        task = bar.add_task(f"{len(plan.points)} points x {replications} seeds", total=units)
        try:
            table = run_sweep(
                plan, out, jobs, _backend(backend, address), lambda d, n: bar.update(task, completed=d)
            )
        except KeyboardInterrupt:
            bar.stop()
            done = int(bar.tasks[0].completed)
            Console(stderr=True).print(
                f"interrupted: {done} of {units} runs are saved in {out}/; run the same command to resume"
            )
            raise typer.Exit(130) from None
        except InputError as e:
            fail(e.problems)
            return
    console = Console()
    console.print(
        f"{len(plan.points)} points x {replications} seeds in {time.monotonic() - started:.1f} s: "
        f"{len(table)} rows in {out}/sweep.parquet and {out}/sweep.csv"
    )
    for tier, slo in plan.tier_slo.items():
        if not (math.isfinite(slo["ttft_s"]) or math.isfinite(slo["e2e_s"])):
            continue
        targets = utilization_targets(table, plan.tier_slo, tier)
        targets.to_csv(out / f"utilization_targets_{tier}.csv", index=False)
        console.print(_targets_table(targets, tier, slo))


def _targets_table(targets: pd.DataFrame, tier: str, slo: dict[str, float]) -> Table:
    title = f"best utilization target, {tier}: highest GPU utilization with p99 TTFT <= {slo['ttft_s']:g} s"
    title += f" and p99 E2E <= {slo['e2e_s']:g} s"
    table = Table(title=title, title_justify="left", header_style="bold")
    columns = [
        c for c in targets.columns if c not in ("utilization_target", "ci95", "arrival_rate_rps", "sla_left")
    ]
    for c in [*(c.split(".")[-1] for c in columns), "GPU utilization", "±95%", "at load (req/s)", "note"]:
        table.add_column(
            c, justify="right" if c in ("GPU utilization", "±95%", "at load (req/s)") else "left"
        )
    for _, r in targets.iterrows():
        note = "p99 within SLA at every load swept" if not r["sla_left"] else ""
        if math.isnan(r["utilization_target"]):
            note = "p99 over the SLA even at the lowest load"
        table.add_row(*("-" if pd.isna(r[c]) else str(r[c]) for c in columns), _fmt("work_utilization", r["utilization_target"]),
                      _fmt("work_utilization", r["ci95"]), f"{r['arrival_rate_rps']:.1f}", note)  # fmt: skip
    return table


def optimize_cmd(
    scenario: Annotated[
        Path | None, typer.Argument(help="scenario YAML (default: the bundled default)")
    ] = None,
    slo: Annotated[list[str], typer.Option(help="tier.measure<=value, e.g. interactive.ttft_p99<=3s")] = [],  # noqa: B006
    objective: Annotated[
        str, typer.Option(help="goodput, goodput_per_gpu, throughput, throughput_per_gpu, rejection")
    ] = "goodput",
    search: Annotated[
        list[str], typer.Option(help="path=lo:hi to search (default: each policy's own knobs)")
    ] = [],  # noqa: B006
    loads: Annotated[str, typer.Option(help="traffic multipliers every SLO must hold at")] = "1,1.5,2",
    replications: Annotated[int, typer.Option(min=1, help="seeds per setting and load")] = 1,
    seed: Annotated[int | None, typer.Option(help="first seed (default: the scenario's)")] = None,
    rounds: Annotated[int, typer.Option(min=1, help="refinement rounds")] = 3,
    candidates: Annotated[int, typer.Option(min=2, help="values tried per dimension and round")] = 5,
    jobs: Annotated[int, typer.Option(min=1, help="parallel worker processes")] = os.cpu_count() or 1,
    backend: Annotated[BackendName, typer.Option(help="process (this machine) or ray")] = BackendName.process,
    address: Annotated[
        str | None, typer.Option(help="Ray cluster address (default: start a local Ray)")
    ] = None,
) -> None:
    """Find each policy's settings with the best objective that meet every SLO at 1x, 1.5x and 2x traffic."""
    problems: list[str] = []
    slos, dims = [], []
    for text in slo:
        try:
            slos.append(parse_slo(text))
        except InputError as e:
            problems += e.problems
    for text in search:
        try:
            dims.append(parse_dimension(text))
        except InputError as e:
            problems += e.problems
    try:
        load_values = tuple(float(x) for x in loads.split(","))
    except ValueError:
        problems.append(f"--loads: {loads}: expected comma-separated multipliers, e.g. 1,1.5,2")
        load_values = ()
    if not slo:
        problems.append("--slo: give at least one SLO, e.g. --slo 'interactive.ttft_p99<=3s'")
    if problems:
        fail(problems)
        return
    config = SearchConfig(load_values, replications, seed, rounds, candidates, jobs)
    path = scenario or default_scenario()
    started = time.monotonic()
    try:
        results = optimize(path, slos, objective, config, dims or None, _backend(backend, address))
    except InputError as e:
        fail(e.problems)
        return
    name = load_scenario(path, None)[0].name
    _print_results(results, objective, loads, name, time.monotonic() - started)


def _print_results(
    results: list[PolicyResult], objective: str, loads: str, name: str, elapsed: float
) -> None:
    console = Console()
    console.print(f"[bold]{name}[/bold]: best {objective} meeting every SLO at {loads} x traffic")
    for r in results:
        b = r.best
        verdict = (
            "[green]meets every SLO[/green]" if b.feasible else "[red]no setting tried meets every SLO[/red]"
        )
        console.print(f"\n[bold]{r.policy}[/bold]: {verdict} ({r.simulations} simulations)")
        for path, value in b.setting:
            console.print(f"  {path} = {value:g}" if isinstance(value, float) else f"  {path} = {value}")
        first = next(iter(b.summaries))  # the load the objective is measured at
        console.print(f"  {objective} = {b.objective:.4g} at {first:g}x traffic on {b.gpus} GPUs")
        for text, margin in b.margins.items():
            measure = parse_slo(text).measure
            console.print(f"  {text}: margin {_fmt(measure, margin)} at the worst load")
        throughput = b.summaries[first]["all"]["throughput_rps"]
        ref = r.unconditional_throughput_rps
        cost = 1 - throughput / ref if ref > 0 else math.nan
        effect = (
            f"costs {_fmt('rejection_rate', cost)}"
            if not cost < 0
            else f"gains {_fmt('rejection_rate', -cost)}"
        )
        console.print(
            f"  throughput {throughput:.2f} req/s vs unconditional {ref:.2f} req/s with the same pool: {effect}"
        )
    feasible = [r for r in results if r.best.feasible]
    total = sum(r.simulations for r in results)
    if feasible:
        sign = 1 if objective != "rejection" else -1
        win = max(feasible, key=lambda r: r.best.rank(sign))
        console.print(f"\n[bold]best: {win.policy}[/bold] ({total} simulations in {elapsed:.1f} s)")
    else:
        console.print(f"\n[red]no policy meets every SLO[/red] ({total} simulations in {elapsed:.1f} s)")
        console.print(
            "more GPUs (--objective goodput_per_gpu also searches replicas) or looser SLOs are needed"
        )


def plot(
    directory: Annotated[
        Path, typer.Argument(help="a sweep directory, or a `simadmit simulate --out` directory")
    ],
    scenario: Annotated[
        Path | None,
        typer.Option(help="scenario whose tier SLOs are drawn as SLA lines (default: DIR/scenario.yaml)"),
    ] = None,
) -> None:
    """Draw the figures the directory's tables allow, as PNG and SVG next to them."""
    import matplotlib

    matplotlib.use("Agg")
    if not directory.is_dir():
        fail([f"{directory}: not a directory"])
        return
    slo = None
    if scenario is None and (directory / "scenario.yaml").is_file():
        scenario = directory / "scenario.yaml"  # written by `simadmit simulate --out`
    if scenario is not None:
        try:
            spec, _ = load_scenario(scenario, None)
        except InputError as e:
            fail(e.problems)
            return
        slo = {t.name: {"ttft_s": t.slo.ttft_s, "e2e_s": t.slo.e2e_s} for t in spec.workload.tiers}
    written = plot_directory(directory, slo)
    if not written:
        fail([f"{directory}: no sweep.parquet, requests.parquet or timeseries.parquet to plot"])
        return
    Console().print(f"{len(written)} files in {directory}/: " + ", ".join(sorted({p.stem for p in written})))


def register(app: typer.Typer) -> None:
    """Add `sweep`, `optimize` and `plot` to the `simadmit` command."""
    app.command()(sweep)
    app.command("optimize")(optimize_cmd)
    app.command()(plot)
