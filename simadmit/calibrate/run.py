"""One calibration from start to profile: discover the endpoint, run the plan, fit, write the YAML.

Measurements go to `<out>.measurements.csv` as they happen; the fit and the profile use every successful row
in that file, including rows from an interrupted run that this one resumed.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from simadmit.calibrate.api_latency import measure_api_latency
from simadmit.calibrate.client import Endpoint, discover, normalize_base_url, tokenize
from simadmit.calibrate.deadline import Stalls, later_rounds_end_s, stall_after_s
from simadmit.calibrate.drift import drift_warnings, round_drift
from simadmit.calibrate.fit import FitResult, fit_step_model, fit_warnings, observations
from simadmit.calibrate.measurements import Measurement, MeasurementLog, measurements_path, read_measurements
from simadmit.calibrate.metrics import CacheConfig, MetricsSampler, parse_cache_config, scrape
from simadmit.calibrate.overhead import OverheadMonitor
from simadmit.calibrate.phases import (
    Cell,
    Runner,
    RunnerSettings,
    aggregate_throughput,
    in_rounds,
    plan_cells,
)
from simadmit.calibrate.prompts import SAMPLE_TEXT, PromptMaker
from simadmit.config.errors import InputError, cannot_write_in, problem
from simadmit.config.profile import EngineLimits, Profile, profile_from_dict, save_profile, summary_figures


@dataclass(frozen=True, slots=True)
class CalibrationConfig:
    """Everything `simadmit calibrate` was asked to do."""

    endpoint: str
    out: Path
    model: str | None = None
    budget_s: float = 480.0
    max_concurrency: int = 64
    gpus: int = 1
    gpu_name: str = "unknown"
    resume: bool = False
    max_num_seqs: int = 256  # the server's scheduler limits: not visible over HTTP, so taken from the user
    max_num_batched_tokens: int = 8192
    workload_prompts: tuple[int, ...] = ()  # prompt lengths of the user's traffic, added to the prefill sweep
    launched: bool = False  # the server was started by `--launch` (on a new loopback port each time)
    runner: RunnerSettings = field(default_factory=RunnerSettings)


@dataclass(frozen=True, slots=True)
class Calibration:
    """The outcome: the profile written, its fit, and the run's own accounting."""

    profile: Profile
    fit: FitResult
    measurements: Path
    faults: dict[str, int]
    gave_up: int
    client_overhead: dict[str, float]


async def _connect(client: httpx.AsyncClient, cfg: CalibrationConfig) -> tuple[Endpoint, CacheConfig]:
    endpoint = await discover(client, normalize_base_url(cfg.endpoint), cfg.model)
    try:
        cache = parse_cache_config(await scrape(client, endpoint.base_url))
    except (httpx.HTTPError, ValueError):
        cache = None
    if cache is None:
        raise InputError(
            [
                problem(
                    None,
                    "--endpoint",
                    f"{endpoint.shown_url}/metrics has no vllm:cache_config_info: not a vLLM server?",
                )
            ]
        )
    return endpoint, cache


def check_out(out: Path, resume: bool) -> None:
    """Before anything is measured or launched: a new calibration writes over no file (a profile, or
    anything else given as --out), in a folder it can write in, and `--resume` needs the measurements file
    it continues."""
    csv_path = measurements_path(out)
    if out.is_symlink() and not out.exists():  # the profile would be written through it at the very end
        raise InputError(
            [
                problem(
                    out, None, f"is a link to {os.readlink(out)}, which points nowhere: give --out a new file"
                )
            ]
        )
    if csv_path.is_dir():
        raise InputError([problem(csv_path, None, "is a folder, where the measurements file goes")])
    if why := cannot_write_in(out.parent):  # the measurements file and the profile both go there
        raise InputError([problem(out, None, why)])
    if resume and not csv_path.is_file():
        why = "nothing to resume: no measurements file (drop --resume to start a calibration)"
        raise InputError([problem(csv_path, None, why)])
    if not resume and csv_path.exists():
        raise InputError(
            [problem(csv_path, None, "already exists: pass --resume to continue it, or remove it")]
        )
    if not resume and out.exists():
        raise InputError([problem(out, None, "already exists: give --out a new file, or remove it")])


def server_identity(cfg: CalibrationConfig, endpoint: Endpoint, cache: CacheConfig) -> str:
    """What was measured, as each row records it: the server (its URL; a launched one has a new port each
    time) and the settings that shape its timings. `--resume` continues only rows of the same."""
    where = "launched" if cfg.launched else endpoint.shown_url
    return (
        f"endpoint={where} vllm={endpoint.vllm_version} max_model_len={endpoint.max_model_len} "
        f"kv_block_size={cache.block_size} engines={cache.engines} max_num_seqs={cfg.max_num_seqs} "
        f"max_num_batched_tokens={cfg.max_num_batched_tokens}"
    )


def _history(csv_path: Path, endpoint: Endpoint, server: str, console: Console) -> list[Measurement]:
    """The rows of the run resumed (none for a new one: `check_out` found no file), all of this model and
    this server (`server_identity`); rows of a file written before rows recorded it are taken on trust."""
    rows = read_measurements(csv_path)
    others = {r.model for r in rows} - {endpoint.model}
    if others:
        raise InputError(
            [
                problem(
                    csv_path, None, f"holds measurements of {', '.join(sorted(others))}, not {endpoint.model}"
                )
            ]
        )
    recorded = {r.server for r in rows if r.server} - {server}
    if recorded:
        was = dict(item.split("=", 1) for item in sorted(recorded)[0].split())
        now = dict(item.split("=", 1) for item in server.split())
        changed = ", ".join(f"{k} {was.get(k, '?')} -> {v}" for k, v in now.items() if was.get(k) != v)
        why = (
            f"holds measurements of another server or configuration ({changed}): resume against the one it "
            "measured, or give --out a new file"
        )
        raise InputError([problem(csv_path, None, why)])
    if rows and not any(r.server for r in rows):
        console.print(
            f"note: {csv_path} does not record which server it measured (written by an older simadmit): "
            "resuming on trust that it is this one",
            style="yellow", markup=False, highlight=False,
        )  # fmt: skip
    return rows


def plan(cfg: CalibrationConfig, endpoint: Endpoint, cache: CacheConfig) -> list[Cell]:
    """The cells this calibration runs, in rounds (the same for a run and its resumption); no batch larger
    than the server's `max_num_seqs`, which would queue the rest and time the queue as decode steps."""
    return in_rounds(
        plan_cells(
            endpoint.max_model_len,
            cache.capacity_tokens,
            min(cfg.max_concurrency, cfg.max_num_seqs),
            cfg.budget_s,
            cfg.max_num_batched_tokens,
            cfg.workload_prompts,
        )
    )


async def _run_plan(
    cfg: CalibrationConfig,
    client: httpx.AsyncClient,
    endpoint: Endpoint,
    cache: CacheConfig,
    console: Console,
    cap_at: float,
) -> tuple[Runner, MetricsSampler, OverheadMonitor, int]:
    csv_path = measurements_path(cfg.out)
    server = server_identity(cfg, endpoint, cache)
    history = _history(csv_path, endpoint, server, console)
    pool = await tokenize(client, endpoint, SAMPLE_TEXT)
    if pool is None:
        console.print(
            "[yellow]no /tokenize on this server: sizing text prompts from the server's usage counts[/]"
        )
    prompts = PromptMaker(pool, random.Random())  # unseeded: no prompt may repeat one the server has cached
    cells = plan(cfg, endpoint, cache)
    overhead = OverheadMonitor()
    sampler = MetricsSampler(client, endpoint.base_url)
    with MeasurementLog(csv_path, server) as log:
        runner = Runner(client, endpoint, prompts, log, history, overhead, cfg.runner)
        overhead.start()
        sampler.start()
        try:
            skipped = await _run_with_progress(
                runner, cells, sampler, console, stall_after_s(cfg.runner.request_timeout_s), cap_at
            )
        finally:
            await sampler.stop()
            await overhead.stop()
    return runner, sampler, overhead, skipped


async def _run_with_progress(
    runner: Runner,
    cells: list[Cell],
    sampler: MetricsSampler,
    console: Console,
    stall_s: float,
    cap_at: float,
) -> int:
    """Run the cells in order, one progress bar (with ETA) per cell plus one for the whole budget; the
    latter counts the stalled requests while there are any, and one line sums them up at the end.

    A server too slow for its budget has every cell measured once all the same: a cell of a later round
    (measuring the same again, for the drift between rounds) that would run past `cap_at` (the run's hard cap
    less the time to fit), judged by how long it took in the rounds before, is skipped, one that runs slower
    than that and is still going at `cap_at` is cut short (what it completed is kept), and one line says
    how many; their count is returned."""
    columns = (
        TextColumn("{task.description:<28}"),
        BarColumn(),
        TextColumn("{task.fields[requests]:>5} req"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[stalled]}", style="yellow"),
    )
    whole = {cell.label: cell for cell in cells}  # each cell's last round: all it owes
    stalls = Stalls(stall_s)
    skipped = 0
    try:
        with Progress(*columns, console=console, refresh_per_second=2) as progress:
            total_s = sum(runner.remaining_s(cell)[0] for cell in whole.values()) or 1.0
            total = progress.add_task("calibration", total=total_s, requests=0, stalled="")
            base = 0.0
            for cell in cells:
                seconds, owed = runner.remaining_s(cell)  # after the rounds before this one
                if seconds <= 0 and owed <= 0:
                    continue
                took_s = runner.stats.wall_s[cell.label] / max(1, cell.round - 1)  # per round before
                if cell.round > 1 and time.perf_counter() + took_s >= cap_at:
                    skipped += 1
                    continue
                sampler.phase = cell.phase
                task = progress.add_task(cell.label, total=max(seconds, 1e-3), requests=0, stalled="")
                started = time.perf_counter()
                count = 0

                def tick(task: TaskID = task) -> None:
                    nonlocal count
                    count += 1
                    progress.update(task, requests=count)
                    progress.update(total, requests=runner.stats.completed)

                run = asyncio.create_task(runner.run_cell(cell, tick))
                cut = False  # by this loop, at the cap; a cancel from outside (budget, Ctrl-C) ends the run
                while not run.done():
                    if cell.round > 1 and time.perf_counter() >= cap_at:
                        cut = run.cancel()
                        await asyncio.wait({run})
                        skipped += cut
                        break
                    elapsed = time.perf_counter() - started
                    progress.update(task, completed=min(elapsed, seconds))
                    stalled = stalls.now()
                    progress.update(
                        total,
                        completed=base + min(elapsed, seconds),
                        stalled=f"{stalled} stalled" if stalled else "",
                    )
                    await asyncio.wait({run}, timeout=0.5)
                if cut:
                    continue
                await run
                progress.update(task, completed=max(seconds, 1e-3))
                base += seconds
    finally:  # also when the budget or Ctrl-C cancels the run
        if line := stalls.summary():
            console.print(line, style="yellow", markup=False, highlight=False)
    if skipped:
        console.print(
            f"the server is too slow for the budget: {skipped} cells of a later round skipped or cut short, "
            "as they would have run past twice the budget plus a minute (a larger --budget measures them "
            "again, and how far the machine drifted between)",
            style="yellow", markup=False, highlight=False,
        )  # fmt: skip
    return skipped


def _measured_figures(rows: list[Measurement], cells: list[Cell], gpus: int) -> dict[str, object]:
    """The article's simple figures straight from the measurements (per GPU), next to the fit's."""
    prefill = [r for r in rows if r.ok and r.phase == "prefill" and r.ttft_s > 0]
    longer = sorted(r.prompt_tokens for r in prefill)
    cut = longer[len(longer) // 2] if longer else 0
    big = [r for r in prefill if r.prompt_tokens >= cut]
    prefill_rate = sum(r.prompt_tokens for r in big) / sum(r.ttft_s for r in big) if big else math.nan
    decode = {
        c.concurrency: round(aggregate_throughput(rows, c.phase, c.concurrency) / gpus, 2)
        for c in cells
        if c.phase == "decode"
    }
    sat = next(c for c in cells if c.phase == "saturation")
    saturation = aggregate_throughput(rows, "saturation", sat.concurrency) / gpus
    return {
        "prefill_tokens_per_gpu_s": round(prefill_rate / gpus, 2),
        "decode_tokens_per_gpu_s_by_concurrency": decode,
        "saturation_decode_tokens_per_gpu_s": round(saturation, 2),
        "saturation_concurrency": sat.concurrency,
        "saturation_prompt_tokens": sat.prompt_tokens[0],
    }


def api_latency_s(fit: FitResult) -> float:
    """The latency outside the engine a profile carries: the fit's TTFT offset (measured, or fitted where
    the server's clocks could not be read), which no server has below zero."""
    return float(f"{max(0.0, fit.ttft_offset_s):.4g}")


def build_profile(
    cfg: CalibrationConfig,
    endpoint: Endpoint,
    cache: CacheConfig,
    fit: FitResult,
    warnings: list[str],
    extra_fit: dict[str, object],
) -> Profile:
    """Assemble and validate the profile (validation catches, e.g., a fit that makes a step free)."""
    limits = EngineLimits(cfg.max_num_seqs, cfg.max_num_batched_tokens, endpoint.max_model_len)
    prefill, decode = summary_figures(fit.step, limits, cache.capacity_tokens, cfg.gpus)
    if not (math.isfinite(prefill) and math.isfinite(decode)):
        why = (
            "the fit finds a full prefill or decode step free: the latencies measured did not grow with the "
            "prompt or the batch, so nothing in them prices a step (is this a vLLM engine doing the work?)"
        )
        raise InputError([problem(measurements_path(cfg.out), None, why)])
    today = datetime.now(UTC).strftime("%Y-%m-%d")
    profile = Profile(
        model=endpoint.model,
        gpu=cfg.gpu_name,
        step_time=fit.step,
        kv_capacity_tokens=cache.capacity_tokens,
        engine=limits,
        prefill_tokens_per_gpu_s=round(prefill, 2),
        decode_tokens_per_gpu_s=round(decode, 2),
        gpus_per_replica=cfg.gpus,
        tensor_parallel=cfg.gpus,
        kv_block_size=cache.block_size,
        api_latency_s=api_latency_s(fit),
        source=f"measured by simadmit calibrate at {endpoint.shown_url} (vLLM {endpoint.vllm_version}) on {today}",
        fit={**fit.report(), **extra_fit},
        warnings=tuple(warnings),
    )
    return profile_from_dict(profile.to_dict(), "fitted profile")


async def calibrate(cfg: CalibrationConfig, console: Console) -> Calibration:
    """Run a whole calibration and write the profile; `InputError` for anything the user must fix."""
    cap_at = time.perf_counter() + later_rounds_end_s(cfg.budget_s)
    check_out(cfg.out, cfg.resume)
    limits = httpx.Limits(
        max_connections=cfg.max_concurrency + 4, max_keepalive_connections=cfg.max_concurrency + 4
    )
    timeout = httpx.Timeout(connect=10.0, read=cfg.runner.request_timeout_s, write=30.0, pool=None)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        endpoint, cache = await _connect(client, cfg)
        console.print(
            f"endpoint {endpoint.shown_url}: model {endpoint.model}, context {endpoint.max_model_len} tokens, "
            f"KV cache {cache.capacity_tokens} tokens ({cache.num_blocks} blocks x {cache.block_size}), vLLM {endpoint.vllm_version}"
        )
        latency = await measure_api_latency(client, endpoint)  # on the idle server, before the load
        console.print(
            f"API server latency (outside the engine): {1e3 * latency:.1f} ms, median of lone requests"
            if latency is not None
            else "API server latency not measured (no engine queue/prefill histograms): fitted as the TTFT offset",
            markup=False, highlight=False,
        )  # fmt: skip
        runner, sampler, overhead, skipped = await _run_plan(cfg, client, endpoint, cache, console, cap_at)
    csv_path = measurements_path(cfg.out)
    rows = read_measurements(csv_path)
    obs, discarded = observations(rows, cfg.max_num_batched_tokens)
    if not obs:
        raise InputError([problem(csv_path, None, "no successful measurements to fit")])
    fit = fit_step_model(obs, ttft_offset_s=latency)
    drift = round_drift(rows)
    warnings = fit_warnings(fit, obs) + drift_warnings(drift)
    cells = plan(cfg, endpoint, cache)
    faults = dict(runner.stats.faults)
    extra: dict[str, object] = {
        "ttft_offset_source": "measured" if latency is not None else "fitted",
        "discarded_as_burst_delivery": discarded,
        "drift_between_rounds": {phase: d.report() for phase, d in drift.items()},
        "cells_skipped_at_cap": skipped,
        "measured": _measured_figures(rows, cells, cfg.gpus),
        "server_metrics": sampler.summary(),
        "metrics_polls_failed": sampler.failed_polls,
        "faults_retried": faults,
        "requests_given_up": runner.stats.gave_up,
        "client_overhead": overhead.report(),
        "concurrency_held": runner.stats.concurrency_held(),
        "measurements": csv_path.name,
    }
    profile = build_profile(cfg, endpoint, cache, fit, warnings, extra)
    header = (
        f"Calibrated by `simadmit calibrate` against {endpoint.model} at {endpoint.shown_url}.\n"
        f"Raw measurements: {csv_path.name} (one row per request attempt)."
    )
    try:
        cfg.out.parent.mkdir(parents=True, exist_ok=True)
        save_profile(profile, cfg.out, header)
    except OSError as e:
        why = f"cannot write it ({e.strerror or e}); the measurements are kept in {csv_path}: rerun with --resume"
        raise InputError([problem(cfg.out, None, why)]) from None
    return Calibration(profile, fit, csv_path, faults, runner.stats.gave_up, overhead.report())
