"""Arrival processes have the configured rate and burstiness, within sampling error.

Tolerances are sized to the sample, not pinned digits: each check states the standard error it relies on
and allows about 4-5 of them, so a correct process fails far less than once in ten thousand runs, while
a wrong rate, a reset state or a misplaced curve is off by many standard errors.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simadmit.workload.arrivals import (
    MMPP2,
    Diurnal,
    GammaRenewal,
    Poisson,
    RateCurve,
    TimeVarying,
    arrival_times,
)
from simadmit.workload.trace_fit import fit_trace, iat_cv, idc
from simadmit.workload.traces import TraceOptions, load_azure, load_mooncake

DATA = Path(__file__).parents[1] / "data" / "traces"
RAMP_SPIKE_DRAIN = RateCurve(((0, 0.5), (600, 1.0), (900, 3.0), (960, 1.0), (1200, 1.0), (1500, 0.0)))


def test_exactly_one_of_duration_and_count() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="exactly one"):
        arrival_times(Poisson(), rng, 1.0, 10.0, 10)
    with pytest.raises(ValueError, match="exactly one"):
        arrival_times(Poisson(), rng, 1.0, None, None)


@pytest.mark.parametrize(
    "process",
    [
        Poisson(),
        GammaRenewal(2.0),
        MMPP2(5, 10, 2),
        TimeVarying(Diurnal(0.5, 600)),
        TimeVarying(RAMP_SPIKE_DRAIN, 2.0),
    ],
)
def test_streams_are_sorted_and_sized(process: object) -> None:
    by_count = arrival_times(process, np.random.default_rng(1), 5.0, None, 3000)  # type: ignore[arg-type]
    by_time = arrival_times(process, np.random.default_rng(1), 5.0, 700.0, None)  # type: ignore[arg-type]
    assert len(by_count) == 3000 and (np.diff(by_count) >= 0).all() and by_count[0] >= 0
    assert (np.diff(by_time) >= 0).all() and by_time[-1] < 700


def test_poisson_by_count_is_the_cumulative_sum_of_exponentials() -> None:
    """The original API is unchanged: the same generator gives the same stream."""
    got = arrival_times(Poisson(), np.random.default_rng(7), 4.0, None, 100)
    assert got.tolist() == np.cumsum(np.random.default_rng(7).exponential(0.25, 100)).tolist()


@settings(max_examples=12, deadline=None)
@given(cv=st.floats(0.3, 4.0), rate=st.floats(0.5, 50.0), seed=st.integers(0, 2**32 - 1))
def test_gamma_renewal_has_the_configured_rate_and_cv(cv: float, rate: float, seed: int) -> None:
    """200,000 gamma gaps: the mean has relative sd cv / sqrt(n) (<= 0.9%); the sample variance of a gamma
    has relative sd sqrt((2 + 6 cv^2) / n), so the CV's is about half that (<= 1.2% at cv = 4). Allow 5%."""
    n = 200_000
    t = arrival_times(GammaRenewal(cv), np.random.default_rng(seed), rate, None, n)
    assert n / t[-1] == pytest.approx(rate, rel=5 * cv / np.sqrt(n))
    assert iat_cv(t) == pytest.approx(cv, rel=0.05)


def mmpp_idc(p: MMPP2, rate: float, window_s: float) -> float:
    """IDC of counts in a window of an MMPP2 in steady state:
    1 + 2 r1 r2 (l1 - l2)^2 / ((r1 + r2)^3 l) x (1 - (1 - exp(-sT)) / (sT)), s = r1 + r2."""
    r1, r2 = 1 / p.calm_s, 1 / p.burst_s
    l1, l2 = p.rates(rate)
    s = r1 + r2
    return 1 + 2 * r1 * r2 * (l1 - l2) ** 2 / (s**3 * rate) * (
        1 - (1 - np.exp(-s * window_s)) / (s * window_s)
    )


@pytest.mark.parametrize(("p", "rate"), [(MMPP2(5, 10, 2), 20.0), (MMPP2(3, 30, 30), 4.0)])
def test_mmpp_has_the_configured_rate_and_dispersion(p: MMPP2, rate: float) -> None:
    """Over 10 x 20,000 s the mean rate has relative sd ~1% / sqrt(10) per the per-run spread (0.2/20), and
    IDC_1s ~1.5% / sqrt(10). Rate within 2%, IDC_1s within 4% of theory, and IDC_60s (sd ~8% per run, a
    few percent over 10 runs) within 15%."""
    runs = [arrival_times(p, np.random.default_rng([s, 9]), rate, 20_000.0, None) for s in range(10)]
    assert np.mean([len(t) / 20_000 for t in runs]) == pytest.approx(rate, rel=0.02)
    assert np.mean([idc(t, 1.0, 20_000) for t in runs]) == pytest.approx(mmpp_idc(p, rate, 1.0), rel=0.04)
    assert np.mean([idc(t, 60.0, 20_000) for t in runs]) == pytest.approx(mmpp_idc(p, rate, 60.0), rel=0.15)


def test_mmpp_starts_in_steady_state() -> None:
    """The first state is drawn from the stationary distribution, so even the first 2 s carry the mean
    rate: 20,000 streams x 2 s x 10 req/s = 400,000 expected, sd ~ sqrt(400,000 x IDC_2s = 3.9) ~ 1,250."""
    p = MMPP2(5, 10, 2)
    total = sum(len(arrival_times(p, np.random.default_rng([s, 3]), 10.0, 2.0, None)) for s in range(20_000))
    assert total == pytest.approx(400_000, abs=5 * np.sqrt(400_000 * mmpp_idc(p, 10.0, 2.0)))


def test_mmpp_by_duration_extends_one_stream() -> None:
    """A longer duration (or a count) continues the same modulated stream instead of restarting the
    modulating chain for each chunk: the shorter stream is exactly the start of the longer one."""
    p = MMPP2(4, 5, 1)
    short = arrival_times(p, np.random.default_rng(5), 50.0, 30.0, None)
    long = arrival_times(p, np.random.default_rng(5), 50.0, 5_000.0, None)
    counted = arrival_times(p, np.random.default_rng(5), 50.0, None, 200_000)
    assert short.tolist() == long[long < 30].tolist() == counted[counted < 30].tolist()
    assert len(long) > 100_000  # several bulk draws of sojourns


def test_mmpp_intervals_sum_to_the_times() -> None:
    p = MMPP2(5, 10, 2)
    gaps = p.intervals(np.random.default_rng(2), 3.0, 1000)
    assert len(gaps) == 1000 and (gaps >= 0).all()
    assert np.cumsum(gaps) == pytest.approx(p.times(np.random.default_rng(2), 3.0, None, 1000))


def expected_per_bin(process: TimeVarying, rate: float, edges: np.ndarray) -> np.ndarray:
    return rate * np.diff(process.shape.cumulative(edges))


@pytest.mark.parametrize("shape", [RAMP_SPIKE_DRAIN, Diurnal(0.8, 1200, 300)])
def test_thinned_process_follows_its_rate_curve(shape: RateCurve | Diurnal) -> None:
    """Poisson counts in 20 s bins over 200 runs: each bin total is Poisson with mean 200 x integral of
    the rate, so it lies within 4.5 sqrt(mean) (+1 for bins expected empty) of it; and the counts are
    Poisson, not just right on average: the overall IDC_20s is 1 within 2%."""
    process, rate, edges = TimeVarying(shape), 8.0, np.arange(0.0, 1801.0, 20.0)
    runs = [arrival_times(process, np.random.default_rng([s, 4]), rate, 1800.0, None) for s in range(200)]
    counts = np.array([np.histogram(t, edges)[0] for t in runs])
    expected = 200 * expected_per_bin(process, rate, edges)
    assert (np.abs(counts.sum(axis=0) - expected) <= 4.5 * np.sqrt(expected) + 1).all()
    dispersion = (counts.var(axis=0, ddof=1) / np.maximum(counts.mean(axis=0), 1e-12))[expected > 200 * 20]
    assert dispersion.mean() == pytest.approx(1.0, abs=0.02 * 4)


def test_time_changed_gamma_follows_the_curve_with_its_cv() -> None:
    """With cv = 2 the bin totals vary cv^2 = 4 times more than Poisson (allow 5 x 2 sd); mapped back
    through the cumulative rate, the gaps have CV 2 (about 40,000 gaps over 20 runs: within 5%)."""
    process, rate, edges = TimeVarying(RAMP_SPIKE_DRAIN, cv=2.0), 5.0, np.arange(0.0, 1501.0, 50.0)
    runs = [arrival_times(process, np.random.default_rng([s, 5]), rate, 1800.0, None) for s in range(20)]
    counts = np.array([np.histogram(t, edges)[0] for t in runs])
    expected = 20 * expected_per_bin(process, rate, edges)
    assert (np.abs(counts.sum(axis=0) - expected) <= 5 * 2 * np.sqrt(expected) + 1).all()
    cvs = [iat_cv(RAMP_SPIKE_DRAIN.cumulative(t)) for t in runs]
    assert np.mean(cvs) == pytest.approx(2.0, rel=0.05)


@given(t=st.lists(st.floats(0, 5000), min_size=1, max_size=20))
def test_inverse_undoes_the_cumulative(t: list[float]) -> None:
    x = np.array(t)
    shapes = [
        RAMP_SPIKE_DRAIN,
        Diurnal(0.9, 3600, 100),
        RateCurve(((0, 1), (10, 1), (10, 0), (20, 0), (20, 2))),
    ]
    for shape in shapes:
        c = shape.cumulative(x)
        assert shape.cumulative(shape.inverse(c)) == pytest.approx(c, abs=1e-6)


def test_profile_is_exact_on_a_hand_example() -> None:
    """Factor 0 -> 2 over 10 s, a jump to 1, held: cumulative t^2/10 then 10 + (t - 10)."""
    p = RateCurve(((0, 0), (10, 2), (10, 1)))
    assert p.factor(np.array([0.0, 5.0, 10.0, 30.0])).tolist() == [0.0, 1.0, 1.0, 1.0]
    assert p.cumulative(np.array([5.0, 10.0, 30.0])).tolist() == [2.5, 10.0, 30.0]
    assert p.inverse(np.array([2.5, 10.0, 30.0])).tolist() == [5.0, 10.0, 30.0]


def test_profile_validation_and_dead_ends() -> None:
    with pytest.raises(ValueError, match="starting at 0"):
        RateCurve(((5, 1), (10, 1)))
    with pytest.raises(ValueError, match="all 0"):
        RateCurve(((0, 0), (10, 0)))
    drained = TimeVarying(RateCurve(((0, 1), (10, 0))))
    with pytest.raises(ValueError, match="ends at rate 0"):
        arrival_times(drained, np.random.default_rng(0), 1.0, None, 1000)
    with pytest.raises(ValueError, match="ends at rate 0"):
        arrival_times(TimeVarying(drained.shape, 2.0), np.random.default_rng(0), 1.0, None, 1000)
    assert (arrival_times(drained, np.random.default_rng(0), 1.0, 100.0, None) < 10).all()


def test_fit_reproduces_the_azure_trace() -> None:
    """The fitted step curve carries exactly the trace's mean rate (5.53 req/s). Streams generated from it
    (5 runs of ~19,400 requests) reproduce the rate within 2% (Poisson-ish sd 0.7% per run) and the trace's
    IAT CV 1.09 within 5%; the dispersion only roughly, since a renewal process has no correlation between
    gaps: IDC_1s 1.39 within 10% and IDC_60s 20.6 within 30% (its sd over 58 bins is ~20%)."""
    t = load_azure(DATA / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv").frame["arrival_s"].to_numpy()
    fit = fit_trace(t, bin_s=60.0)
    assert fit.rate == pytest.approx(len(t) / t[-1], rel=1e-12) and fit.span_s == t[-1]
    assert float(fit.shape.cumulative(np.array(t[-1]))) == pytest.approx(t[-1], rel=1e-12)
    assert fit.iat_cv == pytest.approx(1.09, abs=0.005) and fit.idc == pytest.approx(1.39, abs=0.005)
    assert 1.0 < fit.cv < fit.iat_cv  # the curve explains part of the raw burstiness
    runs = [
        arrival_times(fit.process(), np.random.default_rng(s), fit.rate, fit.span_s, None) for s in range(5)
    ]
    assert np.mean([len(g) / fit.span_s for g in runs]) == pytest.approx(fit.rate, rel=0.02)
    assert np.mean([iat_cv(g) for g in runs]) == pytest.approx(fit.iat_cv, rel=0.05)
    assert np.mean([idc(g, 1.0, fit.span_s) for g in runs]) == pytest.approx(idc(t, 1.0), rel=0.10)
    assert np.mean([idc(g, 60.0, fit.span_s) for g in runs]) == pytest.approx(idc(t, 60.0), rel=0.30)


def test_fit_follows_a_jittered_mooncake_replay() -> None:
    """Quantized Mooncake timestamps are jittered within their buckets before fitting; the generated
    stream keeps the mean rate 3.40 req/s (within 2%) and the per-minute rate curve: counts per 60 s bin
    within 5 sd of the trace's, the sd being cv x sqrt(count) for a gamma renewal."""
    t = load_mooncake(
        DATA / "mooncake_fast25" / "conversation_trace.jsonl", TraceOptions(bucket_jitter=True)
    ).frame
    t = t["arrival_s"].to_numpy()
    fit = fit_trace(t, bin_s=60.0)
    g = arrival_times(fit.process(), np.random.default_rng(1), fit.rate, fit.span_s, None)
    assert len(g) / fit.span_s == pytest.approx(3.40, rel=0.02)
    edges = np.arange(0.0, 3480.0, 60.0)
    trace_counts, counts = np.histogram(t, edges)[0], np.histogram(g, edges)[0]
    assert (np.abs(counts - trace_counts) <= 5 * fit.cv * np.sqrt(trace_counts) + 1).all()
