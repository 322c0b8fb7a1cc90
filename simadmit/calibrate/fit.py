"""Least-squares fit of the step-time model to measured TTFTs and inter-token latencies.

Each measurement becomes a sum of engine steps:
- a prefill-sweep request (concurrency 1, one output token) has TTFT = the steps that compute its P prompt
  tokens in chunks of at most the token budget, each chunk attending to the context before it and to itself
  (`prefill_attention_pairs`), plus an offset: the latency outside the engine (HTTP, tokenisation);
- a decode request at concurrency c spends output - 1 steps between its first and last token, each decoding
  c sequences that hold c * (prompt + half the output) tokens of context; the steps that also prefill other
  requests (found from their first tokens) carry those prompt tokens and their attention.
Each step's linear layers cost max(weights_read_s, their arithmetic), as the simulated engine charges it
(`StepTimeModel`): given which steps are memory-bound the sum is linear in the coefficients, so the fit
alternates between sorting the steps and solving least squares (`_roofline`). The TTFT offset is the latency
outside the engine: measured from the server's own clocks when it can be (`calibrate.api_latency`) and then
taken as it is; otherwise fitted, free in sign, so it does not leak into the step costs. Rows
are weighted by 1/observed so a 0.2 s TTFT counts as much as a 5 s decode window (the fit minimises relative
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
    "weights_read_s",
    "ttft_offset_s",
)
WEIGHTS, OFFSET = COEFFICIENTS.index("weights_read_s"), COEFFICIENTS.index("ttft_offset_s")
FITTED_PHASES = ("prefill", "decode", "context", "mixed", "saturation")
HOLDOUT_EVERY = 5  # request seq % 5 == 4 of each cell is held out
MAX_ROUNDS = 30  # re-sorting steps into memory- and compute-bound settles in a few rounds


@dataclass(frozen=True, slots=True)
class Steps:
    """`count` alike engine steps: what each computes and the context it holds."""

    count: float
    prefill_tokens: float
    decode_seqs: float
    context_tokens: float
    attention_pairs: float = 0.0

    def memory_bound(self, step: StepTimeModel) -> bool:
        """Whether these steps' linear layers wait on the weights' read rather than on their arithmetic."""
        return step.arithmetic_s(self.prefill_tokens, self.decode_seqs) < step.weights_read_s


@dataclass(frozen=True, slots=True)
class Observation:
    """One measured duration: the engine steps it spans (and how many request latencies outside the engine)."""

    phase: str
    groups: tuple[Steps, ...]
    requests: float
    seconds: float
    prompt_tokens: int = 0  # of the measured request: its prompt-length band
    held_out: bool = False

    def predict(self, step: StepTimeModel, ttft_offset_s: float = 0.0) -> float:
        """Seconds the model gives this observation: each step as the engine charges it, plus the offsets."""
        engine = sum(
            g.count * step.step_time(g.prefill_tokens, g.decode_seqs, g.context_tokens, g.attention_pairs)
            for g in self.groups
        )
        return engine + ttft_offset_s * self.requests

    def without_attention(self) -> Observation:
        return replace(self, groups=tuple(replace(g, attention_pairs=0.0) for g in self.groups))

    def _total(self, name: str) -> float:
        return float(sum(g.count * getattr(g, name) for g in self.groups))

    @property
    def steps(self) -> float:
        return float(sum(g.count for g in self.groups))

    @property
    def prefill_tokens(self) -> float:
        return self._total("prefill_tokens")

    @property
    def decode_seqs(self) -> float:
        return self._total("decode_seqs")

    @property
    def context_tokens(self) -> float:
        return self._total("context_tokens")

    @property
    def attention_pairs(self) -> float:
        return self._total("attention_pairs")


def ttft_observation(
    prompt_tokens: int, token_budget: int, seconds: float = math.nan, phase: str = "prefill"
) -> Observation:
    """TTFT of a lone request: its prompt prefilled in chunks of at most `token_budget` tokens; each chunk's
    step holds the context computed so far and attends to it."""
    chunks = tuple(
        Steps(1.0, chunk, 0.0, offset + chunk, prefill_attention_pairs(chunk, offset))
        for chunk, offset in prefill_chunks(prompt_tokens, token_budget)
    )
    return Observation(phase, chunks, 1.0, seconds, prompt_tokens=prompt_tokens)


def decode_observation(
    batch: float,
    prompt_tokens: int,
    output_tokens: int,
    interfering_prompt_tokens: float = 0.0,
    seconds: float = math.nan,
    phase: str = "decode",
    interfering_attention_pairs: float = 0.0,
    interfering_prefills: int = 0,
    context_tokens: float | None = None,
) -> Observation:
    """The decode window of one request (first to last token: output - 1 steps) in a batch of `batch`
    decoding sequences on average, holding `context_tokens` KV tokens per step (default: each sequence its
    prompt and half its output, as this one). Other requests whose prefill ran inside the window
    (`interfering_prefills` of them, with these prompt tokens and attention pairs) share their steps with the
    decodes (chunked prefill): those steps carry a prompt each, the others only decode."""
    steps = output_tokens - 1
    context = batch * (prompt_tokens + output_tokens / 2) if context_tokens is None else context_tokens
    mixed = min(steps, interfering_prefills) if interfering_prompt_tokens else 0
    groups = [Steps(steps - mixed, 0.0, batch, context)]
    if mixed:
        tokens = interfering_prompt_tokens / mixed
        groups.append(Steps(mixed, tokens, batch, context + tokens, interfering_attention_pairs / mixed))
    return Observation(phase, tuple(g for g in groups if g.count), 0.0, seconds, prompt_tokens=prompt_tokens)


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

    Prefill-sweep rows give their TTFT; decode, context, mixed and saturation rows their decode window, timed from
    first to last token so chunks arriving in bursts do not matter. Prefills of other requests inside a
    window are found from their first-token times, and the batch it decoded in from the decode tokens of every
    request that came out inside it (`decode_tokens`): a cell's nominal concurrency overstates the batch
    wherever its workers are out of step (one is still prefilling, another's last request has ended), and a
    fit that took it at face value would price full batches too cheaply. Each observation says whether its
    request is held out.
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
    token_time, kv_held = decode_tokens(ok)
    kv_cumsum = np.concatenate(([0.0], np.cumsum(kv_held)))
    prefill = [r for r in ok if r.phase == "prefill" and reading(r) is not None]
    decode = [r for r in ok if r.phase != "prefill" and reading(r) is not None]
    kept_prefill = _typical(prefill, lambda r: r.ttft_s, band)
    kept_decode = _typical(decode, lambda r: r.itl_mean_s, band)
    out = [
        replace(ttft_observation(r.prompt_tokens, token_budget, r.ttft_s), held_out=held_out(r))
        for r in kept_prefill
    ]
    for r in kept_decode:
        t0 = r.start_unix_s + r.ttft_s
        window, steps = _decode_window(r), r.output_tokens - 1
        # A step's tokens reach the client microseconds to milliseconds apart: the window's steps are the
        # tokens from half a step after its first token to half a step after its last, its own included.
        half_step = typical_step_s(r) / 2
        bounds = [t0 + half_step, t0 + window + half_step]
        lo, hi = np.searchsorted(token_time, bounds, side="right")
        first_lo, first_hi = np.searchsorted(first_sorted, bounds, side="right")
        o = decode_observation(
            (hi - lo) / steps,
            r.prompt_tokens,
            r.output_tokens,
            float(prompt_cumsum[first_hi] - prompt_cumsum[first_lo]),
            window,
            r.phase,
            float(pairs_cumsum[first_hi] - pairs_cumsum[first_lo]),
            int(first_hi - first_lo),
            float(kv_cumsum[hi] - kv_cumsum[lo]) / steps,
        )
        out.append(replace(o, held_out=held_out(r)))
    discarded = len(prefill) + len(decode) - len(out)
    return out, discarded


def typical_step_s(row: Measurement) -> float:
    """A request's usual gap between tokens: the median of its recorded ones (a long step where a batch-mate's
    prompt was prefilled does not move it), else its mean."""
    gaps = np.diff(row.token_times_s)
    gaps = gaps[gaps > 0]
    return float(np.median(gaps)) if len(gaps) else row.itl_mean_s


def decode_tokens(rows: Sequence[Measurement]) -> tuple[np.ndarray, np.ndarray]:
    """When each decode token of these requests came out (unix seconds, sorted), and the KV its sequence held
    in the step that made it (the prompt and the tokens made before).

    A token's step is read from its recorded arrival. A file without arrivals spreads each request's tokens
    evenly over its window; that misplaces them around a long step (a batch-mate's prefill): a window that
    holds one is slower per token than the steps outside it."""
    times: list[np.ndarray] = []
    held: list[np.ndarray] = []
    for r in rows:
        if not _decode_window(r):
            continue
        made = np.arange(1, r.output_tokens)
        if r.token_times_s:
            times.append(r.start_unix_s + np.asarray(r.token_times_s[1:], dtype=float))
        else:
            times.append(r.start_unix_s + r.ttft_s + made * r.itl_mean_s)
        held.append(r.prompt_tokens + made)
    if not times:
        return np.zeros(0), np.zeros(0)
    t, kv = np.concatenate(times), np.concatenate(held).astype(float)
    order = np.argsort(t, kind="stable")
    return t[order], kv[order]


def reading(row: Measurement) -> float | None:
    """What the fit reads from a request: a prefill-sweep TTFT, a decode window's mean inter-token time (None:
    a row it does not use)."""
    if row.phase == "prefill":
        return row.ttft_s if row.ttft_s > 0 else None
    fitted = row.phase in FITTED_PHASES[1:] and row.output_tokens > 2 and row.itl_mean_s > 0
    return row.itl_mean_s if fitted else None


def _decode_window(row: Measurement) -> float:
    """Seconds from a request's first token to its last (0 for an answer of one token)."""
    return row.itl_mean_s * (row.output_tokens - 1) if row.output_tokens > 1 and row.itl_mean_s > 0 else 0.0


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

    def coefficients(self) -> tuple[float, ...]:
        """The fitted values in the order of `COEFFICIENTS`."""
        s = self.step
        return (
            s.overhead_s,
            s.per_prefill_token_s,
            s.per_decode_seq_s,
            s.per_context_token_s,
            s.per_prefill_attention_s,
            s.weights_read_s,
            self.ttft_offset_s,
        )

    def predict(self, o: Observation) -> float:
        """Predicted seconds of an observation, TTFT offset included."""
        return o.predict(self.step, self.ttft_offset_s)

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


def _design(obs: Sequence[Observation], step: StepTimeModel) -> np.ndarray:
    """The rows of `COEFFICIENTS` for these observations, with each step group sorted as `step` prices it:
    a memory-bound group counts its steps on `weights_read_s`, a compute-bound one its tokens on the
    per-token and per-sequence costs; overhead and attention count either way."""
    x = np.zeros((len(obs), len(COEFFICIENTS)))
    for i, o in enumerate(obs):
        for g in o.groups:
            x[i, [0, 3, 4]] += g.count * np.array([1.0, g.context_tokens, g.attention_pairs])
            if g.memory_bound(step):
                x[i, WEIGHTS] += g.count
            else:
                x[i, [1, 2]] += g.count * np.array([g.prefill_tokens, g.decode_seqs])
        x[i, OFFSET] = o.requests
    return x


def _solve(
    obs: Sequence[Observation], step: StepTimeModel, roofline: bool, offset: float | None = None
) -> tuple[StepTimeModel, float]:
    """Least squares on relative error with each step sorted as `step` prices it; the TTFT offset is
    fitted (free in sign) unless it is known (`offset`: measured, then each TTFT less it is fitted)."""
    x = _design(obs, step)
    y = np.array([o.seconds for o in obs], dtype=float)
    columns = [
        j for j in range(len(COEFFICIENTS)) if (roofline or j != WEIGHTS) and (offset is None or j != OFFSET)
    ]
    target = np.ones_like(y) if offset is None else 1.0 - offset * x[:, OFFSET] / y
    coef = np.zeros(len(COEFFICIENTS))
    free = [columns.index(OFFSET)] if offset is None else []
    coef[columns] = nonnegative_least_squares(x[:, columns] / y[:, None], target, free=free)
    return StepTimeModel(*(float(c) for c in coef[:OFFSET])), float(
        coef[OFFSET] if offset is None else offset
    )


def _relative_cost(obs: Sequence[Observation], step: StepTimeModel, offset: float) -> float:
    return float(sum((o.predict(step, offset) / o.seconds - 1.0) ** 2 for o in obs))


def _roofline(
    obs: Sequence[Observation], linear: StepTimeModel, linear_offset: float, known_offset: float | None
) -> tuple[StepTimeModel, float]:
    """The least-squares step model with the weights' read as the floor of its linear layers.

    Which steps the floor binds depends on the coefficients, so the fit alternates: sort every step group by
    the current model, solve the (then linear) least squares, re-sort, until the sorting settles. It starts
    from the linear fit with the weights' read set to each of a range of fractions of the lower half of
    the measured per-step durations (it binds small steps), and keeps the start that ends with the least
    error of the model as charged.
    """
    best = (math.inf, linear, linear_offset)
    per_step = [o.seconds / o.steps for o in obs if o.steps]
    starts = np.quantile(per_step, np.linspace(0.0, 0.5, 6))[:, None] * np.linspace(0.2, 1.0, 5)[None, :]
    for weights in np.unique(starts) if per_step else ():
        step, sorting = replace(linear, weights_read_s=float(weights)), None
        for _ in range(MAX_ROUNDS):
            new_sorting = _design(obs, step)[:, WEIGHTS].tobytes()
            if new_sorting == sorting:
                break
            sorting = new_sorting
            step, offset = _solve(obs, step, roofline=True, offset=known_offset)
        cost = _relative_cost(obs, step, offset)
        if cost < best[0]:
            best = (cost, step, offset)
    return best[1], best[2]


def fit_step_model(
    obs: Sequence[Observation], roofline: bool = True, ttft_offset_s: float | None = None
) -> FitResult:
    """Fit the step coefficients and the per-request latency on the points not held out, and report the
    error on the held-out ones; needs at least one point to fit. A measured latency outside the engine
    (`ttft_offset_s`) is taken as it is rather than fitted, so it cannot absorb what the step model misses.

    With `roofline`, the weights' read (`weights_read_s`) is fitted too, and kept only where it predicts
    the held-out points better than the linear model does (or, with none held out, fits better): the floor
    is a physical fact on CPUs and small GPU batches, but a kink placed from a few points can also mislead
    beyond them, and the held-out points are what says which."""
    train = [o for o in obs if not o.held_out]
    test = [o for o in obs if o.held_out]
    if not train:
        raise ValueError("no observations to fit")
    step, offset = _solve(train, StepTimeModel(0, 0, 0, 0), roofline=False, offset=ttft_offset_s)
    if roofline:
        floor, floor_offset = _roofline(train, step, offset, ttft_offset_s)
        judge = test or train
        gain = _relative_cost(judge, step, offset) - _relative_cost(judge, floor, floor_offset)
        if gain > 1e-9 * len(judge):  # better by more than rounding
            step, offset = floor, floor_offset
    y = np.array([o.seconds for o in train], dtype=float)
    pred = np.array([o.predict(step, offset) for o in train])
    phases = _by(train, pred, lambda o: o.phase)
    held = {}
    if test:
        pred_test = np.array([o.predict(step, offset) for o in test])
        held = _by(test, pred_test, lambda o: (o.phase, prompt_band(o.prompt_tokens)))
    return FitResult(
        step=step,
        ttft_offset_s=offset,
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
