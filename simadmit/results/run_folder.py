"""Output folders: written whole or not at all, checked before a run starts and before they are read.

A run's folder is written into a hidden temporary folder beside its destination and moved into place
only once every file is complete; `manifest.json` (the files, their sizes, and whether the run was cut
short) is written last. A write that fails part-way (disk full, permission denied) leaves the previous
folder exactly as it was and no folder that looks complete. A folder that also holds state to keep (a
sweep's saved points) is updated file by file, each file replaced atomically, the old manifest removed
first (with the figures `plot` drew from the tables being replaced) and the new one written last.
Readers (`plot`) refuse a folder without a manifest that matches its files. `check_destination` finds a
destination that cannot be written before anything runs.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

import pandas as pd

from simadmit.config.errors import InputError, cannot_write_in, problem, unreadable

MANIFEST = "manifest.json"
DAMAGED = "damaged"  # what `held_run` calls a folder whose manifest cannot be read: a run of unknown kind
Writer = Callable[[Path], None]  # writes one file at the path it is given
_OURS = (".parquet", ".csv", ".json", ".yaml", ".png", ".svg")  # what a run folder and `plot` leave
FIGURES = ("p99_vs_utilization_*", "rejection_vs_load_*", "goodput_vs_load_*", "latency_cdf", "timeline")
"""The names `plot` gives the figures it draws beside a run's tables, each as .png and .svg."""


def held_run(folder: Path) -> str | None:
    """The command whose run (or report) `folder` holds: its manifest's, else what its files show (a
    replay, a compare report, a sweep or optimize whose manifest an interrupted update removed); `DAMAGED`
    when its manifest cannot be read; None when it holds none."""
    if not folder.is_dir():
        return None
    if (folder / MANIFEST).is_file():
        try:
            command = json.loads((folder / MANIFEST).read_text()).get("command")
        except (OSError, ValueError, AttributeError):
            command = None
        return DAMAGED if command is None else str(command)  # a damaged run is never written over
    signs = {
        "replay": ("replay.json", "requests.parquet", "repeat-*/requests.parquet"),
        "compare": ("compare.json",),
        "sweep": ("sweep.csv", "sweep.parquet"),
        "optimize": ("optimize.csv", "optimize.parquet"),
    }
    return next((cmd for cmd, names in signs.items() if any(any(folder.glob(n)) for n in names)), None)


def check_destination(out: Path, replace: bool, command: str | None = None) -> None:
    """Raise `InputError` (`out: why`) when `out` cannot receive the outputs of `command`; creates nothing.

    `replace`: the folder is replaced whole (its temporary twin is made beside it), so it may hold only
    files simadmit writes: a folder of other files is never swapped out from under its owner. A folder
    holding another command's run is refused either way, so runs are never mixed nor replaced by another
    kind (a run of `command` itself is replaced, or resumed).
    """
    if out.is_symlink() and (replace or not out.exists()):  # swapped in place of the link, or nowhere
        target = os.readlink(out)
        why = "it points nowhere" if not out.exists() else "the folder is replaced whole, the link with it"
        raise InputError(
            [problem(out, None, f"is a link to {target} ({why}): give --out the folder itself, or a new one")]
        )
    if out.exists() and not out.is_dir():
        raise InputError([problem(out, None, "is a file, not a folder; give a folder for the outputs")])
    held = held_run(out)
    if held == DAMAGED:
        raise InputError(
            [
                problem(
                    out, None, f"holds a run whose {MANIFEST} cannot be read: give --out a folder of its own"
                )
            ]
        )
    if held is not None and held != command:
        raise InputError([problem(out, None, f"holds a {held} run: give --out a folder of its own")])
    # a folder inside a simulate or replay run: simulating it again would refuse to replace it, and the
    # runs `compare` reads would be mixed with it
    inside = next(
        ((p, k) for p in out.resolve().parents if (k := held_run(p)) in ("simulate", "replay")), None
    )
    if inside is not None:
        folder, kind = inside
        raise InputError(
            [problem(out, None, f"is inside {folder}, a {kind} run's folder: give --out a folder of its own")]
        )
    if replace and out.resolve() in (Path.cwd(), *Path.cwd().parents):
        raise InputError([problem(out, None, "is the current folder (or holds it); give a folder inside it")])
    if unwritable := cannot_write_in(out.parent if replace else out):
        raise InputError([problem(out, None, unwritable)])
    if replace and out.is_dir():  # a folder holding no run: every file in it is someone else's
        foreign = sorted(p.name for p in out.iterdir() if held is None or p.is_dir() or p.suffix not in _OURS)
        if foreign:
            shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise InputError(
                [
                    problem(
                        out, None, f"holds files simadmit did not write ({shown}); give a new or empty folder"
                    )
                ]
            )


def write_folder(out: Path, files: Mapping[str, Writer], manifest: dict[str, object]) -> None:
    """Write `files` into a temporary folder beside `out`, the manifest last, then swap it into place.

    On any failure the temporary folder is removed and `out` is left as it was; an `OSError` becomes an
    `InputError` naming the folder.
    """
    tmp = _scratch(out)
    try:
        for name, write in files.items():
            write(tmp / name)
        _write_manifest(tmp, list(files), manifest)
        _swap(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise write_failed(out, e) from None
        raise


def add_files(out: Path, files: Mapping[str, Writer]) -> None:
    """Write `files` into a temporary folder beside `out`, then move them into `out` in their order (other
    files there are left alone); a write that fails moves nothing in, as an `InputError` naming `out`."""
    tmp = _scratch(out)
    try:
        for name, write in files.items():
            write(tmp / name)
        out.mkdir(exist_ok=True)
        for name in files:
            os.replace(tmp / name, out / name)
    except OSError as e:
        raise write_failed(out, e) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _scratch(out: Path) -> Path:
    """A new temporary folder beside `out` (same file system, so its files move in atomically)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.writing-", dir=out.parent))
        # mkdtemp's folder is private; the run folder it becomes is shared as any mkdir's
        tmp.chmod(0o777 & ~_umask())
        return tmp
    except OSError as e:
        raise write_failed(out, e) from None


def _umask() -> int:
    """The process's file-mode creation mask (reading it means setting it: put straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def update_in_place(out: Path, files: Mapping[str, Writer], manifest: dict[str, object]) -> None:
    """Replace `files` inside `out` one by one (each atomically), removing the old manifest first and
    writing the new one last, so the folder never looks complete while its files disagree. Figures `plot`
    drew from the tables replaced are removed with the manifest: they would show the previous run's
    results beside the new tables (a folder without those tables holds no figure of ours)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / MANIFEST).unlink(missing_ok=True)
        if any((out / name).is_file() for name in files):
            for figure in (f for n in FIGURES for ext in (".png", ".svg") for f in out.glob(n + ext)):
                figure.unlink()
        for name, write in files.items():
            replace_file(out / name, write)
        _write_manifest(out, list(files), manifest)
    except OSError as e:
        raise write_failed(out, e, "its tables are not marked complete until a run writes them all") from None


def interrupted_note(directory: Path) -> str | None:
    """The note for a folder an interrupted run wrote (its manifest says `partial`), else None."""
    if (directory / MANIFEST).is_file() and read_manifest(directory).get("partial"):
        return f"note: {directory}/ holds an interrupted run: only the runs that finished (manifest.json)"
    return None


def read_manifest(directory: Path) -> dict[str, object]:
    """The manifest of a complete folder; `InputError` when it is missing or its files do not match."""
    path = directory / MANIFEST
    if not path.is_file() and (directory / "replay.json").is_file():  # complete, but never has one
        raise InputError([problem(directory, None, "holds a replay run: plot draws simulate and sweep folders; "
                                  "`simadmit compare SIM_DIR REPLAY_DIR --out DIR` draws a replay")])  # fmt: skip
    if not path.is_file():
        raise InputError([problem(directory, None, f"incomplete folder: no {MANIFEST} (written last, once every "
                                  "file is complete); run the command that writes it again")])  # fmt: skip
    try:
        text = path.read_text()
    except OSError as e:
        raise InputError([problem(path, None, unreadable(e))]) from None
    try:
        manifest = json.loads(text)
        sizes = dict(manifest["files"])
    except (ValueError, KeyError, TypeError):
        raise InputError([problem(path, None, "not a valid manifest")]) from None
    for name, size in sizes.items():
        f = directory / name
        actual = f.stat().st_size if f.is_file() else None
        if actual != size:
            found = "missing" if actual is None else f"{actual} bytes, the manifest says {size}"
            raise InputError([problem(directory, None, f"incomplete folder: {name} is {found}")])
    return dict(manifest)


def read_table(path: Path, what: str, columns: list[str] | None = None) -> pd.DataFrame:
    """The Parquet table at `path`; one that cannot be read is an `InputError` naming it (`not_a_table`)."""
    try:
        return pd.read_parquet(path, columns=columns)
    except (OSError, ValueError) as e:  # pyarrow's "not a Parquet file" is a ValueError
        raise not_a_table(path, what, e) from None


def not_a_table(path: Path, what: str, e: OSError | ValueError) -> InputError:
    """Why the table at `path` was not read as `what` (`a requests table`): a file the system refuses
    (permission denied), or one that holds no such table (damaged, another kind of file: a manifest's sizes
    still match a file overwritten in place), with the reader's first sentence."""
    if isinstance(e, OSError) and e.errno:
        return InputError([problem(path, None, unreadable(e))])
    return InputError([problem(path, None, f"not {what} ({str(e).split('. ')[0]})")])


def _write_manifest(folder: Path, names: list[str], manifest: dict[str, object]) -> None:
    doc = {**manifest, "files": {n: (folder / n).stat().st_size for n in names}}
    text = json.dumps(doc, indent=2, allow_nan=True) + "\n"
    replace_file(folder / MANIFEST, lambda p: write_text(p, text))


def replace_file(path: Path, write: Writer) -> None:
    """Write a file through a temporary one beside it, renamed into place: never half a file at `path`."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _swap(tmp: Path, out: Path) -> None:
    """Move the finished folder into place; the previous one is removed only after the move."""
    if not out.exists():
        os.rename(tmp, out)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.previous-", dir=out.parent))
    os.rmdir(old)
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except OSError:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def write_failed(out: Path, e: OSError, note: str = "the folder is as it was") -> InputError:
    """The one line for outputs that could not be written in `out`, with what became of it (`note`)."""
    return InputError([problem(out, None, f"could not write the outputs ({e.strerror or e}); {note}")])


def write_text(path: Path, text: str) -> None:
    """A `Writer` of `text`, once `text` is bound (`Path.write_text` returns a count, a `Writer` nothing)."""
    path.write_text(text)
