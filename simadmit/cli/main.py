"""The `simadmit` command line: the Typer app, the `simulate` command, and the other commands attached.

`sweep`, `optimize` and `plot` come from `simadmit.cli.study`, `replay` and `compare` from
`simadmit.cli.replay`, and `calibrate` from
`simadmit.calibrate.cli`. User mistakes (a bad scenario, a missing profile, an unreachable endpoint) print
one line per problem and exit with code 2 (`simadmit.cli.common.fail`); they never show a traceback.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
import yaml
from rich.console import Console

from simadmit.calibrate.cli import calibrate_app
from simadmit.cli import gateway, replay, study
from simadmit.cli.common import MAX_REPLICATIONS, App, LazyProgress, check_seed, fail, preflight, print_notes
from simadmit.config.errors import InputError
from simadmit.config.loading import load_scenario_with_origin, trace_refs
from simadmit.config.overrides import apply_overrides, parse_assignments
from simadmit.config.resources import resolve_profile, resolve_scenario
from simadmit.config.schema import ScenarioSpec
from simadmit.results.report import print_summary
from simadmit.results.run_folder import Writer, check_destination, write_folder
from simadmit.study.runner import Interrupted, Progress, ScenarioResult, run_study

app = App(
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
        int,
        typer.Option(
            min=1, max=MAX_REPLICATIONS, help="runs with seeds seed..seed+n-1, for confidence intervals"
        ),
    ] = 1,
    set_: Annotated[list[str], typer.Option("--set", help="override a scenario field: path=value")] = [],  # noqa: B006
) -> None:
    """Replay a scenario's traffic through each admission policy and report latency, rejections and goodput."""
    try:
        check_seed(seed, replications)
        path = resolve_scenario(scenario)
        spec, base, origin = load_scenario_with_origin(path, parse_assignments(set_))
        notes = preflight(spec, base, origin, seed)  # profiles, traces, sizes: checked before anything runs
        check_destination(out, replace=True, command="simulate")
    except InputError as e:
        fail(e.problems)
        return
    print_notes(notes)
    progress = LazyProgress()
    started = time.monotonic()
    try:
        result = run_study(spec, base, seed, replications, _with_log(progress))
    except Interrupted as e:
        result = e.partial
    finally:
        progress.close()
    elapsed = time.monotonic() - started
    try:
        write_folder(out, run_files(result, spec, base), _manifest(result, spec, seed, replications))
    except InputError as e:
        fail(e.problems)
        return
    except KeyboardInterrupt:
        Console(stderr=True, soft_wrap=True).print(f"interrupted while writing: {out}/ is as it was")
        raise typer.Exit(130) from None
    console = Console()
    if not console.is_terminal:  # files and pipes get the whole table, not an 80-column squeeze
        console = Console(width=140)
    if not result.complete:
        runs = ", ".join(f"{p} {len(r)}" for p, r in result.runs.items()) or "none"
        Console(stderr=True, soft_wrap=True).print(
            f"interrupted after {elapsed:.1f} s: the runs that finished (per policy: {runs} of "
            f"{replications}) are in {out}/, marked partial in manifest.json"
        )
        raise typer.Exit(130)
    print_summary(result.summary, f"{spec.name}: {spec.description}".rstrip(": "), console)
    console.print(
        f"{result.simulated_requests:,} simulated requests in {elapsed:.1f} s; tables in {out}/ "
        "(requests.parquet, timeseries.parquet, summary.json, scenario.yaml, manifest.json)"
    )


def _with_log(progress: LazyProgress) -> Progress:
    """The live bar on a terminal; elsewhere one line per finished run on stderr (logs show progress)."""
    if sys.stderr.isatty():
        return progress
    err = Console(stderr=True, highlight=False, soft_wrap=True)

    def log(label: str, done: int, total: int) -> None:
        if done == total:
            err.print(f"finished {label}")

    return log


def run_files(result: ScenarioResult, spec: ScenarioSpec, base: Path) -> dict[str, Writer]:
    """The tables, the summary, and the scenario as run (paths made absolute), so `plot` can draw its SLAs."""
    doc = spec.model_dump(mode="json")
    for pool in doc["pools"]:
        pool["profile"] = str(Path(resolve_profile(pool["profile"], base) or pool["profile"]).absolute())
    paths = {f"{where}.path": str(Path(t.path).absolute()) for where, t in trace_refs(spec)}
    doc = apply_overrides(doc, paths)
    scenario_text = yaml.safe_dump(doc, sort_keys=False)
    summary_text = json.dumps(result.summary, indent=2, allow_nan=True) + "\n"
    return {
        "scenario.yaml": functools.partial(_write_text, text=scenario_text),
        "requests.parquet": lambda p: result.requests.to_parquet(p, index=False),
        "timeseries.parquet": lambda p: result.timeseries.to_parquet(p, index=False),
        "summary.json": functools.partial(_write_text, text=summary_text),
    }


def _write_text(path: Path, text: str) -> None:
    path.write_text(text)


def _manifest(result: ScenarioResult, spec: ScenarioSpec, seed: int | None, replications: int) -> dict:
    first = spec.workload.seed if seed is None else seed
    return {
        "command": "simulate",
        "partial": not result.complete,
        "seeds": list(range(first, first + replications)),
        "runs_finished": {policy: len(runs) for policy, runs in result.runs.items()},
    }


study.register(app)
gateway.register(app)
replay.register(app)
app.add_typer(calibrate_app, name="calibrate")
