"""The `sweep`, `optimize` and `plot` commands of the `simadmit` CLI.

`register(app)` adds them to the main Typer app. As everywhere in the CLI, user mistakes print one line
per problem and exit with code 2, and nothing runs until the whole input has been checked.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Annotated, TypeVar

import pandas as pd
import typer
from rich.console import Console
from rich.table import Table

from simadmit.cli.common import MAX_REPLICATIONS, check_seed, fail, preflight_each, print_notes
from simadmit.cli.progress import UnitProgress
from simadmit.config.errors import InputError, problem
from simadmit.config.loading import (
    load_scenario,
    load_scenario_fields,
    load_scenario_with_origin,
    scenario_with_origin,
)
from simadmit.config.overrides import parse_assignments
from simadmit.config.resources import resolve_scenario
from simadmit.results.plots import plot_directory
from simadmit.results.run_folder import check_destination, held_run, interrupted_note
from simadmit.study.backends import Backend, process_map, run_sweep
from simadmit.study.dimensions import Dimension, parse_dimension
from simadmit.study.grid import parse_param, plan_sweep
from simadmit.study.search import PolicyResult, SearchConfig, optimize
from simadmit.study.slo import SLO, parse_slo
from simadmit.study.table import sla_tiers

T = TypeVar("T")


JOBS_PER_CPU = 4  # worker processes per CPU: more only wait on each other
MIN_MAX_JOBS = 32  # allowed whatever the CPUs


def available_cpus() -> int:
    """The CPUs this process may run on (a container's or a `taskset`'s share, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class BackendName(StrEnum):
    process = "process"
    ray = "ray"


def check_jobs(jobs: int, backend: BackendName) -> None:
    """Worker processes this machine can run: each forks the simulator, so a typo (--jobs 100000) would
    start that many processes. A Ray cluster spreads its tasks over its own machines: not checked."""
    most = max(MIN_MAX_JOBS, JOBS_PER_CPU * available_cpus())
    if backend is BackendName.process and jobs > most:
        raise InputError(
            [
                problem(
                    None,
                    "--jobs",
                    f"{jobs} worker processes on this machine's {available_cpus()} CPUs: at most {most} "
                    f"({JOBS_PER_CPU} per CPU, or {MIN_MAX_JOBS})",
                )
            ]
        )


def check_backend(backend: BackendName, address: str | None) -> None:
    """`--address` names a Ray cluster: refused without `--backend ray` (the run would stay on this
    machine), and checked to answer before anything runs."""
    if address is None:
        return
    if backend is not BackendName.ray:
        raise InputError(
            [problem(None, "--address", f"{address}: a Ray cluster's address: add --backend ray")]
        )
    from simadmit.study.ray_backend import check_address

    check_address(address)


def _backend(name: BackendName, address: str | None) -> Backend:
    if name is BackendName.ray:
        from simadmit.study.ray_backend import ray_backend

        return ray_backend(address)
    return process_map


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
        Path | None, typer.Argument(help="scenario YAML or a bundled scenario's name (default: the default)")
    ] = None,
    param: Annotated[list[str], typer.Option(help="path=lo:hi:n or path=a,b,c (repeat for a grid)")] = [],  # noqa: B006
    replications: Annotated[
        int, typer.Option(min=1, max=MAX_REPLICATIONS, help="seeds per point, for confidence intervals")
    ] = 1,
    seed: Annotated[
        int | None, typer.Option(help="first seed of every point (default: the scenario's)")
    ] = None,
    jobs: Annotated[int, typer.Option(min=1, help="parallel worker processes")] = available_cpus(),
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
        check_seed(seed, replications)
        check_jobs(jobs, backend)
        check_backend(backend, address)
        path = resolve_scenario(scenario)
        plan = plan_sweep(path, [parse_param(p) for p in param], replications, seed)
        check_destination(out, replace=False, command="sweep")
        notes = preflight_each(
            [
                (
                    f"point {dict(point)}" if point else "",
                    *scenario_with_origin(plan.document, path, dict(point)),
                    seeds[0],
                )
                for point, seeds in zip(plan.points, plan.seeds, strict=True)
            ],
            path,
            "sweep",
        )  # every point's traces and size, before any point runs
    except InputError as e:
        fail(e.problems)
        return
    print_notes(notes)
    started = time.monotonic()
    units = len(plan.units())
    saved: list[int] = []

    def on_progress(done: int, total: int) -> None:
        saved.append(done)
        bar.update(done)

    with UnitProgress(f"{len(plan.points)} points x {replications} seeds", units) as bar:
        table = _run_resumable(
            bar,
            lambda: run_sweep(plan, out, jobs, _backend(backend, address), on_progress),
            lambda: f"{saved[-1] if saved else 0} of {units} runs are saved in {out}/",
        )
    console = _console()
    reused = f" ({saved[0]} reused from {out}/points)" if saved and saved[0] else ""
    console.print(
        f"{len(plan.points)} points x {replications} seeds in {time.monotonic() - started:.1f} s{reused}: "
        f"{len(table)} rows in {out}/sweep.parquet and {out}/sweep.csv"
    )
    for tier in sla_tiers(plan.tier_slo):
        targets = pd.read_csv(out / f"utilization_targets_{tier}.csv")
        shown, notes = _targets_table(targets, tier, plan.tier_slo[tier])
        console.print(shown)
        for line in notes:
            console.print(line)


def _run_resumable(bar: UnitProgress, study: Callable[[], T], saved: Callable[[], str]) -> T:
    """Run a study that saves each simulation as it finishes (`sweep`, `optimize`).

    Ctrl-C stops it at once, says what is saved (`saved()`) and exits 130, and the same command resumes; a
    bad input that only shows once running (a trace row of one grid point) is one line and exit 2.
    """
    try:
        return study()
    except KeyboardInterrupt:
        bar.stop()
        Console(stderr=True, soft_wrap=True).print(f"interrupted: {saved()}; run the same command to resume")
        raise typer.Exit(130) from None
    except InputError as e:
        bar.stop()
        fail(e.problems)


def _console() -> Console:
    """stdout at the terminal's width, or 80 columns in a file or a pipe; tables fit that width, and lines
    of text are never broken (a long path stays on one line, for grep and copy-paste)."""
    console = Console(soft_wrap=True)
    return console if console.is_terminal else Console(width=80, soft_wrap=True)


def _targets_table(targets: pd.DataFrame, tier: str, slo: dict[str, float]) -> tuple[Table, list[str]]:
    """The targets in a table that fits 80 columns, and the lines that explain its marks."""
    title = f"best utilization target, {tier}: highest GPU utilization with\np99 TTFT <= {slo['ttft_s']:g} s"
    title += f" and p99 E2E <= {slo['e2e_s']:g} s"
    table = Table(title=title, title_justify="left", header_style="bold")
    hidden = ("utilization_target", "ci_low", "ci_high", "ci95", "arrival_rate_rps", "sla_left")
    columns = [c for c in targets.columns if c not in hidden]
    for c in columns:
        table.add_column(c.split(".")[-1], overflow="fold")
    for c in ("GPU util.", "95% interval", "at req/s"):
        table.add_column(c, justify="right", no_wrap=True)
    notes = set()
    for _, r in targets.iterrows():
        target = _fmt("work_utilization", r["utilization_target"])
        if math.isnan(r["utilization_target"]):
            target, note = "-", "-: p99 over the SLA even at the lowest load"
            notes.add(note)
        elif not r["sla_left"]:
            target, note = f"{target}*", "*: p99 within the SLA at every load swept (the highest seen)"
            notes.add(note)
        interval = "-"
        if not math.isnan(r["ci_low"]):
            interval = f"{100 * r['ci_low']:.1f}-{_fmt('work_utilization', r['ci_high'])}"
        rate = "-" if math.isnan(r["arrival_rate_rps"]) else f"{r['arrival_rate_rps']:.1f}"
        table.add_row(*("-" if pd.isna(r[c]) else str(r[c]) for c in columns), target, interval, rate)
    notes.add("95% interval: where the p99 crosses the SLA, replications resampled (- with one)")
    return table, sorted(notes)


def optimize_cmd(
    scenario: Annotated[
        Path | None, typer.Argument(help="scenario YAML or a bundled scenario's name (default: the default)")
    ] = None,
    slo: Annotated[list[str], typer.Option(help="tier.measure<=value, e.g. interactive.ttft_p99<=3s")] = [],  # noqa: B006
    objective: Annotated[
        str, typer.Option(help="goodput, goodput_per_gpu, throughput, throughput_per_gpu, rejection")
    ] = "goodput",
    search: Annotated[
        list[str],
        typer.Option(
            help="path=lo:hi to search, or path=false:true for a true/false field (default: each policy's own "
            "knobs)"
        ),
    ] = [],  # noqa: B006
    set_: Annotated[list[str], typer.Option("--set", help="override a scenario field: path=value")] = [],  # noqa: B006
    loads: Annotated[str, typer.Option(help="traffic multipliers every SLO must hold at")] = "1,1.5,2",
    replications: Annotated[
        int, typer.Option(min=1, max=MAX_REPLICATIONS, help="seeds per setting and load")
    ] = 1,
    seed: Annotated[int | None, typer.Option(help="first seed (default: the scenario's)")] = None,
    rounds: Annotated[int, typer.Option(min=1, help="refinement rounds")] = 3,
    candidates: Annotated[int, typer.Option(min=2, help="values tried per dimension and round")] = 5,
    fresh_seeds: Annotated[
        int, typer.Option(min=0, help="seeds the winner is re-run on after the search (0: none)")
    ] = 2,
    jobs: Annotated[int, typer.Option(min=1, help="parallel worker processes")] = available_cpus(),
    out: Annotated[
        Path, typer.Option(help="directory for optimize.csv/.parquet and saved simulations (resumable)")
    ] = Path("runs/optimize"),
    backend: Annotated[BackendName, typer.Option(help="process (this machine) or ray")] = BackendName.process,
    address: Annotated[
        str | None, typer.Option(help="Ray cluster address (default: start a local Ray)")
    ] = None,
) -> None:
    """Find each policy's settings with the best objective that meet every SLO at 1x, 1.5x and 2x traffic."""
    problems: list[str] = []
    slos: list[SLO] = []
    dims: list[Dimension] = []
    for text in slo:
        try:
            new = parse_slo(text)
        except InputError as e:
            problems += e.problems
            continue
        same = [o for o in slos if (o.tier, o.measure, o.upper) == (new.tier, new.measure, new.upper)]
        if same:  # two limits on one side of one measure: one of them is dead, or a typo
            problems.append(
                f"--slo {text}: {new.tier}.{new.measure} is already limited by --slo {same[0].text}"
            )
        slos.append(new)
    for text in search:
        try:
            dim = parse_dimension(text)
        except InputError as e:
            problems += e.problems
            continue
        if dim.path in (d.path for d in dims):  # one knob searched over two ranges: one of them unused
            problems.append(f"--search {text}: {dim.path} is already searched: give each path once")
        dims.append(dim)
    try:
        load_values = tuple(float(x) for x in loads.split(","))
    except ValueError:
        load_values = ()
    if not load_values or not all(0 < x < math.inf for x in load_values):
        problems.append(f"--loads: {loads}: expected comma-separated multipliers above 0, e.g. 1,1.5,2")
    elif len(set(load_values)) < len(load_values):  # the same simulations run twice, to no end
        twice = sorted({x for x in load_values if load_values.count(x) > 1})
        problems.append(f"--loads: {loads}: {', '.join(f'{x:g}' for x in twice)} given twice")
    if not slo:
        problems.append("--slo: give at least one SLO, e.g. --slo 'interactive.ttft_p99<=3s'")
    try:
        check_seed(seed, replications + fresh_seeds)
        check_jobs(jobs, backend)
        check_backend(backend, address)
        overrides = parse_assignments(set_)
        check_destination(out, replace=False, command="optimize")
    except InputError as e:
        problems += e.problems
    if problems:
        fail(problems)
        return
    config = SearchConfig(load_values, replications, seed, rounds, candidates, jobs, fresh_seeds)
    path = resolve_scenario(scenario)
    try:  # the scenario's traces and size at every load, before any simulation
        base_rate = load_scenario(path, overrides)[0].workload.rate_multiplier
        at_loads = [{**overrides, "workload.rate_multiplier": base_rate * x} for x in load_values]
        runs = []
        for x, o in zip(load_values, at_loads, strict=True):
            spec, _, origin = load_scenario_with_origin(
                path, o, given_by={"workload.rate_multiplier": "--loads"}
            )
            runs.append((f"--loads {x:g}", spec, origin, seed))
        notes = preflight_each(runs, path, "optimize")
    except InputError as e:
        fail(e.problems)
        return
    print_notes(notes)
    started = time.monotonic()
    with UnitProgress("simulations", 1) as bar:
        results = _run_resumable(
            bar,
            lambda: optimize(path, slos, objective, config, dims or None, _backend(backend, address),
                             overrides, out, lambda d, n, p: bar.update(d, n, f"{p}: simulations")),
            lambda: f"{bar.done} simulations are saved in {out}/points",
        )  # fmt: skip
    name = load_scenario(path, overrides)[0].name
    _print_results(results, objective, load_values, name, time.monotonic() - started, out)


def _print_results(
    results: list[PolicyResult],
    objective: str,
    loads: tuple[float, ...],
    name: str,
    elapsed: float,
    out: Path,
) -> None:
    console = _console()
    at = ", ".join(f"{x:g}" for x in loads)
    console.print(f"[bold]{name}[/bold]: best {objective} meeting every SLO at {at} x traffic")
    for r in results:
        b, c = r.best, r.confirmed
        fresh = f"{len(r.fresh_seeds)} fresh seeds" if r.fresh_seeds else "its seeds (nothing to search)"
        if c.feasible:
            verdict = f"[green]meets every SLO[/green] on {fresh}"
        elif b.feasible:
            verdict = f"[yellow]met every SLO in the search, not on {fresh}[/yellow]"
        else:
            verdict = "[red]no setting tried meets every SLO[/red]"
        console.print(f"\n[bold]{r.policy}[/bold]: {verdict} ({r.simulations} simulations)")
        for path, value in b.setting:
            console.print(f"  {path} = {_yaml_value(value)}")
        console.print(_winner_table(r, objective, loads[0]))
        console.print(
            f"  throughput cost: vs unconditional, same pool and seeds ({r.unconditional_throughput_rps:.2f} req/s)"
        )
    feasible = [r for r in results if r.confirmed.feasible]
    total = sum(r.simulations for r in results)
    if feasible:
        sign = 1 if objective != "rejection" else -1
        win = max(feasible, key=lambda r: r.confirmed.rank(sign))
        console.print(f"\n[bold]best: {win.policy}[/bold] ({total} simulations in {elapsed:.1f} s)")
    else:
        console.print(f"\n[red]no policy meets every SLO[/red] ({total} simulations in {elapsed:.1f} s)")
        console.print("more GPUs (--objective goodput_per_gpu also searches replicas), less traffic")
        console.print("(--set workload.rate_multiplier=...) or looser SLOs are needed")
    console.print(f"searched points: {out}/optimize.csv")


def _yaml_value(value: float | int | bool) -> str:
    """A searched setting as it would be written in the scenario, so it can be pasted there."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _winner_table(r: PolicyResult, objective: str, first: float) -> Table:
    """The winner as the search ranked it and on fresh seeds, side by side (the winner's curse)."""
    table = Table(box=None, padding=(0, 1), header_style="bold")
    table.add_column("  measure (SLOs: margin at the worst load)", no_wrap=True)
    table.add_column("search", justify="right")
    if r.fresh_seeds:
        table.add_column("fresh seeds", justify="right")
    evaluations = [r.best, r.confirmed] if r.fresh_seeds else [r.best]
    table.add_row(f"  {objective} at {first:g}x", *(f"{e.objective:.4g}" for e in evaluations))
    for text in r.best.margins:
        measure = parse_slo(text).measure
        table.add_row(f"  {text}", *(_fmt(measure, e.margins[text]) for e in evaluations))
    refs = [r.unconditional_throughput_rps, r.unconditional_fresh_rps]
    cost = [
        1 - e.summaries[first]["all"]["throughput_rps"] / ref if ref > 0 else math.nan
        for e, ref in zip(evaluations, refs, strict=False)
    ]
    table.add_row("  throughput cost", *(_fmt("rejection_rate", x) for x in cost))
    return table


def plot(
    directory: Annotated[
        Path, typer.Argument(help="a sweep directory, or a `simadmit simulate --out` directory")
    ],
    scenario: Annotated[
        Path | None,
        typer.Option(
            help="scenario (a file or a bundled name) whose tier SLOs are drawn as SLA lines "
            "(default: DIR/scenario.yaml)"
        ),
    ] = None,
) -> None:
    """Draw the figures the directory's tables allow, as PNG and SVG next to them."""
    import matplotlib

    matplotlib.use("Agg")
    if not directory.is_dir():
        what = "is a file, not a folder" if directory.exists() else "folder not found"
        fail([f"{directory}: {what} (give a simulate or sweep --out folder)"])
        return
    given = resolve_scenario(scenario) if scenario is not None else None  # a file, or a bundled name
    slo, scenario = None, given
    if scenario is None and (directory / "scenario.yaml").is_file():
        scenario = directory / "scenario.yaml"  # written by `simadmit simulate --out`
    if scenario is not None:
        try:
            spec = load_scenario_fields(scenario)  # the SLOs; its profiles need not be where the run was
        except InputError as e:
            fail(e.problems)
            return
        slo = {t.name: {"ttft_s": t.slo.ttft_s, "e2e_s": t.slo.e2e_s} for t in spec.workload.tiers}
    try:
        written = plot_directory(directory, slo, given)
    except InputError as e:
        fail(e.problems)
        return
    held = held_run(directory)
    if not written and held in ("optimize", "compare"):  # their own tables are what they show
        fail([f"{directory}: holds {'an' if held == 'optimize' else 'a'} {held} run: plot draws simulate and sweep "
              f"folders ({held}.csv holds its results)"])  # fmt: skip
    if not written:
        fail([f"{directory}: no sweep.parquet, requests.parquet or timeseries.parquet to plot"])
        return
    Console(soft_wrap=True).print(
        f"{len(written)} files in {directory}/: " + ", ".join(sorted({p.stem for p in written}))
    )
    if note := interrupted_note(directory):
        Console(stderr=True, soft_wrap=True).print(note)


def register(app: typer.Typer) -> None:
    """Add `sweep`, `optimize` and `plot` to the `simadmit` command."""
    app.command()(sweep)
    app.command("optimize")(optimize_cmd)
    app.command()(plot)
