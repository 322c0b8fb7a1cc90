"""The `simadmit` command line: simulate scenarios (and calibrate endpoints).

User mistakes (a bad scenario, a missing profile, an unreachable endpoint) print one line per problem and
exit with code 2; they never show a traceback.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
import yaml
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

from simadmit.config.errors import InputError, problem
from simadmit.results.report import print_summary
from simadmit.config.resources import resolve_profile, resolve_scenario
from simadmit.study.runner import ScenarioResult, run_study
from simadmit.config.scenario import ScenarioSpec, load_scenario
from simadmit.sim.world import build_world

app = typer.Typer(
    help="Capacity planning for admission control in front of a vLLM pool.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


@app.callback()
def _root() -> None:
    """simadmit: simulate admission policies in front of a vLLM pool, calibrate real endpoints."""


def fail(problems: list[str]) -> None:
    """Print one line per problem to stderr and exit 2."""
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    for line in problems:
        err.print(f"[red]error:[/red] {line}", markup=True)
    raise typer.Exit(2)


def parse_overrides(values: list[str]) -> dict[str, object]:
    """`--set path=value` pairs; values are parsed as YAML (numbers, lists, mappings)."""
    out: dict[str, object] = {}
    bad = []
    for item in values:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            bad.append(problem("--set", item, "expected path=value, e.g. workload.rate_multiplier=2"))
            continue
        out[key.strip()] = yaml.safe_load(raw)
    if bad:
        raise InputError(bad)
    return out


class _LazyProgress:
    """A progress bar that only appears once a run has taken more than a moment."""

    def __init__(self, delay_s: float = 0.7) -> None:
        self.start = time.monotonic()
        self.delay_s = delay_s
        self.bar: Progress | None = None
        self.tasks: dict[str, TaskID] = {}

    def __call__(self, label: str, done: int, total: int) -> None:
        if self.bar is None:
            if time.monotonic() - self.start < self.delay_s or not sys.stderr.isatty():
                return
            self.bar = Progress(
                TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                TimeRemainingColumn(), console=Console(stderr=True), transient=True,
            )  # fmt: skip
            self.bar.start()
        if label not in self.tasks:
            self.tasks[label] = self.bar.add_task(label, total=total)
        self.bar.update(self.tasks[label], completed=done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def write_outputs(result: ScenarioResult, out: Path, spec: ScenarioSpec, base: Path) -> None:
    """The tables, the summary, and the scenario as run (paths made absolute), so `plot` can draw its SLAs."""
    out.mkdir(parents=True, exist_ok=True)
    doc = spec.model_dump(mode="json")
    for pool in doc["pools"]:
        pool["profile"] = str(resolve_profile(pool["profile"], base))
    (out / "scenario.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    result.requests.to_parquet(out / "requests.parquet", index=False)
    result.timeseries.to_parquet(out / "timeseries.parquet", index=False)
    (out / "summary.json").write_text(json.dumps(result.summary, indent=2, allow_nan=True) + "\n")


@app.command()
def simulate(
    scenario: Annotated[
        Path | None, typer.Argument(help="scenario YAML, or a bundled scenario's name (default: the default)")
    ] = None,
    out: Annotated[Path, typer.Option(help="directory for requests.parquet, timeseries.parquet, summary.json")] = Path(
        "runs/latest"
    ),
    seed: Annotated[int | None, typer.Option(help="seed of the first replication (default: the scenario's)")] = None,
    replications: Annotated[int, typer.Option(min=1, help="runs with seeds seed..seed+n-1, for confidence intervals")] = 1,
    set_: Annotated[list[str], typer.Option("--set", help="override a scenario field: path=value")] = [],  # noqa: B006
) -> None:
    """Replay a scenario's traffic through each admission policy and report latency, rejections and goodput."""
    try:
        spec, base = load_scenario(resolve_scenario(scenario), parse_overrides(set_))
        build_world(spec, base)  # profiles are read and checked before anything runs
    except InputError as e:
        fail(e.problems)
        return
    progress = _LazyProgress()
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


from simadmit.cli import study as sweep_cli  # noqa: E402
from simadmit.calibrate.cli import calibrate_app  # noqa: E402

sweep_cli.register(app)
app.add_typer(calibrate_app, name="calibrate")
