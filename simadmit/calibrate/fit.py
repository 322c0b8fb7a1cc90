"""Least-squares fit of the step-time model to measured TTFTs and inter-token latencies.

Each measurement becomes a sum of engine steps, which is linear in the model's coefficients:
- a prefill-sweep request (concurrency 1, one output token) has TTFT = ceil(P / token budget) steps that
  compute P prompt tokens, plus a per-request latency outside the engine (HTTP, tokenisation, detokenisation);
- a decode request at concurrency c has a median inter-token gap of one step decoding c sequences that hold
  c * (prompt + half the output) tokens of context.
The per-request latency is fitted as a fifth, nuisance coefficient so it does not inflate the step overhead.
Rows are weighted by 1/observed so a 20 ms gap counts as much as a 2 s TTFT (the fit minimises relative
error), and coefficients are constrained to be non-negative, as the profile requires.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from simadmit.calibrate.measurements import Measurement
from simadmit.profile import StepTimeModel

COEFFICIENTS = ("overhead_s", "per_prefill_token_s", "per_decode_seq_s", "per_context_token_s", "request_overhead_s")
FITTED_PHASES = ("prefill", "decode", "saturation")


@dataclass(frozen=True, slots=True)
class Observation:
    """One measured duration as a count of each cost term (a row of the design matrix)."""

    phase: str
    steps: float
    prefill_tokens: float
    decode_seqs: float
    context_tokens: float
    requests: float
    seconds: float

    def features(self) -> tuple[float, float, float, float, float]:
        return (self.steps, self.prefill_tokens, self.decode_seqs, self.context_tokens, self.requests)


def ttft_observation(prompt_tokens: int, token_budget: int, seconds: float = math.nan, phase: str = "prefill") -> Observation:
    """TTFT of a lone request: its prompt prefilled in chunks of at most `token_budget` tokens; each chunk's
    step holds the context computed so far."""
    chunks = max(1, math.ceil(prompt_tokens / token_budget))
    context = sum(min((k + 1) * token_budget, prompt_tokens) for k in range(chunks))
    return Observation(phase, chunks, prompt_tokens, 0.0, context, 1.0, seconds)


def itl_observation(
    concurrency: int, prompt_tokens: int, output_tokens: int, seconds: float = math.nan, phase: str = "decode"
) -> Observation:
    """One decode step of `concurrency` sequences, each holding its prompt and half its output on average."""
    return Observation(phase, 1.0, 0.0, concurrency, concurrency * (prompt_tokens + output_tokens / 2), 0.0, seconds)


def observations(rows: Sequence[Measurement], token_budget: int) -> list[Observation]:
    """The fit's data: prefill-sweep TTFTs and decode/saturation median inter-token gaps of successful rows."""
    out = []
    for r in rows:
        if not r.ok or r.phase not in FITTED_PHASES:
            continue
        if r.phase == "prefill" and r.ttft_s > 0:
            out.append(ttft_observation(r.prompt_tokens, token_budget, r.ttft_s))
        elif r.phase != "prefill" and r.output_tokens > 2 and r.itl_p50_s > 0:
            out.append(itl_observation(r.concurrency, r.prompt_tokens, r.output_tokens, r.itl_p50_s, r.phase))
    return out


def nonnegative_least_squares(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin |a x - b| subject to x >= 0, for a handful of columns.

    The constrained optimum is the unconstrained least-squares solution on its own support, so trying every
    support (2^5 = 32 here) and keeping the best feasible one is exact, and plainly correct.
    """
    n = a.shape[1]
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    best, best_cost = np.zeros(n), float(np.sum(b**2))
    for k in range(1, n + 1):
        for support in itertools.combinations(range(n), k):
            cols = list(support)
            x_s, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if np.any(x_s < 0):
                continue
            cost = float(np.sum((a[:, cols] @ x_s - b) ** 2))
            if cost < best_cost - 1e-15:
                best = np.zeros(n)
                best[cols] = x_s
                best_cost = cost
    return best / scale


@dataclass(frozen=True, slots=True)
class PhaseFit:
    """Fit quality on one phase's points: relative residuals (predicted/measured - 1) and R^2."""

    n: int
    r2: float | None  # None when the phase's measured values do not vary
    median_residual: float
    median_abs_residual: float
    max_abs_residual: float


@dataclass(frozen=True, slots=True)
class FitResult:
    step: StepTimeModel
    request_overhead_s: float
    n: int
    r2: float
    phases: dict[str, PhaseFit]

    def predict(self, obs: Observation) -> float:
        return float(np.dot(obs.features(), self.coefficients()))

    def coefficients(self) -> tuple[float, float, float, float, float]:
        s = self.step
        return (s.overhead_s, s.per_prefill_token_s, s.per_decode_seq_s, s.per_context_token_s, self.request_overhead_s)

    def report(self) -> dict[str, object]:
        """The `fit:` section of the profile."""
        return {
            "points": self.n,
            "r2": round(self.r2, 4),
            "request_overhead_s": float(f"{self.request_overhead_s:.4g}"),
            "phases": {
                name: {
                    "points": p.n,
                    "r2": None if p.r2 is None else round(p.r2, 4),
                    "median_residual": round(p.median_residual, 4),
                    "median_abs_residual": round(p.median_abs_residual, 4),
                    "max_abs_residual": round(p.max_abs_residual, 4),
                }
                for name, p in self.phases.items()
            },
        }


def _r2(y: np.ndarray, pred: np.ndarray) -> float | None:
    total = float(np.sum((y - y.mean()) ** 2))
    return None if total <= 0 else 1.0 - float(np.sum((y - pred) ** 2)) / total


def fit_step_model(obs: Sequence[Observation]) -> FitResult:
    """Fit the four step coefficients and the per-request latency; needs at least one observation."""
    if not obs:
        raise ValueError("no observations to fit")
    x = np.array([o.features() for o in obs], dtype=float)
    y = np.array([o.seconds for o in obs], dtype=float)
    coef = nonnegative_least_squares(x / y[:, None], np.ones_like(y))
    pred = x @ coef
    phases = {}
    for name in FITTED_PHASES:
        mask = np.array([o.phase == name for o in obs])
        if not mask.any():
            continue
        rel = pred[mask] / y[mask] - 1.0
        phases[name] = PhaseFit(
            n=int(mask.sum()),
            r2=_r2(y[mask], pred[mask]),
            median_residual=float(np.median(rel)),
            median_abs_residual=float(np.median(np.abs(rel))),
            max_abs_residual=float(np.max(np.abs(rel))),
        )
    return FitResult(
        step=StepTimeModel(*(float(c) for c in coef[:4])),
        request_overhead_s=float(coef[4]),
        n=len(obs),
        r2=_r2(y, pred) or 0.0,
        phases=phases,
    )


@dataclass(frozen=True, slots=True)
class FitThresholds:
    """When a fit is too weak to trust silently."""

    min_points: int = 12  # all fitted points together
    min_phase_points: int = 3  # prefill and decode each
    min_r2: float = 0.9  # over all points
    max_median_abs_residual: float = 0.25  # per phase


def fit_warnings(fit: FitResult, obs: Sequence[Observation], limits: FitThresholds = FitThresholds()) -> list[str]:
    """Human-readable reasons to distrust the fit; empty when it is sound."""
    out = []
    if fit.n < limits.min_points:
        out.append(f"poor fit: only {fit.n} points (at least {limits.min_points} wanted); give it a longer --budget")
    for name in ("prefill", "decode"):
        n = fit.phases[name].n if name in fit.phases else 0
        if n < limits.min_phase_points:
            out.append(f"poor fit: {n} {name} points (at least {limits.min_phase_points} wanted)")
    distinct_prompts = {o.prefill_tokens for o in obs if o.phase == "prefill"}
    if 0 < len(distinct_prompts) < 3:
        out.append(f"poor fit: only {len(distinct_prompts)} distinct prompt lengths in the prefill sweep")
    if fit.r2 < limits.min_r2:
        out.append(f"poor fit: R^2 {fit.r2:.3f} below {limits.min_r2}")
    for name, p in fit.phases.items():
        if p.median_abs_residual > limits.max_median_abs_residual:
            out.append(
                f"poor fit: {name} predictions off by {p.median_abs_residual:.0%} (median), "
                f"more than {limits.max_median_abs_residual:.0%}"
            )
    return out
