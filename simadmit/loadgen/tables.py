"""A replay's files, in the tables `simulate` writes, so `compare` (and `plot`) read both alike.

- `requests.parquet`: one row per attempt with the columns of `simulate`'s table (`predicted_wait_s`: a
  gateway's `X-Queue-Predict-Wait`, empty without a gateway), plus `scheduled_send_s` (when the attempt was
  due), `send_lag_s` (how late it left) and `status` (what the attempt came to); `gateway` is the endpoint
  the attempt went to.
  What a client cannot see stays empty: the engine's first-scheduled time, the replica, preemptions, the
  gateway's estimate; queue wait comes from the server's histogram instead (`replay.json`).
- `timeseries.parquet`: one row per `/metrics` poll, with the client's attempts, admits and rejects since
  the previous poll.
- `replay.json`: the run's facts and the load client's own figures: send lag, CPU share, whether it kept up;
  `complete` is false for a run Ctrl-C stopped, which keeps the requests that had ended (`compare` refuses it).
- `sent.csv` + `replayed.yaml`: the requests as sent (actual send times) as a trace, and the scenario
  replaying that trace, so `simulate replayed.yaml` runs exactly the requests the endpoint saw.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from simadmit.config.resources import resolve_profile
from simadmit.config.schema import ScenarioSpec
from simadmit.loadgen.run import ReplayRun
from simadmit.loadgen.sender import ABANDONED, OK, REJECTED, TOO_LONG
from simadmit.results.run_folder import add_files, write_text

# outcome of a request from its last attempt's status; any other status is a failure the server caused
OUTCOME = {OK: "completed", REJECTED: "rejected", TOO_LONG: "too_long", ABANDONED: "abandoned"}
KEPT_UP_FRACTION = 0.25  # send-lag p99 must stay under this share of a decode step


def requests_table(run: ReplayRun, label: str) -> pd.DataFrame:
    """One row per attempt, in `simulate`'s schema plus the send schedule."""
    w = run.plan.workload
    att = pd.DataFrame(
        {
            "request_id": [a.request_id for a in run.attempts],
            "attempt": [a.attempt for a in run.attempts],
            "attempt_s": [a.result.sent for a in run.attempts],
            "scheduled_send_s": [a.planned_s for a in run.attempts],
            "status": [a.result.status for a in run.attempts],
            "reason": [a.result.reason for a in run.attempts],
            "retry_after_s": [a.result.retry_after_s for a in run.attempts],
            "answered_s": [a.result.answered for a in run.attempts],
            "first_token_s": [a.result.first_token for a in run.attempts],
            "finish_s": [a.result.finish for a in run.attempts],
            "served_output": [a.result.output_tokens for a in run.attempts],
            "gateway": [a.endpoint for a in run.attempts],
            "predicted_wait_s": [a.result.predicted_wait_s for a in run.attempts],
        }
    )
    rid = att["request_id"].to_numpy()
    last = att.groupby("request_id")["attempt"].transform("max").to_numpy() == att["attempt"].to_numpy()
    outcome_of = dict(
        zip(rid[last], att["status"][last].map(lambda s: OUTCOME.get(s, "aborted")), strict=True)
    )
    arrival = att[att["attempt"] == 1].set_index("request_id")["attempt_s"]
    admitted = ~att["status"].isin([REJECTED, TOO_LONG])
    nan = np.full(len(att), np.nan)
    outcome = pd.Series(rid).map(outcome_of).to_numpy()
    completed = outcome == "completed"
    arrival_s = arrival.reindex(rid).to_numpy()
    df = pd.DataFrame(
        {
            "policy": label,
            "seed": run.plan.seed,
            "request_id": rid,
            "attempt": att["attempt"],
            "tier": pd.Categorical.from_codes(w.tier[rid], pd.Index(w.tier_names)),
            "pool": [run.plan.tier_pool[t] for t in w.tier[rid]],
            "gateway": att["gateway"],
            "arrival_s": arrival_s,
            "attempt_s": att["attempt_s"],
            "decision": np.where(admitted, "admit", "reject"),
            "reason": att["reason"],
            "retry_after_s": att["retry_after_s"],
            "predicted_wait_s": att["predicted_wait_s"],
            "admit_s": np.where(admitted, att["answered_s"], np.nan),
            "scheduled_s": nan,
            "first_token_s": np.where(admitted, att["first_token_s"], np.nan),
            "finish_s": np.where(admitted, att["finish_s"], np.nan),
            "prompt_tokens": w.prompt[rid],
            "max_tokens": run.plan.target_output[rid],
            "output_tokens": np.where(
                completed & admitted, att["served_output"], run.plan.target_output[rid]
            ),
            "estimate_gpu_s": nan,
            "replica": -1,
            "preemptions": pd.array([pd.NA] * len(att), dtype="Int64"),
            "outcome": outcome,
            "scheduled_send_s": att["scheduled_send_s"],
            "send_lag_s": att["attempt_s"] - att["scheduled_send_s"],
            "status": att["status"],
        }
    )
    ok = completed & admitted
    df["ttft_s"] = np.where(ok, df["first_token_s"] - df["arrival_s"], np.nan)
    df["e2e_s"] = np.where(ok, df["finish_s"] - df["arrival_s"], np.nan)
    df["queue_wait_s"] = nan
    df["outcome"] = pd.Categorical(df["outcome"])
    return df


def timeseries_table(run: ReplayRun, label: str) -> pd.DataFrame:
    """One row per poll: server gauges and counters, and the client's attempts since the previous poll."""
    polls = pd.DataFrame(run.polls)
    if polls.empty:
        return polls
    edges = np.concatenate([[-np.inf], polls["t_s"].to_numpy()])
    sent = np.array([a.result.sent for a in run.attempts])
    rejected = np.array([a.result.status == REJECTED for a in run.attempts], dtype=bool)
    polls.insert(0, "policy", label)
    polls.insert(1, "seed", run.plan.seed)
    polls["arrivals"] = np.histogram(sent, edges)[0]
    polls["rejects"] = np.histogram(sent[rejected], edges)[0]
    polls["admits"] = polls["arrivals"] - polls["rejects"]
    return polls


def _pct(x: np.ndarray, q: float) -> float:
    x = x[np.isfinite(x)]
    return float(np.percentile(x, q)) if len(x) else math.nan


def run_facts(run: ReplayRun, req: pd.DataFrame) -> dict[str, object]:
    """The run's facts and whether the client kept up: its send-lag p99 against a decode step.

    The decode step is read off the run itself: the median inter-token latency of completed requests.
    """
    first = req[req["attempt"] == 1]
    lag = first["send_lag_s"].to_numpy(dtype=float)
    all_lag = req["send_lag_s"].to_numpy(dtype=float)
    done = req[req["ttft_s"].notna() & (req["output_tokens"] > 1)]
    itl = ((done["finish_s"] - done["first_token_s"]) / (done["output_tokens"] - 1)).to_numpy(dtype=float)
    step = _pct(itl, 50)
    lag_p99 = _pct(lag, 99)
    polls = run.polls
    queue_wait = math.nan
    if len(polls) >= 2:
        n = polls[-1]["queue_time_count"] - polls[0]["queue_time_count"]
        if n > 0:
            queue_wait = (polls[-1]["queue_time_sum_s"] - polls[0]["queue_time_sum_s"]) / n
    outcomes = first["outcome"].value_counts()
    overhead = {k: v for k, v in run.overhead.items() if k != "handling_ms_per_request"}
    return {
        "endpoint": run.endpoint.shown_url,  # a key is never written down
        "model": run.endpoint.model,
        "vllm_version": run.endpoint.vllm_version,
        "seed": run.plan.seed,
        "started_unix_s": run.started_unix_s,
        "wall_s": run.wall_s,
        "requests": len(first),
        "complete": not run.interrupted,  # False: Ctrl-C stopped it; only the requests that had ended are here
        "requests_planned": len(run.plan.workload),
        "attempts": len(req),
        "outcomes": {str(k): int(v) for k, v in outcomes.items() if v},
        "warmup_s": run.plan.warmup_s,
        "send_lag_s": {
            "p50": _pct(lag, 50),
            "p99": lag_p99,
            "max": _pct(lag, 100),
            "retries_p99": _pct(all_lag[req["attempt"].to_numpy() > 1], 99),
        },  # fmt: skip
        "client": overhead,
        "decode_step_s": step,
        "kept_up": bool(lag_p99 < KEPT_UP_FRACTION * step) if math.isfinite(step) else None,
        "server": {
            "queue_wait_mean_s": queue_wait,
            "preemptions": (polls[-1]["preemptions_total"] - polls[0]["preemptions_total"])
            if len(polls) >= 2
            else math.nan,
            "failed_polls": run.failed_polls,
        },
    }


def replayed_scenario(spec: ScenarioSpec, base: Path, trace: Path) -> dict[str, object]:
    """The scenario with its workload replaced by the trace of what was sent (profiles made absolute)."""
    doc = spec.model_dump(mode="json", exclude={"variants"})
    for pool in doc["pools"]:
        pool["profile"] = str(resolve_profile(pool["profile"], base))
    w = doc["workload"]
    for key in ("duration_s", "requests", "rate_rps"):
        w[key] = None
    w["rate_multiplier"] = 1.0
    w["arrival"] = {"kind": "poisson"}
    w["trace"] = {
        "path": trace.name,
        "format": "mapped",
        "columns": {
            "arrival": "arrival_s",
            "prompt_tokens": "prompt_tokens",
            "output_tokens": "output_tokens",
            "tier": "tier",
        },  # fmt: skip
        "tiers": {"by": "column", "column": "tier"},
        "max_tokens": {"kind": "scaled", "factor": 1.0},
    }
    return doc


def write_run(run: ReplayRun, spec: ScenarioSpec, base: Path, out: Path, label: str) -> dict[str, object]:
    """Write the run's files into `out` (which must not hold a run already) and return its facts; all of them
    or none (`add_files`), `requests.parquet` last, so a failed write never leaves what looks like a run."""
    req = requests_table(run, label)
    first = req[req["attempt"] == 1]
    sent = pd.DataFrame(
        {
            "arrival_s": first["arrival_s"].to_numpy(),
            "prompt_tokens": first["prompt_tokens"].to_numpy(),
            "output_tokens": first["max_tokens"].to_numpy(),
            "tier": first["tier"].astype(str).to_numpy(),
        }
    )
    replayed = yaml.safe_dump(replayed_scenario(spec, base, out / "sent.csv"), sort_keys=False)
    facts = run_facts(run, req)
    facts_text = json.dumps(facts, indent=2, allow_nan=True) + "\n"
    add_files(
        out,
        {
            "timeseries.parquet": lambda p: timeseries_table(run, label).to_parquet(p, index=False),
            "sent.csv": lambda p: sent.to_csv(p, index=False, float_format="%.6f"),
            "replayed.yaml": lambda p: write_text(p, replayed),
            "replay.json": lambda p: write_text(p, facts_text),
            "requests.parquet": lambda p: req.to_parquet(p, index=False),
        },
    )
    return facts
