"""The step-time model fitted to published GPU timings: does its form hold on A100 and H100?

SplitwiseSim's measured performance table (Patel et al., ISCA 2024; MIT; copied under
`calibration/gpu_evidence/`) gives, per model, GPU and tensor parallelism, the time to prefill a batch of
prompts (one iteration: the whole batch, no chunking) and the time of one decode iteration, over prompts of
128-8,192 tokens, batches of 1-64 and outputs of 128-8,192 tokens, five repeats each. Each row becomes two
observations of the same step model the simulated engine charges, fitted by the same least squares on relative
error; the largest prompt and the largest batch are held out, so their error says whether the model
extrapolates to where a linear one fails.

Two kinds of data are left out. Batched prefills of more tokens than vLLM's default step budget (8,192 on these
GPUs) are steps the engine never runs: it chunks them (their rows' decode iterations stay). And a row whose
batched prefill is faster per token than a third of its setup's median is not a measurement of this engine
(Llama-2-70B at TP2, batch 64: 64 x 512 tokens in less time than 8 x 512, and decode faster than at batch 32).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from simadmit.calibrate.fit import FitResult, Observation, Steps, fit_step_model
from simadmit.config.profile import prefill_attention_pairs

HARDWARE = {"a100-80gb": "A100-80GB", "h100-80gb": "H100-80GB", "h100-80gb-pcap": "H100-80GB power-capped"}
MODELS = {"llama2-70b": "Llama-2-70B", "bloom-176b": "BLOOM-176B"}


@dataclass(frozen=True, slots=True)
class Setup:
    """One model on one GPU type at one tensor parallelism."""

    model: str
    hardware: str
    tensor_parallel: int

    @property
    def label(self) -> str:
        return f"{MODELS.get(self.model, self.model)} {HARDWARE.get(self.hardware, self.hardware)} TP{self.tensor_parallel}"


STEP_BUDGET = 8192  # vLLM's default max_num_batched_tokens on A100/H100-class GPUs


def read_table(path: str | Path) -> pd.DataFrame:
    """SplitwiseSim's `perf_model.csv` (times in milliseconds)."""
    return pd.read_csv(path)


def plausible(rows: pd.DataFrame) -> pd.DataFrame:
    """Rows whose prefill is not implausibly fast for their setup (see module docstring)."""
    per_token = rows.prompt_time / (rows.batch_size * rows.prompt_size)
    median = per_token.groupby([rows.model, rows.hardware, rows.tensor_parallel]).transform("median")
    return rows[per_token >= median / 3]


def observations(
    rows: pd.DataFrame, held_out_prompt: int, held_out_batch: int, step_budget: int = STEP_BUDGET
) -> list[Observation]:
    """Prefill (up to the step budget) and decode-iteration observations of one setup's rows; rows at the
    held-out prompt or batch size are marked held out. A decode iteration holds each sequence's prompt and, on average, half its
    output; a batch of B prompts of P tokens prefills B x P tokens attending over B x P(P+1)/2 pairs."""
    out = []
    columns = ("batch_size", "prompt_size", "token_size", "prompt_time", "token_time")
    for b, p, t, prompt_ms, token_ms in zip(*(rows[c].to_numpy(dtype=float) for c in columns), strict=True):
        held = p == held_out_prompt or b == held_out_batch
        pairs = b * prefill_attention_pairs(int(p), 0)
        if b * p <= step_budget:
            prefill = (Steps(1.0, b * p, 0.0, b * p, pairs),)
            out.append(Observation("prefill", prefill, 0.0, prompt_ms / 1e3, int(p), held))
        decode = (Steps(1.0, 0.0, b, b * (p + t / 2)),)
        out.append(Observation("decode", decode, 0.0, token_ms / 1e3, int(p), held))
    return out


@dataclass(frozen=True, slots=True)
class Evidence:
    """A setup's points, its fit with attention and the same fit without (the model profiles had before)."""

    setup: Setup
    points: list[Observation]
    fit: FitResult
    linear: FitResult

    def held_out_error(
        self, fit: FitResult, phase: str, prompt: int | None = None, batch: int | None = None
    ) -> float:
        """Median relative error of a fit on held-out points of a phase, optionally of one prompt or batch size
        (for decode points, `decode_seqs` is the batch; for prefill, the tokens over the prompt size)."""
        errors = [
            fit.predict(o) / o.seconds - 1
            for o in self.points
            if o.held_out
            and o.phase == phase
            and (prompt is None or o.prompt_tokens == prompt)
            and (batch is None or _batch(o) == batch)
        ]
        return float(pd.Series(errors).median()) if errors else float("nan")


def _batch(o: Observation) -> int:
    return int(o.decode_seqs) if o.phase == "decode" else round(o.prefill_tokens / o.prompt_tokens)


def evidence(table: pd.DataFrame) -> list[Evidence]:
    """Fit every setup in the table, holding out its largest prompt and its largest batch."""
    out = []
    for (model, hardware, tp), rows in plausible(table).groupby(["model", "hardware", "tensor_parallel"]):
        obs = observations(rows, int(table.prompt_size.max()), int(table.batch_size.max()))
        linear = fit_step_model([o.without_attention() for o in obs], roofline=False)
        out.append(Evidence(Setup(str(model), str(hardware), int(str(tp))), obs, fit_step_model(obs), linear))
    return out
