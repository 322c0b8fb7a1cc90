"""The measurements CSV: rows survive a round trip, a crash mid-write, and resumption."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from simadmit.calibrate.measurements import (
    Measurement,
    MeasurementLog,
    cell_progress,
    measurements_path,
    read_measurements,
)
from simadmit.config.errors import InputError

ROW = Measurement(
    phase="decode", concurrency=4, seq=0, attempt=1, model="m", start_unix_s=1.7e9, prompt_tokens_target=128,
    prompt_tokens=128, output_tokens_target=64, output_tokens=64, ttft_s=0.25, itl_mean_s=0.04, itl_p50_s=0.039,
    itl_p90_s=0.05, itl_max_s=0.1, n_chunks=64, e2e_s=2.8, status="ok",
)  # fmt: skip


def test_path_sits_next_to_profile() -> None:
    assert measurements_path("calibration/x.yaml") == Path("calibration/x.measurements.csv")


def test_round_trip_and_failed_rows(tmp_path: Path) -> None:
    """Every attempt is a row; a failed one keeps NaN for what it never measured."""
    failed = replace(ROW, seq=1, status="timeout", ttft_s=math.nan, itl_mean_s=math.nan, e2e_s=30.0)
    path = tmp_path / "m.csv"
    with MeasurementLog(path) as log:
        log.append(ROW)
        log.append(failed)
    back = read_measurements(path)
    assert back[0] == ROW
    assert back[1].status == "timeout" and not back[1].ok and math.isnan(back[1].ttft_s)


def test_each_row_is_on_disk_as_soon_as_appended(tmp_path: Path) -> None:
    """Flushed per row: a reader sees a row before the writer is closed (what Ctrl-C or a crash leaves)."""
    path = tmp_path / "m.csv"
    log = MeasurementLog(path)
    log.append(ROW)
    assert read_measurements(path) == [ROW]
    log.close()


def test_partial_last_line_is_dropped_and_appending_continues(tmp_path: Path) -> None:
    """A crash mid-write leaves a line without newline: reading ignores it, appending starts a fresh line."""
    path = tmp_path / "m.csv"
    with MeasurementLog(path) as log:
        log.append(ROW)
    path.write_text(path.read_text() + "decode,4,1,1,m,17000")
    assert read_measurements(path) == [ROW]
    with MeasurementLog(path) as log:
        log.append(replace(ROW, seq=1))
    assert [r.seq for r in read_measurements(path)] == [0, 1]


def test_resume_progress_per_cell() -> None:
    """A cell knows its completed requests, its next seq (after retries too) and the busy time it used."""
    rows = [
        ROW,
        replace(ROW, seq=1, e2e_s=3.2),
        replace(ROW, seq=2, status="http_503", e2e_s=0.4),
        replace(ROW, seq=2, attempt=2, e2e_s=2.6),
        replace(ROW, concurrency=8, seq=7),
        replace(ROW, phase="prefill", concurrency=4, seq=9),
    ]
    p = cell_progress(rows, "decode", 4)
    assert (p.completed, p.next_seq) == (3, 3)
    assert p.spent_s == pytest.approx((2.8 + 3.2 + 0.4 + 2.6) / 4)
    assert cell_progress(rows, "saturation", 4).next_seq == 0


def test_foreign_csv_is_an_input_error(tmp_path: Path) -> None:
    path = tmp_path / "other.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(InputError, match="not a measurements file"):
        read_measurements(path)


@pytest.mark.parametrize(("field", "value"), [("ttft_s", math.nan), ("e2e_s", math.inf), ("ttft_s", -0.5)])
def test_an_ok_row_without_its_times_is_an_input_error(tmp_path: Path, field: str, value: float) -> None:
    """A file edited by hand (or damaged) with an ok row missing its TTFT is refused naming the row: the fit
    ended in numpy's 'SVD did not converge' traceback (an infinite E2E was fitted as it was)."""
    path = tmp_path / "m.csv"
    with MeasurementLog(path) as log:
        log.append(ROW)
        log.append(replace(ROW, seq=1, **{field: value}))
    with pytest.raises(InputError, match=f"data row 2: an ok measurement with {field} .*, not a time"):
        read_measurements(path)


def test_a_file_from_before_the_later_columns_reads_and_resumes_without_them(tmp_path: Path) -> None:
    """A file written before `server`, `round` and `token_times_s` existed reads them as "", 0 and ()
    (unrecorded), and a resumed run appends rows with the file's own columns, so it stays one table."""
    path = tmp_path / "m.csv"
    with MeasurementLog(path) as log:
        log.append(replace(ROW, round=2))
    header, row = path.read_text().splitlines()
    assert header.endswith(",server,round,token_times_s")
    path.write_text(
        header.removesuffix(",server,round,token_times_s") + "\n" + row.removesuffix(",,2,") + "\n"
    )
    assert read_measurements(path) == [ROW]
    with MeasurementLog(path, server="s") as log:
        log.append(replace(ROW, seq=1, round=1))
    assert read_measurements(path) == [ROW, replace(ROW, seq=1)]


def test_token_times_round_trip_to_a_tenth_of_a_millisecond(tmp_path: Path) -> None:
    times = tuple(0.25 + 0.04 * k + (0.00003 if k == 5 else 0.0) for k in range(64))
    path = tmp_path / "m.csv"
    with MeasurementLog(path) as log:
        log.append(replace(ROW, token_times_s=times))
    (back,) = read_measurements(path)
    assert back.token_times_s == pytest.approx(times, abs=5e-5)


@pytest.mark.parametrize(
    ("times", "why"),
    [
        ((0.25, 0.29), "holds 2 times for 64 output tokens"),
        (tuple(0.25 + 0.04 * k for k in range(63)) + (0.1,), "is not a rising list"),
        (tuple(0.5 + 0.04 * k for k in range(64)), "starts at 0.5 s, not at the ttft_s 0.25 s"),
    ],
)
def test_an_ok_row_whose_token_times_disagree_with_it_is_an_input_error(
    tmp_path: Path, times: tuple[float, ...], why: str
) -> None:
    """Token times place each token in a step of the fit: a row whose times cannot be its tokens is refused."""
    path = tmp_path / "m.csv"
    with MeasurementLog(path) as log:
        log.append(replace(ROW, token_times_s=times))
    with pytest.raises(InputError, match=f"data row 1: token_times_s {why}"):
        read_measurements(path)
