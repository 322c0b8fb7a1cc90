"""Files that ship with simadmit: the bundled scenarios, calibration profiles and trace samples.

An installed wheel carries them under `simadmit/_bundled/`; a source checkout has them at the repository
root (`scenarios/`, `calibration/`). Both layouts are searched, in that order.
"""

from __future__ import annotations

from pathlib import Path

from simadmit.config.errors import InputError, problem, unreadable

_PACKAGE = Path(__file__).resolve().parents[1]
TRACE_SUFFIXES = {
    ".csv": "csv",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
}
_ROOTS = (_PACKAGE / "_bundled", _PACKAGE.parent)


def bundled(kind: str, name: str) -> Path | None:
    """A bundled file `<kind>/<name>` (kind: scenarios or calibration), or None."""
    for root in _ROOTS:
        candidate = root / kind / name
        if candidate.is_file():
            return candidate
    return None


def default_scenario() -> Path:
    """The scenario `simadmit simulate` runs when given none."""
    path = bundled("scenarios", "default.yaml")
    if path is None:
        raise FileNotFoundError("the bundled default scenario is missing from this installation")
    return path


def resolve_scenario(ref: Path | None) -> Path:
    """A scenario argument: a file, or the name of a bundled scenario (`azure_replay`), or the default."""
    if ref is None:
        return default_scenario()
    if _is_file(ref):
        return ref
    name = ref.name if ref.suffix in (".yaml", ".yml") else f"{ref.name}.yaml"
    return (bundled("scenarios", name) if len(ref.parts) == 1 else None) or ref


def resolve_profile(ref: str, base: Path) -> Path | None:
    """A profile reference: a path (relative to the scenario's folder) or a bundled profile name."""
    path = Path(ref) if Path(ref).is_absolute() else base / ref
    if _is_file(path):
        return path
    name = ref if ref.endswith((".yaml", ".yml")) else f"{ref}.yaml"
    return bundled("calibration", Path(name).name)


def resolve_trace(ref: str, base: Path) -> Path | None:
    """A trace reference: a path (relative to the scenario's folder) or a bundled trace name."""
    path = Path(ref) if Path(ref).is_absolute() else base / ref
    if _is_file(path):
        return path
    try:
        return bundled_trace(ref)
    except InputError:
        return None


def _is_file(path: Path) -> bool:
    """`path.is_file()`, with a folder on the way that may not be searched (mode 000) as the file that cannot
    be read (`InputError`), where Python raises `PermissionError`."""
    try:
        return path.is_file()
    except PermissionError as e:
        raise InputError([problem(path, None, unreadable(e))]) from None


def bundled_trace(name: str) -> Path:
    """A trace shipped with simadmit, by its path under the traces folder.

    Looks in the installed package (`simadmit/data/traces/`: 2,000-row samples) and then, in a source
    checkout, in `data/traces/` (the full files), e.g. `azure_llm_2023/AzureLLMInferenceTrace_conv.csv`.
    """
    roots = [_PACKAGE / "data" / "traces", _PACKAGE.parent / "data" / "traces"]
    for root in roots:
        if (root / name).is_file():
            return root / name
    known = sorted(
        str(p.relative_to(r))
        for r in roots
        if r.is_dir()
        for p in r.rglob("*")
        if p.is_file() and p.suffix in {*TRACE_SUFFIXES, ".gz"}
    )
    raise InputError([problem(None, "trace", f"no bundled trace {name!r}; known: {', '.join(known)}")])
