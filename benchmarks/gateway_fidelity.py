"""Fidelity of the admission layer: `simadmit replay` through live `simadmit gateway` processes in front of a
real vLLM CPU server, against `simadmit simulate` of the very requests sent, with the same gateways.

One tier (prompts lognormal around 128 tokens, sent as random token ids so nothing hits the prefix cache;
64 output tokens with `ignore_eos`, so the truth equals `max_tokens` and both sides charge the same work);
GPU-seconds admission (pool budget `max_pool_gpu_seconds` 12 x headroom 0.9) or `predicted_ttft` (the chat
tier's first token predicted within 3 s, from each backend's gauges and the profile's engine model); clients
that retry twice, honouring Retry-After plus a jittered backoff (the default scenario's clients). For each
policy, each load (a fraction of the capacity measured with a burst) and each number of gateway replicas
(separate OS processes, each polling vLLM's `/metrics` every 200 ms into its own view; the attempts go to
them in turn, as a round-robin load balancer sends them), the request list is replayed `--repeats` times
with fresh gateways each time (in rounds, every point once per round, so the machine's drift over the hour
spreads over every point), the request list the first repeat sent (`replayed.yaml`) is simulated with the
same gateway replicas and poll interval over SIM_DRAWS draws of the clients' jitter, and `compare` sets them
side by side: rejection rate and latencies of admitted requests. The live gateway's own latency (reading a
request, proxying it there and back) is measured once on the idle server, lone requests through a gateway
against straight to the server, and set as `gateway.latency_s` on both sides (`--gateway-latency` gives it).
With `--calibrate-after` the server is calibrated again after the replays and the simulated engines run on
both calibrations fitted together (OUT/profile-bracketed.yaml), while the simulated gateways believe the
first, as the live ones did: a drift of the machine between calibrating and replaying then weighs on the
simulated engines as it did on the real one, and the gateways' errors of belief stay what they were (off by
default, as in `benchmarks/fidelity.py`: a second calibration right after the replays has read the engine
slower than the replays ran).

Beside `compare`, the pool budget: the admitted in-flight GPU-seconds (each admitted attempt charged its
estimate from its send to its last byte in reality, from admission to finish in the simulation) against the
budget line (12 x 0.9), and, in reality, why the gateways let it pass: what each gateway's view held at each
admission (its `X-Queue-Predict-Wait` x GPUs, the work in flight before that request) against the truth at
that instant; the part of the gap that is other gateways' admits since the last poll (staleness); what
vLLM's `/metrics` counted (running + waiting, polled every 200 ms) against the requests admitted and
unfinished; and the price a view puts on another
gateway's requests (its moving mean of the estimates it charged) against their actual mean.

Starts the tests' vLLM server (tests/vllm_server.py) unless given `--endpoint`; run it alone, under the lock:

    flock /tmp/vllm.lock python benchmarks/gateway_fidelity.py --out runs/gateway-fidelity \
        [--profile PROFILE] [--capacity RPS] [--loads 0.6,1,1.5] [--gateways 1,2] [--repeats 3] [--duration 45]

`--workload scenario.yaml` sends the tiers of another scenario instead of the chat tier (each tier gets the
same budgets; the pool budget and the analysis price a request at its `max_tokens`, as the gateway does).

It prints the table (the README's) and writes it to OUT/results.md, with each point's runs and `compare`
report under OUT/<policy>-g<gateways>-<load>/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np
import pandas as pd
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.fidelity import (  # noqa: E402
    Probe,
    bracketed,
    calibrate,
    cpu_model,
    isolate_engine,
    markdown,
    simulate_and_compare,
    speed_probe,
    start_server,
    workload_tiers,
    write_probe,
)
from simadmit.admission.estimator import CostEstimator  # noqa: E402
from simadmit.admission.published import prior_price  # noqa: E402
from simadmit.calibrate.api_latency import measure_gateway_latency  # noqa: E402
from simadmit.calibrate.client import discover  # noqa: E402
from simadmit.config.loading import load_scenario, scenario_from_dict  # noqa: E402
from simadmit.config.schema import ScenarioSpec  # noqa: E402
from simadmit.loadgen.plan import Plan, make_plan  # noqa: E402
from simadmit.loadgen.run import ReplayConfig, replay  # noqa: E402
from simadmit.loadgen.tables import write_run  # noqa: E402
from simadmit.serve.backends import LivePool  # noqa: E402
from simadmit.sim.world import build_world  # noqa: E402

OUTPUT = 64
MAX_POOL_GPU_S = 12.0
HEADROOM = 0.9
BUDGET_LINE = MAX_POOL_GPU_S * HEADROOM
POLL_S = 0.2
KEY = ("ttft_mean_s", "ttft_p99_s", "e2e_mean_s", "e2e_p99_s", "itl_mean_s")
TTFT_BUDGET_S = 3.0  # predicted_ttft: admit while the chat tier's first token is predicted within this
# Clients back off with full jitter, so one simulation of a request list is one draw of its retry times:
# the simulated figures are over this many draws (on the same arrivals), as the real ones are over repeats.
SIM_DRAWS = 10
POLICIES = ("gpu_seconds", "predicted_ttft")
TIERS = (
    {"name": "chat", "max_tokens": OUTPUT,
     "prompt_tokens": {"kind": "lognormal", "median": 128, "sigma": 0.5, "min": 16, "max": 512},
     "output_tokens": {"kind": "fixed", "value": OUTPUT}},
)  # fmt: skip


def policy_doc(policy: str, tiers: list[str]) -> dict:
    """The benchmark's `policy`, with the same budgets for every tier."""
    if policy == "gpu_seconds":
        return {"kind": "gpu_seconds", "budgets_s": dict.fromkeys(tiers, 12.0), "headroom": HEADROOM,
                "max_pool_gpu_seconds": MAX_POOL_GPU_S}  # fmt: skip
    return {"kind": "predicted_ttft", "budgets_s": dict.fromkeys(tiers, TTFT_BUDGET_S),
            "e2e_budgets_s": dict.fromkeys(tiers, 5 * TTFT_BUDGET_S)}  # fmt: skip


def scenario(
    profile: Path,
    rate: float,
    duration_s: float,
    policy: str,
    gateways: int,
    seed: int = 11,
    tiers: tuple[dict, ...] = TIERS,
    latency_s: float = 0.0,
) -> dict:
    """The workload (`tiers`, the chat tier by default) at `rate` through `gateways` replicas of `policy`,
    each adding `latency_s` of its own to every request (`gateway.latency_s`)."""
    return {
        "name": f"gateway-fidelity-{policy}-g{gateways}",
        "workload": {"seed": seed, "rate_rps": float(rate), "duration_s": float(duration_s), "tiers": list(tiers)},
        "pools": [{"name": "cpu", "profile": str(profile), "replicas": 1}],
        "gateway": {"replicas": gateways, "poll_interval_s": POLL_S, "latency_s": latency_s},
        "clients": {"max_retries": 2, "honor_retry_after": True,
                    "backoff": {"base_s": 1.0, "cap_s": 20.0, "jitter": "full"}},
        "policies": [policy_doc(policy, [t["name"] for t in tiers])],
    }  # fmt: skip


def priced_at(spec: ScenarioSpec, estimator: CostEstimator) -> float:
    """What a fresh gateway prices another gateway's request at (`prior_price` over the tiers)."""
    return prior_price(estimator, [t.max_tokens or 0 for t in spec.workload.tiers])


def write_scenario(doc: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def capacity(
    url: str, profile: Path, work: Path, requests: int = 48, tiers: tuple[dict, ...] = TIERS
) -> float:
    """Requests per second the server completes with a burst of the workload's requests in flight (the
    burst over its makespan, first send to last finish: errs low, by the thinning tail)."""
    doc = scenario(profile, 1000.0, 1.0, "gpu_seconds", 1, tiers=tiers)
    doc["workload"] |= {"duration_s": None, "requests": requests}
    spec = scenario_from_dict(doc, work / "capacity.yaml")
    run = replay(make_plan(spec, work), ReplayConfig(url), random.Random())
    done = [a.result for a in run.attempts if a.result.status == "ok"]
    return len(done) / (max(r.finish for r in done) - min(r.sent for r in done))


def gateway_latency(url: str, profile: Path, work: Path, requests: int = 12) -> float:
    """The live gateway's own latency (`measure_gateway_latency`): lone short requests through one gateway
    process and straight to the server, in turns, on the idle server; 0 when it cannot be measured."""
    path = write_scenario(scenario(profile, 1.0, 1.0, "gpu_seconds", 1), work / "gateway-latency.yaml")

    async def measure(gateway: str) -> float | None:
        async with httpx.AsyncClient(timeout=60) as client:
            endpoint = await discover(client, url, None)
            return await measure_gateway_latency(client, endpoint, gateway, requests)

    with gateways(path, url, "gpu_seconds", 1, work / "gateway-latency-logs") as urls:
        measured = asyncio.run(measure(urls[0]))
    return 0.0 if measured is None else measured


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def gateways(scenario_file: Path, backend: str, policy: str, n: int, logs: Path) -> Iterator[list[str]]:
    """`n` `simadmit gateway` processes in front of `backend`, each with its own view; stopped at the end."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    procs, urls = [], []
    logs.mkdir(parents=True, exist_ok=True)
    for k in range(n):
        port = free_port()
        log = (logs / f"gateway-{k}.log").open("wb")
        procs.append(subprocess.Popen(
            [sys.executable, "-c", "from simadmit.cli import app; app()", "gateway", "--scenario", str(scenario_file),
             "--backend", backend, "--policy", policy, "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        ))  # fmt: skip
        urls.append(f"http://127.0.0.1:{port}")
    try:
        for url, proc in zip(urls, procs, strict=True):
            for _ in range(600):
                if proc.poll() is not None:
                    raise RuntimeError(f"a gateway exited ({proc.returncode}); see {logs}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                time.sleep(0.1)
        time.sleep(2 * POLL_S)  # every view has polled
        yield urls
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


# --- the pool budget --------------------------------------------------------------------------------------


def level_at(times: np.ndarray, starts: np.ndarray, ends: np.ndarray, work: np.ndarray) -> np.ndarray:
    """Sum of `work` over the intervals [start, end) open at each of `times`."""
    opened = (starts[None, :] <= times[:, None]) & (times[:, None] < ends[None, :])
    return np.asarray(opened @ work, dtype=float)


def admitted_intervals(
    req: pd.DataFrame, estimator: CostEstimator, start: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start, end, estimate) of every admitted attempt; an attempt that never finished ends when answered."""
    a = req[req["decision"] == "admit"]
    s = a[start].to_numpy(dtype=float)
    e = a["finish_s"].fillna(a["admit_s"]).to_numpy(dtype=float)
    w = estimator.estimate_many(a["prompt_tokens"].to_numpy(), a["max_tokens"].to_numpy())
    return s, e, np.asarray(w, dtype=float)


def price_of_others(req: pd.DataFrame, estimator: CostEstimator, prior: float) -> float:
    """Mean, over admissions, of (the price a gateway puts on one request of another gateway: the mean of
    the estimates it made, admitted or not, kept by `serve.backends.LivePool`) / (the actual mean estimate of
    the requests admitted)."""
    priced = req[req["reason"] != "too_long"].sort_values("attempt_s")
    w = estimator.estimate_many(priced["prompt_tokens"].to_numpy(), priced["max_tokens"].to_numpy())
    admitted = (priced["decision"] == "admit").to_numpy()
    actual = float(np.mean(w[admitted])) if admitted.any() else float("nan")
    books: dict[int, LivePool] = {}
    ratios = []
    for g, est, prompt, admit in zip(priced["gateway"].tolist(), w.tolist(), priced["prompt_tokens"].tolist(),
                                     admitted.tolist(), strict=True):  # fmt: skip
        pool = books.setdefault(g, LivePool("p", ["http://b"], 1, 1, prior, "unavailable"))
        if admit:
            ratios.append(pool.mean_estimate / actual)
        pool.priced(est, int(prompt))
    return float(np.mean(ratios)) if ratios else float("nan")


@dataclass(frozen=True)
class Budget:
    """One run's pool budget figures (GPU-seconds; counts in requests)."""

    peak: float  # most admitted work in flight
    view_gap_mean: float  # truth before the admission - view, mean over admissions
    view_gap_at_peak: float  # that gap at the admissions that took the truth past the line (mean; 0: none)
    stale_at_peak: float  # other gateways' admits in the poll interval before those admissions (mean)
    uncounted_at_peak: float  # others' requests in flight at the last poll that vLLM's count left out (mean)
    vllm_count_gap: float  # admitted-and-unfinished requests - vLLM's running + waiting, mean over polls
    price_ratio: float  # price of another gateway's request / its actual mean estimate (NaN: one gateway)
    largest_estimate: float  # the largest estimate admitted


def view_gap(req: pd.DataFrame, estimator: CostEstimator, start: str) -> tuple[np.ndarray, np.ndarray]:
    """At each admission: the admitted work in flight with it (what passes the line), and the truth before
    it minus the gateway's view (its predicted wait x GPUs, one GPU here: the in-flight work the policy
    decided on, which leaves the request out). NaN gaps where the table has no predicted wait."""
    s, e, w = admitted_intervals(req, estimator, start)
    truth = level_at(s, s, e, w)
    admitted = req[req["decision"] == "admit"]
    view = admitted["predicted_wait_s"].to_numpy(dtype=float) if "predicted_wait_s" in req else np.nan
    return truth, truth - w - view


def real_budget(folder: Path, estimator: CostEstimator, prior: float) -> Budget:
    req = pd.read_parquet(folder / "requests.parquet")
    s, e, w = admitted_intervals(req, estimator, "attempt_s")
    truth, gap = view_gap(req, estimator, "attempt_s")
    a = req[req["decision"] == "admit"]
    gw = a["gateway"].to_numpy()
    over = truth > BUDGET_LINE
    stale = np.array(
        [w[(gw != g) & (s < t) & (s >= t - POLL_S)].sum() for t, g in zip(s[over], gw[over], strict=True)]
    )
    series = pd.read_parquet(folder / "timeseries.parquet")
    t = series["t_s"].to_numpy(dtype=float)
    counted = level_at(t, s, e, np.ones_like(w))
    engine = (series["running"] + series["queued"]).to_numpy(dtype=float)
    busy = counted > 0
    several = a["gateway"].nunique() > 1
    uncounted = []  # what a view built at the poll before each over-the-line admission missed of the others
    for at, g in zip(s[over], gw[over], strict=True):
        k = np.searchsorted(t, at) - 1
        if k < 0 or not several:
            continue
        mine = gw == g
        own = level_at(t[k : k + 1], s[mine], e[mine], np.ones(mine.sum()))[0]
        others = level_at(t[k : k + 1], s[~mine], e[~mine], np.ones((~mine).sum()))[0]
        uncounted.append((others - max(0.0, engine[k] - own)) * float(w.mean()))
    return Budget(
        float(truth.max()) if len(truth) else 0.0,
        float(np.nanmean(gap)) if len(gap) else float("nan"),
        float(np.nanmean(gap[over])) if over.any() else 0.0,
        float(stale.mean()) if len(stale) else 0.0,
        float(np.mean(uncounted)) if uncounted else float("nan"),
        float(np.mean(counted[busy] - engine[busy])) if busy.any() else float("nan"),
        price_of_others(req, estimator, prior) if several else float("nan"),
        float(w.max()) if len(w) else 0.0,
    )


def sim_budget(folder: Path, estimator: CostEstimator) -> tuple[float, float]:
    """The simulation's peak admitted work in flight (mean over its draws) and its gateways' mean view gap
    (`view_gap`, over the admissions of every draw)."""
    req = pd.read_parquet(folder / "requests.parquet")
    draws = [view_gap(one, estimator, "admit_s") for _, one in req.groupby("seed")]
    peak = [float(truth.max()) if len(truth) else 0.0 for truth, _ in draws]
    gap = np.concatenate([g for _, g in draws])
    return float(np.mean(peak)), (float(np.nanmean(gap)) if np.isfinite(gap).any() else math.nan)


# --- one point ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    table: pd.DataFrame  # `compare`'s
    budgets: list[Budget]  # per real repeat
    sim_peak: float
    sim_view_gap: float  # mean over the simulated admissions, as Budget.view_gap_mean
    requests: int
    probes: list[float]  # the speed probe before each real repeat, over its reading after calibrating


@dataclass(frozen=True)
class Planned:
    """One point before its runs: its folder, scenario and the request list every repeat sends."""

    out: Path
    path: Path  # its scenario.yaml
    spec: ScenarioSpec
    base: Path
    plan: Plan
    policy: str
    n_gateways: int


def prepare_point(
    profile: Path,
    policy: str,
    n_gateways: int,
    rate: float,
    duration_s: float,
    out: Path,
    tiers: tuple[dict, ...] = TIERS,
    latency_s: float = 0.0,
) -> Planned:
    """Write the point's scenario under `out` and plan its requests (the same list for every repeat)."""
    doc = scenario(profile, rate, duration_s, policy, n_gateways, tiers=tiers, latency_s=latency_s)
    path = write_scenario(doc, out / "scenario.yaml")
    spec, base = load_scenario(path)
    return Planned(out, path, spec, base, make_plan(spec, base), policy, n_gateways)


def replay_repeat(url: str, profile: Path, point: Planned, k: int, reference: Probe | None) -> None:
    """Replay the point's request list once through fresh gateways into OUT/real/repeat-k. Before it, the
    speed probe (`benchmarks.fidelity.speed_probe`) over its `reference` reading: a repeat whose probe strays
    from 1 ran on a server faster or slower than the one calibrated, which the latencies (and so the
    predicted-TTFT policy's decisions) follow. No probe without a reference."""
    time.sleep(2.0)  # let the server settle between runs
    where = point.out / "real" / f"repeat-{k}"
    where.mkdir(parents=True, exist_ok=True)
    speed = math.nan
    if reference is not None:
        speed = write_probe(where, speed_probe(url, profile, point.out), reference)
    with gateways(point.path, url, point.policy, point.n_gateways, where / "logs") as urls:
        cfg = ReplayConfig(urls[0], more_endpoints=tuple(urls[1:]), server=url,
                           metrics_interval_s=POLL_S)  # fmt: skip
        run = replay(point.plan, cfg, random.Random())
    facts = write_run(run, point.spec, point.base, where, "real")
    estimator = build_world(point.spec, point.base).pools[0].estimator
    budget = real_budget(where, estimator, priced_at(point.spec, estimator))
    lag = facts["send_lag_s"]
    print(f"  repeat {k} (speed probe {speed:.2f}): {facts['outcomes']} send lag p99 {1e3 * lag['p99']:.1f} ms, kept up "  # type: ignore[index]
          f"{facts['kept_up']}; {budget}", flush=True)  # fmt: skip


def finish_point(point: Planned, repeats: int, engines: Path | None = None) -> Point:
    """Simulate what the first repeat sent, over SIM_DRAWS draws of the clients' jitter, and compare; the
    gateways believe the scenario's profile, as the live ones did, and the engines run on `engines` if given."""
    simulate_and_compare(point.out, repeats, replications=SIM_DRAWS, engines=engines)
    return load_point(point.out)


def run_point(url: str, profile: Path, policy: str, n_gateways: int, rate: float, duration_s: float,
              repeats: int, out: Path, reference: Probe | None = None) -> Point:  # fmt: skip
    """Replay `repeats` times back to back through fresh gateways (`replay_repeat`), then simulate and
    compare (`finish_point`)."""
    point = prepare_point(profile, policy, n_gateways, rate, duration_s, out)
    for k in range(1, repeats + 1):
        replay_repeat(url, profile, point, k, reference)
    return finish_point(point, repeats)


def load_point(out: Path) -> Point:
    """A point's figures from its folder (`compare.csv`, the real repeats, the simulation)."""
    spec, base = load_scenario(out / "scenario.yaml")
    estimator = build_world(spec, base).pools[0].estimator
    prior = priced_at(spec, estimator)
    repeats = sorted((out / "real").glob("repeat-*"), key=lambda d: int(d.name.split("-")[1]))
    budgets = [real_budget(d, estimator, prior) for d in repeats]
    table = pd.read_csv(out / "compare.csv")
    probes = [json.loads((d / "speed_probe.json").read_text())["speed"] for d in repeats
              if (d / "speed_probe.json").exists()]  # fmt: skip
    return Point(
        table, budgets, *sim_budget(out / "sim", estimator), len(make_plan(spec, base).workload), probes
    )


def tabulate(out: Path) -> str:
    """The table again from an earlier run's folders (the measures recomputed, no server needed)."""
    rows = []
    for where in sorted(
        out.glob("*-g*-*"),
        key=lambda d: (d.name.rsplit("-g", 1)[0], *map(float, d.name.rsplit("-g", 1)[1].split("-"))),
    ):
        policy, rest = where.name.rsplit("-g", 1)
        n, load = rest.split("-", 1)
        rows.append(row(policy, int(n), float(load), load_point(where)))
    header = (out / "results.md").read_text().splitlines()[0] if (out / "results.md").exists() else ""
    return header + "\n\n" + markdown(pd.DataFrame(rows)) + "\n"


def spread(values: list[float], fmt: str) -> str:
    v = [x for x in values if x == x]
    if not v:
        return "-"
    mean = fmt.format(float(np.mean(v)))
    return mean if len(v) == 1 else f"{mean} ({fmt.format(min(v))}-{fmt.format(max(v))})"


def row(policy: str, n: int, load: float, point: Point) -> dict[str, object]:
    t = point.table
    t = t[t["tier"] == "all"].set_index("measure")
    keys = ["sim", "real_mean", "real_min", "real_max"]
    rej = dict(zip(keys, t.loc["rejection_rate", keys].to_numpy(dtype=float).tolist(), strict=True))
    real_rej = [rej["real_min"], rej["real_max"]]
    gap = 100 * (rej["sim"] - rej["real_mean"])
    inside = real_rej[0] <= rej["sim"] <= real_rej[1]
    cells: dict[str, object] = {
        "policy": policy, "gateways": n, "load": f"{load:.0%}", "requests": point.requests,
        "probe": f"{min(point.probes):.2f}-{max(point.probes):.2f}" if point.probes else "-",
        "rejected": f"{100 * rej['sim']:.1f}% / {100 * rej['real_mean']:.1f}% ({100 * real_rej[0]:.1f}-"
                    f"{100 * real_rej[1]:.1f}) {gap:+.1f} pt {'ok' if abs(gap) <= 2 or inside else 'FAIL'}",
    }  # fmt: skip
    for m in KEY:
        r = t.loc[m]
        d = 3 if m.startswith("itl") else 2  # per-token times are tens of milliseconds
        cells[m] = (f"{r['sim']:.{d}f} / {r['real_mean']:.{d}f} ({r['real_min']:.{d}f}-{r['real_max']:.{d}f}) "
                    f"{100 * r['error']:+.0f}%")  # fmt: skip
        if r["verdict"] == r["verdict"]:  # a measure with a target (compare leaves the others' verdict empty)
            cells[m] += " ok" if str(r["verdict"]).startswith("pass") else " FAIL"
    b = point.budgets
    cells["peak GPU-s sim / real"] = f"{point.sim_peak:.1f} / " + spread([x.peak for x in b], "{:.1f}")
    cells["view gap sim / real"] = f"{point.sim_view_gap:.2f} / " + spread(
        [x.view_gap_mean for x in b], "{:.2f}"
    )
    cells["view gap over the line"] = spread([x.view_gap_at_peak for x in b], "{:.2f}")
    cells["of it stale"] = spread([x.stale_at_peak for x in b], "{:.2f}")
    cells["of it uncounted by vLLM"] = spread([x.uncounted_at_peak for x in b], "{:.2f}")
    cells["vLLM count gap"] = spread([x.vllm_count_gap for x in b], "{:.2f}")
    cells["price of others"] = spread([x.price_ratio for x in b], "{:.2f}")
    return cells


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/gateway-fidelity"))
    ap.add_argument("--loads", default="0.6,1.0,1.5", help="fractions of the measured capacity")
    ap.add_argument("--gateways", default="1,2", help="numbers of gateway processes")
    ap.add_argument("--policies", default=",".join(POLICIES), help=f"of {', '.join(POLICIES)}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--duration", type=float, default=45.0, help="seconds of arrivals per run")
    ap.add_argument("--endpoint", help="use this running vLLM server instead of starting one")
    ap.add_argument("--profile", type=Path, help="use this profile instead of calibrating")
    ap.add_argument("--calibrate-budget", default="3m")
    ap.add_argument("--calibrate-after", action=argparse.BooleanOptionalAction, default=False,
                    help="calibrate again after the replays and run the simulated engines on both calibrations "
                         "fitted together (the simulated gateways still believe the first, as the live ones did)")  # fmt: skip
    ap.add_argument("--capacity", type=float, help="use this capacity (req/s) instead of measuring it")
    ap.add_argument("--workload", type=Path, help="a scenario whose tiers replace the chat tier")
    ap.add_argument("--gateway-latency", type=float, help="the gateways' own latency in seconds instead of "
                    "measuring it (0: simulated gateways that add none)")  # fmt: skip
    ap.add_argument("--tabulate", action="store_true", help="print the table of the runs already in --out")
    args = ap.parse_args()
    if args.tabulate:
        print(tabulate(args.out))
        return
    unknown = set(args.policies.split(",")) - set(POLICIES)
    if unknown:
        sys.exit(
            f"--policies: no policy {', '.join(sorted(unknown))} (the benchmark runs {', '.join(POLICIES)})"
        )
    tiers = workload_tiers(args.workload) if args.workload else TIERS  # a bad file stops before the server
    if (args.out / "results.md").exists():
        sys.exit(f"{args.out} already holds results; choose another --out")
    args.out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    started = datetime.now(UTC)
    rows = []
    with ExitStack() as stack:
        url = args.endpoint or stack.enter_context(start_server(args.out))
        print(isolate_engine(), flush=True)  # gateways and load client off the engine's core
        profile = args.profile or calibrate(url, args.out, args.calibrate_budget)
        cap = args.capacity or capacity(url, profile, args.out, tiers=tiers)
        print(f"capacity: {cap:.2f} requests/s; profile {profile}", flush=True)
        reference = speed_probe(url, profile, args.out)
        print(f"speed probe after calibrating: {reference.speed:.2f} x the profile's solo time, "
              f"{reference.slowdown}", flush=True)  # fmt: skip
        latency = args.gateway_latency
        if latency is None:
            latency = gateway_latency(url, profile, args.out)
        print(f"gateway latency: {1e3 * latency:.1f} ms per request (gateway.latency_s)", flush=True)
        points = [
            (policy, n, load, prepare_point(profile, policy, n, load * cap, args.duration,
                                            args.out / f"{policy}-g{n}-{load:g}", tiers, latency))
            for policy in args.policies.split(",")
            for n in (int(x) for x in args.gateways.split(","))
            for load in (float(x) for x in args.loads.split(","))
        ]  # fmt: skip
        done: dict[Path, int] = {}  # repeats each point has; a point that fails stops there, the others go on
        for k in range(1, args.repeats + 1):  # round k replays every point once: drift spreads over all
            for policy, n, load, point in points:
                if done.get(point.out, 0) < k - 1:
                    continue
                print(f"round {k}: {policy}, {n} gateway(s), {load:.0%} ({load * cap:.2f} req/s)", flush=True)
                try:
                    replay_repeat(url, profile, point, k, reference)
                    done[point.out] = k
                except Exception:  # noqa: BLE001
                    traceback.print_exc()
                    partial = point.out / "real" / f"repeat-{k}"
                    if partial.exists():  # kept for a look, out of the way of the repeats compared
                        partial.rename(partial.with_name(f"failed-repeat-{k}"))
        engines = None
        if args.calibrate_after and not args.profile:  # the drift since the first weighs on the engines too
            calibrate(url, args.out / "after", args.calibrate_budget)
            engines = bracketed(args.out)
        for policy, n, load, point in points:
            if done.get(point.out, 0) > 0:  # compared on the repeats it has
                rows.append(row(policy, n, load, finish_point(point, done[point.out], engines)))
                print(rows[-1], flush=True)
    load_after = os.getloadavg()
    header = (f"{started:%Y-%m-%d %H:%M} UTC, {platform.node()}: {cpu_model()}, {os.cpu_count()} CPUs; load average "
              f"{load_before[0]:.1f} before, {load_after[0]:.1f} after; capacity {cap:.2f} req/s; gateway latency "
              f"{1e3 * latency:.1f} ms; {args.repeats} "
              f"repeats of {args.duration:.0f} s; probe: a lone request's time before each repeat over its time after "
              f"calibrating; simulated engines on {(engines or profile).name}; cells: sim / real mean (real range)")  # fmt: skip
    text = header + "\n\n" + markdown(pd.DataFrame(rows)) + "\n"
    (args.out / "results.md").write_text(text)
    (args.out / "results.json").write_text(json.dumps({"capacity_rps": cap, "rows": rows}, indent=2) + "\n")
    print(text)


if __name__ == "__main__":
    main()
