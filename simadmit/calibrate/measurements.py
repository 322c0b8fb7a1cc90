"""The measurements CSV: one row per request attempt, appended and flushed as each attempt completes.

Appending row by row means Ctrl-C or a crash keeps everything measured so far, and `--resume` reads the file
back to continue where the run stopped: each (phase, concurrency) cell knows how many requests it already has
and how much of its time budget they used.
"""

from __future__ import annotations

import contextlib
import csv
import io
import math
from collections.abc import Iterable, Sequence
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import IO, Any, Self

from simadmit.config.errors import InputError, problem

OK = "ok"


@dataclass(frozen=True, slots=True)
class Measurement:
    """One request attempt. Times in seconds; NaN where the attempt failed before producing the value."""

    phase: str
    concurrency: int
    seq: int  # index of the request within its (phase, concurrency) cell; retries keep it
    attempt: int  # 1 for the first try
    model: str
    start_unix_s: float
    prompt_tokens_target: int
    prompt_tokens: int  # as counted by the server (`usage`), 0 if unknown
    output_tokens_target: int
    output_tokens: int
    ttft_s: float
    itl_mean_s: float  # (last token time - first token time) / (output tokens - 1)
    itl_p50_s: float  # over the gaps between streamed chunks
    itl_p90_s: float
    itl_max_s: float
    n_chunks: int
    e2e_s: float
    status: str  # "ok", or the fault: "timeout", "http_503", "dropped", "connect"...
    server: str = ""  # the server and configuration measured (`run.server_identity`); "" in older files
    round: int = 0  # the plan's round it ran in (`phases.in_rounds`); 0 for the warm-up and in older files
    # each output token's arrival, seconds after the start (tokens sent together share a time); () if unknown
    token_times_s: tuple[float, ...] = ()

    @property
    def ok(self) -> bool:
        return self.status == OK


COLUMNS = tuple(f.name for f in fields(Measurement))
# columns files written before them lack: read as this
OPTIONAL = {"server": "", "round": 0, "token_times_s": ()}
TIMED = ("start_unix_s", "ttft_s", "e2e_s")  # what every ok request has measured: finite, 0 or more
_TYPES = {f.name: f.type for f in fields(Measurement)}


def measurements_path(profile_path: str | Path) -> Path:
    """`calibration/x.yaml` -> `calibration/x.measurements.csv`: the raw data sits next to its profile."""
    p = Path(profile_path)
    return (
        p.with_name(p.stem + ".measurements.csv")
        if p.suffix in (".yaml", ".yml")
        else Path(f"{p}.measurements.csv")
    )


def _format(value: object) -> str:
    if isinstance(value, tuple):
        return " ".join(f"{t:.4f}" for t in value)
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6f}" if abs(value) < 1e6 else f"{value:.3f}"
    return str(value)


def read_measurements(path: str | Path) -> list[Measurement]:
    """Read a measurements CSV back; a missing file is an empty run, a foreign file is an `InputError`."""
    path = Path(path)
    if not path.exists():
        return []
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise InputError([problem(path, None, "not a measurements file (not UTF-8 text)")]) from None
    if not text.endswith("\n"):  # a line cut short by a crash mid-write: drop it, keep the rest
        text = text[: text.rfind("\n") + 1]
    reader = csv.DictReader(io.StringIO(text, newline=""))
    present = reader.fieldnames or COLUMNS
    missing = [c for c in COLUMNS if c not in present and c not in OPTIONAL]
    if missing:
        raise InputError(
            [problem(path, None, f"not a measurements file (missing columns: {', '.join(missing)})")]
        )
    columns = [c for c in COLUMNS if c in present]
    rows = []
    for n, rec in enumerate(reader, start=1):
        try:
            m = Measurement(**{c: _parse(c, rec[c]) for c in columns})
        except (TypeError, ValueError):
            raise InputError([problem(path, f"data row {n}", "malformed measurement row")]) from None
        if m.ok and (bad := [c for c in TIMED if not 0 <= getattr(m, c) < math.inf]):
            why = f"an ok measurement with {bad[0]} {rec[bad[0]]!r}, not a time (the fit needs it)"
            raise InputError([problem(path, f"data row {n}", why)])
        if m.ok and (wrong := _token_times_problem(m)):
            raise InputError([problem(path, f"data row {n}", wrong)])
        rows.append(m)
    return rows


def _token_times_problem(m: Measurement) -> str | None:
    """What is wrong with an ok row's token times, if anything: one finite time per output token, in order,
    the first being the TTFT (a row whose times say otherwise would place its tokens in the wrong steps)."""
    t = m.token_times_s
    if not t:
        return None
    if len(t) != m.output_tokens:
        return f"token_times_s holds {len(t)} times for {m.output_tokens} output tokens"
    if not all(0 <= a <= b < math.inf for a, b in zip(t, t[1:] + t[-1:], strict=True)):
        return "token_times_s is not a rising list of times"
    if abs(t[0] - m.ttft_s) > 1e-3:
        return f"token_times_s starts at {t[0]:g} s, not at the ttft_s {m.ttft_s:g} s"
    return None


def _parse(column: str, text: str | None) -> Any:
    kind = _TYPES[column]
    if text is None:
        raise ValueError(column)
    if kind == "float":
        return float("nan") if text == "" else float(text)
    if kind.startswith("tuple"):
        return tuple(float(t) for t in text.split())
    return int(text) if kind == "int" else text


def _drop_partial_last_line(path: Path) -> None:
    """Cut a trailing line without its newline (a crash mid-write) so appended rows start on a fresh line."""
    with path.open("rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)


class MeasurementLog:
    """Append-only CSV writer: writes the header once, then one flushed line per `append`, each row stamped
    with `server` (what was measured). A file resumed keeps its own columns: one written before a column
    existed gets rows without it."""

    def __init__(self, path: str | Path, server: str = "") -> None:
        self.path = Path(path)
        self.server = server
        try:  # opened before the first request: a place that cannot be written costs no measurement
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.exists():
                _drop_partial_last_line(self.path)
            fresh = not self.path.exists() or self.path.stat().st_size == 0
            header = None
            if not fresh:
                with self.path.open(newline="") as f:
                    header = next(csv.reader(f), None)
            self._file: IO[str] = self.path.open("a", newline="")
        except OSError as e:
            raise InputError([problem(self.path, None, f"cannot write it ({e.strerror or e})")]) from None
        self._writer = csv.writer(self._file)
        self._columns = [c for c in COLUMNS if header is None or c in header]
        if fresh:
            self._write(COLUMNS)

    def append(self, m: Measurement) -> None:
        values = dict(zip(COLUMNS, astuple(m), strict=True)) | (
            {"server": self.server} if self.server else {}
        )
        self._write([_format(values[c]) for c in self._columns])

    def _write(self, row: Sequence[str]) -> None:
        """One line, flushed; a full disk stops the run with the lines already written kept for --resume
        (a line cut short is dropped when the file is opened again)."""
        try:
            self._writer.writerow(row)
            self._file.flush()
        except OSError as e:
            why = (
                f"cannot write it ({e.strerror or e}); the rows written so far are kept: rerun with --resume"
            )
            raise InputError([problem(self.path, None, why)]) from None

    def close(self) -> None:
        # Every line was flushed as written: only a line a write error already reported can be pending.
        with contextlib.suppress(OSError):
            self._file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class CellProgress:
    """What a (phase, concurrency) cell already holds: requests done, next seq, and busy time spent."""

    completed: int
    next_seq: int
    spent_s: float


def cell_progress(rows: Iterable[Measurement], phase: str, concurrency: int) -> CellProgress:
    """Progress of one cell from earlier rows. Time spent is the attempts' total duration divided by the
    concurrency (the cell's workers run in parallel), so gaps between an interrupted run and its resumption
    are not charged to the budget."""
    mine = [r for r in rows if r.phase == phase and r.concurrency == concurrency]
    completed = sum(1 for r in mine if r.ok)
    next_seq = max((r.seq for r in mine), default=-1) + 1
    busy = sum(r.e2e_s for r in mine if not math.isnan(r.e2e_s))
    return CellProgress(completed=completed, next_seq=next_seq, spent_s=busy / max(1, concurrency))
