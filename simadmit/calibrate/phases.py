"""The calibration plan (warm-up, prefill sweep, decode sweep, long-context decode, mixed, saturation) and the
closed-loop runner.

The plan is a list of cells, each a (phase, concurrency) pair with prompt and output lengths, a share of the
time budget and a minimum number of requests. It depends only on the endpoint's context length, the KV
capacity and the options, so a resumed run rebuilds the same plan and skips what the CSV already holds.
It covers what users send: prompts from 16 tokens up to the context length (chunked when longer than the
step's token budget), decode batches from 1 to the maximum concurrency, the same batches holding long
prompts (context: a decode step reads every token's KV, so its cost grows with the context held, which
short-prompt batches cannot tell apart from their size), steps where long prefills join running decodes
(mixed), and a saturated batch.

The cells after the warm-up run in rounds (`in_rounds`), each round taking every cell's share of its time:
the speed of a shared machine drifts by 10-25% over minutes, and a phase measured in one stretch takes the
speed of that stretch (a lone decode step measured 37 ms in one calibration, 33 ms in the next calibration
of the same server and in the replays after it), while rounds spread a drift over every phase. Every round
holds at least one full batch of every cell: a large batch's requests last longer than its share of a short
budget, and a cell that ran once would take one stretch's speed after all (a decode batch of 16 measured 63
and 72 ms in the two rounds of one calibration, 53-59 ms in two calibrations after it).

A cell at concurrency c runs c workers, each sending its next request as soon as the previous one ends, so
exactly c requests are in flight (a closed loop) until the cell's time is up; retries happen inside the
worker, keeping the slot. Every attempt, failed or not, is appended to the measurements CSV at once.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import httpx

from simadmit.calibrate.client import Endpoint, RequestRejected, stream_completion
from simadmit.calibrate.measurements import Measurement, MeasurementLog, cell_progress
from simadmit.calibrate.overhead import OverheadMonitor
from simadmit.calibrate.prompts import PromptMaker
from simadmit.config.errors import InputError, problem

PHASE_SHARES = {
    "warmup": 0.04,
    "prefill": 0.30,
    "decode": 0.32,
    "context": 0.08,
    "mixed": 0.08,
    "saturation": 0.13,
}  # the rest: drain tails
MIXED_CONCURRENCY = 2  # each request decodes while the other's long prompt is prefilled
# Output tokens of a decode request, whatever the concurrency: the fit reads each decode window with the other
# requests' prefills inside it (found from their first tokens), so windows need not be pure decode, and short
# requests let the sweep reach the large batches a saturated server runs within the budget.
DECODE_OUTPUT_TOKENS = 64
ROUNDS = 2  # each a pass over every cell but the warm-up; more would add the cells' drain tails again


@dataclass(frozen=True, slots=True)
class Cell:
    """A block of requests at one concurrency; prompt lengths are cycled in order by request seq."""

    phase: str
    concurrency: int
    prompt_tokens: tuple[int, ...]
    output_tokens: int
    budget_s: float
    min_requests: int
    round: int = 0  # its round in the plan as it runs (`in_rounds`); 0 for the warm-up

    @property
    def label(self) -> str:
        return f"{self.phase} c={self.concurrency}"


def concurrency_levels(max_concurrency: int) -> list[int]:
    """1, 2, 4, ... below the maximum, then the maximum itself."""
    levels = [1]
    while levels[-1] * 2 < max_concurrency:
        levels.append(levels[-1] * 2)
    if max_concurrency > 1:
        levels.append(max_concurrency)
    return levels


def prefill_lengths(
    max_model_len: int, token_budget: int, points: int = 8, shortest: int = 16
) -> tuple[int, ...]:
    """Geometric prompt lengths from `shortest` to the longest prompt the context takes with one output token;
    when that is longer than the step's token budget, at least two lengths are prefilled in several chunks."""
    longest = max(shortest + 1, max_model_len - 1)
    ratio = (longest / shortest) ** (1 / (points - 1))
    lengths = {round(shortest * ratio**k) for k in range(points)} | {longest}
    if longest > token_budget:
        lengths.add(min(longest, token_budget + token_budget // 2))
    return tuple(sorted(lengths))


def mixed_prompts(
    max_model_len: int, token_budget: int, output_tokens: int, kv_per_seq: int
) -> tuple[int, ...]:
    """Long prompts for the mixed cell: half a step's token budget and, when the context takes it, one and a
    half (prefilled in two chunks); within the context and each sequence's share of the KV cache."""
    longest = max(16, min(max_model_len, kv_per_seq) - output_tokens)
    chunked = token_budget + token_budget // 2
    return tuple(sorted({min(longest, token_budget // 2)} | ({chunked} if chunked <= longest else set())))


def long_context_prompt(
    max_model_len: int, token_budget: int, kv_capacity_tokens: int, concurrency: int, output_tokens: int
) -> int:
    """The prompt of a long-context decode cell: three quarters of the context, prefilled in one step, and
    within each of `concurrency` sequences' share of the KV cache."""
    kv_per_seq = int(0.9 * kv_capacity_tokens / concurrency) - output_tokens
    return max(16, min(3 * max_model_len // 4, max_model_len - output_tokens, token_budget, kv_per_seq))


def plan_cells(
    max_model_len: int,
    kv_capacity_tokens: int,
    max_concurrency: int,
    budget_s: float,
    token_budget: int = 8192,
    workload_prompts: tuple[int, ...] = (),
) -> list[Cell]:
    """The whole calibration as cells in execution order (see module docstring); `token_budget` is the
    server's max_num_batched_tokens; `workload_prompts`, lengths of the user's own traffic, join the prefill
    sweep (those the context takes)."""
    c_max = max_concurrency
    out_tokens = min(DECODE_OUTPUT_TOKENS, max_model_len // 4)
    decode_prompt = min(128, max_model_len // 8)
    kv_per_seq = (
        int(0.9 * kv_capacity_tokens / c_max) - out_tokens
    )  # keep the saturation batch inside the KV cache
    sat_prompt = max(decode_prompt, min(max_model_len // 4, 1024, kv_per_seq))
    levels = concurrency_levels(c_max)
    per_level = budget_s * PHASE_SHARES["decode"] / len(levels)
    context_levels = sorted({1, levels[len(levels) // 2]})
    context_prompts = [
        long_context_prompt(max_model_len, token_budget, kv_capacity_tokens, c, out_tokens)
        for c in context_levels
    ]
    lengths = tuple(
        sorted(
            set(prefill_lengths(max_model_len, token_budget))
            | {p for p in workload_prompts if p < max_model_len}
        )
    )
    c_mixed = min(MIXED_CONCURRENCY, c_max)
    mixed_out = min(32, max_model_len // 8)
    mixed = mixed_prompts(max_model_len, token_budget, mixed_out, int(0.9 * kv_capacity_tokens / c_mixed))
    cells = [
        Cell("warmup", c_max, (32,), 16, budget_s * PHASE_SHARES["warmup"], 2 * c_max),
        Cell("prefill", 1, lengths, 1, budget_s * PHASE_SHARES["prefill"], len(lengths)),
    ]
    cells += [Cell("decode", c, (decode_prompt,), out_tokens, per_level, c) for c in levels]
    per_context = budget_s * PHASE_SHARES["context"] / len(context_levels)
    cells += [
        Cell("context", c, (p,), out_tokens, per_context, c)
        for c, p in zip(context_levels, context_prompts, strict=True)
        if p > decode_prompt
    ]
    cells.append(Cell("mixed", c_mixed, mixed, mixed_out, budget_s * PHASE_SHARES["mixed"], c_mixed))
    cells.append(
        Cell("saturation", c_max, (sat_prompt,), out_tokens, budget_s * PHASE_SHARES["saturation"], c_max)
    )
    return cells


def in_rounds(cells: list[Cell], rounds: int = ROUNDS) -> list[Cell]:
    """The plan as it runs: the warm-up, then every other cell `rounds` times, in order. A round's cell holds
    what the cell owes by the end of that round (k/rounds of its time and of its minimum requests, and at
    least k full batches), so the runner, which subtracts what is already measured, gives each round its
    share, and a resumed run picks up where it stopped."""
    warmup = [c for c in cells if c.phase == "warmup"]
    rest = [c for c in cells if c.phase != "warmup"]
    return warmup + [
        replace(
            c,
            budget_s=c.budget_s * k / rounds,
            min_requests=max(math.ceil(c.min_requests * k / rounds), k * c.concurrency),
            round=k,
        )
        for k in range(1, rounds + 1)
        for c in rest
    ]


@dataclass(slots=True)
class RunStats:
    """Counters over the run: successes, retried faults by kind, requests given up after all retries."""

    completed: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    gave_up: int = 0
    consecutive_failures: int = 0
    busy_s: defaultdict[str, float] = field(
        default_factory=lambda: defaultdict(float)
    )  # per cell: request time
    wall_s: defaultdict[str, float] = field(
        default_factory=lambda: defaultdict(float)
    )  # per cell: time it ran

    def concurrency_held(self) -> dict[str, float]:
        """Mean requests in flight per cell (time-weighted): equals the target but for the drain at its end."""
        return {k: round(self.busy_s[k] / w, 3) for k, w in self.wall_s.items() if w > 0}


class EndpointLost(Exception):
    """Too many failures in a row: the endpoint is gone, so stop and keep what was measured."""


@dataclass(frozen=True, slots=True)
class RunnerSettings:
    max_retries: int = 3  # per request, after the first attempt
    request_timeout_s: float = 300.0
    give_up_after_failures: int = 20  # in a row, across all workers
    backoff_s: float = 0.25  # before retry k: backoff_s * 2^k, at most 5 s


class Runner:
    """Runs cells against one endpoint, appending every attempt to the measurement log."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        endpoint: Endpoint,
        prompts: PromptMaker,
        log: MeasurementLog,
        history: list[Measurement],
        overhead: OverheadMonitor,
        settings: RunnerSettings = RunnerSettings(),
    ) -> None:
        self._client = client
        self._endpoint = endpoint
        self._prompts = prompts
        self._log = log
        self._history = history
        self._overhead = overhead
        self._settings = settings
        self.stats = RunStats()

    def remaining_s(self, cell: Cell) -> tuple[float, int]:
        """Time left for the cell and requests it still owes, after what earlier runs measured."""
        done = cell_progress(self._history, cell.phase, cell.concurrency)
        return max(0.0, cell.budget_s - done.spent_s), max(0, cell.min_requests - done.completed)

    async def run_cell(self, cell: Cell, on_request: Callable[[], None] = lambda: None) -> None:
        """Hold `cell.concurrency` requests in flight until its time is up and its minimum is met."""
        done = cell_progress(self._history, cell.phase, cell.concurrency)
        remaining_s, owed = self.remaining_s(cell)
        deadline = time.perf_counter() + remaining_s
        next_seq = done.next_seq

        async def worker() -> None:
            nonlocal next_seq, owed
            while owed > 0 or time.perf_counter() < deadline:
                seq, next_seq, owed = next_seq, next_seq + 1, owed - 1
                prompt_tokens = cell.prompt_tokens[seq % len(cell.prompt_tokens)]
                await self._measure(cell, seq, prompt_tokens)
                on_request()

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(cell.concurrency)))
        self.stats.wall_s[cell.label] += time.perf_counter() - started

    async def _measure(self, cell: Cell, seq: int, prompt_tokens: int) -> None:
        """One request with bounded retries (a fresh prompt each time, so no attempt hits the prefix cache)."""
        s = self._settings
        for attempt in range(1, s.max_retries + 2):
            prompt = self._prompts.make(prompt_tokens)
            try:
                a = await stream_completion(
                    self._client, self._endpoint, prompt, cell.output_tokens, s.request_timeout_s
                )
            except RequestRejected as e:
                raise InputError(
                    [problem(None, "--endpoint", f"the server rejected a {prompt_tokens}-token request: {e}")]
                ) from None
            self._overhead.record(a.client_busy_s)
            self.stats.busy_s[cell.label] += a.e2e_s
            measured = Measurement(
                phase=cell.phase,
                concurrency=cell.concurrency,
                seq=seq,
                attempt=attempt,
                model=self._endpoint.model,
                start_unix_s=a.start_unix_s,
                prompt_tokens_target=prompt_tokens,
                prompt_tokens=a.prompt_tokens,
                output_tokens_target=cell.output_tokens,
                output_tokens=a.output_tokens,
                ttft_s=a.ttft_s,
                itl_mean_s=a.itl_mean_s,
                itl_p50_s=a.itl_p50_s,
                itl_p90_s=a.itl_p90_s,
                itl_max_s=a.itl_max_s,
                n_chunks=a.n_chunks,
                e2e_s=a.e2e_s,
                status=a.status,
                round=cell.round,
                token_times_s=a.token_times_s,
            )
            self._log.append(measured)
            self._history.append(measured)  # what a later round of this cell finds done
            if a.status == "ok":
                self._prompts.observe(prompt, a.prompt_tokens)
                self.stats.completed += 1
                self.stats.consecutive_failures = 0
                return
            self.stats.faults[a.status] += 1
            self.stats.consecutive_failures += 1
            if self.stats.consecutive_failures >= s.give_up_after_failures:
                raise EndpointLost(
                    f"{self.stats.consecutive_failures} failed requests in a row (last: {a.status})"
                )
            await asyncio.sleep(min(5.0, s.backoff_s * 2**attempt))
        self.stats.gave_up += 1


def aggregate_throughput(rows: list[Measurement], phase: str, concurrency: int) -> float:
    """Output tokens per second of a closed-loop cell: c x (tokens) / (request time), from its CSV rows."""
    mine = [r for r in rows if r.ok and r.phase == phase and r.concurrency == concurrency]
    busy = sum(r.e2e_s for r in mine)
    return concurrency * sum(r.output_tokens for r in mine) / busy if busy > 0 else math.nan
