"""The `replay` and `compare` commands: send a scenario's workload to a live endpoint, and set a simulation
beside the real runs.

`register(app)` adds them to the main Typer app. Input mistakes print one line each and exit with code 2;
a run never writes into a folder that already holds one, so a new run is never mixed with an old one.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from pathlib import Path
from typing import Annotated

import pandas as pd
import typer
from pydantic import TypeAdapter, ValidationError
from rich.console import Console
from rich.table import Table

from simadmit.calibrate.client import normalize_base_url, without_credentials
from simadmit.cli.common import MAX_REPLICATIONS, check_seed, fail, preflight, print_notes, print_problems
from simadmit.config.errors import InputError, problem, pydantic_problems, read_yaml
from simadmit.config.loading import load_scenario_with_origin
from simadmit.config.overrides import parse_assignments
from simadmit.config.resources import resolve_scenario
from simadmit.config.workload_schema import Name
from simadmit.loadgen.plan import make_plan
from simadmit.loadgen.run import ReplayConfig, ReplayRun, replay
from simadmit.loadgen.tables import OUTCOME, write_run
from simadmit.results.compare import Run, compare, load_runs, overall, run_dirs
from simadmit.results.compare_plots import cdf_files
from simadmit.results.run_folder import (
    Writer,
    add_files,
    check_destination,
    held_run,
    interrupted_note,
    not_a_table,
    write_text,
)

MAX_TIMEOUT_S = 86_400  # an attempt of more than a day is a hung server, not a slow one


def replay_command(
    scenario: Annotated[Path, typer.Argument(help="scenario YAML, or a bundled scenario's name")],
    endpoint: Annotated[
        list[str],
        typer.Option(
            help="the live OpenAI-compatible endpoint, http://host:port; repeated (gateway replicas), the "
            "attempts go to them in turn"
        ),
    ],
    out: Annotated[Path, typer.Option(help="folder for requests.parquet, timeseries.parquet, replay.json")],
    repeat: Annotated[
        int,
        typer.Option(min=1, max=MAX_REPLICATIONS, help="send the same request list N times (repeat-1..N)"),
    ] = 1,
    model: Annotated[
        str | None, typer.Option(help="served model name (default: the endpoint's first)")
    ] = None,
    seed: Annotated[int | None, typer.Option(help="workload seed (default: the scenario's)")] = None,
    label: Annotated[str, typer.Option(help="the policy column of the tables")] = "real",
    timeout: Annotated[float, typer.Option(help="seconds one attempt may take, from 1 to a day")] = 600.0,
    server: Annotated[
        str | None,
        typer.Option(
            help="the vLLM server behind the endpoints (gateways): its /metrics is polled and its /tokenize "
            "gives the prompts' token ids (default: the first endpoint)"
        ),
    ] = None,
    set_: Annotated[list[str], typer.Option("--set", help="override a scenario field: path=value")] = [],  # noqa: B006
) -> None:
    """Send the scenario's workload open-loop to a live endpoint at its scheduled times and record it as
    `simulate` records a run."""
    try:
        check_seed(seed)
        if not 1 <= timeout <= MAX_TIMEOUT_S:  # written so that nan fails too
            raise InputError(
                [problem(None, "--timeout", f"must be from 1 to {MAX_TIMEOUT_S} seconds, got {timeout:g}")]
            )
        path = resolve_scenario(scenario)
        spec, base, origin = load_scenario_with_origin(path, parse_assignments(set_))
        if spec.variants:
            raise InputError(
                [problem(scenario, "variants", "replay sends one workload: remove the variants")]
            )
        notes = preflight(spec, base, origin, seed)  # as simulate checks it: its size, traces, warm-up
        urls = [normalize_base_url(url) for url in endpoint]  # every URL before anything is written or sent
        if twice := sorted({u for u in urls if urls.count(u) > 1}):
            why = "given twice: each --endpoint stands for one gateway replica, its attempts in the gateway column"
            raise InputError([problem(None, "--endpoint", f"{twice[0]} {why}")])
        if server is not None:
            normalize_base_url(server, "--server")
        if not label.strip():  # compare and the tables tell runs apart by it
            raise InputError(
                [problem(None, "--label", "must not be empty: it names the run in the policy column")]
            )
        try:  # a policy's name, as a scenario's policies are named: no /, no newline
            TypeAdapter(Name).validate_python(label)
        except ValidationError as e:
            raise InputError(pydantic_problems(None, e, "--label")) from None
        if held_run(out) is not None:  # before sending anything: a run cannot be sent twice
            raise InputError([problem(out, None, "already holds a run; choose another --out")])
        check_destination(out, replace=False, command="replay")
        plan = make_plan(spec, base, seed)
    except InputError as e:
        fail(e.problems)
        return
    print_notes(notes)
    console = Console()
    if not console.is_terminal:  # files and pipes get whole lines
        console = Console(width=140)
    cfg = ReplayConfig(
        endpoint=endpoint[0],
        model=model,
        timeout_s=timeout,
        more_endpoints=tuple(endpoint[1:]),
        server=server,
    )
    console.print(
        f"{len(plan.workload)} requests over {plan.scheduled_s[-1]:.0f} s, {repeat} run(s) -> {out}/"
    )
    for k in range(1, repeat + 1):
        where = out if repeat == 1 else out / f"repeat-{k}"
        kept = f"; {', '.join(f'repeat-{j}' for j in range(1, k))} kept" if k > 1 else ""
        try:
            run = replay(plan, cfg, random.Random())
            if run.interrupted and not run.attempts:
                raise KeyboardInterrupt
            facts = write_run(run, spec, base, where, label)
        except InputError as e:
            fail(e.problems)
            return
        except KeyboardInterrupt:
            _say_interrupted(f"{where} is not written{kept}")
            raise typer.Exit(130) from None
        if run.interrupted:
            _say_interrupted(
                f"the {facts['requests']} of {facts['requests_planned']} requests that had ended are kept in "
                f"{where}, marked incomplete (compare refuses it){kept}"
            )
            raise typer.Exit(130)
        _print_facts(console, where, facts)
        if failed := _unanswered(run):
            reasons = ", ".join(f"{n} {status}" for status, n in failed.most_common())
            print_problems([f"{where}: no request was answered ({reasons}): is {without_credentials(endpoint[0])} an OpenAI-compatible "
                            "completions endpoint? the run is kept"])  # fmt: skip
            raise typer.Exit(1)


def _say_interrupted(what: str) -> None:
    Console(stderr=True, soft_wrap=True, highlight=False).print(f"interrupted: {what}", markup=False)


def _unanswered(run: ReplayRun) -> Counter[str]:
    """The failures by status when no attempt got an answer (tokens, a 429, a 400 for length): a run of
    nothing but failures measured a server that does not speak the completions API, not a latency."""
    statuses = Counter(a.result.status for a in run.attempts)
    return Counter() if statuses.keys() & OUTCOME.keys() else statuses  # abandoning is no failure either


def _print_facts(console: Console, where: Path, facts: dict) -> None:
    lag, client = facts["send_lag_s"], facts["client"]
    console.print(
        f"{where}: {facts['requests']} requests {facts['outcomes']} in {facts['wall_s']:.0f} s; send lag p50 "
        f"{1e3 * lag['p50']:.1f} ms, p99 {1e3 * lag['p99']:.1f} ms, max {1e3 * lag['max']:.1f} ms; client CPU "
        f"{100 * client['cpu_share_of_one_core']:.0f}% of a core, loop lag p99 {client['loop_lag_p99_ms']:.1f} ms"
    )
    if facts["kept_up"] is False:
        console.print(
            f"[red]WARNING: the load client did not keep up[/red]: send-lag p99 {1e3 * lag['p99']:.1f} ms is not "
            f"well under a decode step ({1e3 * facts['decode_step_s']:.1f} ms); its timings are suspect"
        )


def _fmt(measure: str, value: float) -> str:
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"  # a percentile over every arrival when some went unanswered
    if math.isnan(value):
        return "-"
    if measure.endswith("_rate"):
        return f"{100 * value:.1f}%"
    if measure.endswith("_rps"):
        return f"{value:.3g}/s"
    return f"{value * 1e3:.0f} ms" if value < 1 else f"{value:.2f} s"


def compare_command(
    sim_dir: Annotated[Path, typer.Argument(help="a `simulate --out` folder")],
    real_dirs: Annotated[
        list[Path], typer.Argument(help="`replay --out` folders (repeats of one request list)")
    ],
    policy: Annotated[
        str | None,
        typer.Option(
            help="the simulated policy (needed when there are several; also picks it in a real folder of several)"
        ),
    ] = None,
    warmup: Annotated[
        float | None, typer.Option(help="leave out arrivals before this (default: the scenario's warm-up)")
    ] = None,
    out: Annotated[Path | None, typer.Option(help="folder for compare.csv, compare.json, CDF plots")] = None,
) -> None:
    """The fidelity report: per tier and measure, simulated vs real (mean and range over the real runs)."""
    try:
        if out is not None:
            check_destination(out, replace=False, command="compare")
        reals = run_dirs(real_dirs)
        _not_swapped(sim_dir, reals)
        sim = _runs(sim_dir, policy)
        partial = interrupted_note(sim_dir)
        real_by_dir = [(d, _runs(d, policy, when_several=True)) for d in reals]
        _same_request_list([(sim_dir, sim), *real_by_dir])
        real = [r for _, runs in real_by_dir for r in runs]
        source, given = None, warmup
        if warmup is None:
            source = sim_dir / "scenario.yaml"
            doc = read_yaml(source, "scenario") if source.is_file() else {}
            workload = doc.get("workload") if isinstance(doc, dict) else None
            given = (workload if isinstance(workload, dict) else {}).get("warmup_s") or 0.0
        warmup = _checked_warmup(given, [*sim, *real], source)
    except InputError as e:
        fail(e.problems)
    if partial:
        Console(stderr=True, soft_wrap=True).print(partial)
    table = compare(sim, real, warmup)
    console = Console() if Console().is_terminal else Console(width=160)
    shown = Table(
        title=f"simulated ({sim_dir}) vs {len(real)} real runs", header_style="bold", title_justify="left"
    )
    for col in ("tier", "measure", "sim", "real mean", "real range", "error", "target", "verdict"):
        shown.add_column(col, justify="left" if col in ("tier", "measure", "verdict") else "right")
    for r in table.to_dict("records"):
        m = str(r["measure"])
        error, target = float(r["error"]), float(r["target"])
        err = "-" if not math.isfinite(error) else f"{100 * error:+.1f}%"
        tol = "" if not math.isfinite(target) else f"±{100 * target:.0f}%"
        rng = f"{_fmt(m, float(r['real_min']))} – {_fmt(m, float(r['real_max']))}"
        cells = (_fmt(m, float(r["sim"])), _fmt(m, float(r["real_mean"])), rng, err, tol, str(r["verdict"]))
        shown.add_row(str(r["tier"]), m, *cells)
    console.print(shown)
    ok = overall(table)
    console.print(f"verdict: {'PASS' if ok else 'FAIL'} (E2E mean/p99 ±10%, TTFT mean ±15%, TTFT p99 ±20%, or "
                  "inside the real range where the real runs spread wider)")  # fmt: skip
    if out is not None:
        doc = {"sim": str(sim_dir), "real": [str(d) for d in reals], "warmup_s": warmup, "pass": ok,
               "rows": json.loads(table.to_json(orient="records"))}  # fmt: skip
        text = json.dumps(doc, indent=2) + "\n"
        tiers = [*sorted(set(pd.concat([r.requests["tier"] for r in real + sim]))), "all"]
        files: dict[str, Writer] = {
            "compare.csv": lambda p: table.to_csv(p, index=False),
            "compare.json": lambda p: write_text(p, text),
            **cdf_files(sim, real, tiers, warmup),
        }
        stale = _stale_plots(out, files)
        try:
            add_files(out, files)
            for plot in stale:
                plot.unlink(missing_ok=True)
        except InputError as e:
            fail(e.problems)
        except OSError as e:
            fail([f"{out}: could not remove the previous report's plot ({e.strerror or e}); remove it"])
        console.print(f"table and CDF plots in {out}/")


def _stale_plots(out: Path, files: dict[str, Writer]) -> list[Path]:
    """The CDF plots of the previous compare report in `out` that this one does not draw (a tier it no
    longer has): left there, they would sit beside the new report as if they were part of it."""
    if held_run(out) != "compare":
        return []
    return sorted(p for p in out.glob("cdf_*.png") if p.name not in files)


def _is_replay(folder: Path) -> bool:
    """A `replay --out` folder (or one holding its repeats), as against a simulation's."""
    return (folder / "replay.json").is_file() or any(folder.glob("repeat-*/replay.json"))


def _not_swapped(sim_dir: Path, reals: list[Path]) -> None:
    """`InputError` for a replay given as the simulated side with a simulation among the real ones: the two
    folders swapped, which would report the real run's error against the simulation. Two real runs compared
    with each other (the noise between them) are left alone."""
    if _is_replay(sim_dir) and not all(_is_replay(r) for r in reals):
        why = "holds a replay run: the first folder is the simulation (compare SIM_DIR REAL_DIR...)"
        raise InputError([problem(sim_dir, None, why)])


def _runs(folder: Path, policy: str | None, when_several: bool = False) -> list[Run]:
    """`load_runs`, with a `requests.parquet` that is not a Parquet file as one line naming it."""
    try:
        return load_runs(folder, policy, when_several=when_several)
    except (OSError, ValueError) as e:  # pyarrow's "not a Parquet file" is a ValueError
        raise not_a_table(folder / "requests.parquet", "a requests table of simulate or replay", e) from None


def _checked_warmup(warmup: object, runs: list[Run], scenario: Path | None) -> float:
    """The warm-up (`--warmup`, else the `scenario`'s): 0 or more seconds, short of some request of every run
    (leaving them all out would make a report of empty measures)."""
    field = "--warmup" if scenario is None else "workload.warmup_s"
    if isinstance(warmup, bool) or not isinstance(warmup, int | float) or not 0 <= warmup < math.inf:
        raise InputError(
            [problem(scenario, field, f"must be a finite number of seconds, 0 or more, got {warmup!r}")]
        )
    for run in runs:
        last = float(run.requests["arrival_s"].max())
        if warmup > last:
            raise InputError([problem(scenario, field, f"{warmup:g} s leaves out every request of {run.source} "
                                      f"(the last arrives at {last:.1f} s)")])  # fmt: skip
    return float(warmup)


def _same_request_list(folders: list[tuple[Path, list[Run]]]) -> None:
    """Every run compared must have sent the same request list: the same number of requests per tier and,
    against a simulation of one seed, arrivals over the same span (within 5% and 50 ms: a real run's
    requests leave a little late).

    A simulation of another scenario (another seed, another rate) would otherwise be reported as a fidelity
    error.
    """
    first_folder, first = folders[0]
    want, want_span = _tier_counts(first[0]), _span(first[0])
    for folder, runs in folders:
        for run in runs:
            where = run.source if folder != first_folder else first_folder
            if (got := _tier_counts(run)) != want:
                raise _other_list(where, first[0], f"{_shown(got)} vs {_shown(want)}")
            span = _span(run)
            if len(first) == 1 and abs(span - want_span) > 0.05 * want_span + 0.05:
                raise _other_list(where, first[0], f"arrivals over {span:.3g} s vs {want_span:.3g} s")


def _other_list(where: str | Path, first: Run, how: str) -> InputError:
    return InputError(
        [
            problem(
                where,
                None,
                f"not the request list of {first.source} ({how}): compare runs of one scenario and seed",
            )
        ]
    )


def _span(run: Run) -> float:
    arrivals = run.requests["arrival_s"]
    return float(arrivals.max() - arrivals.min())


def _tier_counts(run: Run) -> dict[str, int]:
    return {str(k): int(v) for k, v in run.requests["tier"].value_counts().sort_index().items()}


def _shown(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {tier}" for tier, n in counts.items()) + " requests"


def register(app: typer.Typer) -> None:
    app.command("replay")(replay_command)
    app.command("compare")(compare_command)
