"""Overrides: the one dotted-path engine behind `--set`, variants, sweeps and optimize.

A path such as `workload.tiers.interactive.share` or `policies.gpu_seconds.headroom` walks a scenario
document key by key. A list element is addressed by its index (negative counts from the end), else by the
first element called the key (its `name`, or its `kind` when it has no name, as policies are named in
results), else by the first element of that `kind` whatever its name. A mapping key that holds the rest
of the path, dots and all (a variant's `set: {workload.rate_rps: 3}`), is that key. Keeping this rule in
one place means a path that `--set` accepts means the same thing to a variant's `set:`, a sweep's
`--param` and optimize's `--search`. Values given as text are parsed as YAML.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping

import yaml

from simadmit.config.errors import InputError, load_yaml_text, not_yaml, problem


def parse_assignments(values: Iterable[str]) -> dict[str, object]:
    """`--set path=value` pairs as overrides; values are parsed as YAML (numbers, lists, mappings)."""
    out: dict[str, object] = {}
    bad = []
    for item in values:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            bad.append(problem("--set", item, "expected path=value, e.g. workload.rate_multiplier=2"))
            continue
        if not raw.strip():  # YAML reads nothing as null, reported as "required field is missing"
            bad.append(problem("--set", item, "no value after '=': write path=null to unset a field"))
            continue
        if key.strip() in out:  # which one was meant? (a later one would silently win)
            bad.append(problem("--set", item, f"{key.strip()} is set twice: give each path once"))
            continue
        try:
            out[key.strip()] = load_yaml_text(raw)
        except yaml.YAMLError as e:
            bad.append(problem("--set", item, not_yaml(e)))
    if bad:
        raise InputError(bad)
    return out


def element_name(element: object) -> object:
    """What a list element (a raw mapping or a validated spec) is called: its `name`, else its `kind`.

    This is also a policy's name in results (`simadmit.config.schema.policy_name`), so a policy is
    addressed in paths by the name its results carry.
    """
    if isinstance(element, Mapping):
        return element.get("name") or element.get("kind")
    return getattr(element, "name", None) or getattr(element, "kind", None)


def list_index(items: list[object], key: str) -> int | None:
    """The position `key` addresses (by index, else by `element_name`, else by any `kind`), or None."""
    if key.removeprefix("-").isdecimal():  # what int() reads: not `²`, not `--1`
        i = int(key)
        return i % len(items) if -len(items) <= i < len(items) else None
    named = [i for i, item in enumerate(items) if element_name(item) == key]
    kinds = [i for i, item in enumerate(items) if isinstance(item, Mapping) and item.get("kind") == key]
    return next(iter(named + kinds), None)


def apply_overrides(
    document: dict[str, object], overrides: Mapping[str, object], given_by: str | None = "--set"
) -> dict[str, object]:
    """A copy of `document` with each dotted path set to its value; missing mappings are created. A path
    that cannot be followed is a problem named `given_by`: the option, or the field, the paths were given
    by (None: the caller names it)."""
    return override(document, overrides, lambda _: given_by)[0]


def override(
    document: dict[str, object],
    overrides: Mapping[str, object],
    given_by: Callable[[str], str | None] = lambda _: "--set",
) -> tuple[dict[str, object], list[str]]:
    """`apply_overrides`, with the field each path wrote as validation names it, list elements by index
    (`workload.tiers.interactive.share` writes `workload.tiers.0.share`): a problem at or below one of
    them is the override's, not the file's. A path also writes the first mapping it created
    (`polices.gpu_seconds.headroom` writes `polices`), and a `kind` the mapping it is in, since a
    new kind takes other fields (`workload.arrival.kind=gamma` writes `workload.arrival`). A path that
    cannot be followed is a problem named `given_by(path)` (`--set`, a variant's `set`)."""
    document = copy.deepcopy(document)
    fields = []
    paths = list(overrides)
    for n, path in enumerate(paths):  # a.b then a: a, applied after, would silently undo a.b
        undone = next((p for p in paths[:n] if p.startswith(f"{path}.")), None)
        if undone is not None:
            why = f"replaces {undone}, set before it: set {path} first"
            raise InputError([problem(given_by(path), path, why)])
    for dotted, value in overrides.items():
        node: object = document
        keys = dotted.split(".")
        if "" in keys:
            raise InputError([problem(given_by(dotted), dotted, "a path has no empty part: write a.b.c")])
        written = []
        created = None  # how many keys of the path lead to the first mapping it created
        for depth, key in enumerate(keys):
            last = depth == len(keys) - 1
            written.append(key)
            if isinstance(node, list):
                i = list_index(node, key)
                if i is None:
                    raise InputError([problem(given_by(dotted), dotted, f"no element {key!r} in this list")])
                written[-1] = str(i)
                if last:
                    node[i] = copy.deepcopy(value)
                else:
                    node = node[i]
            elif isinstance(node, dict):
                rest = ".".join(keys[depth:])
                if not last and rest in node:  # a key holding the rest, dots and all: a variant's set
                    node[rest] = copy.deepcopy(value)
                    written[-1] = rest
                    break
                if last:
                    node[key] = copy.deepcopy(value)
                else:
                    created = depth + 1 if created is None and key not in node else created
                    node = node.setdefault(key, {})
            else:
                raise InputError(
                    [problem(given_by(dotted), dotted, f"{'.'.join(keys[:depth])} is not a mapping or list")]
                )
        if created is None and len(keys) > 1 and keys[-1] == "kind":
            created = len(keys) - 1
        fields.append(".".join(written[:created]))
    return document, fields


def lookup(document: object, dotted: str) -> object | None:
    """The value at a dotted path of `document`, or None where the path leads nowhere."""
    node = document
    keys = dotted.split(".")
    for depth, key in enumerate(keys):
        if isinstance(node, list):
            i = list_index(node, key)
            node = None if i is None else node[i]
        elif isinstance(node, dict):
            rest = ".".join(keys[depth:])
            if rest in node:  # a key holding the rest, dots and all: a variant's set
                return node[rest]
            node = node.get(key)
        else:
            return None
    return node
