"""SLOs: the `--slo` grammar of optimize, `tier.measure <= limit` with units, and how far a value meets it.

An SLO names a tier (or `all`), a summary measure and a limit: `interactive.ttft_p99<=3s`,
`interactive.rejection<=2%`, `all.queue_wait_mean_s<=0.5s`; `>=` bounds a measure that is better the
higher it is (`all.goodput>=10`), never a latency or a failure rate. Short aliases name the summary's
measures (`ttft_p99` for `ttft_p99_s`, `failure` for `failure_rate`), limits are converted to the measure's
own unit (ms to seconds, % to a fraction), and each SLO reports its margin and a relative violation so a
search can walk from infeasible settings towards feasible ones. A latency percentile an SLO names counts
every arrival: a request never answered (rejected, abandoned, aborted) is a miss, so `ttft_p99<=3s` holds
only when 99% of requests got a first token within 3 s. The `served_` percentiles (completed requests
only) can be named explicitly.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from simadmit.config.errors import InputError, problem
from simadmit.results.summary import PERCENTILES

ALIASES = {
    **{
        f"{s}{m}_{p}": f"{s}{m}_{p}_s"
        for s in ("", "served_")
        for m in ("ttft", "e2e")
        for p in ("p50", "p90", "p99")
    },
    "failure": "failure_rate",
    "queue_wait_mean": "queue_wait_mean_s",
    "queue_wait_p99": "queue_wait_p99_s",
    "rejection": "rejection_rate",
    "goodput": "goodput_rps",
    "throughput": "throughput_rps",
}
MEASURES = (
    "requests", "failure_rate", "rejection_rate", "attempt_rejection_rate", *PERCENTILES, "queue_wait_mean_s",
    "utilization", "work_utilization", "paid_work_utilization", "goodput_rps", "slo_attainment", "offered_rps",
    "carried_rps", "admitted_rps", "retries_per_request", "throughput_rps", "output_tokens_per_s",
)  # fmt: skip
_SLO = re.compile(r"^\s*([\w-]+)\.(\w+)\s*(<=|>=|<|>)\s*([-+\d.eE]+)\s*([A-Za-z%]*)\s*$")
DURATIONS = {*PERCENTILES, "queue_wait_mean_s"}  # seconds: written with s, ms or no unit
SHARES = {  # parts of a whole, from 0 to 1
    "failure_rate", "rejection_rate", "attempt_rejection_rate", "utilization", "slo_attainment",
}  # fmt: skip
FRACTIONS = {*SHARES, "work_utilization", "paid_work_utilization"}  # written with % or no unit
# the less the better: an SLO bounds them from above (a floor on a latency or a failure rate is never a goal)
CEILINGS = {*DURATIONS, "failure_rate", "rejection_rate", "attempt_rejection_rate", "retries_per_request"}
SCALE = {"": 1.0, "s": 1.0, "ms": 1e-3, "%": 1e-2}


@dataclass(frozen=True)
class SLO:
    """`tier.measure <= limit` (or >=), the limit in the measure's own unit (seconds, a fraction)."""

    tier: str
    measure: str
    upper: bool  # True: the measure must stay at or below the limit
    limit: float
    text: str

    def margin(self, value: float) -> float:
        """How far inside the limit the value is, in the measure's unit (negative: violated)."""
        if math.isnan(value):
            return -math.inf
        return self.limit - value if self.upper else value - self.limit

    def violation(self, value: float) -> float:
        """The shortfall relative to the limit (0 when met), comparable across SLOs."""
        return max(0.0, -self.margin(value)) / max(abs(self.limit), 1e-9)

    def violation_in(self, measures: dict[str, float]) -> float:
        """`violation` of this SLO's measure in a group's measures. A percentile over every arrival is
        infinite when more requests failed than its tail holds; it is then judged by that excess (1 + the
        failures beyond the tail share, in units of it), so a search can still walk towards feasibility."""
        value = measures[self.measure]
        if math.isinf(value) and value > 0 and self.measure in PERCENTILES and PERCENTILES[self.measure][2]:
            tail = 1 - PERCENTILES[self.measure][1]
            return 1.0 + max(0.0, measures["failure_rate"] - tail) / tail
        return self.violation(value)


def parse_slo(text: str) -> SLO:
    """Parse `tier.measure<=value[unit]`; units: s, ms (to seconds), % (to a fraction)."""
    m = _SLO.match(text)
    if not m:
        raise InputError(
            [problem("--slo", text, "expected tier.measure<=value, e.g. interactive.ttft_p99<=3s")]
        )
    tier, name, op, raw, unit = m.groups()
    measure = ALIASES.get(name, name)
    if measure not in MEASURES:
        known = ", ".join(sorted({*ALIASES, *MEASURES}))
        raise InputError([problem("--slo", text, f"unknown measure {name!r}; known: {known}")])
    units = ("s", "ms") if measure in DURATIONS else ("%",) if measure in FRACTIONS else ()
    if unit and unit not in units:  # 50% of a latency, 2 ms of a rate: never what was meant
        fits = f"write {' or '.join(units)}, or no unit" if units else "it takes no unit"
        raise InputError([problem("--slo", text, f"the unit {unit!r} does not fit {measure} ({fits})")])
    try:
        value = float(raw) * SCALE[unit]
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:  # every measure is a duration, rate or fraction: never below 0
        raise InputError([problem("--slo", text, f"the limit {raw!r} is not a finite number >= 0")])
    if measure in CEILINGS and not op.startswith("<"):
        raise InputError([problem("--slo", text, f"{measure} is better the lower it is: bound it with <=")])
    if measure.startswith(("ttft", "e2e", "served_")) and value == 0:  # a request takes time: never met
        raise InputError(
            [problem("--slo", text, f"{measure} of 0 s: no request is that fast, none meets it")]
        )
    if measure in SHARES and value > 1:  # `rejection<=2` meant 2%: as a share it holds always
        why = "at most 100%" if unit else f"from 0 to 1: for {raw} percent write {raw}%"
        raise InputError([problem("--slo", text, f"{measure} is a share, {why}")])
    return SLO(tier, measure, op.startswith("<"), value, text.strip())
