"""User-facing input errors: one line per problem, naming the file and the field.

The CLI catches `InputError` and prints its lines with exit code 2, so bad input never shows a traceback.
"""

from __future__ import annotations

import codecs
import math
import os
import tempfile
from collections.abc import Callable, Hashable, Iterable
from pathlib import Path

import yaml
from rich.console import Console
from rich.text import Text

from simadmit.config.defaults import DEFAULT_ENGINE_KIND

SPECIAL = "is not a regular file (a device, pipe or socket)"  # what exists, is no folder, and no file
MAX_YAML_BYTES = 2**20  # a scenario or profile is kilobytes; the parser reads ~130 KB/s, so 1 MiB is ~8 s
TOO_DEEP = "nested too deeply"  # YAML or JSON beyond the parser's recursion limit: no scenario is that deep
UTF16 = "not a UTF-8 text file: a UTF-16 one (save it as UTF-8)"  # Notepad's "Unicode", PowerShell's `>`


class InputError(Exception):
    """Bad user input (scenario, profile, trace, endpoint); `problems` holds one line per problem."""

    def __init__(self, problems: Iterable[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))

    def __reduce__(self) -> tuple[type[InputError], tuple[list[str]]]:
        # Rebuilt from its lines when it crosses from a worker process to the command: by default pickle
        # would call __init__ with the joined message (one problem per character) and patch it afterwards.
        return (type(self), (self.problems,))


def print_problems(problems: Iterable[str]) -> None:
    """Each problem on its own `error:` line on stderr, as written: `a:b:3` is no emoji code, `[x]` no markup.

    Every command prints its input errors through this, so they all read alike."""
    err = Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)
    for line in problems:
        err.print(Text.assemble(("error:", "red"), " ", line))


def problem(source: str | Path | None, field: str | None, message: str) -> str:
    """Format one problem as `file: field: message`, omitting the parts that are unknown."""
    parts = [str(p) for p in (source, field) if p not in (None, "")]
    return ": ".join([*parts, message])


def pydantic_problems(
    source: str | Path | None,
    error: object,
    prefix: str = "",
    document: object = None,
    origin: Callable[[str], str | Path | None] | None = None,
) -> list[str]:
    """Turn a pydantic ValidationError into one `file: field.path: message` line per error; with the
    validated `document`, a field path names only what the file writes (see `_written_path`); with
    `origin`, each line names where its field was written (`--set`) rather than `source`."""
    lines = []
    for e in error.errors():  # type: ignore[attr-defined]
        steps = _written_path(e["loc"], document)
        parts = [str(p) for p in steps if not isinstance(p, str) or not p.startswith("function-")]
        key = e["type"] == "invalid_key" or parts[-1:] == ["[key]"]  # a key that is no text: `1:`, `null:`
        parts = parts[: -2 if parts[-1:] == ["[key]"] else -1] if key else parts
        loc = ".".join(parts)
        field = ".".join(p for p in (prefix, loc) if p)
        msg = e["msg"].removeprefix("Value error, ")
        if key:  # named as the file writes it (null, true), not as Python does (None, True)
            written = yaml.safe_dump(e["input"], default_flow_style=True).removesuffix("\n...\n").strip()
            msg = f"the key {written} is not a name: write it in quotes if it is one ('{written}': ...)"
        elif e["type"] == "extra_forbidden":
            msg = "unknown field (misspelled?)"
        elif e["type"] == "missing":
            msg = "required field is missing"
        elif e["type"] in ("model_type", "model_attributes_type"):  # pydantic's words, not the file's
            msg = f"Input should be a mapping of fields, not {_written_type(e['input'])}"
        elif e["type"] == "union_tag_not_found":  # a policy without its kind
            field, msg = f"{field}.kind", "required field is missing"
        elif e["type"] == "int_parsing" and (whole := _whole_number_text(e.get("input"))) is not None:
            msg = f"{e['input']!r} is text to YAML (a number needs a dot and a signed exponent, 1.0e+3): write {whole}"
        elif type(e.get("input")).__name__ == "BooleanInput":  # workload_schema.Spec's marker of true/false
            msg = f"Input should be a number, not {e['input']!r}"
        lines.append(problem(origin(field) if origin else source, field or None, msg))
    return lines


def another_kind(
    source: str | Path | None,
    document: object,
    fields: Iterable[str],
    what: str,
    other: Iterable[str],
    kind: str,
) -> list[str]:
    """One line for a file of another kind given as a `what`: none of its keys is one of `fields` and all
    are fields of `kind` (`other`): a calibration profile given as the scenario, or the reverse, where a
    line per key (missing, unknown) would not say what happened. Empty when the file is not one."""
    keys = set(document) if isinstance(document, dict) else set()
    if not keys or keys & set(fields) or not keys <= set(other):
        return []
    return [
        problem(source, None, f"is {kind}, not a {what}: a scenario's pools name a profile (profile: ...)")
    ]


def _written_path(loc: tuple[object, ...], document: object) -> list[object]:
    """`loc` without the steps pydantic adds for a tagged union: `prompt_tokens.lognormal.sigma` is
    `prompt_tokens.sigma` in the file, whose mapping says `kind: lognormal`."""
    node, out = document, []
    for part in loc:
        if isinstance(node, dict) and part not in node and node.get("kind", DEFAULT_ENGINE_KIND) == part:
            continue  # the union's tag (the engine's default when no kind is written): no key of the file
        out.append(part)
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and -len(node) <= part < len(node):
            node = node[part]
        else:
            node = None
    return out


def _written_type(value: object) -> str:
    """What the file wrote where a mapping belongs: `section:` with nothing under it (null) is said to be
    empty, not Python's `NoneType`."""
    return "empty (nothing is written under it)" if value is None else type(value).__name__


def _whole_number_text(value: object) -> int | None:
    """The whole number a text such as '1e3' writes, which YAML 1.1 reads as text, not a number."""
    try:
        number = float(value) if isinstance(value, str) else math.nan
    except ValueError:
        return None
    return int(number) if math.isfinite(number) and number.is_integer() else None


_INT, _FLOAT, _STR = (f"tag:yaml.org,2002:{t}" for t in ("int", "float", "str"))


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader`, refusing a key given twice in one mapping (YAML would keep the last silently),
    a value its explicit tag cannot take (`!!int tiny`) as a YAML error at its line, where PyYAML's
    constructors raise a bare ValueError, KeyError or AttributeError, and the tags whose values no field
    takes as written (`!!binary`: bytes the schema would read as text; `!!set`: a list in no set order);
    a plain value with a colon (`1:30`) is text, not YAML 1.1's base-60 number (90), which no user means."""

    def resolve(self, kind: type[yaml.Node], value: str, implicit: tuple[bool, bool]) -> str:
        tag = super().resolve(kind, value, implicit)
        if kind is yaml.ScalarNode and tag in (_INT, _FLOAT) and ":" in value:
            return _STR
        return tag

    def construct_refused(self, node: yaml.Node) -> object:
        tag = node.tag.removeprefix("tag:yaml.org,2002:")
        raise yaml.constructor.ConstructorError(
            None,
            None,
            f"no field takes a !!{tag} value: write it as plain YAML (text, number, list)",
            node.start_mark,
        )

    def construct_object(self, node: yaml.Node, deep: bool = False) -> object:
        try:
            return super().construct_object(node, deep)
        except (ValueError, KeyError, AttributeError, TypeError):
            tag = node.tag.removeprefix("tag:yaml.org,2002:")
            raise yaml.constructor.ConstructorError(
                None, None, f"{node.value!r} is not a !!{tag}", node.start_mark
            ) from None

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` merges keys that may be overridden
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):  # the base class reports it
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:binary", _UniqueKeyLoader.construct_refused)
_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:set", _UniqueKeyLoader.construct_refused)


def load_yaml_text(text: str) -> object:
    """YAML text read as `read_yaml` reads a file (a key given twice, a value its tag cannot take, nesting
    deeper than the parser's recursion: a `yaml.YAMLError`); a `--set` value, a `--param` value."""
    try:
        return yaml.load(text, _UniqueKeyLoader)
    except RecursionError:  # the parser recurses once per level of brackets or indentation
        raise yaml.YAMLError(TOO_DEEP) from None
    except yaml.reader.ReaderError as e:  # a control character: PyYAML says so on two lines, and no line
        before = text[: e.position]
        line, column = before.count("\n"), e.position - before.rfind("\n") - 1
        raise yaml.MarkedYAMLError(
            problem=f"unacceptable character #x{e.character:04x}: {e.reason}",
            problem_mark=yaml.Mark(e.name, e.position, line, column, None, 0),
        ) from None


def not_yaml(e: yaml.YAMLError) -> str:
    """Why YAML text was refused, as every reader of it says so: `not valid YAML (key 'kind' given twice)`."""
    return f"not valid YAML ({getattr(e, 'problem', None) or e})"


def not_found(path: Path, what: str) -> str:
    """Why nothing is read at `path`: nothing there, a link leading nowhere (its target gone, or a loop), or
    something that is no regular file (a device, a pipe)."""
    if path.exists() and not path.is_dir():
        return f"{what} {SPECIAL}"
    if path.is_symlink():
        return f"{what} not found: a link to a missing file or a loop of links"
    return f"{what} not found"


def is_utf16(head: bytes) -> bool:
    """Whether a file's first bytes are UTF-16's byte-order mark: text, in an encoding no reader here takes."""
    return head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE))


def unreadable(e: OSError) -> str:
    """Why a file that is there cannot be read, as every reader says so: `cannot read it (Permission denied)`
    (the system's words for its error number: pyarrow's strerror is a whole message naming the file again)."""
    return f"cannot read it ({os.strerror(e.errno) if e.errno else e})"


def cannot_write_in(where: Path) -> str | None:
    """Why nothing can be created in the folder `where` (made when missing), or None: the nearest of it and
    its parents that exists is a file, or refuses a new file (read-only, a system folder). Creates nothing."""
    while not where.exists() and where != where.parent:
        where = where.parent
    if not where.is_dir():
        return f"{where} is a file, not a folder"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".simadmit-probe-", dir=where))
    except OSError as e:
        return f"cannot write in {where} ({e.strerror or e})"
    return None


def read_yaml(path: str | Path, what: str) -> object:
    """Parse a YAML file, or raise `InputError`: not found, a folder, not text, or the line that is not YAML."""
    path = Path(path)
    if path.is_dir():
        raise InputError([problem(path, None, f"is a folder, not a {what} file")])
    if not path.is_file():
        raise InputError([problem(path, None, not_found(path, f"{what} file"))])
    try:
        if (size := path.stat().st_size) > MAX_YAML_BYTES:  # a trace or data file given by mistake
            why = f"{size / 2**20:.1f} MiB, over the {MAX_YAML_BYTES // 2**20} MiB read as a {what}"
            raise InputError([problem(path, None, f"{why}: a {what} is kilobytes of YAML (a data file?)")])
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark is not content
        return load_yaml_text(text)
    except UnicodeDecodeError as e:
        why = UTF16 if is_utf16(e.object) else f"not a text file (byte {e.start} is not UTF-8)"
        raise InputError([problem(path, None, why)]) from None
    except OSError as e:
        raise InputError([problem(path, None, unreadable(e))]) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else None
        raise InputError([problem(path, where, not_yaml(e))]) from None


def read_mapping(path: str | Path, what: str) -> dict:
    """`read_yaml` of a file that must hold a mapping (a scenario, a profile): an empty file, a list or a
    lone value is one line saying so."""
    data = read_yaml(path, what)
    if data is None:
        raise InputError([problem(path, None, f"empty file: a {what} is a YAML mapping of its fields")])
    if not isinstance(data, dict):
        found = "a list" if isinstance(data, list) else f"a single value ({type(data).__name__})"
        raise InputError([problem(path, None, f"a {what} must be a YAML mapping of its fields, not {found}")])
    return data
