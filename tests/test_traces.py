"""Trace loaders read the real files exactly; options transform times exactly; bad rows are named.

The statistics are the ones published in data/traces/README.md, recomputed here from the repository's own
copies of the traces, so the tests pass on a fresh clone.
"""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simadmit.config.errors import InputError
from simadmit.config.resources import bundled_trace
from simadmit.workload import tiers
from simadmit.workload.trace_fit import iat_cv, idc
from simadmit.workload.traces import (
    MAX_LISTED,
    Columns,
    TraceOptions,
    load_azure,
    load_mooncake,
    load_trace,
)

DATA = Path(__file__).parents[1] / "data" / "traces"
AZURE = DATA / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
MOONCAKE = DATA / "mooncake_fast25" / "conversation_trace.jsonl"
SYNTHETIC = DATA / "mooncake_fast25" / "synthetic_trace.jsonl"


@pytest.fixture(scope="module")
def azure() -> pd.DataFrame:
    return load_azure(AZURE).frame


@pytest.fixture(scope="module")
def mooncake() -> pd.DataFrame:
    return load_mooncake(MOONCAKE).frame


def pct(values: pd.Series) -> list[float]:
    return list(np.percentile(values, [50, 90, 99]))


# --- the real traces ---------------------------------------------------------------------------------


def test_azure_conversation_matches_published_statistics(azure: pd.DataFrame) -> None:
    """19,366 rows over 58.4 min, 5.53 req/s, IAT CV 1.09, IDC 1.39 (1 s) and 20.6 (60 s); README lengths.

    Percentiles are compared to within one token: the README rounds interpolated percentiles."""
    t = azure["arrival_s"].to_numpy()
    assert list(azure.columns) == ["arrival_s", "prompt_tokens", "output_tokens"]
    assert len(azure) == 19_366 and t[0] == 0 and (np.diff(t) >= 0).all()
    assert t[-1] / 60 == pytest.approx(58.4, abs=0.05)
    assert len(t) / t[-1] == pytest.approx(5.53, abs=0.005)
    assert np.diff(t).mean() == pytest.approx(0.181, abs=0.0005)
    assert iat_cv(t) == pytest.approx(1.09, abs=0.005)
    assert idc(t, 1.0) == pytest.approx(1.39, abs=0.005)
    assert idc(t, 60.0) == pytest.approx(20.6, abs=0.05)
    assert pct(azure["prompt_tokens"]) == pytest.approx([1020, 2735, 4142], abs=1)
    assert pct(azure["output_tokens"]) == pytest.approx([129, 424, 601], abs=1)
    assert azure["prompt_tokens"].agg(["mean", "min", "max"]).tolist() == pytest.approx(
        [1155, 2, 14050], abs=0.5
    )
    assert azure["output_tokens"].agg(["mean", "min", "max"]).tolist() == pytest.approx(
        [211, 7, 1000], abs=0.5
    )


def test_azure_timestamps_keep_their_100ns_resolution(azure: pd.DataFrame) -> None:
    """The first rows are 18:15:46.6805900, 18:15:50.9951690 and 18:15:51.2224670."""
    assert azure["arrival_s"].iloc[:3].tolist() == [0.0, 4.314579, 4.541877]


def test_mooncake_conversation_matches_published_statistics(mooncake: pd.DataFrame) -> None:
    """12,031 rows over 3537 s, 3.40 req/s, 1,180 distinct ~3 s buckets of up to 28 requests each."""
    t = mooncake["arrival_s"].to_numpy()
    assert len(mooncake) == 12_031 and t[0] == 0 and t[-1] == 3536.999
    assert len(t) / t[-1] == pytest.approx(3.40, abs=0.005)
    stamps, counts = np.unique(t, return_counts=True)
    assert len(stamps) == 1180 and counts.max() == 28
    assert np.diff(stamps).min() == pytest.approx(2.997) and np.diff(stamps).max() == pytest.approx(3.003)
    assert iat_cv(t) == pytest.approx(3.03, abs=0.005)
    assert idc(t, 1.0) == pytest.approx(7.9, abs=0.05) and idc(t, 60.0) == pytest.approx(2.8, abs=0.05)
    assert pct(mooncake["prompt_tokens"]) == pytest.approx([6909, 27367, 85400], abs=1)
    assert pct(mooncake["output_tokens"]) == pytest.approx([350, 597, 1119], abs=1)
    assert mooncake["prompt_tokens"].agg(["mean", "max"]).tolist() == pytest.approx([12035, 126195], abs=0.5)
    assert mooncake["output_tokens"].agg(["mean", "max"]).tolist() == pytest.approx([343, 2000], abs=0.5)


def test_mooncake_synthetic_is_poisson_at_3_91_per_second() -> None:
    frame = load_mooncake(SYNTHETIC).frame
    t = frame["arrival_s"].to_numpy()
    assert len(frame) == 3993 and t[-1] / 60 == pytest.approx(17.0, abs=0.05)
    assert len(t) / t[-1] == pytest.approx(3.91, abs=0.005)
    assert iat_cv(t) == pytest.approx(1.01, abs=0.005) and idc(t, 1.0) == pytest.approx(1.09, abs=0.005)
    assert pct(frame["prompt_tokens"]) == pytest.approx([11587, 38611, 66456], abs=1)
    assert pct(frame["output_tokens"]) == pytest.approx([69, 389, 768], abs=1)


def test_bundled_samples_are_the_first_2000_rows(azure: pd.DataFrame, mooncake: pd.DataFrame) -> None:
    """The installed samples replay exactly like the head of the full traces."""
    sample = load_azure(bundled_trace("azure_llm_2023/AzureLLMInferenceTrace_conv_first2000.csv")).frame
    pd.testing.assert_frame_equal(sample, azure.iloc[:2000])
    sample = load_mooncake(bundled_trace("mooncake_fast25/conversation_trace_first2000.jsonl")).frame
    pd.testing.assert_frame_equal(sample, mooncake.iloc[:2000])
    assert bundled_trace("azure_llm_2023/AzureLLMInferenceTrace_conv.csv") == AZURE


def test_unknown_bundled_trace_lists_the_known_ones() -> None:
    with pytest.raises(
        InputError, match="no bundled trace 'azure'; known: .*conversation_trace_first2000.jsonl"
    ):
        bundled_trace("azure")


# --- exact time transformations ----------------------------------------------------------------------


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


SECONDS = Columns("t", "p", "o")
TIMES_S = "t,p,o\n10,1,1\n10.5,2,2\n11,3,3\n12.25,4,4\n13,5,5\n"


def test_times_start_at_the_first_request(tmp_path: Path) -> None:
    frame = load_trace(write(tmp_path, "a.csv", TIMES_S), SECONDS).frame
    assert frame["arrival_s"].tolist() == [0.0, 0.5, 1.0, 2.25, 3.0]
    assert frame["prompt_tokens"].tolist() == [1, 2, 3, 4, 5] and frame["output_tokens"].dtype == np.int64


def test_window_then_speedup_is_exact(tmp_path: Path) -> None:
    """Window [0.5, 3) of trace time keeps rows 2-4, shifted to the window start, then halved by 2x."""
    options = TraceOptions(start_s=0.5, end_s=3.0, speedup=2.0)
    frame = load_trace(write(tmp_path, "a.csv", TIMES_S), SECONDS, options).frame
    assert frame["arrival_s"].tolist() == [0.0, 0.25, 0.875]
    assert frame["prompt_tokens"].tolist() == [2, 3, 4]


@pytest.mark.parametrize(
    ("unit", "stamps"),
    [
        ("ms", ["1000", "1500", "3000", "4250"]),
        ("us", ["1000000", "1500000", "3000000", "4250000"]),
        (
            "datetime",
            [
                "2023-11-16 23:59:59.0000000",
                "2023-11-16 23:59:59.5000000",
                "2023-11-17 00:00:01",
                "2023-11-17 00:00:02.2500000",
            ],
        ),
    ],
)
def test_units_convert_exactly(tmp_path: Path, unit: str, stamps: list[str]) -> None:
    text = "t,p,o\n" + "".join(f"{s},7,3\n" for s in stamps)
    frame = load_trace(write(tmp_path, "a.csv", text), Columns("t", "p", "o", arrival_unit=unit)).frame  # type: ignore[arg-type]
    assert frame["arrival_s"].tolist() == [0.0, 0.5, 2.0, 3.25]
    frame = load_trace(
        write(tmp_path, "a.csv", text),
        Columns("t", "p", "o", arrival_unit=unit),
        TraceOptions(speedup=3.0),  # type: ignore[arg-type]
    ).frame
    assert frame["arrival_s"].tolist() == [0.0, 0.5 / 3, 2.0 / 3, 3.25 / 3]


def test_unsorted_rows_are_sorted_stably(tmp_path: Path) -> None:
    frame = load_trace(write(tmp_path, "a.csv", "t,p,o\n2,1,1\n1,2,2\n2,3,3\n1,4,4\n"), SECONDS).frame
    assert frame["arrival_s"].tolist() == [0.0, 0.0, 1.0, 1.0] and frame["prompt_tokens"].tolist() == [
        2,
        4,
        1,
        3,
    ]


def test_window_on_the_real_trace_is_exact(azure: pd.DataFrame) -> None:
    """Minutes 10-20 at 3x: the same requests, times (t - 600) / 3."""
    frame = load_azure(AZURE, TraceOptions(start_s=600, end_s=1200, speedup=3.0)).frame
    inside = azure[(azure["arrival_s"] >= 600) & (azure["arrival_s"] < 1200)].reset_index(drop=True)
    assert frame["arrival_s"].tolist() == ((inside["arrival_s"] - 600) / 3).tolist()
    pd.testing.assert_frame_equal(frame.drop(columns="arrival_s"), inside.drop(columns="arrival_s"))


@settings(max_examples=10, deadline=None)
@given(fraction=st.floats(0.05, 0.95), seed=st.integers(0, 2**32 - 1))
def test_sampling_keeps_the_fraction(azure: pd.DataFrame, fraction: float, seed: int) -> None:
    """Each of the 19,366 rows is kept with probability f: the count is binomial, within 5 sd of f x n."""
    frame = load_azure(AZURE, TraceOptions(sample=fraction, seed=seed)).frame
    n = len(azure)
    assert abs(len(frame) - fraction * n) < 5 * np.sqrt(n * fraction * (1 - fraction))
    assert frame["arrival_s"].isin(azure["arrival_s"]).all()


def test_sample_does_not_depend_on_the_window(azure: pd.DataFrame) -> None:
    """The sample is drawn over the whole trace: a window of a sample is the sample of the window."""
    whole = load_azure(AZURE, TraceOptions(sample=0.5, seed=3)).frame
    part = load_azure(AZURE, TraceOptions(sample=0.5, seed=3, start_s=1000, end_s=2000)).frame
    expected = whole[(whole["arrival_s"] >= 1000) & (whole["arrival_s"] < 2000)]["arrival_s"] - 1000
    assert part["arrival_s"].tolist() == expected.tolist()


def test_bucket_jitter_spreads_requests_within_their_bucket(mooncake: pd.DataFrame) -> None:
    """Off by default (requests of a bucket arrive together); on, each bucket's requests are uniform over
    its ~3 s, bucket counts and request order within a bucket are kept, and the seed fixes the draw."""
    jittered = load_mooncake(MOONCAKE, TraceOptions(bucket_jitter=True, seed=1)).frame
    t = jittered["arrival_s"].to_numpy()
    stamps = mooncake["arrival_s"].to_numpy()
    assert (np.diff(t) >= 0).all() and len(np.unique(t)) == len(t)
    assert (t >= stamps).all() and (t - stamps < 3.003).all()
    pd.testing.assert_frame_equal(jittered.drop(columns="arrival_s"), mooncake.drop(columns="arrival_s"))
    offset = (t - stamps) / 3.0  # uniform on [0, 1): mean 1/2, sd of the mean 0.29 / sqrt(n)
    assert offset.mean() == pytest.approx(0.5, abs=5 * 0.29 / np.sqrt(len(t)))
    assert iat_cv(t) < 1.5 < iat_cv(stamps)
    again = load_mooncake(MOONCAKE, TraceOptions(bucket_jitter=True, seed=1)).frame
    assert again["arrival_s"].tolist() == t.tolist()


def test_mapping_reads_jsonl_parquet_and_gzip_with_a_tier(tmp_path: Path) -> None:
    rows = pd.DataFrame(
        {"ts": [5.0, 6.0, 8.0], "in": [10, 20, 30], "out": [1, 2, 3], "class": ["a", "b", "a"]}
    )
    columns = Columns("ts", "in", "out", tier="class")
    jsonl = tmp_path / "t.jsonl"
    rows.to_json(jsonl, orient="records", lines=True)
    parquet = tmp_path / "t.parquet"
    rows.to_parquet(parquet)
    gz = tmp_path / "t.csv.gz"
    with gzip.open(gz, "wt") as f:
        rows.to_csv(f, index=False)
    for path in (jsonl, parquet, gz):
        frame = load_trace(path, columns).frame
        assert frame["arrival_s"].tolist() == [0.0, 1.0, 3.0], path
        assert frame["tier"].tolist() == ["a", "b", "a"] and frame["prompt_tokens"].tolist() == [10, 20, 30]
    same = load_trace(jsonl, Columns("ts", "in", "in")).frame
    assert same["prompt_tokens"].tolist() == same["output_tokens"].tolist() == [10, 20, 30]


def test_a_tier_column_of_numbers_names_the_same_tiers_in_every_format(tmp_path: Path) -> None:
    """CSV reads a tier written `1` as the text "1"; a Parquet or JSON column of the same numbers names the
    same tiers (it was refused as "not a non-empty string"), while true/false and fractions stay refused."""
    rows = pd.DataFrame({"ts": [5.0, 6.0, 8.0], "in": [10, 20, 30], "out": [1, 2, 3], "class": [1, 2, 1]})
    columns = Columns("ts", "in", "out", tier="class")
    paths = {"csv": tmp_path / "t.csv", "jsonl": tmp_path / "t.jsonl", "parquet": tmp_path / "t.parquet"}
    rows.to_csv(paths["csv"], index=False)
    rows.to_json(paths["jsonl"], orient="records", lines=True)
    rows.to_parquet(paths["parquet"])
    for path in paths.values():
        assert load_trace(path, columns).frame["tier"].tolist() == ["1", "2", "1"], path
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ts": 1, "in": 5, "out": 1, "class": 1}\n{"ts": 2, "in": 5, "out": 1, "class": true}\n')
    with pytest.raises(InputError, match="line 2: class True is not a non-empty string or whole number"):
        load_trace(bad, columns)


# --- malformed input ---------------------------------------------------------------------------------

BAD_CSV = "t,p,o\n1,10,5\n2,abc,5\n\n3,10,5\n4,10\n5,10,0\n"


def test_a_malformed_row_is_named_by_file_and_line(tmp_path: Path) -> None:
    """One line per problem, `file: line N: what`, with N as an editor counts lines (blank ones too)."""
    path = write(tmp_path, "bad.csv", "t,p,o\n1,10,5\n2,abc,5\n3,10,5\n")
    with pytest.raises(InputError) as err:
        load_trace(path, SECONDS)
    assert str(err.value) == f"{path}: line 3: p 'abc' is not a whole number >= 1"
    path = write(tmp_path, "bad2.csv", BAD_CSV)
    with pytest.raises(InputError) as err:
        load_trace(path, SECONDS)
    assert err.value.problems == [
        f"{path}: line 3: p 'abc' is not a whole number >= 1",
        f"{path}: line 6: expected 3 comma-separated fields, found 2",
        f"{path}: line 7: o '0' is not a whole number >= 1",
    ]


def test_skip_drops_malformed_rows_and_counts_them(tmp_path: Path) -> None:
    load = load_trace(write(tmp_path, "bad.csv", BAD_CSV), SECONDS, TraceOptions(on_error="skip"))
    assert load.skipped == 3 and len(load.problems) == 3 and "line 6" in load.problems[1]
    assert load.frame["arrival_s"].tolist() == [0.0, 2.0] and load.frame["prompt_tokens"].tolist() == [10, 10]


def test_jsonl_problems_name_the_line(tmp_path: Path) -> None:
    text = (
        '{"timestamp": 0, "input_length": 5, "output_length": 1}\n'
        '{"timestamp": 3000, "input_length": 5\n'
        '{"timestamp": 3000, "input_length": 5}\n'
        "[1, 2]\n"
        '{"timestamp": "soon", "input_length": 2.5, "output_length": 1}\n'
        '{"timestamp": 6000, "input_length": 5, "output_length": 4}\n'
    )
    path = write(tmp_path, "bad.jsonl", text)
    with pytest.raises(InputError) as err:
        load_mooncake(path)
    assert [p.split(": ", 2)[1:] for p in err.value.problems] == [
        ["line 2", "not valid JSON (Expecting ',' delimiter)"],
        ["line 3", "output_length is missing"],
        ["line 4", "not valid JSON (not a JSON object)"],
        ["line 5", "timestamp 'soon' is not a finite number"],
    ]
    load = load_mooncake(path, TraceOptions(on_error="skip"))
    assert load.skipped == 4 and load.frame["arrival_s"].tolist() == [0.0, 6.0]


def test_bad_datetime_and_many_errors_are_summarised(tmp_path: Path) -> None:
    rows = "".join(f"2023-11-16 18:00:{i:02d},10,x\n" for i in range(MAX_LISTED + 5))
    path = write(tmp_path, "az.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,1\n" + rows)
    with pytest.raises(InputError) as err:
        load_azure(path)
    assert err.value.problems[0] == f"{path}: line 2: TIMESTAMP 'yesterday' is not a date-time"
    assert len(err.value.problems) == MAX_LISTED + 1
    assert err.value.problems[-1] == f"{path}: ... and 6 more malformed rows"


def test_file_level_problems(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="trace file not found"):
        load_trace(tmp_path / "none.csv", SECONDS)
    with pytest.raises(InputError, match="unknown trace format"):
        load_trace(write(tmp_path, "a.txt", TIMES_S), SECONDS)
    with pytest.raises(InputError, match=r"no column 'p' \(columns: t, q, o\)"):
        load_trace(write(tmp_path, "a.csv", "t,q,o\n1,1,1\n"), SECONDS)
    with pytest.raises(InputError, match="no requests left"):
        load_trace(write(tmp_path, "a.csv", TIMES_S), SECONDS, TraceOptions(start_s=100))
    # a file without a single request says so, whatever its format, rather than blame the options
    for name, text in (("a.csv", "t,p,o\n"), ("a.jsonl", ""), ("b.jsonl", "\n  \n")):
        with pytest.raises(InputError, match=f"{name}: no requests in it: the file holds no rows"):
            load_trace(write(tmp_path, name, text), SECONDS)
    empty_parquet = tmp_path / "a.parquet"
    pd.DataFrame({"t": [], "p": [], "o": []}).to_parquet(empty_parquet)
    with pytest.raises(InputError, match="no requests in it"):
        load_trace(empty_parquet, SECONDS)
    with pytest.raises(ValueError, match="speedup"):
        TraceOptions(speedup=0)


def test_parquet_problems_name_the_row(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    pd.DataFrame({"t": [0.0, 1.0, 2.0], "p": [5.0, None, 2.5], "o": [1, 1, 1]}).to_parquet(path)
    with pytest.raises(InputError) as err:
        load_trace(path, SECONDS)
    assert err.value.problems == [
        f"{path}: row 2: p is missing",
        f"{path}: row 3: p 2.5 is not a whole number >= 1",
    ]


# --- tiers and max_tokens ----------------------------------------------------------------------------


def test_tier_by_column_by_length_and_by_share(azure: pd.DataFrame) -> None:
    frame = pd.DataFrame(
        {"prompt_tokens": [100, 5000, 9000], "output_tokens": [10, 900, 5], "tier": ["x", "y", "z"]}
    )
    rng = np.random.default_rng(0)
    rename = tiers.ByColumn(names={"x": "chat"})
    assert tiers.assign_tiers(frame, rename, rng).tolist() == ["chat", "y", "z"]
    assert tiers.assign_tiers(frame, tiers.ByColumn(names={"x": "chat"}, default="other"), rng).tolist() == [
        "chat",
        "other",
        "other",
    ]
    rules = (tiers.LengthRule("long", above=8000), tiers.LengthRule("batch", "output_tokens", above=500))
    assert tiers.assign_tiers(frame, tiers.ByLength(rules, "chat"), rng).tolist() == ["chat", "batch", "long"]
    shared = tiers.assign_tiers(azure, tiers.ByShare({"chat": 3, "batch": 1}), np.random.default_rng(1))
    n = len(azure)
    assert abs((shared == "batch").sum() - n / 4) < 5 * np.sqrt(n * 0.25 * 0.75)
    with pytest.raises(InputError, match="no column 'kind'"):
        tiers.assign_tiers(frame, tiers.ByColumn("kind"), rng)


@given(
    out=st.lists(st.integers(1, 100_000), min_size=1, max_size=50),
    factor=st.floats(1.0, 10.0),
    cap=st.none() | st.integers(1, 200_000),
)
def test_scaled_max_tokens_is_rounded_up_and_never_below_the_output(
    out: list[int], factor: float, cap: int | None
) -> None:
    o = np.array(out)
    m = tiers.max_tokens(o, tiers.ScaledMaxTokens(factor, cap))
    assert (m >= o).all() and m.dtype == np.int64
    target = o * factor if cap is None else np.minimum(o * factor, cap)
    assert (m >= np.minimum(np.floor(target), np.maximum(o, target))).all()
    assert (m < np.maximum(o, target) + 1).all()


def test_max_tokens_exact_cases() -> None:
    """100 x 1.1 is 110 (not 111 from float noise); a fixed cap is raised to longer outputs."""
    o = np.array([100, 7, 1000])
    assert tiers.max_tokens(o, tiers.ScaledMaxTokens(1.1)).tolist() == [110, 8, 1100]
    assert tiers.max_tokens(o, tiers.ScaledMaxTokens(2.0, cap=1500)).tolist() == [200, 14, 1500]
    assert tiers.max_tokens(o, tiers.FixedMaxTokens(512)).tolist() == [512, 512, 1000]
