"""Fidelity: a simulation set beside the real runs of the same request list, measure by measure.

For each tier (and all) and each measure, the simulated value, the real runs' mean and range (their spread
is the noise floor: a simulator cannot be judged more precisely than the real system repeats itself) and
the error of the simulation against the real mean. The target: E2E mean and p99 within 10%, TTFT mean within
15% and TTFT p99 within 20% of the real mean; where the real runs spread wider than the target, a simulated
value inside their range passes.

Both sides are read from `requests.parquet` files in `simulate`'s schema and measured by the same code, so a
folder compared with itself reports zero error. Inter-token latency is (finish - first token) / (output - 1)
on both sides; percentiles are over completed requests, failures are counted in their own rates.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from simadmit.config.errors import InputError, problem

LATENCIES = ("ttft", "itl", "e2e")
STATS = ("mean", "p50", "p90", "p99")
OTHER = ("queue_wait_mean_s", "rejection_rate", "failure_rate", "throughput_rps")
MEASURES = tuple(f"{m}_{s}_s" for m in LATENCIES for s in STATS) + OTHER
TARGETS = {"e2e_mean_s": 0.10, "e2e_p99_s": 0.10, "ttft_mean_s": 0.15, "ttft_p99_s": 0.20}


@dataclass(frozen=True)
class Run:
    """One run's requests (one row per request, latencies of completed ones) and where they came from."""

    source: str
    requests: pd.DataFrame
    server_queue_wait_s: float  # a replay's mean queue wait from the server's histogram (NaN otherwise)


def run_dirs(paths: list[Path]) -> list[Path]:
    """The run folders named: a folder holding `repeat-*` folders (from `replay --repeat`) stands for them."""
    out = []
    for p in paths:
        repeats = sorted(p.glob("repeat-*"), key=lambda d: int(d.name.split("-")[-1]))
        found = [d for d in repeats if (d / "requests.parquet").is_file()]
        if not (p / "requests.parquet").is_file() and found:
            out.extend(found)
        else:
            out.append(p)
    return out


def request_rows(attempts: pd.DataFrame) -> pd.DataFrame:
    """One row per request from an attempt table: the first arrival, the outcome, the admitted attempt's times."""
    attempts = attempts.sort_values(["request_id", "attempt"])
    last = attempts.groupby("request_id", sort=False).tail(1).set_index("request_id")
    admitted = attempts[attempts["decision"] == "admit"].groupby("request_id").tail(1).set_index("request_id")
    out = last[["tier", "arrival_s", "outcome", "output_tokens"]].copy()
    for col in ("first_token_s", "finish_s", "ttft_s", "e2e_s", "queue_wait_s"):
        out[col] = admitted[col].reindex(out.index)
    out["tier"] = out["tier"].astype(str)
    out["outcome"] = out["outcome"].astype(str)
    done = (out["outcome"] == "completed") & (out["output_tokens"] > 1)
    out["itl_s"] = ((out["finish_s"] - out["first_token_s"]) / (out["output_tokens"] - 1)).where(done)
    return out.reset_index()


def load_runs(folder: Path, policy: str | None) -> list[Run]:
    """The runs in a `simulate` or `replay` folder: one per seed of the chosen policy."""
    path = folder / "requests.parquet"
    if not path.is_file():
        raise InputError(
            [problem(folder, None, "no requests.parquet here (not a simulate or replay folder)")]
        )
    table = pd.read_parquet(path)
    policies = sorted(table["policy"].astype(str).unique())
    if policy is None:
        if len(policies) > 1:
            raise InputError(
                [problem(path, "policy", f"several policies ({', '.join(policies)}): pick one with --policy")]
            )
        policy = policies[0] if policies else ""
    elif policy not in policies:
        raise InputError([problem(path, "policy", f"no policy {policy!r} (found: {', '.join(policies)})")])
    facts = folder / "replay.json"
    queue_wait = math.nan
    if facts.is_file():
        queue_wait = float(json.loads(facts.read_text()).get("server", {}).get("queue_wait_mean_s", math.nan))
    table = table[table["policy"].astype(str) == policy]
    return [
        Run(
            f"{folder} seed {seed}" if table["seed"].nunique() > 1 else str(folder),
            request_rows(group),
            queue_wait,
        )
        for seed, group in table.groupby("seed")
    ]


def _stats(values: np.ndarray) -> dict[str, float]:
    v = values[np.isfinite(values)]
    if not len(v):
        return dict.fromkeys(STATS, math.nan)
    return {"mean": float(v.mean()), **{f"p{q}": float(np.percentile(v, q)) for q in (50, 90, 99)}}


def measures(run: Run, tier: str, warmup_s: float) -> dict[str, float]:
    """The measures of one run for one tier ("all": every request) that arrived after the warm-up."""
    req = run.requests
    req = req[req["arrival_s"] >= warmup_s]
    end = float(req["arrival_s"].max()) if len(req) else warmup_s
    done_any = run.requests[
        (run.requests["outcome"] == "completed") & run.requests["finish_s"].between(warmup_s, end)
    ]
    if tier != "all":
        req = req[req["tier"] == tier]
        done_any = done_any[done_any["tier"] == tier]
    n = len(req)
    completed = req[req["outcome"] == "completed"]
    out: dict[str, float] = {}
    for m in LATENCIES:
        for s, v in _stats(completed[f"{m}_s"].to_numpy(dtype=float)).items():
            out[f"{m}_{s}_s"] = v
    waits = req["queue_wait_s"].to_numpy(dtype=float)
    waits = waits[np.isfinite(waits)]
    if len(waits):
        out["queue_wait_mean_s"] = float(waits.mean())
    else:  # a replay: the server's own mean, over all requests
        out["queue_wait_mean_s"] = run.server_queue_wait_s if tier == "all" else math.nan
    outcome = req["outcome"]
    out["rejection_rate"] = float(outcome.isin(["rejected", "too_long"]).mean()) if n else math.nan
    out["failure_rate"] = float((outcome != "completed").mean()) if n else math.nan
    out["throughput_rps"] = len(done_any) / (end - warmup_s) if end > warmup_s else math.nan
    return out


def verdict(measure: str, sim: float, real: np.ndarray) -> str:
    """pass / fail against the target for the measures that have one ("" for the others)."""
    tol = TARGETS.get(measure)
    real = real[np.isfinite(real)]
    if tol is None or not len(real) or not math.isfinite(sim):
        return ""
    mean = float(real.mean())
    if abs(sim / mean - 1) <= tol:
        return "pass"
    spread = max(abs(real.max() / mean - 1), abs(real.min() / mean - 1))
    if spread > tol and real.min() <= sim <= real.max():
        return "pass (within the real spread)"
    return "fail"


def compare(sim: list[Run], real: list[Run], warmup_s: float) -> pd.DataFrame:
    """One row per tier and measure: simulated (mean over seeds), real mean, min, max, spread, error, verdict."""
    tiers = sorted(set().union(*(set(r.requests["tier"]) for r in real + sim))) + ["all"]
    rows = []
    for tier in tiers:
        s = pd.DataFrame([measures(r, tier, warmup_s) for r in sim])
        m = pd.DataFrame([measures(r, tier, warmup_s) for r in real])
        for measure in MEASURES:
            sv = float(np.nanmean(s[measure])) if s[measure].notna().any() else math.nan
            rv = m[measure].to_numpy(dtype=float)
            finite = rv[np.isfinite(rv)]
            mean = float(finite.mean()) if len(finite) else math.nan
            lo = float(finite.min()) if len(finite) else math.nan
            hi = float(finite.max()) if len(finite) else math.nan
            rows.append(
                {
                    "tier": tier,
                    "measure": measure,
                    "sim": sv,
                    "real_mean": mean,
                    "real_min": lo,
                    "real_max": hi,
                    "real_spread": max(hi / mean - 1, 1 - lo / mean) if mean > 0 else math.nan,
                    "error": sv / mean - 1 if mean > 0 else (0.0 if sv == mean else math.nan),
                    "target": TARGETS.get(measure, math.nan),
                    "verdict": verdict(measure, sv, rv),
                }
            )
    return pd.DataFrame(rows)


def overall(table: pd.DataFrame) -> bool:
    """True when every measure with a target passes."""
    judged = table[table["verdict"] != ""]
    return bool(len(judged)) and bool(judged["verdict"].str.startswith("pass").all())
