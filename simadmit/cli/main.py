"""The `simadmit` command line: the Typer app, the `simulate` command, and the other commands attached.

`sweep`, `optimize` and `plot` come from `simadmit.cli.study`, `replay` and `compare` from
`simadmit.cli.replay`, and `calibrate` from
`simadmit.calibrate.cli`. User mistakes (a bad scenario, a missing profile, an unreachable endpoint) print
one line per problem and exit with code 2 (`simadmit.cli.common.fail`); they never show a traceback.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from simadmit.calibrate.cli import calibrate_app
from simadmit.cli import gateway, replay, study
from simadmit.cli.common import LazyProgress, check_seed, fail, preflight, write_outputs
from simadmit.config.errors import InputError
from simadmit.config.loading import load_scenario
from simadmit.config.overrides import parse_assignments
from simadmit.config.resources import resolve_scenario
from simadmit.results.report import print_summary
from simadmit.study.runner import run_study

app = typer.Typer(
    help="Capacity planning for admission control in front of a vLLM pool.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.callback()
def _root() -> None:
    """simadmit: simulate admission policies in front of a vLLM pool, calibrate real endpoints."""


@app.command()
def simulate(
    scenario: Annotated[
        Path | None, typer.Argument(help="scenario YAML, or a bundled scenario's name (default: the default)")
    ] = None,
    out: Annotated[
        Path, typer.Option(help="directory for requests.parquet, timeseries.parquet, summary.json")
    ] = Path("runs/latest"),
    seed: Annotated[
        int | None, typer.Option(help="seed of the first replication (default: the scenario's)")
    ] = None,
    replications: Annotated[
        int, typer.Option(min=1, help="runs with seeds seed..seed+n-1, for confidence intervals")
    ] = 1,
    set_: Annotated[list[str], typer.Option("--set", help="override a scenario field: path=value")] = [],  # noqa: B006
) -> None:
    """Replay a scenario's traffic through each admission policy and report latency, rejections and goodput."""
    try:
        check_seed(seed, replications)
        path = resolve_scenario(scenario)
        spec, base = load_scenario(path, parse_assignments(set_))
        notes = preflight(spec, base, path, seed)  # profiles, traces and sizes: checked before anything runs
    except InputError as e:
        fail(e.problems)
        return
    for note in notes:
        Console(stderr=True, highlight=False, soft_wrap=True).print(f"note: {note}", markup=False)
    progress = LazyProgress()
    started = time.monotonic()
    try:
        result = run_study(spec, base, seed, replications, progress)
    finally:
        progress.close()
    elapsed = time.monotonic() - started
    write_outputs(result, out, spec, base)
    console = Console()
    if not console.is_terminal:  # files and pipes get the whole table, not an 80-column squeeze
        console = Console(width=140)
    print_summary(result.summary, f"{spec.name}: {spec.description}".rstrip(": "), console)
    console.print(
        f"{result.simulated_requests:,} simulated requests in {elapsed:.1f} s; tables in {out}/ "
        "(requests.parquet, timeseries.parquet, summary.json, scenario.yaml)"
    )


study.register(app)
gateway.register(app)
replay.register(app)
app.add_typer(calibrate_app, name="calibrate")
