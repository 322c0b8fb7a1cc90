"""CLI helpers shared by the commands: reporting input errors and a progress bar.

User mistakes (a bad scenario, a missing profile, an unreachable endpoint) print one line per problem and
exit with code 2; they never show a traceback. These helpers live apart from the command modules so that
`simadmit.cli.main` can import the study commands (`simadmit.cli.study`) without either importing the
other back.
"""

from __future__ import annotations

import errno
import json
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeRemainingColumn
from typer._click.exceptions import NoArgsIsHelpError, UsageError  # Typer's own copy of Click

from simadmit.config.errors import InputError, print_problems, problem
from simadmit.config.loading import Origin, variant_spec
from simadmit.config.schema import ScenarioSpec
from simadmit.sim.world import build_world
from simadmit.workload.check import check_workload

MAX_SEED = 2**63 - 1  # numpy seeds are non-negative; replication r uses seed + r
MAX_PROBLEMS = 20  # lines of one report: a grid can repeat one mistake at every point
MAX_REPLICATIONS = 1_000  # seeds of one run or point: intervals settle long before, and each run is kept


def fail(problems: list[str]) -> NoReturn:
    """Print one line per problem to stderr and exit 2."""
    print_problems(problems)
    raise typer.Exit(2)


def print_notes(notes: list[str]) -> None:
    """One `note:` line per note on stderr, as written (no markup): what a run will do that the user may
    not expect, such as trace rows it skips."""
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    for note in notes:
        err.print(f"note: {note}", markup=False)


class App(typer.Typer):
    """The `simadmit` app: a mistake on the command line itself (an unknown option, a value out of range)
    is one `error:` line and exit code 2 like every other input error, not a framed panel."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if "standalone_mode" in kwargs:
            return super().__call__(*args, **kwargs)
        try:
            code = super().__call__(*args, standalone_mode=False, **kwargs)
        except NoArgsIsHelpError:  # the help is already printed
            sys.exit(2)
        except UsageError as e:
            hint = f" (see {e.ctx.command_path} --help)" if e.ctx is not None else ""
            print_problems([e.format_message() + hint])
            sys.exit(e.exit_code)
        except typer.Abort:  # what Typer does by itself
            typer.echo("Aborted!", err=True)
            sys.exit(1)
        except OSError as e:  # a path given that no file system takes, wherever the command first touches it
            if e.errno not in (errno.ENAMETOOLONG, errno.ELOOP):
                raise
            print_problems([problem(e.filename, None, e.strerror or str(e))])
            sys.exit(2)
        sys.exit(code if isinstance(code, int) else 0)


def check_seed(seed: int | None, replications: int = 1, option: str = "--seed") -> None:
    """A seed the random streams accept for every replication: 0 <= seed and seed + replications - 1 < 2^63."""
    if seed is not None and not 0 <= seed <= MAX_SEED:
        raise InputError([problem(None, option, f"must be a whole number from 0 to 2^63 - 1, got {seed}")])
    if seed is not None and seed > MAX_SEED - (replications - 1):  # the last replication's seed is too big
        raise InputError(
            [
                problem(
                    None,
                    option,
                    f"{seed}: replication r runs seed + r, so with {replications} replications the seed must be "
                    f"at most 2^63 - {replications}",
                )
            ]
        )


def preflight(spec: ScenarioSpec, base: Path, origin: Origin, seed: int | None = None) -> list[str]:
    """Everything a run reads, checked before it starts (each variant too); notes about skipped trace rows.
    A problem names where its field was written, `origin(field)`: the scenario file, or `--set`."""
    specs = [variant_spec(spec, v) for v in spec.variants] or [spec]
    notes: list[str] = []
    for s in specs:
        world = build_world(s, base)  # reads the profiles
        limits = [world.pools[p].max_request_tokens for p in world.pool_of_tier]
        notes += [n for n in check_workload(s, origin, seed, limits) if n not in notes]
    return notes


def preflight_each(
    runs: list[tuple[str, ScenarioSpec, Origin, int | None]], source: Path, command: str
) -> list[str]:
    """`preflight` of every run a study (`command`) will make (a sweep's points, optimize's loads), before
    any starts, so a bad trace or a workload too big is refused up front rather than by a worker midway.
    `runs` are (label, spec, the origin of its fields, seed); runs sharing their workload, pools and seed are
    checked once, and each problem is reported once, labelled with the first run it was found in. A study
    simulates the scenario's own settings: variants it leaves out are named in a note."""
    notes: list[str] = []
    if variants := sorted({v.name for _, spec, _, _ in runs for v in spec.variants}):
        left_out = f"its variants ({', '.join(variants)}) are left out: `simadmit simulate` runs them"
        notes.append(f"{command} runs the scenario's own settings; {left_out}")
    problems: list[str] = []
    seen_runs: set[str] = set()
    seen_problems: set[str] = set()
    for label, spec, origin, seed in runs:
        drawn = spec.model_dump(mode="json", include={"workload", "pools", "variants"})
        key = json.dumps([drawn, len(spec.policies), seed], sort_keys=True, default=str)
        if key in seen_runs:
            continue
        seen_runs.add(key)
        try:
            notes += [n for n in preflight(spec, source.parent, origin, seed) if n not in notes]
        except InputError as e:
            new = [line for line in e.problems if line not in seen_problems]
            seen_problems.update(new)
            problems += [f"{label}: {line}" if label else line for line in new]
    if problems:
        more = [f"... and {len(problems) - MAX_PROBLEMS} more"] if len(problems) > MAX_PROBLEMS else []
        raise InputError(problems[:MAX_PROBLEMS] + more)
    return notes


class LazyProgress:
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
