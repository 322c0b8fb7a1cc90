"""Curves: a sweep table split into one curve per policy and setting, along the load axis.

Pure table -> curves, shared by the plots and by the utilization-target analysis, so both group the rows
the same way. The load axis is the arrival rate; the swept load parameters (`LOAD_AXES`) move points along
a curve instead of splitting it, and every other swept column splits the curves of the policies it
concerns.
"""

from __future__ import annotations

from collections.abc import Hashable

import pandas as pd

LOAD_AXES = ("workload.rate_multiplier", "workload.rate_rps")


def curves(table: pd.DataFrame) -> list[tuple[str, dict[str, object], pd.DataFrame]]:
    """Split a sweep table into curves along the load axis: (policy, settings, rows), rows by arrival rate.

    A curve is one policy at one value of every other swept setting that concerns it. A swept
    `policies.<name>.*` field only splits the curves of that policy: the other policies' rows for its
    values are identical runs, and only the first is kept.
    """
    params = [c for c in table.columns if "." in c and c not in LOAD_AXES and not c.endswith("_ci95")]
    table = table.assign(**{p: table[p].map(_comparable) for p in params})
    out: list[tuple[str, dict[str, object], pd.DataFrame]] = []
    for policy, rows in table.groupby("policy", sort=False):
        mine = [p for p in params if not p.startswith("policies.") or p.split(".")[1] == policy]
        for p in params:
            if p not in mine:
                rows = rows[rows[p] == rows[p].iloc[0]]
        varying = [p for p in mine if rows[p].nunique() > 1]
        if not varying:
            out.append((str(policy), {}, rows.sort_values("arrival_rate_rps")))
            continue
        for key, part in rows.groupby(varying, sort=True):
            values = key if isinstance(key, tuple) else (key,)
            out.append(
                (str(policy), dict(zip(varying, values, strict=True)), part.sort_values("arrival_rate_rps"))
            )
    return out


def _comparable(value: object) -> object:
    """A swept value as curves are told apart by: a mapping or list (`--param 'x={a: 1},{a: 2}'`, read back
    from the table as a dict or an array) by its text, as a value that cannot be grouped by."""
    return value if isinstance(value, Hashable) else str(value)
