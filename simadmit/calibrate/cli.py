"""The `simadmit calibrate` command line: calibrate an endpoint (or a server it launches), or check a profile.

User mistakes (bad URL, connection refused, a profile that does not validate) print one line per problem and
exit with code 2; Ctrl-C exits with 130 and keeps the measurements for `--resume`.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from typer.core import TyperGroup

from simadmit.calibrate.client import normalize_base_url, without_credentials
from simadmit.calibrate.deadline import BudgetSpent, stall_after_s, within_budget
from simadmit.calibrate.launch import LaunchError, launched_server
from simadmit.calibrate.measurements import measurements_path, read_measurements
from simadmit.calibrate.phases import EndpointLost, RunnerSettings
from simadmit.calibrate.report import print_calibration
from simadmit.calibrate.run import CalibrationConfig, calibrate, check_out
from simadmit.calibrate.workload_mix import workload_prompt_lengths
from simadmit.config.errors import InputError, print_problems, problem
from simadmit.config.profile import load_profile
from simadmit.config.resources import resolve_profile
from simadmit.config.schema import engine_limits_problem
from simadmit.config.workload_schema import MAX_GPUS_PER_REPLICA


class _PassThroughGroup(TyperGroup):
    """Keeps everything after a bare `--` for the launched vLLM server instead of parsing it as a subcommand."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if "--" in args:
            cut = args.index("--")
            args, ctx.meta["vllm_args"] = args[:cut], args[cut + 1 :]
        return super().parse_args(ctx, args)


calibrate_app = typer.Typer(
    cls=_PassThroughGroup,
    invoke_without_command=True,
    no_args_is_help=False,
    help="Measure a vLLM endpoint's cost model and write a calibration profile.",
)
_err = Console(stderr=True)
MAX_BUDGET_S = 7 * 86400.0


def parse_duration(text: str, option: str = "--budget") -> float:
    """'90s', '10m', '1h', '1h30m' or plain seconds -> seconds (more than zero)."""
    t = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", t):
        seconds = float(t)
    else:
        parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", t)
        if not parts or "".join(n + u for n, u in parts) != t:
            raise InputError([problem(None, option, f"{text!r} is not a duration like 90s, 10m or 1h")])
        seconds = sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)
    if not seconds > 0:
        raise InputError([problem(None, option, f"{text!r}: must be longer than zero")])
    return seconds


def fail(problems: list[str], code: int = 2) -> None:
    """One `error:` line per problem, as every command prints them (an interruption is no error: plain)."""
    if code == 130:
        for line in problems:
            _err.print(line, markup=False, highlight=False, soft_wrap=True)
    else:
        print_problems(problems)
    raise typer.Exit(code)


@calibrate_app.callback()
def calibrate_command(
    ctx: typer.Context,
    endpoint: Annotated[str | None, typer.Option(help="base URL of a vLLM OpenAI-compatible server")] = None,
    out_arg: Annotated[
        str | None, typer.Option("--out", help="profile YAML to write; measurements go next to it")
    ] = None,
    model: Annotated[
        str | None, typer.Option(help="served model name (default: the first one served)")
    ] = None,
    gpus: Annotated[
        int,
        typer.Option(
            min=1,
            max=MAX_GPUS_PER_REPLICA,  # a profile's bound: checked before measuring, not once it is fitted
            help="GPUs one replica spans; per-GPU figures divide by it",
        ),
    ] = 1,
    gpu_name: Annotated[
        str, typer.Option(help="accelerator name recorded in the profile, e.g. H100-80GB-SXM")
    ] = "unknown",
    budget: Annotated[
        str,
        typer.Option(
            help="time budget of the whole run, e.g. 10m: the plan fits inside it; a server gone silent ends "
            "the run at the budget (plus a short grace); a slow one may finish the first round, and the second "
            "as far as it ends by twice the budget plus a minute"
        ),
    ] = "8m",
    request_timeout: Annotated[
        str, typer.Option(help="longest wait for one request's whole answer before it counts as failed")
    ] = "5m",
    max_concurrency: Annotated[
        int,
        typer.Option(
            min=1,
            help="largest batch of the decode sweep: the batch your pool runs when saturated (the step cost "
            "of larger ones is extrapolated)",
        ),
    ] = 64,
    max_num_seqs: Annotated[
        int, typer.Option(min=1, help="the server's --max-num-seqs (not visible over HTTP)")
    ] = 256,
    max_num_batched_tokens: Annotated[
        int, typer.Option(min=1, help="the server's --max-num-batched-tokens (not visible over HTTP)")
    ] = 8192,
    resume: Annotated[bool, typer.Option(help="continue the measurements CSV of an interrupted run")] = False,
    workload: Annotated[
        Path | None,
        typer.Option(
            help="scenario YAML (or a bundled scenario's name) whose prompt lengths join the prefill sweep "
            "(weights it like your mix)"
        ),
    ] = None,
    launch: Annotated[
        str | None,
        typer.Option(help="start vLLM serving this model on loopback, calibrate, stop it; args after --"),
    ] = None,
    vllm_python: Annotated[
        str | None,
        typer.Option(help="Python interpreter of the environment holding vLLM (default: this one)"),
    ] = None,
    launch_timeout: Annotated[
        str, typer.Option(help="how long to wait for the launched server's /health")
    ] = "15m",
) -> None:
    """Load-test a vLLM endpoint and fit the simulator's step-time model (see `calibrate check` to verify one)."""
    if ctx.invoked_subcommand is not None:
        return
    vllm_args: list[str] = ctx.meta.get("vllm_args", [])
    out = None if out_arg is None else Path(out_arg)  # the text kept: Path drops a trailing slash
    try:
        problems = []
        if out is None:
            problems.append(problem(None, "--out", "required: where to write the profile YAML"))
        if (endpoint is None) == (launch is None):
            problems.append(problem(None, "--endpoint", "give either --endpoint URL or --launch MODEL"))
        if vllm_args and launch is None:
            problems.append(problem(None, "--", "arguments after -- are for a server started with --launch"))
        if limits := engine_limits_problem(max_num_batched_tokens, max_num_seqs):
            problems.append(problem(None, "--max-num-batched-tokens", limits))
        if out is not None and out_arg is not None and (out_arg.endswith(("/", os.sep)) or out.is_dir()):
            what = "is a folder" if out.is_dir() else "names a folder (it ends in /)"
            problems.append(
                problem(out, None, f"{what}; give the profile's file, e.g. profiles/my-model.yaml")
            )
        if problems:
            raise InputError(problems)
        assert out is not None
        check_out(out, resume)  # before a server is launched; `calibrate` checks it again for its callers
        budget_s = parse_duration(budget)
        if budget_s > MAX_BUDGET_S:
            raise InputError(
                [problem(None, "--budget", f"{budget!r}: at most a week (the plan spreads over it)")]
            )
        launch_timeout_s = parse_duration(launch_timeout, "--launch-timeout")
        cfg = CalibrationConfig(
            endpoint=endpoint or "",
            out=out,
            model=model,
            budget_s=budget_s,
            max_concurrency=max_concurrency,
            gpus=gpus,
            gpu_name=gpu_name,
            resume=resume,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            runner=RunnerSettings(request_timeout_s=parse_duration(request_timeout, "--request-timeout")),
            workload_prompts=workload_prompt_lengths(workload) if workload else (),
        )
        console = Console(stderr=False)
        stall_s = stall_after_s(cfg.runner.request_timeout_s)
        if launch is None:
            result = asyncio.run(within_budget(calibrate(cfg, console), budget_s, stall_s))
        else:
            # The server's log stays after the run: it is where to look when start-up fails.
            log = Path(tempfile.gettempdir()) / f"simadmit-vllm-{out.stem}.log"
            python = vllm_python or sys.executable
            with launched_server(launch, vllm_args, python, log, launch_timeout_s) as url:
                console.print(f"vLLM is up at {url} (log: {log})")
                run = calibrate(replace(cfg, endpoint=url, launched=True), console)
                result = asyncio.run(within_budget(run, budget_s, stall_s))
        print_calibration(result, console)
    except InputError as e:
        fail(e.problems)
    except LaunchError as e:
        fail([str(e)])
    except EndpointLost as e:
        assert out is not None
        fail([f"stopped after {e}; {_kept(out)}"], code=1)
    except BudgetSpent as e:
        assert out is not None
        fail([f"stopped at the time budget ({budget}): {e}; {_kept(out)} (a larger --budget, or a shorter "
              "--request-timeout for a server that hangs)"], code=1)  # fmt: skip
    except KeyboardInterrupt:
        if out is None:
            raise typer.Exit(130) from None
        fail([f"interrupted: {_kept(out)}"], code=130)


@calibrate_app.command("check")
def check_command(
    profile: Annotated[
        str, typer.Argument(help="calibration profile YAML to check, or a bundled profile's name")
    ],
    endpoint: Annotated[str, typer.Option(help="base URL of the vLLM endpoint the profile describes")],
    model: Annotated[
        str | None, typer.Option(help="served model name (default: the profile's model)")
    ] = None,
    requests: Annotated[
        int,
        typer.Option(
            min=1, max=100_000, help="requests in the replayed load (a short load: at most 100,000)"
        ),
    ] = 40,
    rate: Annotated[
        float | None, typer.Option(help="arrivals per second (default: about two in flight)")
    ] = None,
    seed: Annotated[int, typer.Option(min=0, help="seed of the replayed load")] = 0,
    request_timeout: Annotated[
        str, typer.Option(help="longest wait for one request's whole answer before it counts as failed")
    ] = "5m",
) -> None:
    """Replay a short mixed load on the endpoint and on the simulator with PROFILE; compare TTFT and ITL."""
    console = Console()
    try:
        if rate is not None and not (0 < rate < math.inf):
            raise InputError(
                [problem(None, "--rate", f"must be a positive number of arrivals per second, got {rate}")]
            )
        timeout_s = parse_duration(request_timeout, "--request-timeout")
        path = resolve_profile(profile, Path.cwd())
        loaded = load_profile(path or profile)
        normalize_base_url(endpoint)
        # Imported here: the check pulls in the simulator, which calibration itself does not need.
        from simadmit.calibrate.check import CheckConfig, check_load

        cfg = CheckConfig(requests=requests, rate_per_s=rate, seed=seed, request_timeout_s=timeout_s)
        table, failures = check_load(loaded, endpoint, model, cfg)
    except InputError as e:
        fail(e.problems)
    except KeyboardInterrupt:
        fail(["interrupted"], code=130)
    failed = sum(failures.values())
    reasons = ", ".join(f"{n} {status}" for status, n in failures.most_common())
    if failed == requests:
        fail(
            [
                f"{without_credentials(endpoint)}: all {requests} requests failed ({reasons}): nothing to compare"
            ],
            code=1,
        )
    out = Table(title=f"{profile}: simulated vs measured ({requests} requests, {failed} failed)")
    for col in ("metric", "stat", "predicted", "measured", "error"):
        out.add_column(col, justify="right")
    for row in table.to_dict("records"):
        out.add_row(
            str(row["metric"]),
            str(row["stat"]),
            f"{row['predicted_s'] * 1e3:.1f} ms",
            f"{row['measured_s'] * 1e3:.1f} ms",
            f"{row['error']:+.1%}",
        )
    console.print(out)
    if failed:
        _err.print(f"warning: {failed} of {requests} requests failed ({reasons}) and are left out of the comparison",
                   markup=False, highlight=False, soft_wrap=True)  # fmt: skip


def _kept(out: Path) -> str:
    """What a run that stopped early leaves and how to go on: its measurements CSV and --resume, or, stopped
    before it wrote one (the server never answered), the same command again (--resume would find nothing)."""
    path = measurements_path(out)
    if not path.is_file():
        return f"nothing was measured ({path} was not written): run the same command again, without --resume"
    try:
        rows = read_measurements(path)
    except InputError:
        rows = []
    ok = sum(r.ok for r in rows)
    return f"{ok} requests measured ({len(rows) - ok} failed attempts) are kept in {path}; rerun with --resume to continue"
