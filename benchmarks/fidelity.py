"""Fidelity of the simulator against a real vLLM server: replay the same request lists on both and compare.

Starts the vLLM CPU server the tests use (SmolLM2-135M, tests/vllm_server.py), calibrates it with `simadmit
calibrate`, measures its capacity for the workload below (a burst of requests over its makespan), then at
each load (a fraction of that capacity) and arrival kind (Poisson, and bursty: gamma renewal with CV 3; or
on-off bursts, or the Azure conversation trace's rate curve and burstiness) replays the workload `--repeats` times open-loop,
simulates the request list the first repeat sent on the calibrated profile, and writes the `compare`
report. The repeats are the noise floor: the spread of the real system against itself. They are taken in
rounds, each replaying every point once, so a drift of the machine's speed over the hour (a lone request
measured up to 20% faster late in a run than just after calibrating) shows as spread between every point's
repeats rather than shifting the points run late against those run early; a speed probe before every
replay records it. With `--calibrate-after` the server is calibrated again after the replays and the
points are simulated on both calibrations fitted together (OUT/profile-bracketed.yaml), so a drift between
calibrating and replaying weighs on the model as on the real runs. It is off by default: a calibration right
after an hour of replays read the engine up to 8% slower per prompt token than the one before, while the
probe between the replays stayed within 0.97-1.09 of it (but in one disturbed repeat), and the points simulated on the two together met
the target at fewer points (5 of 10) than on the first alone (7 of 10).

Noise: the load client shares the machine with the server (the engine, scheduler and model worker, takes
core 0 alone, `isolate_engine`; this process and what it starts core 1), and on a shared
machine other processes add their own noise: the load average is recorded before and after.
Run it alone, under the lock every user of the server takes:

    flock /tmp/vllm.lock python benchmarks/fidelity.py --out runs/fidelity
    flock /tmp/vllm.lock python benchmarks/fidelity.py --loads 0.3,0.9 --arrivals poisson --repeats 3 \
        --duration 30 --out runs/fidelity-reduced          # the reduced form

It prints the results table (the README's) and writes it to OUT/results.md, with every point's
`compare` report under OUT/<arrival>-<load>/. With `--resimulate` it starts no server: it fits the
calibration measurements under OUT again with the current step model (OUT/profile-refit.yaml) and simulates
the runs already there anew (OUT/results-refit.md), so a change of the model is checked on the same real runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from statistics import median

import pandas as pd
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from simadmit.calibrate.drift import DRIFT_WARNING  # noqa: E402
from simadmit.calibrate.fit import fit_step_model, fit_warnings, observations  # noqa: E402
from simadmit.calibrate.measurements import read_measurements  # noqa: E402
from simadmit.calibrate.run import api_latency_s  # noqa: E402
from simadmit.cli.main import run_files  # noqa: E402
from simadmit.config.errors import InputError  # noqa: E402
from simadmit.config.loading import load_scenario, scenario_from_dict  # noqa: E402
from simadmit.config.profile import (  # noqa: E402
    Profile,
    StepTimeModel,
    load_profile,
    save_profile,
    solo_service_s,
    summary_figures,
)
from simadmit.config.schema import ScenarioSpec  # noqa: E402
from simadmit.loadgen.plan import Plan, make_plan  # noqa: E402
from simadmit.loadgen.run import ReplayConfig, replay  # noqa: E402
from simadmit.loadgen.sender import AttemptResult  # noqa: E402
from simadmit.loadgen.tables import write_run  # noqa: E402
from simadmit.results.compare import Run, compare, load_runs, overall  # noqa: E402
from simadmit.results.compare_plots import write_cdfs  # noqa: E402
from simadmit.results.run_folder import write_folder  # noqa: E402
from simadmit.sim.world import build_world  # noqa: E402
from simadmit.study.runner import run_scenario  # noqa: E402

AZURE = "azure_llm_2023/AzureLLMInferenceTrace_conv_first2000.csv"
# The Azure conversation trace is close to Poisson over a minute (inter-arrival CV 1.14, and its rate curve
# in the first minute runs ~30% under its mean), so the bursty case is a gamma renewal with CV 3; `onoff`
# (bursts at 20x the calm rate lasting ~3 s, every ~20 s: a queue builds and drains within a run) and
# `trace` (the trace's fitted rate curve and burstiness) are there to run on request.
ARRIVALS = {
    "poisson": {"kind": "poisson"},
    "bursty": {"kind": "gamma", "cv": 3.0},
    "onoff": {"kind": "mmpp", "burst_factor": 20.0, "calm_s": 20.0, "burst_s": 3.0},
    "trace": {"kind": "fit", "trace": {"path": AZURE, "format": "azure"}, "bin_s": 10},
}
KEY = ("ttft_mean_s", "ttft_p99_s", "e2e_mean_s", "e2e_p99_s")


# The benchmark's own mix: chat requests (short prompts and answers) and a quarter of longer ones.
# `--workload scenario.yaml` replaces it with the tiers of a user's scenario.
TIERS = (
    {
        "name": "chat",
        "share": 3,
        "max_tokens": 128,
        "prompt_tokens": {"kind": "lognormal", "median": 128, "sigma": 0.6, "min": 16, "max": 1024},
        "output_tokens": {"kind": "lognormal", "median": 32, "sigma": 0.6, "min": 4, "max": 128},
    },
    {
        "name": "long",
        "share": 1,
        "max_tokens": 128,
        "prompt_tokens": {"kind": "lognormal", "median": 600, "sigma": 0.3, "min": 256, "max": 1400},
        "output_tokens": {"kind": "lognormal", "median": 64, "sigma": 0.4, "min": 8, "max": 128},
    },
)


def scenario(
    profile: Path,
    rate: float,
    arrival: str,
    duration_s: float,
    seed: int = 1,
    tiers: tuple[dict, ...] = TIERS,
) -> dict:
    """The workload (`tiers`, the benchmark's mix by default) at `rate` with `arrival`, on one replica."""
    return {
        "name": f"fidelity-{arrival}",
        "workload": {
            "seed": seed,
            "rate_rps": float(rate),
            "duration_s": float(duration_s),
            "arrival": ARRIVALS[arrival],
            "tiers": list(tiers),
        },
        "pools": [{"name": "cpu", "profile": str(profile), "replicas": 1}],
        "gateway": {"replicas": 1, "poll_interval_s": 0},
        "clients": {"max_retries": 0},
        "policies": [{"kind": "unconditional"}],
    }


MEASUREMENTS = "profile.measurements.csv"  # beside the profile.yaml `calibrate` writes
CALIBRATED_CONCURRENCY = 64  # the batches this server runs at 150% load (56-68 sequences measured)


def calibrate(
    url: str, out: Path, budget: str, max_concurrency: int = CALIBRATED_CONCURRENCY, attempts: int = 2
) -> Path:
    """`simadmit calibrate` on the running server into OUT/profile.yaml, with the server's batch limits,
    measuring decode batches as large as the loads replayed reach (`max_concurrency`), so the step cost
    there is measured rather than extrapolated. On this CPU a saturated batch of 64 takes about 75 s and each
    of the two rounds holds one, so a budget of 3 minutes runs about 6.5.

    A calibration whose rounds disagree by more than `DRIFT_WARNING` (its "unsteady machine" warning)
    measured a server whose speed changed under it, and predicts replays at neither speed: it is set aside
    under OUT/unsteady-K/ and the server calibrated again, up to `attempts` in all; the steadiest is kept."""
    profile = out / "profile.yaml"
    for k in range(1, attempts + 1):
        calibrate_once(url, profile, budget, max_concurrency)
        moved = unsteadiness(profile)
        if moved <= DRIFT_WARNING or k == attempts:
            break
        set_aside(out, out / f"unsteady-{k}")
        print(
            f"calibration {k} unsteady (a phase moved {moved:.0%} between its rounds): calibrating again",
            flush=True,
        )
    keep_steadiest(out)
    return profile


def calibrate_once(url: str, profile: Path, budget: str, max_concurrency: int) -> None:
    from tests.vllm_server import MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS

    cmd = [sys.executable, "-m", "simadmit.calibrate", "--endpoint", url, "--budget", budget,
           "--max-concurrency", str(max_concurrency), "--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens",
           str(MAX_NUM_BATCHED_TOKENS), "--gpu-name", "CPU", "--out", str(profile)]  # fmt: skip
    subprocess.run(cmd, check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def unsteadiness(profile: Path) -> float:
    """How far the calibration's slowest-to-agree phase moved between its rounds (the median over its
    cells, as the profile records it); 0 for a profile that records none."""
    drift = load_profile(profile).fit.get("drift_between_rounds") or {}
    assert isinstance(drift, dict)
    return max((abs(float(d["median"])) for d in drift.values()), default=0.0)


def set_aside(out: Path, folder: Path) -> None:
    """Move the calibration in `out` (its profile and measurements) into `folder`, keeping every row."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("profile.yaml", MEASUREMENTS):
        if (out / name).exists():
            (out / name).rename(folder / name)


def keep_steadiest(out: Path) -> None:
    """Of the calibration in `out` and those set aside under OUT/unsteady-K/, leave the steadiest in `out`
    (`unsteadiness`; the latest on a tie) and the others set aside."""
    aside = sorted(out.glob("unsteady-*"), key=lambda f: int(f.name.rsplit("-", 1)[1]))
    best = min([out, *aside], key=lambda f: unsteadiness(f / "profile.yaml"))
    if best != out:
        set_aside(out, out / f"unsteady-{len(aside) + 1}")
        set_aside(best, out)
        best.rmdir()


def burst(url: str, profile: Path, work: Path, requests: int, tiers: tuple[dict, ...]) -> list[AttemptResult]:
    """Send `requests` of the `tiers` mix at once to the server; the answers of those that completed."""
    doc = scenario(profile, 1000.0, "poisson", 1.0, tiers=tiers)
    doc["workload"] |= {"duration_s": None, "requests": requests}
    spec = scenario_from_dict(doc, work / "burst.yaml")
    run = replay(make_plan(spec, work), ReplayConfig(url), random.Random())
    return [a.result for a in run.attempts if a.result.status == "ok"]


def capacity(
    url: str, profile: Path, work: Path, requests: int = 60, tiers: tuple[dict, ...] = TIERS
) -> float:
    """Requests per second the server completes with every batch slot it can use busy: a burst of the
    workload's requests is sent at once and the rate is the burst over its makespan (first send to last
    finish). The requests of a burst share one batch and finish together, so a rate read between finishes
    would overstate it; the makespan includes the thinning tail, so this errs low, by a little."""
    done = burst(url, profile, work, requests, tiers)
    return len(done) / (max(r.finish for r in done) - min(r.sent for r in done))


# the speed probe: lone requests (prompt, output tokens), a prefill-heavy and a decode part; then a decode
# batch as loaded points hold (sequences sent at once, prompt, output tokens)
PROBE = (512, 16)
DECODE_PROBE = (8, 16, 48)
# a decode step's parts, which the decode factor scales; the rest is what a prompt adds
DECODE_TERMS = ("overhead_s", "weights_read_s", "per_decode_seq_s", "per_context_token_s")


@dataclass(frozen=True)
class Slowdown:
    """How many times its profile's step costs the server takes, per phase: `decode` on what a decode step is
    made of (overhead, weights, sequences, context), `prefill` on what a prompt adds (its tokens, their
    attention). On this CPU the two drift apart (a calibration's rounds: prefill -5%, decode +7%)."""

    prefill: float = 1.0
    decode: float = 1.0


def scaled_step(step: StepTimeModel, by: Slowdown) -> StepTimeModel:
    """`step` with each cost times its phase's factor."""
    costs = asdict(step)
    return StepTimeModel(
        **{k: v * (by.decode if k in DECODE_TERMS else by.prefill) for k, v in costs.items()}
    )


def slowed(profile: Profile, by: Slowdown | float) -> Profile:
    """`profile` with its step costs times the slowdown (a number: every cost times it)."""
    by = by if isinstance(by, Slowdown) else Slowdown(by, by)
    return replace(profile, step_time=scaled_step(profile.step_time, by))


def phase_slowdown(profile: Profile, prefill_s: float, decode_step_s: float) -> Slowdown:
    """The slowdown under which `profile` takes what the probe measured: a decode step of DECODE_PROBE's batch
    `decode_step_s` (its mean context: prompt and half the output), then a lone PROBE prompt's prefill
    `prefill_s`. The decode factor comes first, its parts being in every step; the prefill factor is what the
    prompt's own terms (its tokens, their attention) need on top: exact while they outweigh the weights' read,
    as a prompt of PROBE's length does."""
    n, prompt, output = DECODE_PROBE
    decode = decode_step_s / profile.step_time.step_time(0, n, n * (prompt + output / 2))
    budget = profile.engine.max_num_batched_tokens
    bare = replace(profile.step_time, weights_read_s=0.0)
    base = solo_service_s(scaled_step(bare, Slowdown(0.0, decode)), budget, PROBE[0])
    own = solo_service_s(scaled_step(bare, Slowdown(1.0, 0.0)), budget, PROBE[0])
    return Slowdown((prefill_s - base) / own, decode)


@dataclass(frozen=True)
class Probe:
    """What a speed probe read: a lone request's time over the profile's (`speed`, the results' column) and
    the per-phase slowdown that reproduces its prefill and a decode batch's steps."""

    speed: float
    slowdown: Slowdown


def probe_requests(
    url: str, profile: Path, work: Path, n: int, prompt: int, output: int
) -> list[AttemptResult]:
    """Send `n` requests of these lengths at once to the server and wait for their answers."""
    tier = TIERS[0] | {"max_tokens": output, "prompt_tokens": {"kind": "fixed", "value": prompt},
                       "output_tokens": {"kind": "fixed", "value": output}}  # fmt: skip
    return burst(url, profile, work, n, (tier,))


def speed_probe(url: str, profile: Path, work: Path, times: int = 3) -> Probe:
    """How slow the server is now against its profile: the median, over `times` lone requests of PROBE's
    size sent one after another to the idle server, of measured E2E / the profile's solo service time; and
    per phase, from those requests' first tokens and from a batch of DECODE_PROBE's sequences decoding
    together. Taken after calibrating and before every point, it shows the machine's speed drifting between
    the two (other jobs on a shared machine, CPU frequency): a simulation can only be as right as this is
    steady."""
    prof = load_profile(profile)
    predicted = (
        solo_service_s(prof.step_time, prof.engine.max_num_batched_tokens, *PROBE) + prof.api_latency_s
    )
    ratios, prefills = [], []
    for _ in range(times):
        for r in probe_requests(url, profile, work, 1, *PROBE):
            ratios.append((r.finish - r.sent) / predicted)
            prefills.append(r.first_token - r.sent - prof.api_latency_s)
        time.sleep(0.5)
    batch = probe_requests(url, profile, work, *DECODE_PROBE)
    steps = [(r.finish - r.first_token) / (r.output_tokens - 1) for r in batch if r.output_tokens > 1]
    if not ratios or not steps:
        return Probe(float("nan"), Slowdown(float("nan"), float("nan")))
    return Probe(float(median(ratios)), phase_slowdown(prof, float(median(prefills)), float(median(steps))))


def write_probe(folder: Path, probe: Probe, reference: Probe) -> float:
    """Record a repeat's probe in FOLDER/speed_probe.json: its speed over the `reference` reading (taken after
    calibrating), and its slowdown per phase against the profile. The relative speed."""
    speed = probe.speed / reference.speed
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "speed_probe.json").write_text(json.dumps({"speed": speed, **asdict(probe.slowdown)}) + "\n")
    return speed


def read_slowdown(folder: Path, reference: float = 1.0) -> Slowdown:
    """A repeat's slowdown against the profile from its speed_probe.json: per phase where the probe measured
    them, else its one speed times `reference` (the reference reading over the calibration's)."""
    probe = json.loads((folder / "speed_probe.json").read_text())
    if "prefill" in probe:
        return Slowdown(float(probe["prefill"]), float(probe["decode"]))
    return Slowdown(reference * float(probe["speed"]), reference * float(probe["speed"]))


@dataclass(frozen=True)
class Point:
    """One load point: its folder, and the request plan every repeat sends."""

    out: Path
    spec: ScenarioSpec
    base: Path
    plan: Plan


def prepare_point(
    profile: Path,
    rate: float,
    arrival: str,
    duration_s: float,
    out: Path,
    seed: int,
    tiers: tuple[dict, ...] = TIERS,
) -> Point:
    """Write the point's scenario under `out` and plan its requests (the same list for every repeat)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "scenario.yaml"
    path.write_text(
        yaml.safe_dump(scenario(profile, rate, arrival, duration_s, seed, tiers), sort_keys=False)
    )
    spec, base = load_scenario(path)
    return Point(out, spec, base, make_plan(spec, base))


def replay_repeat(url: str, point: Point, k: int) -> None:
    """Send the point's request list once, open-loop, into OUT/real/repeat-k."""
    time.sleep(2.0)  # let the server settle between runs
    run = replay(point.plan, ReplayConfig(url), random.Random())
    facts = write_run(run, point.spec, point.base, point.out / "real" / f"repeat-{k}", "real")
    lag = facts["send_lag_s"]
    print(f"  {point.out.name} repeat {k}: {facts['outcomes']} send lag p99 {1e3 * lag['p99']:.1f} ms, kept up: "  # type: ignore[index]
          f"{facts['kept_up']}, client CPU {facts['client']['cpu_share_of_one_core']:.0%}", flush=True)  # type: ignore[index]  # fmt: skip


def finish_point(point: Point, repeats: int, profile: Path | None = None) -> pd.DataFrame:
    """Simulate what the first repeat sent (on `profile`, else the one it was planned on), compare against
    every repeat, draw the CDFs; the compare table."""
    table = simulate_and_compare(point.out, repeats, profile)
    write_cdfs(load_runs(point.out / "sim", None), real_runs(point.out, repeats), ["all"], 0.0, point.out)
    return table


def run_point(url: str, profile: Path, rate: float, arrival: str, duration_s: float, repeats: int, out: Path,
              seed: int, tiers: tuple[dict, ...] = TIERS) -> pd.DataFrame:  # fmt: skip
    """Replay `repeats` times, simulate what the first repeat sent, compare; returns the compare table."""
    point = prepare_point(profile, rate, arrival, duration_s, out, seed, tiers)
    for k in range(1, repeats + 1):
        replay_repeat(url, point, k)
    return finish_point(point, repeats)


def real_runs(out: Path, repeats: int) -> list[Run]:
    """The real repeats under `out`, as `compare` reads them."""
    return [r for k in range(1, repeats + 1) for r in load_runs(out / "real" / f"repeat-{k}", None)]


def simulate_replayed(
    point: Path,
    into: Path,
    profile: Path | None = None,
    repeat: int = 1,
    slower: Slowdown | float = 1.0,
    replications: int = 1,
    engines: Path | None = None,
) -> None:
    """Simulate the request list a real repeat under `point` sent (the first by default; `replayed.yaml`; on
    `profile` if given, else the one it names) into the run folder `into`. The gateways always believe that
    profile, as the live ones did; the engines run on `engines` if given (a profile fitted after the live
    gateways were started, e.g. on calibrations before and after the replays), and with `slower` at that
    many times its step costs (per phase with a `Slowdown`) (`benchmarks/fidelity_speed.py`). `replications` > 1: that many draws of the
    clients' jitter on the same arrivals (consecutive seeds), for a workload whose clients retry."""
    replayed = point / "real" / f"repeat-{repeat}" / "replayed.yaml"
    doc = yaml.safe_load(replayed.read_text())
    if profile is not None:
        for pool in doc["pools"]:
            pool["profile"] = str(profile.resolve())
    spec, base = scenario_from_dict(doc, replayed), replayed.parent  # a replayed scenario has no variants
    world = build_world(spec, base)
    ran = load_profile(engines) if engines is not None else None
    pools = tuple(
        replace(p, profile=slowed(ran or p.profile, slower), believed=p.gateway_profile) for p in world.pools
    )
    result = run_scenario(spec, replace(world, pools=pools), replications=replications)
    write_folder(into, run_files(result, spec, base), {"command": "simulate", "partial": False})


def simulate_and_compare(
    out: Path, repeats: int, profile: Path | None = None, replications: int = 1, engines: Path | None = None
) -> pd.DataFrame:
    """Simulate what the first real repeat under `out` sent into OUT/sim (`simulate_replayed`) and write the
    compare table of the simulation (its replications combined) against every repeat to OUT/compare.csv."""
    simulate_replayed(out, out / "sim", profile, replications=replications, engines=engines)
    table = compare(load_runs(out / "sim", None), real_runs(out, repeats), 0.0)
    table.to_csv(out / "compare.csv", index=False)
    return table


def refit(out: Path) -> Path:
    """Fit the calibration measurements under `out` (and under OUT/after, if the run calibrated again after
    its replays) anew with the current step model and fit, into OUT/profile-refit.yaml (the profiles
    calibrated then are kept as they are)."""
    note = "Refitted from the run's calibration measurements by benchmarks/fidelity.py --resimulate."
    return fit_together(out / "profile.yaml", calibrations(out), out / "profile-refit.yaml", note)


def bracketed(out: Path) -> Path:
    """OUT/profile-bracketed.yaml: the calibrations under OUT (before the replays) and OUT/after, together."""
    note = "The calibrations before (profile.yaml) and after (after/) the replays, fitted together."
    return fit_together(out / "profile.yaml", calibrations(out), out / "profile-bracketed.yaml", note)


def calibrations(out: Path) -> list[Path]:
    """The measurements files of a run under `out`: its calibration, and the one after its replays if taken."""
    return [m for m in (out / MEASUREMENTS, out / "after" / MEASUREMENTS) if m.exists()]


def fit_together(profile_path: Path, measurements: list[Path], path: Path, note: str) -> Path:
    """The profile at `profile_path` fitted anew, with the current step model and fit, on the rows of every
    measurements file together (a calibration taken before a run and one after: the machine's drift in
    between weighs on the fit as on the run); written to `path`."""
    profile = load_profile(profile_path)
    rows = [r for file in measurements for r in read_measurements(file)]
    obs, _ = observations(rows, profile.engine.max_num_batched_tokens)
    measured = profile.fit.get("ttft_offset_source") == "measured"  # then the latency stays as measured
    fit = fit_step_model(obs, ttft_offset_s=profile.api_latency_s if measured else None)
    prefill, decode = summary_figures(
        fit.step, profile.engine, profile.kv_capacity_tokens, profile.gpus_per_replica
    )
    refitted = replace(
        profile,
        step_time=fit.step,
        api_latency_s=api_latency_s(fit),
        prefill_tokens_per_gpu_s=round(prefill, 2),
        decode_tokens_per_gpu_s=round(decode, 2),
        fit={**profile.fit, **fit.report()},
        warnings=tuple(fit_warnings(fit, obs)),
    )
    save_profile(refitted, path, note)
    return path


def resimulate(out: Path, repeats: int) -> str:
    """Simulate the runs already under `out` anew on its refitted calibration; the results table."""
    profile = refit(out)
    before = json.loads((out / "results.json").read_text())
    rows = []
    for r in before["rows"]:
        load = float(str(r["load"]).rstrip("%")) / 100
        where = out / f"{r['arrivals']}-{load:g}"
        table = simulate_and_compare(where, repeats, profile)
        n = len(pd.read_parquet(where / "sim" / "requests.parquet"))
        rows.append(row(str(r["arrivals"]), load, float(r["req/s"]), table, n, str(r["probe"])))
    header = (f"re-simulated {datetime.now(UTC):%Y-%m-%d %H:%M} UTC on {profile.name} (the same calibration "
              f"measurements, fitted anew); real runs as in results.md")  # fmt: skip
    text = header + "\n\n" + markdown(pd.DataFrame(rows)) + "\n"
    (out / "results-refit.md").write_text(text)
    return text


def row(
    arrival: str, load: float, rate: float, table: pd.DataFrame, requests: int, probe: list[float] | str
) -> dict[str, object]:
    """The results table's row of a point; `probe`: its speed probes (a range is shown), or as already shown."""
    speed = probe if isinstance(probe, str) else f"{min(probe):.2f}-{max(probe):.2f}"
    t = table[table["tier"] == "all"].set_index("measure")
    cells: dict[str, object] = {"arrivals": arrival, "load": f"{load:.0%}", "req/s": f"{rate:.2f}",
                                "requests": requests, "probe": speed}  # fmt: skip
    for m in KEY:
        r = t.loc[m]
        cells[m] = (f"{r['sim']:.2f} / {r['real_mean']:.2f} ({r['real_min']:.2f}-{r['real_max']:.2f}) "
                    f"{100 * r['error']:+.0f}% {'ok' if str(r['verdict']).startswith('pass') else 'FAIL'}")  # fmt: skip
    cells["verdict"] = "pass" if overall(table[table["tier"] == "all"]) else "fail"
    return cells


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/fidelity"))
    ap.add_argument("--loads", default="0.3,0.6,0.9,1.2,1.5", help="fractions of the measured capacity")
    ap.add_argument("--arrivals", default="poisson,bursty", help=f"of {', '.join(ARRIVALS)}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per run (at least)")
    ap.add_argument("--min-requests", type=int, default=20,
                    help="a point's runs last long enough for this many requests at its rate")  # fmt: skip
    ap.add_argument("--calibrate-budget", default="3m")
    ap.add_argument("--calibrate-concurrency", type=int, default=CALIBRATED_CONCURRENCY,
                    help="largest decode batch the calibration measures")  # fmt: skip
    ap.add_argument("--calibrate-after", action=argparse.BooleanOptionalAction, default=False,
                    help="calibrate again after the replays and simulate on both calibrations fitted together")  # fmt: skip
    ap.add_argument("--endpoint", help="use this running server instead of starting one")
    ap.add_argument("--profile", type=Path, help="use this profile instead of calibrating")
    ap.add_argument("--capacity", type=float, help="use this capacity (req/s) instead of measuring it")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--workload", type=Path, help="replay the tiers of this scenario instead of the benchmark's mix"
    )
    ap.add_argument("--resimulate", action="store_true",
                    help="no server: refit the calibration under --out and simulate its runs anew")  # fmt: skip
    args = ap.parse_args()
    if args.resimulate:
        print(resimulate(args.out, args.repeats))
        return
    if (args.out / "results.md").exists():
        sys.exit(f"{args.out} already holds results; choose another --out")
    tiers = workload_tiers(args.workload) if args.workload else TIERS
    args.out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    started = datetime.now(UTC)
    with ExitStack() as stack:
        url = args.endpoint or stack.enter_context(start_server(args.out))
        placement = isolate_engine()  # after the server started; what this process starts inherits it
        print(placement, flush=True)
        profile = args.profile or calibrate(url, args.out, args.calibrate_budget, args.calibrate_concurrency)
        cap = args.capacity or capacity(url, profile, args.out, tiers=tiers)
        print(f"capacity: {cap:.2f} requests/s", flush=True)
        reference = speed_probe(url, profile, args.out)
        print(f"speed probe after calibrating: {reference.speed:.2f} x the profile's solo time, "
              f"{reference.slowdown}", flush=True)  # fmt: skip
        points = [
            (arrival, load, prepare_point(profile, load * cap, arrival, point_duration(load * cap, args.duration, args.min_requests),
                                          args.out / f"{arrival}-{load:g}", args.seed, tiers))
            for arrival in args.arrivals.split(",")
            for load in (float(x) for x in args.loads.split(","))
        ]  # fmt: skip
        probes: dict[Path, list[float]] = {p.out: [] for _, _, p in points}
        for k in range(1, args.repeats + 1):  # round k replays every point once: drift spreads over all
            for arrival, load, point in points:
                probe = speed_probe(url, profile, args.out)
                speed = write_probe(point.out / "real" / f"repeat-{k}", probe, reference)
                probes[point.out].append(speed)
                print(
                    f"round {k}: {arrival} at {load:.0%} ({load * cap:.2f} req/s), speed probe {speed:.2f}, "
                    f"{probe.slowdown}",
                    flush=True,
                )
                replay_repeat(url, point, k)
        simulated_on = profile
        if args.calibrate_after and not args.profile:  # the drift since the first weighs on the model too
            calibrate(url, args.out / "after", args.calibrate_budget, args.calibrate_concurrency)
            simulated_on = bracketed(args.out)
        rows = []
        for arrival, load, point in points:
            table = finish_point(point, args.repeats, simulated_on)
            n = len(pd.read_parquet(point.out / "sim" / "requests.parquet"))
            duration = point_duration(load * cap, args.duration, args.min_requests)
            rows.append(row(arrival, load, n / duration, table, n, probes[point.out]))
    load_after = os.getloadavg()
    results = pd.DataFrame(rows)
    header = (f"{started:%Y-%m-%d %H:%M} UTC, {platform.node()}: {cpu_model()}, {os.cpu_count()} CPUs; load average "
              f"{load_before[0]:.1f} before, {load_after[0]:.1f} after; {placement}; capacity {cap:.2f} req/s; {args.repeats} "
              f"repeats of {args.duration:.0f} s or as long as {args.min_requests} requests take at the point's rate; probe: a lone request's time before each replay of the point over its time "
              f"after calibrating (range over the rounds); simulated on {simulated_on.name}; cells: sim / real mean (real range) error")  # fmt: skip
    text = header + "\n\n" + markdown(results) + "\n"
    (args.out / "results.md").write_text(text)
    (args.out / "results.json").write_text(json.dumps({"capacity_rps": cap, "rows": rows}, indent=2) + "\n")
    print(text)


def point_duration(rate: float, duration_s: float, min_requests: int) -> float:
    """Seconds of arrivals for a point at `rate`: `duration_s`, or longer where that would draw fewer than
    `min_requests` on average (a light load's point of a few requests judges nothing)."""
    return max(duration_s, min_requests / rate)


def workload_tiers(path: Path) -> tuple[dict, ...]:
    """The tiers of the scenario at `path`, checked as the benchmark's scenario (on the bundled CPU profile)
    before any server starts, so a bad file stops here with its error; their distributions may not name files."""
    try:
        tiers = tuple(yaml.safe_load(path.read_text())["workload"]["tiers"])
        scenario_from_dict(scenario(Path("smollm2-135m-cpu"), 1.0, "poisson", 1.0, tiers=tiers), path)
    except InputError as e:
        sys.exit("\n".join(e.problems))
    except (OSError, KeyError, TypeError, yaml.YAMLError) as e:
        sys.exit(f"{path}: workload.tiers: {e}")
    return tiers


def markdown(table: pd.DataFrame) -> str:
    lines = ["| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(str(v) for v in r) + " |" for r in table.itertuples(index=False)]
    return "\n".join(lines)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def engine_threads() -> tuple[list[str], list[int]]:
    """(process ids, thread ids) of vLLM's engine here: its scheduler, `VLLM::EngineCore`, and its model
    worker, `VLLM::Worker` (only one server runs, under the lock)."""
    processes, threads = [], []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/comm").read_text().startswith(("VLLM::Worker", "VLLM::EngineCor")):
                threads += [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
                processes.append(pid)
        except OSError:  # gone
            continue
    return processes, threads


def isolate_engine() -> str:
    """Give vLLM's engine (`engine_threads`) the first core this process may use to itself and put this
    process (and what it starts) on the others.

    On 2 cores the engine's steps are what is measured: a load client, API server or calibration sharing
    the worker's core slows every step (by 10-25% in one trial), and so does one sharing the scheduler's (a
    busy loop on the API server's core slowed a lone decode by 11% with the scheduler there, 5% with it
    beside the worker), so the placement is set here rather than left to how the server bound its threads.
    Every thread of those processes is moved. Returns what was done, for the results header."""
    if not hasattr(os, "sched_setaffinity"):
        return "no core placement (not on this system)"
    engine_core, *others = sorted(os.sched_getaffinity(0))  # a container may allow cores other than 0 and 1
    if not others:
        return "no core placement (one core)"
    processes, threads = engine_threads()
    for tid in threads:
        with suppress(OSError):  # gone, or not ours to move
            os.sched_setaffinity(tid, {engine_core})
    os.sched_setaffinity(0, set(others))
    rest = f"core{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}"
    return (
        f"vLLM engine {', '.join(processes)} alone on core {engine_core}, the rest on {rest}"
        if processes
        else "no local worker"
    )


@contextmanager
def engine_alone() -> Iterator[str]:
    """`isolate_engine` for the length of a block (a test's): the engine's threads and this process get
    their own cores back after it, so what runs next shares the machine as before."""
    if not hasattr(os, "sched_getaffinity"):
        yield isolate_engine()
        return
    before = {tid: os.sched_getaffinity(tid) for tid in engine_threads()[1]}
    mine = os.sched_getaffinity(0)
    try:
        yield isolate_engine()
    finally:
        os.sched_setaffinity(0, mine)
        for tid, cores in before.items():
            with suppress(OSError):
                os.sched_setaffinity(tid, cores)


def start_server(out: Path, kv_cache_gib: int = 2, extra_args: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
    """The tests' SmolLM2 server (provisioned on first use), stopped when the benchmark ends; its KV cache
    `kv_cache_gib` GiB (2: 93,184 tokens in bfloat16), `extra_args` after the tests' arguments."""
    from simadmit.calibrate.launch import launched_server
    from tests.vllm_server import provision, server_args

    python, model_dir = provision()
    env = {
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CACHE_ROOT": str(out / "vllm-cache"),
    }
    return launched_server(
        str(model_dir), [*server_args(), *extra_args], str(python), out / "server.log", timeout_s=600, env=env
    )


if __name__ == "__main__":
    main()
