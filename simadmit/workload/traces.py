"""Request traces: read a recorded stream of requests into a table the workload can replay.

A trace is a file with one request per row: when it arrived, how many prompt tokens it sent and how many
tokens it generated. Readers exist for the Azure LLM inference trace (CSV), the Mooncake format (JSONL,
which other LLM benchmarks read too) and any CSV/JSONL/Parquet file through a column mapping. Every reader
returns the same table, sorted by arrival:

    arrival_s       float, seconds from the window start (trace time start_s; the trace's first request
                    is at trace time 0), divided by the speed-up
    prompt_tokens   int >= 1
    output_tokens   int >= 1, the truth the gateway never sees
    tier            str, only when the mapping names a tier column

Options apply in a fixed order: drop malformed rows (or fail), sort, measure time from the trace's first
request, optionally jitter quantized timestamps within their bucket, keep the window [start_s, end_s) of
trace time, keep a seeded random fraction of rows, then shift to the window start and divide by the
speed-up. The sample is drawn over the whole trace, so the window does not change which requests are kept.
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

import numpy as np
import pandas as pd

from simadmit.config.errors import TOO_DEEP, UTF16, InputError, is_utf16, not_found, problem
from simadmit.config.resources import TRACE_SUFFIXES
from simadmit.config.workload_schema import MAX_SECONDS, MAX_TOKENS

MAX_LISTED = 10  # malformed rows listed one per line; the rest are counted
_UNIT_SECONDS = {"s": 1.0, "ms": 1e3, "us": 1e6, "ns": 1e9}  # ticks per second


@dataclass(frozen=True, slots=True)
class Columns:
    """Where the fields of a request are in a trace file (column names, or JSON keys)."""

    arrival: str
    prompt_tokens: str
    output_tokens: str
    arrival_unit: Literal["s", "ms", "us", "datetime"] = "s"
    tier: str | None = None


AZURE_COLUMNS = Columns("TIMESTAMP", "ContextTokens", "GeneratedTokens", arrival_unit="datetime")
MOONCAKE_COLUMNS = Columns("timestamp", "input_length", "output_length", arrival_unit="ms")


@dataclass(frozen=True, slots=True)
class TraceOptions:
    """How to replay a trace; times are in trace seconds, measured from the trace's first request."""

    start_s: float = 0.0
    end_s: float = float("inf")
    speedup: float = 1.0  # 2.0 replays twice as fast: arrival times are divided by it
    sample: float = 1.0  # fraction of requests kept, each independently with this probability
    seed: int = 0  # seeds the sample and the jitter (separate streams)
    bucket_jitter: bool = False  # spread requests sharing a quantized timestamp uniformly over their bucket
    on_error: Literal["fail", "skip"] = "fail"

    def __post_init__(self) -> None:
        if not 0 <= self.start_s < self.end_s:
            raise ValueError(f"need 0 <= start_s < end_s, got {self.start_s} and {self.end_s}")
        if not self.speedup > 0:
            raise ValueError(f"speedup must be > 0, got {self.speedup}")
        if not 0 < self.sample <= 1:
            raise ValueError(f"sample must be in (0, 1], got {self.sample}")


@dataclass(frozen=True)
class TraceLoad:
    """A loaded trace: the table, how many malformed rows were skipped, and the first few reasons."""

    frame: pd.DataFrame
    skipped: int
    problems: tuple[str, ...]  # at most MAX_LISTED lines, `file: line N: what is wrong`
    source: Path


def load_azure(path: str | Path, options: TraceOptions = TraceOptions()) -> TraceLoad:
    """The Azure LLM inference trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens)."""
    return load_trace(path, AZURE_COLUMNS, options)


def load_mooncake(path: str | Path, options: TraceOptions = TraceOptions()) -> TraceLoad:
    """A Mooncake JSONL trace (timestamp in ms, input_length, output_length).

    Mooncake's published timestamps are quantized to ~3 s buckets: by default requests of a bucket arrive
    together, as a batch; `bucket_jitter=True` spreads them uniformly within their bucket instead.
    """
    return load_trace(path, MOONCAKE_COLUMNS, options)


def load_trace(path: str | Path, columns: Columns, options: TraceOptions = TraceOptions()) -> TraceLoad:
    """Read a CSV, JSONL or Parquet trace (optionally gzipped, except Parquet) through a column mapping."""
    path = Path(path)
    fields = {"arrival": columns.arrival, "prompt_tokens": columns.prompt_tokens}
    fields |= {"output_tokens": columns.output_tokens} | ({"tier": columns.tier} if columns.tier else {})
    raw, where = _read(path, list(dict.fromkeys(fields.values())))
    if not where:  # not "none left after ...": there was nothing to leave out
        raise InputError([problem(path, None, "no requests in it: the file holds no rows")])
    parsed, bad = _parse(raw, fields, columns.arrival_unit)
    problems = [problem(path, where[i], msg) for i, msg in sorted(bad.items())]
    if problems and options.on_error == "fail":
        extra = len(problems) - MAX_LISTED
        more = [f"{path}: ... and {extra} more malformed rows"] if extra > 0 else []
        raise InputError([*problems[:MAX_LISTED], *more])
    good = np.ones(len(where), dtype=bool)
    good[list(bad)] = False
    with np.errstate(over="ignore", divide="ignore"):  # a span too long for the timeline is refused below
        frame = _replay(pd.DataFrame({k: v[good] for k, v in parsed.items()}), options)
    if frame.empty:
        raise InputError(
            [problem(path, None, "no requests left after malformed rows, the time window and sampling")]
        )
    span = float(frame["arrival_s"].iloc[-1])
    if not span <= MAX_SECONDS:
        raise InputError(
            [
                problem(
                    path,
                    None,
                    f"its requests span {span:.3g} s as replayed (after speedup): at most {MAX_SECONDS:g} s "
                    "(11.6 days); set end_s, or a larger speedup",
                )
            ]
        )
    return TraceLoad(frame, len(problems), tuple(problems[:MAX_LISTED]), path)


# --- reading: raw values and where each row came from -------------------------------------------------


def _read(path: Path, names: list[str]) -> tuple[dict[str, list[object]], list[str]]:
    """Raw values of the named columns, and for each row its place in the file ('line N' or 'row N')."""
    if not path.is_file():
        raise InputError([problem(path, None, not_found(path, "trace file"))])
    kind = TRACE_SUFFIXES.get(path.suffix if path.suffix != ".gz" else Path(path.stem).suffix)
    if kind is None:
        raise InputError(
            [problem(path, None, f"unknown trace format; use one of {', '.join(TRACE_SUFFIXES)}")]
        )
    if kind == "parquet":
        try:
            table = pd.read_parquet(path)
        except (OSError, ValueError) as e:  # pyarrow's "not a Parquet file" is a ValueError
            raise InputError([problem(path, None, f"not a readable Parquet file ({e})")]) from None
        _require(path, names, list(table.columns))
        return {n: table[n].tolist() for n in names}, [f"row {i}" for i in range(1, len(table) + 1)]
    raw: dict[str, list[object]] = {n: [] for n in names}
    where: list[str] = []
    keys: set[str] = set()  # of the JSON lines' objects
    try:
        with _open(path) as f:
            rows = _csv_rows(path, f, names) if kind == "csv" else _jsonl_rows(path, f, names, keys)
            for line, values in rows:
                where.append(f"line {line}")
                for n, v in zip(names, values, strict=True):
                    raw[n].append(v)
    except UnicodeDecodeError:
        raise InputError([problem(path, None, _not_text(path))]) from None
    except (OSError, EOFError) as e:  # a truncated or damaged .gz
        raise InputError([problem(path, None, f"cannot read it ({e})")]) from None
    if keys:  # a key no line has is the file's, as a CSV header's missing column: not a problem of each row
        _require(path, names, sorted(keys))
    return raw, where


def _not_text(path: Path) -> str:
    """Why a trace is no UTF-8 text: a compressed or Parquet file under a text file's name, or bytes
    of another encoding."""
    try:
        with path.open("rb") as f:
            head = f.read(4)
    except OSError:
        head = b""
    if head.startswith(b"\x1f\x8b") and path.suffix != ".gz":
        return f"not a UTF-8 text file: a gzip file (name it {path.name}.gz)"
    if head == b"PAR1":
        return f"not a UTF-8 text file: a Parquet file (name it {Path(path.stem).stem}.parquet)"
    if is_utf16(head):
        return UTF16
    return "not a UTF-8 text file"


def _open(path: Path) -> IO[str]:
    """The file as text; a byte-order mark (as some spreadsheet exports write) is not part of the header."""
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8-sig", newline="")
    return path.open(encoding="utf-8-sig", newline="")


def _require(path: Path, names: list[str], present: list[str]) -> None:
    missing = [n for n in names if n not in present]
    if missing:
        raise InputError(
            [problem(path, None, f"no column {n!r} (columns: {', '.join(present)})") for n in missing]
        )


def _csv_rows(path: Path, f: IO[str], names: list[str]) -> Iterator[tuple[int, list[object]]]:
    """(line number, values) per record; a record with the wrong number of fields yields None values."""
    reader = csv.reader(f)
    header = next(reader, None)
    if header is None:
        raise InputError([problem(path, None, "empty file, expected a header line")])
    # a spreadsheet's export in a locale whose separator is ';', or a TSV: one line, not one per column
    if len(header) == 1 and (sep := next((c for c in ";\t|" if c in header[0]), None)):
        why = f"the header is one field, its names separated by {sep!r}: a CSV separates them by commas"
        raise InputError([problem(path, "line 1", why)])
    _require(path, names, header)
    twice = [n for n in names if header.count(n) > 1]
    if twice:  # which of them is meant?
        raise InputError([problem(path, "line 1", f"column {n!r} is in the header twice") for n in twice])
    idx = [header.index(n) for n in names]
    try:
        for record in reader:
            if not record:
                continue  # blank line
            if len(record) != len(header):
                yield reader.line_num, [_WrongWidth(len(record), len(header))] * len(names)
            else:
                yield reader.line_num, [record[i] for i in idx]
    except csv.Error as e:  # a field past the csv module's limit (131,072 characters): no trace has one
        raise InputError([problem(path, f"line {reader.line_num}", f"not a CSV record ({e})")]) from None


def _jsonl_rows(
    path: Path, f: IO[str], names: list[str], keys: set[str]
) -> Iterator[tuple[int, list[object]]]:
    """(line number, values) per JSON line; the keys of its objects are added to `keys`."""
    for line, text in enumerate(f, start=1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text, parse_constant=_JSONConstant, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as e:
            yield line, [_NotJSON(e.msg)] * len(names)
            continue
        except ValueError as e:  # a key given twice; an integer of thousands of digits
            yield line, [_NotJSON(str(e) if isinstance(e, _Refused) else "a number too long")] * len(names)
            continue
        except RecursionError:
            yield line, [_NotJSON(TOO_DEEP)] * len(names)
            continue
        if not isinstance(obj, dict):
            yield line, [_NotJSON("not a JSON object")] * len(names)
        else:
            keys.update(obj)
            yield line, [obj.get(n, _MISSING) for n in names]


class _Refused(ValueError):
    """A key given twice in a JSON line: Python's reader would keep the last silently."""


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    obj = dict(pairs)
    if len(obj) < len(pairs):
        twice = next(k for i, (k, _) in enumerate(pairs) if k in (p for p, _ in pairs[:i]))
        raise _Refused(f"key {twice!r} given twice")
    return obj


@dataclass(frozen=True, slots=True)
class _WrongWidth:
    found: int
    expected: int

    def __str__(self) -> str:
        return f"expected {self.expected} comma-separated fields, found {self.found}"


@dataclass(frozen=True, slots=True)
class _NotJSON:
    reason: str

    def __str__(self) -> str:
        return f"not valid JSON ({self.reason})"


@dataclass(frozen=True, slots=True)
class _JSONConstant:
    """NaN or Infinity written in a JSON line: no number, and not a missing value either."""

    text: str

    def __repr__(self) -> str:
        return self.text


_MISSING = object()


# --- parsing: typed columns and one message per malformed row ------------------------------------------


def _parse(
    raw: dict[str, list[object]], fields: dict[str, str], unit: str
) -> tuple[dict[str, np.ndarray], dict[int, str]]:
    """Typed arrays per field (garbage in malformed rows) and {row index: first problem of that row}."""
    bad: dict[int, str] = {}
    for values in raw.values():  # row-level problems first: they make every field meaningless
        for i, v in enumerate(values):
            if isinstance(v, _WrongWidth | _NotJSON):
                bad.setdefault(i, str(v))
    parsed = {}
    for field, name in fields.items():
        values = raw[name]
        too_big = np.zeros(len(values), dtype=bool)
        if field == "arrival":
            arr, ok = _times(values, unit)
            ok = ok.copy()
            what = "is not a date-time" if unit == "datetime" else "is not a finite number"
            if unit == "datetime":
                for row, why in _mixed_zones(values, ok).items():
                    ok[row] = False
                    bad.setdefault(row, f"{name} {values[row]!r} {why}")
        elif field == "tier":
            arr = np.array([_tier_name(v) for v in values], dtype=object)
            ok, what = arr != "", "is not a non-empty string or whole number"
        else:
            num = _numbers(values)
            too_big = np.isfinite(num) & (num > MAX_TOKENS)  # longer than any context: a typo or garbage
            ok = np.isfinite(num) & (num == np.round(num)) & (num >= 1) & ~too_big
            arr, what = np.where(ok, num, 1).astype(np.int64), "is not a whole number >= 1"
        parsed[field] = arr
        for j in np.flatnonzero(~ok):
            v = values[j]
            text = "is missing" if _is_missing(v) else f"{v!r} {what}"
            if too_big[j]:
                text = f"{v!r} is more than {MAX_TOKENS:,} tokens"
            bad.setdefault(int(j), f"{name} {text}")
    return parsed, bad


_ZONED = re.compile(r"(?::\d{2}|T\d{2,6})(?:[.,]\d+)?\s*(?:Z|[+-]\d{2}(?::?\d{2})?)$", re.IGNORECASE)


def _zoned(text: str) -> bool:
    """Whether a date-time text ends in a UTC offset (Z, +02:00, -0500); the regular expression runs
    only on texts whose end could be one (a trace of millions of rows has none)."""
    tail = text[-6:]
    return ("+" in tail or "-" in tail or tail[-1:] in ("Z", "z")) and bool(_ZONED.search(text))


def _mixed_zones(values: list[object], ok: np.ndarray) -> dict[int, str]:
    """{row: why} for the valid date-times that give a UTC offset where the first one gives none, or
    the reverse: a date-time without one is read as UTC, so mixing both would shift requests by hours."""
    zoned = [
        _zoned(v.strip()) if isinstance(v, str) else getattr(v, "tzinfo", None) is not None for v in values
    ]
    rows = np.flatnonzero(ok)
    if not len(rows):
        return {}
    first = int(rows[0])
    why = "gives no UTC offset" if zoned[first] else "gives a UTC offset"
    why += f" where the first date-time ({values[first]!r}) {'does' if zoned[first] else 'gives none'}"
    return {
        int(j): f"{why}: write every one with an offset, or none" for j in rows if zoned[j] != zoned[first]
    }


def _tier_name(v: object) -> str:
    """A tier as named in the file: text, or a whole number written as one (CSV reads `1` as the text "1",
    so a Parquet or JSON column of numbers names the same tier); "" for anything else."""
    if isinstance(v, str):
        return v
    if isinstance(v, int | np.integer) and not isinstance(v, bool):
        return str(v)
    return ""


def _is_missing(v: object) -> bool:
    """Absent key, JSON null, empty CSV field, or a null read from Parquet as NaN/NaT (a Parquet list
    cell is an array, which `== ""` would compare element by element)."""
    return (
        v is _MISSING
        or v is None
        or v is pd.NaT
        or (isinstance(v, str) and v == "")
        or (isinstance(v, float) and math.isnan(v))
    )


def _numbers(values: list[object]) -> np.ndarray:
    """The values as floats, NaN where one is no number; JSON's true and false are none (not 1 and 0)."""
    plain = [math.nan if isinstance(v, bool | _JSONConstant) or v is _MISSING else v for v in values]
    return pd.to_numeric(pd.Series(plain, dtype=object), errors="coerce").to_numpy(dtype=float)


def _times(values: list[object], unit: str) -> tuple[np.ndarray, np.ndarray]:
    """Arrival times as seconds relative to the earliest valid one, and which rows are valid.

    Differences are taken in the file's own unit (integer ticks for date-times) before converting
    to seconds, so e.g. 1500 ms after the first request is exactly 1.5 s. Rows that are not valid get
    meaningless times (`ok` is False for them).
    """
    series = pd.Series([None if v is _MISSING else v for v in values], dtype=object)
    if unit == "datetime":
        stamps = pd.to_datetime(series, format="ISO8601", errors="coerce", utc=True)
        ok = stamps.notna().to_numpy()
        naive = stamps.dt.tz_convert(None).to_numpy()  # in the unit pandas parsed at: ns or us
        ticks = naive.view(np.int64)  # never cast to ns: a date beyond 1677-2262 would wrap silently
        t0 = ticks[ok].min() if ok.any() else 0
        per_s = _UNIT_SECONDS[np.datetime_data(naive.dtype)[0]]
        # in unsigned arithmetic: stamps centuries apart differ by more than int64 holds
        return (ticks.view(np.uint64) - np.int64(t0).view(np.uint64)) / per_s, ok
    num = _numbers(values)
    ok = np.isfinite(num)
    t0 = num[ok].min() if ok.any() else 0.0
    with np.errstate(over="ignore"):  # times 1e308 apart: infinite, refused as a span too long
        return (num - t0) / _UNIT_SECONDS[unit], ok


# --- replay options -------------------------------------------------------------------------------------


def _replay(frame: pd.DataFrame, o: TraceOptions) -> pd.DataFrame:
    frame = frame.sort_values("arrival", kind="stable", ignore_index=True)
    t = frame.pop("arrival").to_numpy(dtype=float)
    t = t - t[0] if len(t) else t  # the first valid request is 0 only after dropping malformed rows
    if o.bucket_jitter:
        t = _jitter(t, np.random.default_rng([o.seed, 1]))
    # a time past float's range (timestamps 1e308 apart) stays, so that the span check refuses it
    keep = (t >= o.start_s) & ((t < o.end_s) | (np.isposinf(t) & math.isinf(o.end_s)))
    if o.sample < 1:
        keep &= np.random.default_rng([o.seed, 0]).random(len(t)) < o.sample
    out = frame.loc[keep].reset_index(drop=True)
    out.insert(0, "arrival_s", (t[keep] - o.start_s) / o.speedup)
    return out


def _jitter(t: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Spread requests sharing a timestamp uniformly over [stamp, stamp + bucket).

    The bucket is the median step between distinct timestamps, cut at the next distinct timestamp, so
    requests stay in their bucket and buckets keep their order and counts.
    """
    stamps, inverse = np.unique(t, return_inverse=True)
    if len(stamps) < 2:
        return t
    step = float(np.median(np.diff(stamps)))
    width = np.minimum(np.diff(stamps, append=stamps[-1] + step), step)
    return np.sort(stamps[inverse] + rng.random(len(t)) * width[inverse])
