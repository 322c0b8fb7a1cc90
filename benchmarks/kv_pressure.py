"""KV-cache pressure against a real vLLM: a burst of long requests outgrows the KV cache, the server
preempts, and the same requests are simulated: do the preemptions and the latencies they cost agree?

The fidelity benchmark's loads rarely fill the KV cache of the tests' server (93,184 tokens), so its
preemption path is never exercised there. This starts the same server with a KV cache of `--kv-cache-gib`
(1 GiB: 46,592 tokens in bfloat16), calibrates it, and sends `--requests` long requests at once (prompts of
~600 tokens, answers of ~300), whose prompts fit the cache together but whose answers do not: about 130
decode steps in, the running requests need more blocks than are free and vLLM preempts the newest ones
(freeing their blocks, recomputing them later). The burst is replayed `--repeats` times (the noise floor),
what the first sent is simulated on the calibrated profile, and the table gives TTFT and E2E (mean, p99),
the makespan and the preemptions: the simulated count against the server's `vllm:num_preemptions_total`.

With `--priority` the server runs `--scheduling-policy priority` and the burst is two tiers of the same
lengths, `high` and `low` (priority 1), which replay sends in each request's `priority`: the waiting queue
then takes `high` first and a shortage preempts `low`, and the table has each tier's rows.

    flock /tmp/vllm.lock python benchmarks/kv_pressure.py --out runs/kv-pressure [--priority]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.fidelity import (  # noqa: E402
    Point,
    calibrate,
    cpu_model,
    finish_point,
    isolate_engine,
    markdown,
    replay_repeat,
    scenario,
    start_server,
)
from simadmit.config.loading import load_scenario  # noqa: E402
from simadmit.config.profile import load_profile  # noqa: E402
from simadmit.loadgen.plan import make_plan  # noqa: E402

TIERS = (
    {
        "name": "long",
        "share": 1,
        "max_tokens": 384,
        "prompt_tokens": {"kind": "lognormal", "median": 600, "sigma": 0.2, "min": 400, "max": 900},
        "output_tokens": {"kind": "lognormal", "median": 300, "sigma": 0.2, "min": 200, "max": 384},
    },
)
PRIORITY_TIERS = tuple({**TIERS[0], "name": name} for name in ("high", "low"))
PRIORITY_ENGINE = {"scheduling": "priority", "tier_priority": {"high": 0, "low": 1}}
KEY = ("ttft_mean_s", "ttft_p99_s", "e2e_mean_s", "e2e_p99_s")


def burst_point(profile: Path, requests: int, out: Path, seed: int, priority: bool = False) -> Point:
    """The burst's scenario under `out` (`requests` of the long mix, all sent within a few milliseconds; with
    `priority`, its two tiers on an engine that schedules by priority) and its request plan, the same for
    every repeat."""
    out.mkdir(parents=True, exist_ok=True)
    doc = scenario(profile, 1000.0, "poisson", 1.0, seed, PRIORITY_TIERS if priority else TIERS)
    doc["workload"] |= {"duration_s": None, "requests": requests}
    if priority:
        doc["pools"][0]["engine"] = PRIORITY_ENGINE
    path = out / "scenario.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    spec, base = load_scenario(path)
    return Point(out, spec, base, make_plan(spec, base))


def makespan_s(requests: pd.DataFrame) -> float:
    """First arrival to last finish."""
    return float(requests["finish_s"].max() - requests["arrival_s"].min())


def real_figures(point: Point, repeats: int) -> list[dict[str, float]]:
    """Per real repeat: its makespan and the server's preemptions while it ran."""
    figures = []
    for k in range(1, repeats + 1):
        folder = point.out / "real" / f"repeat-{k}"
        facts = json.loads((folder / "replay.json").read_text())
        req = pd.read_parquet(folder / "requests.parquet")
        figures.append({"makespan_s": makespan_s(req), "preemptions": float(facts["server"]["preemptions"])})
    return figures


def results(point: Point, table: pd.DataFrame, repeats: int) -> pd.DataFrame:
    """One row per tier and measure (every tier's latencies; the burst's makespan and preemptions): simulated,
    real mean and range over the repeats, error of the simulated value."""
    latencies = table[table["measure"].isin(KEY)]
    if latencies["tier"].nunique() == 2:  # one tier and "all": the same figures twice
        latencies = latencies[latencies["tier"] == "all"]
    rows = [
        {"tier": r.tier, "measure": r.measure, "sim": r.sim, "real_mean": r.real_mean, "real_min": r.real_min,
         "real_max": r.real_max}
        for r in latencies.itertuples()
    ]  # fmt: skip
    sim = pd.read_parquet(point.out / "sim" / "requests.parquet")
    simulated = {"makespan_s": makespan_s(sim), "preemptions": float(sim["preemptions"].sum())}
    real = pd.DataFrame(real_figures(point, repeats))
    for m, value in simulated.items():
        rows.append(
            {
                "tier": "all",
                "measure": m,
                "sim": value,
                "real_mean": float(real[m].mean()),
                "real_min": float(real[m].min()),
                "real_max": float(real[m].max()),
            }
        )
    out = pd.DataFrame(rows)
    out["error"] = out["sim"] / out["real_mean"] - 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/kv-pressure"))
    ap.add_argument("--requests", type=int, default=64, help="requests in the burst")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--kv-cache-gib", type=int, default=1, help="the server's KV cache (VLLM_CPU_KVCACHE_SPACE)"
    )
    ap.add_argument("--calibrate-budget", default="3m")
    ap.add_argument("--endpoint", help="use this running server instead of starting one")
    ap.add_argument("--profile", type=Path, help="use this profile instead of calibrating")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--priority", action="store_true", help="two tiers on a server scheduling by priority")
    args = ap.parse_args()
    if (args.out / "results.md").exists():
        sys.exit(f"{args.out} already holds results; choose another --out")
    args.out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    started = datetime.now(UTC)
    with ExitStack() as stack:
        extra = ("--scheduling-policy", "priority") if args.priority else ()
        url = args.endpoint or stack.enter_context(start_server(args.out, args.kv_cache_gib, extra))
        placement = isolate_engine()
        print(placement, flush=True)
        profile = args.profile or calibrate(url, args.out, args.calibrate_budget, args.requests)
        kv = load_profile(profile).kv_capacity_tokens
        point = burst_point(profile, args.requests, args.out / "burst", args.seed, args.priority)
        for k in range(1, args.repeats + 1):
            replay_repeat(url, point, k)
        table = finish_point(point, args.repeats)
    load_after = os.getloadavg()
    text = (
        f"{started:%Y-%m-%d %H:%M} UTC, {platform.node()}: {cpu_model()}, {os.cpu_count()} CPUs; load average "
        f"{load_before[0]:.1f} before, {load_after[0]:.1f} after; {placement}; KV cache {kv:,} tokens; "
        f"a burst of {args.requests} requests, {args.repeats} repeats"
        f"{', priority scheduling' if args.priority else ''}\n\n"
        + markdown(results(point, table, args.repeats).round(3))
        + "\n"
    )
    (args.out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
