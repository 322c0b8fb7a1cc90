"""Fidelity: a simulation set beside the real runs of the same request list, measure by measure.

For each tier (and all) and each measure, the simulated value, the real runs' mean and range (their spread
is the noise floor: a simulator cannot be judged more precisely than the real system repeats itself) and
the error of the simulation against the real mean. The target: E2E mean and p99 within 10%, TTFT mean within
15% and TTFT p99 within 20% of the real mean; where the real runs spread wider than the target, a simulated
value inside their range passes.

Both sides are read from `requests.parquet` files in `simulate`'s schema and measured by the summary's own
functions (`results.summary`), so the measures mean what they mean in `simulate`'s summary and a folder
compared with itself reports zero error. TTFT and E2E percentiles count every arrival: a request never
answered is an infinite latency, so a p99 is infinite once more than 1% of requests failed; where either
side left requests of a tier unanswered, the `served_` percentiles over completed requests are reported
beside them. Means and inter-token latency ((finish - first token) / (output - 1)) are over completed
requests; failures are counted in their own rates. Several simulated seeds pool their observations: a
percentile is the pooled sample's, any other measure the mean over seeds.

Queue wait is not compared: vLLM's queue-time histogram starts when the engine core takes a request in,
between steps, so it leaves out the wait for the step in progress, which the simulated queue wait includes;
the simulation does not record the step boundaries that would restate its wait vLLM's way.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from simadmit.config.errors import InputError, problem
from simadmit.results import summary
from simadmit.results.histogram import LatencyHistogram, pooled
from simadmit.results.run_folder import MANIFEST, read_manifest

LATENCIES = ("ttft", "itl", "e2e")
# percentile measure -> (histogram, quantile, over every arrival): the summary's, plus inter-token latency
PERCENTILES = {
    **{k: v for k, v in summary.PERCENTILES.items() if v[0] in ("ttft_s", "e2e_s")},
    **{f"itl_p{p}_s": ("itl_s", p / 100, False) for p in (50, 90, 99)},
}
SERVED = tuple(k for k in PERCENTILES if k.startswith("served_"))  # reported where a side has failures
OTHER = ("rejection_rate", "failure_rate", "throughput_rps")
MEASURES = (
    tuple(k for m in LATENCIES for k in (f"{m}_mean_s", *(p for p in PERCENTILES if p.startswith(m))))
    + SERVED
    + OTHER
)
TARGETS = {"e2e_mean_s": 0.10, "e2e_p99_s": 0.10, "ttft_mean_s": 0.15, "ttft_p99_s": 0.20}
# the columns of a requests table that `compare` reads, and which of them hold numbers
NUMERIC = ("seed", "request_id", "attempt", "arrival_s", "output_tokens", "first_token_s", "finish_s", "ttft_s",
           "e2e_s", "queue_wait_s")  # fmt: skip
COLUMNS = ("policy", "tier", "decision", "outcome", *NUMERIC)
# the columns that say which run, request and attempt a row is (and when it arrived): never missing
KEYS = {"policy": "policy", "tier": "tier", "decision": "decision", "outcome": "outcome", "seed": "seed",
        "request_id": "request id", "attempt": "attempt number", "arrival_s": "arrival time"}  # fmt: skip


@dataclass(frozen=True)
class Run:
    """One run's requests (one row per request, latencies of completed ones) and where they came from."""

    source: str
    requests: pd.DataFrame


@dataclass(frozen=True)
class Measured:
    """A run's measures for one tier, and the histograms its percentiles come from (to pool seeds)."""

    values: dict[str, float]
    histograms: dict[str, LatencyHistogram]

    @property
    def failed(self) -> int:
        return self.histograms["ttft_s"].missing


def run_dirs(paths: list[Path]) -> list[Path]:
    """The run folders named: a folder holding `repeat-*` folders (from `replay --repeat`) stands for them.

    Only `repeat-N` folders are repeats: another name there (`repeat-1.bak`, a user's copy) is left out. A
    run named twice (or once itself and once by its parent) is refused: it would count as two real runs,
    each weighing in the mean and the count of the real runs.
    """
    out: list[Path] = []
    for p in paths:
        numbered = [d for d in p.glob("repeat-*") if d.name.removeprefix("repeat-").isdecimal()]
        repeats = sorted(numbered, key=lambda d: int(d.name.removeprefix("repeat-")))
        found = [d for d in repeats if (d / "requests.parquet").is_file()]
        for run in found if not (p / "requests.parquet").is_file() and found else [p]:
            if any(d.resolve() == run.resolve() for d in out):
                why = (
                    "given twice (itself, or through the folder holding its repeats): name each real run once"
                )
                raise InputError([problem(run, None, why)])
            out.append(run)
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


def load_runs(folder: Path, policy: str | None, *, when_several: bool = False) -> list[Run]:
    """The runs in a `simulate` or `replay` folder: one per seed of the chosen policy (`when_several`: the
    policy chosen applies only to a folder of several policies, as to a simulation given as a real run; a
    folder of one, a replay under its own label, is taken as it is)."""
    path = folder / "requests.parquet"
    if not folder.is_dir():
        why = "is a file, not a folder" if folder.exists() else "folder not found"
        raise InputError([problem(folder, None, f"{why} (give a simulate or replay --out folder)")])
    if not path.is_file():
        raise InputError(
            [problem(folder, None, "no requests.parquet here (not a simulate or replay folder)")]
        )
    _check_whole(folder)
    table = pd.read_parquet(path)
    _check_table(path, table)
    policies = sorted(table["policy"].astype(str).unique())
    if when_several and len(policies) == 1:
        policy = None
    if policy is None:
        if len(policies) > 1:
            raise InputError(
                [problem(path, "policy", f"several policies ({', '.join(policies)}): pick one with --policy")]
            )
        policy = policies[0] if policies else ""
    elif policy not in policies:
        raise InputError([problem(path, "policy", f"no policy {policy!r} (found: {', '.join(policies)})")])
    table = table[table["policy"].astype(str) == policy]
    return [
        Run(f"{folder} seed {seed}" if table["seed"].nunique() > 1 else str(folder), request_rows(group))
        for seed, group in table.groupby("seed")
    ]


def _check_whole(folder: Path) -> None:
    """`InputError` for a folder whose runs are not whole: a simulate folder whose files are not the ones its
    manifest lists (a run written over part of another), or a replay Ctrl-C stopped (its requests are the ones
    that ended first, not the run's). A bare requests table, with neither, is taken as it is."""
    if (folder / MANIFEST).is_file():
        read_manifest(folder)
    facts = folder / "replay.json"
    try:
        run = json.loads(facts.read_text())
    except (OSError, ValueError):
        return  # no facts (a simulate folder) or unreadable ones: the table is checked on its own
    if isinstance(run, dict) and run.get("complete") is False:
        ended, planned = run.get("requests", "?"), run.get("requests_planned", "?")
        why = f"an interrupted replay ({ended} of {planned} requests had ended): compare needs whole runs"
        raise InputError([problem(facts, "complete", why)])


def _check_table(path: Path, table: pd.DataFrame) -> None:
    """`InputError` for a table `compare` cannot measure: a column missing or not numbers (true/false are not),
    no rows, or a row without one of its `KEYS` (a row of no seed or policy falls out of every run: a report
    over fewer runs, or none)."""
    if missing := [c for c in COLUMNS if c not in table.columns]:
        why = f"no column {missing[0]!r}"
        raise InputError([problem(path, None, f"not a requests table of simulate or replay ({why})")])
    for col in NUMERIC:
        if not pd.api.types.is_numeric_dtype(table[col]) or pd.api.types.is_bool_dtype(table[col]):
            raise InputError([problem(path, col, f"holds {table[col].dtype} values, not numbers")])
    if table.empty:
        raise InputError([problem(path, None, "holds no requests")])
    for col, what in KEYS.items():
        if unknown := int(table[col].isna().sum()):
            raise InputError([problem(path, col, f"{unknown} rows have no {what}")])


def measured(run: Run, tier: str, warmup_s: float) -> Measured:
    """The measures of one run for one tier ("all": every request) that arrived after the warm-up, over the
    window from the warm-up to the last arrival (throughput counts what finished in it, whenever it arrived)."""
    every = run.requests
    req = every[every["arrival_s"] >= warmup_s]
    window = (warmup_s, float(req["arrival_s"].max()) if len(req) else warmup_s)
    done_any = every[every["outcome"] == "completed"]
    if tier != "all":
        req = req[req["tier"] == tier]
        done_any = done_any[done_any["tier"] == tier]
    completed = req[req["outcome"] == "completed"]
    histograms = {
        **summary.latency_histograms(req),
        "itl_s": LatencyHistogram.of(completed["itl_s"].dropna().to_numpy(dtype=float)),
    }
    outcomes = summary.outcome_measures(req["outcome"])
    window_s = window[1] - window[0]
    values = {
        **{f"{m}_mean_s": _mean(completed[f"{m}_s"]) for m in LATENCIES},
        **summary.percentiles(histograms, PERCENTILES),
        "rejection_rate": outcomes["rejection_rate"],
        "failure_rate": outcomes["failure_rate"],
        "throughput_rps": len(summary.finished_in(done_any, window)) / window_s if window_s > 0 else math.nan,
    }
    return Measured(values, histograms)


def _mean(values: pd.Series) -> float:
    v = values.dropna()
    return float(v.mean()) if len(v) else math.nan


def combined(runs: list[Measured]) -> dict[str, float]:
    """Several seeds of a simulation as one value per measure, as the summary combines replications: a
    percentile is the pooled sample's, any other measure the mean over the seeds that gave one."""
    out = {}
    for key in MEASURES:
        if key in PERCENTILES:
            name, q, every = PERCENTILES[key]
            out[key] = pooled([r.histograms[name] for r in runs]).quantile(q, every)
        else:
            out[key] = _mean(pd.Series([r.values[key] for r in runs], dtype=float))
    return out


def _spread(lo: float, hi: float, mean: float) -> float:
    """How far the real runs spread around their mean, relatively (infinite when some are infinite, some not)."""
    if math.isinf(mean):
        return 0.0 if lo == hi else math.inf
    return max(hi / mean - 1, 1 - lo / mean) if mean > 0 else math.nan


def _error(sim: float, mean: float) -> float:
    """Simulated against the real mean, relatively: zero when equal (both infinite, both zero), -100% when
    only the real side is infinite, infinite when only the simulated side is."""
    if sim == mean:
        return 0.0
    if math.isnan(sim) or math.isnan(mean) or mean == 0:
        return math.nan
    return sim / mean - 1 if math.isfinite(mean) else -1.0


def verdict(measure: str, sim: float, real: np.ndarray) -> str:
    """pass / fail against the target for the measures that have one ("" for the others, or no value).

    An infinite percentile (more of a side's requests unanswered than its tail share) passes only against
    an infinite real one, or inside a real range that reaches infinity."""
    tol = TARGETS.get(measure)
    real = real[~np.isnan(real)]
    if tol is None or not len(real) or math.isnan(sim):
        return ""
    mean = float(real.mean())
    if abs(_error(sim, mean)) <= tol:
        return "pass"
    lo, hi = float(real.min()), float(real.max())
    if _spread(lo, hi, mean) > tol and lo <= sim <= hi:
        return "pass (within the real spread)"
    return "fail"


def compare(sim: list[Run], real: list[Run], warmup_s: float) -> pd.DataFrame:
    """One row per tier and measure: simulated (seeds pooled), real mean, min, max, spread, error, verdict.
    The served percentiles appear for a tier where either side left some of its requests unanswered."""
    tiers = sorted(set().union(*(set(r.requests["tier"]) for r in real + sim))) + ["all"]
    rows = []
    for tier in tiers:
        sims = [measured(r, tier, warmup_s) for r in sim]
        reals = [measured(r, tier, warmup_s) for r in real]
        sv_all = combined(sims)
        failures = any(m.failed for m in sims + reals)
        for measure in MEASURES:
            if measure in SERVED and not failures:
                continue
            sv = sv_all[measure]
            rv = np.array([m.values[measure] for m in reals], dtype=float)
            known = rv[~np.isnan(rv)]
            mean, lo, hi = (float(f(known)) if len(known) else math.nan for f in (np.mean, np.min, np.max))
            rows.append(
                {
                    "tier": tier,
                    "measure": measure,
                    "sim": sv,
                    "real_mean": mean,
                    "real_min": lo,
                    "real_max": hi,
                    "real_spread": _spread(lo, hi, mean),
                    "error": _error(sv, mean),
                    "target": TARGETS.get(measure, math.nan),
                    "verdict": verdict(measure, sv, rv),
                }
            )
    return pd.DataFrame(rows)


def overall(table: pd.DataFrame) -> bool:
    """True when every measure with a target passes."""
    judged = table[table["verdict"] != ""]
    return bool(len(judged)) and bool(judged["verdict"].str.startswith("pass").all())
