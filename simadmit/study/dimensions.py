"""Dimensions: the scenario fields optimize searches, their ranges, and where each search starts.

A dimension is a dotted path (`--search path=lo:hi`, integers when both ends are; `path=false:true` for
a true/false field, which tries both) resolved by
`simadmit.config.overrides` exactly as `--set` resolves it. By default each policy searches its own knobs
over a range around the scenario's values (and pool sizes only for a per-GPU objective); a dimension on a
policy field is searched only for the policy its path addresses. A search starts at the scenario's own
value, clamped into the range, or at the range's middle when the scenario leaves the field unset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from simadmit.config.defaults import default_max_pool_gpu_s
from simadmit.config.errors import InputError, problem
from simadmit.config.loading import scenario_from_dict
from simadmit.config.overrides import list_index, lookup
from simadmit.config.schema import GpuSecondsSpec, QueueDepthSpec, policy_name
from simadmit.sim.world import build_world
from simadmit.study.grid import RANGE_ENDS, range_ends, whole_ends


@dataclass(frozen=True)
class Dimension:
    """A searched scenario field and its range."""

    path: str
    lo: float
    hi: float
    integer: bool
    boolean: bool = False  # a true/false field: 0 and 1 stand for false and true

    def __str__(self) -> str:
        """As `--search` writes it."""
        return f"{self.path}=false:true" if self.boolean else f"{self.path}={self.lo:g}:{self.hi:g}"

    def value(self, v: float) -> float | int | bool:
        """A point of the range as the field takes it: a number, a whole number, or true/false."""
        if self.boolean:
            return bool(v)
        return int(v) if self.integer else v

    def grid(self, lo: float, hi: float, n: int) -> list[float]:
        if self.integer:
            lo_i, hi_i = math.ceil(lo), math.floor(hi)
            if hi_i - lo_i + 1 <= n:
                return [float(v) for v in range(lo_i, hi_i + 1)]
            return sorted({float(round(v)) for v in np.linspace(lo_i, hi_i, n)})
        return [float(f"{v:.6g}") for v in np.linspace(lo, hi, n)]


def parse_dimension(text: str) -> Dimension:
    """`path=lo:hi`, integers when both ends are written as integers; `path=false:true` tries both."""
    path, sep, raw = text.partition("=")
    ends = raw.split(":")
    if sep and sorted(e.strip().lower() for e in ends) == ["false", "true"]:
        return Dimension(path.strip(), 0.0, 1.0, True, True)
    limits = range_ends(*ends) if len(ends) == 2 else None
    if not sep or limits is None:
        raise InputError(
            [
                problem(
                    "--search",
                    text,
                    f"expected path=lo:hi, {RANGE_ENDS}, e.g. pools.0.replicas=1:16 (or path=false:true)",
                )
            ]
        )
    lo, hi = limits
    return Dimension(path.strip(), lo, hi, whole_ends(*ends))


def default_dimensions(document: dict, source: Path, policy: str, per_gpu: bool) -> list[Dimension]:
    """The knobs of one policy, over a range around the scenario's values; replicas only per GPU.

    More replicas always buy goodput and a shorter poll interval always helps, so replicas are searched
    only for a per-GPU objective and the poll interval only when named with --search. A wait budget is
    searched for each of the workload's tiers (its own, or the policy's default): the policy's defaults
    name tiers a scenario need not have.
    """
    spec = scenario_from_dict(document, source)
    world = build_world(spec, source.parent)
    p = next(s for s in spec.policies if policy_name(s) == policy)
    dims = []
    if isinstance(p, GpuSecondsSpec):
        gpus = sum(c.replicas * c.gpus_per_replica for c in world.pools)
        pool_max = p.max_pool_gpu_seconds or default_max_pool_gpu_s(gpus, p.budgets_s, p.default_budget_s)
        dims.append(Dimension(f"policies.{policy}.headroom", 0.5, 1.0, False))
        dims.append(Dimension(f"policies.{policy}.max_pool_gpu_seconds", pool_max / 4, pool_max * 4, False))
        budgets = {t.name: p.budgets_s.get(t.name, p.default_budget_s) for t in spec.workload.tiers}
        dims += [
            Dimension(f"policies.{policy}.budgets_s.{t}", b / 4, b * 4, False) for t, b in budgets.items()
        ]
    elif isinstance(p, QueueDepthSpec):
        dims.append(Dimension(f"policies.{policy}.max_queued", 1, max(4, 4 * p.max_queued), True))
    if per_gpu:
        dims += [
            Dimension(f"pools.{i}.replicas", max(1, pool.replicas // 4), 4 * pool.replicas, True)
            for i, pool in enumerate(spec.pools)
        ]
    return dims


def start_value(document: dict, source: Path, dim: Dimension) -> float:
    """The scenario's own value of a dimension (clamped into its range), or the range's middle."""
    node = lookup(scenario_from_dict(document, source).model_dump(), dim.path)
    value = float(node) if isinstance(node, int | float) else (dim.lo + dim.hi) / 2
    value = min(max(value, dim.lo), dim.hi)
    return float(round(value)) if dim.integer else value


def concerning(dims: list[Dimension], policies: list[object], index: int, name: str) -> list[Dimension]:
    """The dimensions searched for policy `index`: every non-policy one, and the policy fields its path
    addresses (`policies.<key>.*`, resolved as `--set` resolves it), re-addressed by the policy's name.
    """
    out = []
    for d in dims:
        head, _, rest = d.path.partition(".")
        if head != "policies":
            out.append(d)
            continue
        key, dot, tail = rest.partition(".")
        if list_index(policies, key) == index:
            out.append(replace(d, path=f"policies.{name}{dot}{tail}"))
    return out
