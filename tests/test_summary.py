"""Records and summary on hand-built ledgers: every measure checked against a count done by hand.

Ten requests arrive at t = 0, 1, ..., 9 s (no warm-up, so the measurement window is [0, 9] s) at a pool
of one single-GPU replica. Six complete, with TTFT 0.5, 2.0, 0.1, 0.2, 0.3, 0.4 s; one is rejected after
two attempts, one abandoned while backing off, one aborted in the engine, one refused as too long.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from simadmit.config.loading import scenario_from_dict
from simadmit.results import records, summary
from simadmit.results.histogram import ACCURACY
from simadmit.sim.ledger import ABANDONED, ABORTED, COMPLETED, REJECTED, TOO_LONG, Ledger
from simadmit.sim.simulation import RunResult
from simadmit.sim.world import World, build_world
from simadmit.workload.build import Workload
from tests.helpers import PROFILE, ROOT

N = 10
# request -> (outcome, attempts, admit, scheduled, first token, finish), times relative to its arrival
FATES = {
    0: (COMPLETED, 1, 0.0, 0.0, 0.5, 1.0),
    1: (COMPLETED, 1, 0.0, 1.5, 2.0, 2.5),
    2: (REJECTED, 2, None, None, None, None),
    3: (ABANDONED, 2, None, None, None, None),
    4: (ABORTED, 1, 0.0, None, None, 3.0),
    5: (TOO_LONG, 1, None, None, None, None),
    **{i: (COMPLETED, 1, 0.0, 0.05, 0.1 * (i - 5), 0.1 * (i - 5) + 0.5) for i in range(6, 10)},
}
SLO_TTFT, SLO_E2E = 1.0, 2.0


def world(warmup_s: float = 0.0) -> World:
    spec = scenario_from_dict(
        {
            "name": "hand",
            "workload": {
                "rate_rps": 1,
                "requests": N,
                "warmup_s": warmup_s,
                "tiers": [
                    {
                        "name": "only",
                        "prompt_tokens": {"kind": "fixed", "value": 100},
                        "output_tokens": {"kind": "fixed", "value": 10},
                        "max_tokens": 10,
                        "slo": {"ttft_s": SLO_TTFT, "e2e_s": SLO_E2E},
                    }
                ],
            },
            "pools": [{"name": "gpu", "profile": PROFILE, "replicas": 1, "gpus_per_replica": 1}],
            "policies": [{"kind": "unconditional"}],
        },
        ROOT / "tests" / "scenario.yaml",
    )
    return build_world(spec, ROOT)


def workload() -> Workload:
    return Workload(
        tier_names=("only",),
        arrival=np.arange(N, dtype=float),
        tier=np.zeros(N, dtype=int),
        prompt=np.full(N, 100),
        output=np.full(N, 10),
        max_tokens=np.full(N, 10),
        deadline=np.full(N, math.inf),
    )


def ledger(fates: dict = FATES) -> Ledger:
    led = Ledger(N)
    for rid, (outcome, attempts, admit, sched, first, finish) in fates.items():
        t0 = float(rid)
        led.outcome[rid] = outcome
        led.attempts[rid] = attempts
        for column, value in (
            ("admit", admit),
            ("scheduled", sched),
            ("first_token", first),
            ("finish", finish),
        ):
            if value is not None:
                getattr(led, column)[rid] = t0 + value
        if admit is not None:
            led.pool[rid], led.replica[rid] = 0, 0
        for a in range(attempts):
            admitted = admit is not None and a == attempts - 1
            led.att_rid.append(rid)
            led.att_time.append(t0 + 0.5 * a)
            led.att_gateway.append(0)
            led.att_reason.append("admitted" if admitted else "pool_exhausted")
            led.att_retry_after.append(0.0 if admitted else 1.0)
            led.att_predicted_wait.append(0.0)
    return led


def result(
    led: Ledger | None = None,
    busy: list[list[tuple[float, float]]] | None = None,  # per replica
    replica_log: list[tuple[float, int, int, int]] | None = None,
    lifetimes: list[list[float]] | None = None,
) -> RunResult:
    w = workload()
    return RunResult(
        policy="hand",
        seed=0,
        ledger=led or ledger(),
        estimates=[world().pools[0].estimator.estimate_many(w.prompt, w.max_tokens)],
        busy_periods=[busy if busy is not None else [[(0.0, 4.5), (6.0, 9.0)]]],
        lifetimes=[lifetimes or [[0.0, 10.0]]],
        replica_log=[replica_log or [(0.0, 1, 0, 0)]],
        peak_in_flight_gpu_s=[1.0],
        end_s=10.0,
        events=0,
    )


def summarise(run: RunResult | None = None, warmup_s: float = 0.0) -> dict[str, dict]:
    run = run or result()
    w, wd = workload(), world(warmup_s)
    return summary.run_summary(run, w, wd, records.request_table(run, w, wd))


def test_request_table_derives_latencies_of_completed_requests_only() -> None:
    table = records.request_table(result(), workload(), world())
    assert table["ttft_s"].tolist()[:2] == [0.5, 2.0]
    assert table["e2e_s"].tolist()[:2] == [1.0, 2.5]
    assert table["ttft_s"].iloc[2:6].isna().all()  # rejected, abandoned, aborted, too long: no latency
    assert table["queue_wait_s"].iloc[1] == 1.5
    assert list(table["outcome"].iloc[:6]) == [
        "completed",
        "completed",
        "rejected",
        "abandoned",
        "aborted",
        "too_long",
    ]


def test_requests_frame_has_one_row_per_attempt() -> None:
    run = result()
    frame = records.requests_frame(run, records.request_table(run, workload(), world()))
    assert len(frame) == sum(f[1] for f in FATES.values()) == 12
    rejected = frame[frame["request_id"] == 2]
    assert rejected["attempt"].tolist() == [1, 2] and (rejected["decision"] == "reject").all()
    assert rejected["ttft_s"].isna().all()


def test_failure_rate_counts_every_unanswered_request_and_rejection_rate_the_refused() -> None:
    m = summarise()["only"]
    assert m["requests"] == N and m["completed"] == 6
    assert (m["rejected"], m["abandoned"], m["aborted"], m["too_long"]) == (1, 1, 1, 1)
    assert m["failure_rate"] == pytest.approx(4 / N)
    assert m["rejection_rate"] == pytest.approx(2 / N)
    assert m["attempts"] == 12 and m["retries_per_request"] == pytest.approx(0.2)
    assert m["attempt_rejection_rate"] == pytest.approx(1 - 7 / 12)  # seven admissions in twelve attempts


def test_percentiles_count_a_request_never_answered_as_a_miss() -> None:
    """TTFTs sorted: 0.1 0.2 0.3 0.4 0.5 2.0 inf inf inf inf. Over every arrival the median is rank 5
    (0.5 s) and p90 rank 9 (inf); over the six served requests the median is rank 3 (0.3 s), p99 rank 6."""
    m = summarise()["only"]
    assert m["ttft_p50_s"] == pytest.approx(0.5, rel=ACCURACY)
    assert m["ttft_p90_s"] == m["ttft_p99_s"] == m["e2e_p99_s"] == math.inf
    assert m["served_ttft_p50_s"] == pytest.approx(0.3, rel=ACCURACY)
    assert m["served_ttft_p99_s"] == pytest.approx(2.0, rel=ACCURACY)
    assert m["served_e2e_p99_s"] == pytest.approx(2.5, rel=ACCURACY)
    assert m["queue_wait_p99_s"] == pytest.approx(1.5, rel=ACCURACY)


def test_goodput_and_slo_attainment() -> None:
    """Requests 0 and 6-9 meet TTFT <= 1 s and E2E <= 2 s; request 1 (TTFT 2 s) does not: 5 in a 9 s window."""
    m = summarise()["only"]
    assert m["goodput_rps"] == pytest.approx(5 / 9)
    assert m["slo_attainment"] == pytest.approx(5 / N)
    assert summarise()["all"]["goodput_rps"] == pytest.approx(5 / 9)


def test_busy_time_and_utilization() -> None:
    periods = [(1.0, 3.0), (5.0, 6.0)]
    busy = records.busy_seconds_until(periods, np.array([0.0, 2.0, 4.0, 5.5, 10.0]))
    assert busy.tolist() == [0.0, 1.0, 2.0, 2.5, 3.0]
    # busy 4.5 + 3 s of the 9 s window [0, 9], one replica alive throughout
    assert summarise()["only"]["utilization"] == pytest.approx(7.5 / 9)


def test_work_utilization_spreads_each_request_over_its_time_in_the_engine() -> None:
    """Work = each completed request's true cost times the share of its engine time inside the window.
    Requests 0, 1, 6, 7, 8 run inside the window [0, 9]; request 9 runs from 9.05 s to 9.9 s, outside it,
    and adds nothing. The replica offered 9 GPU-seconds."""
    cost = float(world().pools[0].estimator.estimate(100, 10))
    m = summarise()["only"]
    assert m["work_utilization"] == pytest.approx(5 * cost / 9)
    assert m["paid_work_utilization"] == pytest.approx(m["work_utilization"])


def test_warmup_arrivals_are_left_out() -> None:
    m = summarise(warmup_s=2.5)["only"]  # requests 3..9 in a window [2.5, 9]
    assert m["requests"] == 7 and m["failure_rate"] == pytest.approx(3 / 7)
    assert m["goodput_rps"] == pytest.approx(4 / 6.5)


def test_cold_starts_are_paid_for_but_serve_nothing() -> None:
    """One replica serves throughout; a second is asked for at 2 s and ready at 5 s (a 3 s cold start).
    In the window [0, 9]: 5 x 1 + 4 x 2 = 13 replica-seconds serving, 3 starting, 16 paid for."""
    run = result(
        replica_log=[(0.0, 1, 0, 0), (2.0, 1, 1, 0), (5.0, 2, 0, 0)],
        lifetimes=[[0.0, 10.0], [5.0, 10.0]],
        busy=[[(0.0, 4.5), (6.0, 9.0)], []],
    )
    s = summarise(run)
    pool = s["pool:gpu"]
    assert pool["replicas_mean"] == pytest.approx(13 / 9)
    assert pool["cold_start_gpu_s"] == pytest.approx(3.0)
    assert pool["paid_gpu_s"] == pytest.approx(16.0)
    assert pool["paid_replicas_mean"] == pytest.approx(16 / 9)
    m = s["only"]
    assert m["paid_work_utilization"] == pytest.approx(m["work_utilization"] * 13 / 16)


def test_timeseries_counts_per_second() -> None:
    run = result()
    ts = records.timeseries_frame(run, records.request_table(run, workload(), world()))
    assert len(ts) == 10
    assert ts["arrivals"].sum() == 12 and ts["admits"].sum() == 7
    assert ts["rejects"].tolist()[2:4] == [2, 2]  # requests 2 and 3: both attempts in their own second
    # request 1, admitted at 1 s, waits until 2.5 s: queued at the end of second [1, 2)
    assert ts.loc[ts["t_s"] == 1, "queued"].item() == 1
    assert ts.loc[ts["t_s"] == 0, "utilization"].item() == pytest.approx(1.0)
    assert ts.loc[ts["t_s"] == 5, "utilization"].item() == pytest.approx(0.0)


def test_combining_replications_pools_percentiles_and_says_what_is_missing() -> None:
    """Two runs: the pooled median of (0.1..0.5, 2.0, inf x4) twice is still 0.5 s; means and their t
    half-widths for the rest; a run that served nothing leaves the served percentiles to the other run,
    and says so."""
    one = summarise()
    nothing = {rid: (REJECTED, 1, None, None, None, None) for rid in range(N)}
    empty = summarise(result(ledger(nothing)))
    both = summary.combine([one, one])
    m = both["only"]
    assert m["ttft_p50_s"] == pytest.approx(0.5, rel=ACCURACY)
    assert m["failure_rate"] == pytest.approx(0.4) and m["failure_rate_ci95"] == 0.0
    assert m["ttft_p50_s_beyond"] == 10  # 20 observations, the median is rank 10
    assert summary.DISTRIBUTIONS not in m
    mixed = summary.combine([one, empty])["only"]
    assert mixed["failure_rate"] == pytest.approx(0.7)
    assert mixed["ttft_p50_s"] == math.inf  # 14 of 20 never answered
    assert mixed["served_ttft_p50_s"] == pytest.approx(0.3, rel=ACCURACY)
    assert mixed["served_ttft_p50_s_missing"] == 1
    assert math.isnan(mixed["served_ttft_p50_s_ci95"])  # one section left: no interval
    lines = summary.notes({"hand": summary.combine([one, empty])})
    assert any("left out" in line and "served_ttft_p50_s" in line for line in lines)
    assert any("fewer than 100 observations" in line for line in lines)


def test_json_round_trip_of_a_run_summary_combines_the_same() -> None:
    """Sweeps save each run's summary as JSON and combine later: the histograms must survive it."""
    one = summarise()
    again = json.loads(json.dumps(one, allow_nan=True))
    text = [json.dumps(summary.combine([run, run]), allow_nan=True, sort_keys=True) for run in (one, again)]
    assert text[0] == text[1]


def test_wasted_gpu_seconds_count_late_answers_and_aborted_work_on_missed_deadlines() -> None:
    """Deadlines 2 s after arrival on requests 0, 1 and 4 only. Request 0 answers at +1.0 s (in time: no
    waste); request 1 at +2.5 s (late: its whole cost, 100 prompt + 10 output tokens, wasted); request 4 is
    aborted after prefilling its prompt and decoding 3 tokens (that work wasted); request 6, late by no
    deadline of its own, wastes nothing. Priced at the profile's saturation rates; the share is over the
    9 s window of the one GPU offered. The report shows a deadlines table then, and none without deadlines."""
    from rich.console import Console

    from simadmit.results.report import print_summary

    led = ledger()
    led.aborted_prompt_done[4], led.aborted_output_done[4] = 100, 3
    run = result(led)
    w = workload()
    w.deadline[[0, 1, 4]] = w.arrival[[0, 1, 4]] + 2.0
    wd = world()
    est = wd.pools[0].estimator
    by_hand = est.estimate(100, 10) + est.estimate(100, 3)
    s = summary.run_summary(run, w, wd, records.request_table(run, w, wd))
    assert s["only"]["wasted_gpu_s"] == pytest.approx(by_hand)
    assert s["all"]["wasted_gpu_s"] == pytest.approx(by_hand)
    assert s["only"]["wasted_share"] == pytest.approx(by_hand / 9.0)  # the window [0, 9] s of one GPU
    assert summarise()["only"]["wasted_gpu_s"] == 0.0  # no deadlines: nothing wasted on them
    console = Console(width=80, record=True)
    print_summary({"hand": s}, "hand", console)
    assert "missed deadlines" in console.export_text()
    console = Console(width=80, record=True)
    print_summary({"hand": summarise()}, "hand", console)
    assert "missed deadlines" not in console.export_text()
