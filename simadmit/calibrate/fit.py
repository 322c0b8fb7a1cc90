"""Least-squares fit of the step-time model to measured TTFTs and inter-token latencies.

Each measurement becomes a sum of engine steps, which is linear in the model's coefficients:
- a prefill-sweep request (concurrency 1, one output token) has TTFT = the steps that compute its P prompt
  tokens in chunks of at most the token budget, each chunk attending to the context before it and to itself
  (`prefill_attention_pairs`), plus an offset: the latency outside the engine (HTTP, tokenisation);
- a decode request at concurrency c spends output - 1 steps between its first and last token, each decoding
  c sequences that hold c * (prompt + half the output) tokens of context, plus the prompt tokens (and their
  attention) of other requests prefilled meanwhile.
The TTFT offset is a sixth, nuisance coefficient, free in sign, so it does not leak into the step overhead,
which the decode windows pin down. The five step coefficients are exactly those the simulated engine charges.
Rows are weighted by 1/observed so a 0.2 s TTFT counts as much as a 5 s decode window (the fit minimises relative
error), and coefficients are constrained to be non-negative, as the profile requires.

Every fifth request of each calibration cell is held out of the fit; the fit's error on those points is reported
per phase and per prompt-length band, so a model that only interpolates its own points shows it.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from simadmit.calibrate.measurements import Measurement
from simadmit.config.profile import StepTimeModel, prefill_attention_pairs, prefill_chunks

COEFFICIENTS = (
    "overhead_s",
    "per_prefill_token_s",
    "per_decode_seq_s",
    "per_context_token_s",
    "per_prefill_attention_s",
    "ttft_offset_s",
)
FITTED_PHASES = ("prefill", "decode", "mixed", "saturation")
HOLDOUT_EVERY = 5  # request seq % 5 == 4 of each cell is held out


@dataclass(frozen=True, slots=True)
class Observation:
    """One measured duration as a count of each cost term (a row of the design matrix)."""

    phase: str
    steps: float
    prefill_tokens: float
    decode_seqs: float
    context_tokens: float
    attention_pairs: float
    requests: float
    seconds: float
    prompt_tokens: int = 0  # of the measured request: its prompt-length band
    held_out: bool = False

    def features(self) -> tuple[float, float, float, float, float, float]:
        return (
            self.steps,
            self.prefill_tokens,
            self.decode_seqs,
            self.context_tokens,
            self.attention_pairs,
            self.requests,
        )


def ttft_observation(
    prompt_tokens: int, token_budget: int, seconds: float = math.nan, phase: str = "prefill"
) -> Observation:
    """TTFT of a lone request: its prompt prefilled in chunks of at most `token_budget` tokens; each chunk's
    step holds the context computed so far and attends to it."""
    chunks = prefill_chunks(prompt_tokens, token_budget)
    context = sum(offset + chunk for chunk, offset in chunks)
    pairs = sum(prefill_attention_pairs(chunk, offset) for chunk, offset in chunks)
    return Observation(
        phase, len(chunks), prompt_tokens, 0.0, context, pairs, 1.0, seconds, prompt_tokens=prompt_tokens
    )


def decode_observation(
    concurrency: int,
    prompt_tokens: int,
    output_tokens: int,
    interfering_prompt_tokens: float = 0.0,
    seconds: float = math.nan,
    phase: str = "decode",
    interfering_attention_pairs: float = 0.0,
) -> Observation:
    """The decode window of one request (first to last token: output - 1 steps) in a batch of `concurrency`
    sequences, each holding its prompt and half its output on average, plus the prompt tokens (and their
    attention pairs) of other requests whose prefill ran inside the window (chunked prefill mixes them into
    the decode steps)."""
    steps = output_tokens - 1
    context = steps * concurrency * (prompt_tokens + output_tokens / 2) + interfering_prompt_tokens
    return Observation(
        phase,
        steps,
        interfering_prompt_tokens,
        steps * concurrency,
        context,
        interfering_attention_pairs,
        0.0,
        seconds,
        prompt_tokens=prompt_tokens,
    )


def _typical(
    rows: list[Measurement], value: Callable[[Measurement], float], band: float
) -> list[Measurement]:
    """Rows whose value is within a factor `band` of the median of rows with the same phase, concurrency and
    prompt length. A stream the server held back and then flushed in one burst gives a TTFT or a decode
    window that is wrong by several times; such rows are not measurements of the engine."""
    groups: dict[tuple[str, int, int], list[Measurement]] = defaultdict(list)
    for r in rows:
        groups[(r.phase, r.concurrency, r.prompt_tokens_target)].append(r)
    keep = []
    for group in groups.values():
        mid = float(np.median([value(r) for r in group]))
        keep += [r for r in group if mid / band <= value(r) <= mid * band]
    return keep


def held_out(row: Measurement) -> bool:
    """Whether a request is kept out of the fit to measure its error (every fifth of each cell)."""
    return row.seq % HOLDOUT_EVERY == HOLDOUT_EVERY - 1


def observations(
    rows: Sequence[Measurement], token_budget: int, band: float = 2.0
) -> tuple[list[Observation], int]:
    """The fit's data from successful rows, and how many were set aside as delivery artifacts.

    Prefill-sweep rows give their TTFT; decode, mixed and saturation rows their decode window, timed from
    first to last token so chunks arriving in bursts do not matter; prefills of other requests inside a
    window are found from their first-token times. Each observation says whether its request is held out.
    """
    ok = [r for r in rows if r.ok]
    first_token = np.array([r.start_unix_s + r.ttft_s for r in ok])
    order = np.argsort(first_token)
    first_sorted = first_token[order]
    prompt_cumsum = np.concatenate(([0.0], np.cumsum([ok[i].prompt_tokens for i in order])))
    pairs_cumsum = np.concatenate(
        (
            [0.0],
            np.cumsum([ttft_observation(ok[i].prompt_tokens, token_budget).attention_pairs for i in order]),
        )
    )
    prefill = [r for r in ok if r.phase == "prefill" and r.ttft_s > 0]
    decode = [r for r in ok if r.phase in FITTED_PHASES[1:] and r.output_tokens > 2 and r.itl_mean_s > 0]
    kept_prefill = _typical(prefill, lambda r: r.ttft_s, band)
    kept_decode = _typical(decode, lambda r: r.itl_mean_s, band)
    out = [
        replace(ttft_observation(r.prompt_tokens, token_budget, r.ttft_s), held_out=held_out(r))
        for r in kept_prefill
    ]
    for r in kept_decode:
        t0 = r.start_unix_s + r.ttft_s
        window = r.itl_mean_s * (r.output_tokens - 1)
        # Requests prefilled in the same step as this one's first token reach the client a few microseconds
        # apart: only first tokens at least half a step later (up to half a step after the last) interfere.
        half_step = r.itl_mean_s / 2
        lo, hi = np.searchsorted(first_sorted, [t0 + half_step, t0 + window + half_step], side="right")
        o = decode_observation(
            r.concurrency,
            r.prompt_tokens,
            r.output_tokens,
            float(prompt_cumsum[hi] - prompt_cumsum[lo]),
            window,
            r.phase,
            float(pairs_cumsum[hi] - pairs_cumsum[lo]),
        )
        out.append(replace(o, held_out=held_out(r)))
    discarded = len(prefill) + len(decode) - len(out)
    return out, discarded


def decode_step_s(step: StepTimeModel, concurrency: int, prompt_tokens: int, output_tokens: int) -> float:
    """Predicted inter-token latency of a steady batch of `concurrency` identical requests (no prefills)."""
    return step.step_time(0, concurrency, int(concurrency * (prompt_tokens + output_tokens / 2)))


def nonnegative_least_squares(a: np.ndarray, b: np.ndarray, free: Sequence[int] = ()) -> np.ndarray:
    """argmin |a x - b| subject to x >= 0 except for the `free` columns, for a handful of columns.

    The constrained optimum is the unconstrained least-squares solution on its own support, so trying every
    support of the constrained columns (2^5 = 32 here) and keeping the best feasible one is exact, and
    plainly correct.
    """
    n = a.shape[1]
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    bounded = [j for j in range(n) if j not in free]
    best, best_cost = np.zeros(n), math.inf
    for k in range(len(bounded) + 1):
        for support in itertools.combinations(bounded, k):
            cols = sorted([*support, *free])
            if not cols:
                continue
            x_s, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if any(x < 0 for j, x in zip(cols, x_s, strict=True) if j not in free):
                continue
            cost = float(np.sum((a[:, cols] @ x_s - b) ** 2))
            if cost < best_cost - 1e-15:
                best = np.zeros(n)
                best[cols] = x_s
                best_cost = cost
    return best / scale


def prompt_band(prompt_tokens: int) -> str:
    """Prompt-length band of a request, by factors of four from 256 tokens: '<256', '256-1023', ..."""
    if prompt_tokens < 256:
        return "<256"
    lo = 256
    while prompt_tokens >= 4 * lo:
        lo *= 4
    return f"{lo}-{4 * lo - 1}"


@dataclass(frozen=True, slots=True)
class PhaseFit:
    """Fit quality on a set of points: relative residuals (predicted/measured - 1) and R^2."""

    n: int
    r2: float | None  # None when the measured values do not vary
    median_residual: float
    median_abs_residual: float
    max_abs_residual: float

    def report(self) -> dict[str, object]:
        return {
            "points": self.n,
            "r2": None if self.r2 is None else round(self.r2, 4),
            "median_residual": round(self.median_residual, 4),
            "median_abs_residual": round(self.median_abs_residual, 4),
            "max_abs_residual": round(self.max_abs_residual, 4),
        }


def _quality(y: np.ndarray, pred: np.ndarray) -> PhaseFit:
    rel = pred / y - 1.0
    return PhaseFit(
        n=len(y),
        r2=_r2(y, pred),
        median_residual=float(np.median(rel)),
        median_abs_residual=float(np.median(np.abs(rel))),
        max_abs_residual=float(np.max(np.abs(rel))),
    )


@dataclass(frozen=True, slots=True)
class FitResult:
    step: StepTimeModel
    ttft_offset_s: float
    n: int
    r2: float
    phases: dict[str, PhaseFit]
    held_out: dict[tuple[str, str], PhaseFit]  # (phase, prompt band) -> error on points left out of the fit

    def coefficients(self) -> tuple[float, float, float, float, float, float]:
        s = self.step
        return (
            s.overhead_s,
            s.per_prefill_token_s,
            s.per_decode_seq_s,
            s.per_context_token_s,
            s.per_prefill_attention_s,
            self.ttft_offset_s,
        )

    def predict(self, o: Observation) -> float:
        """Predicted seconds of an observation, TTFT offset included."""
        return float(np.dot(o.features(), self.coefficients()))

    def report(self) -> dict[str, object]:
        """The `fit:` section of the profile."""
        held: dict[str, dict[str, object]] = defaultdict(dict)
        for (phase, band), q in self.held_out.items():
            held[phase][band] = q.report()
        return {
            "points": self.n,
            "r2": round(self.r2, 4),
            "ttft_offset_s": float(f"{self.ttft_offset_s:.4g}"),
            "phases": {name: p.report() for name, p in self.phases.items()},
            "held_out": dict(held),
        }


def _r2(y: np.ndarray, pred: np.ndarray) -> float | None:
    total = float(np.sum((y - y.mean()) ** 2))
    return None if total <= 0 else 1.0 - float(np.sum((y - pred) ** 2)) / total


def _by(obs: Sequence[Observation], pred: np.ndarray, key: Callable[[Observation], object]) -> dict:
    y = np.array([o.seconds for o in obs])
    groups: dict[object, list[int]] = defaultdict(list)
    for i, o in enumerate(obs):
        groups[key(o)].append(i)
    return {k: _quality(y[idx], pred[idx]) for k, idx in groups.items()}


def fit_step_model(obs: Sequence[Observation]) -> FitResult:
    """Fit the five step coefficients and the per-request latency on the points not held out, and report the
    error on the held-out ones; needs at least one point to fit."""
    train = [o for o in obs if not o.held_out]
    test = [o for o in obs if o.held_out]
    if not train:
        raise ValueError("no observations to fit")
    x = np.array([o.features() for o in train], dtype=float)
    y = np.array([o.seconds for o in train], dtype=float)
    coef = nonnegative_least_squares(
        x / y[:, None], np.ones_like(y), free=[COEFFICIENTS.index("ttft_offset_s")]
    )
    pred = x @ coef
    phases = _by(train, pred, lambda o: o.phase)
    held = {}
    if test:
        pred_test = np.array([o.features() for o in test], dtype=float) @ coef
        held = _by(test, pred_test, lambda o: (o.phase, prompt_band(o.prompt_tokens)))
    return FitResult(
        step=StepTimeModel(*(float(c) for c in coef[:5])),
        ttft_offset_s=float(coef[5]),
        n=len(train),
        r2=_r2(y, pred) or 0.0,
        phases={name: phases[name] for name in FITTED_PHASES if name in phases},
        held_out=dict(
            sorted(held.items(), key=lambda kv: (FITTED_PHASES.index(kv[0][0]), _band_order(kv[0][1])))
        ),
    )


def _band_order(band: str) -> int:
    return 0 if band.startswith("<") else int(band.split("-")[0])


@dataclass(frozen=True, slots=True)
class FitThresholds:
    """When a fit is too weak to trust silently."""

    min_points: int = 12  # all fitted points together
    min_phase_points: int = 3  # prefill and decode each
    min_r2: float = 0.9  # over all points
    max_median_abs_residual: float = 0.25  # per phase


def fit_warnings(
    fit: FitResult, obs: Sequence[Observation], limits: FitThresholds = FitThresholds()
) -> list[str]:
    """Human-readable reasons to distrust the fit; empty when it is sound."""
    out = []
    if fit.n < limits.min_points:
        out.append(
            f"poor fit: only {fit.n} points (at least {limits.min_points} wanted); give it a longer --budget"
        )
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
    for (name, band), p in fit.held_out.items():
        if p.n >= limits.min_phase_points and p.median_abs_residual > limits.max_median_abs_residual:
            out.append(
                f"poor fit: held-out {name} points with {band} prompt tokens off by {p.median_abs_residual:.0%} "
                f"(median), more than {limits.max_median_abs_residual:.0%}"
            )
    return out
