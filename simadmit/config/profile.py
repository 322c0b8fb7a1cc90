"""Calibration profile: the engine's cost model for one model on one GPU type and parallelism.

This YAML file is the contract between `simadmit calibrate` (which writes it from measurements) and the
simulator (which reads it). One engine iteration (a "step") lasts

    overhead_s + max(weights_read_s, per_prefill_token_s * prefill tokens + per_decode_seq_s * decode sequences)
               + per_context_token_s * context tokens held by the scheduled sequences
               + per_prefill_attention_s * (prompt token, context token) pairs of the prefill chunks

a roofline per part: the linear layers of a step that carries few tokens are bound by reading the weights
from memory (`weights_read_s`), of one that carries many by their arithmetic; attention (reading the KV cache
in decode, the quadratic pairs in prefill) adds to either. The summary figures (prefill and decode tokens per
GPU-second) feed the admission `CostEstimator`. What one request costs alone on an idle replica is
`solo_service_s`, the one place that prices it. `api_latency_s` is what a request spends outside the engine
(the API server taking it in, its tokens' way out): it lengthens every TTFT and end-to-end latency a client
sees and takes no engine time.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml
from pydantic import Field, ValidationError, model_validator

from simadmit.config.errors import InputError, another_kind, problem, pydantic_problems, read_mapping
from simadmit.config.schema import ScenarioSpec
from simadmit.config.workload_schema import MAX_GPUS_PER_REPLICA, MAX_SECONDS, MAX_TOKENS, Spec


class _StepTimeModel(Spec):
    overhead_s: float = Field(ge=0, description="fixed cost of one engine iteration")
    per_prefill_token_s: float = Field(ge=0, description="cost of each prompt token computed in the step")
    per_decode_seq_s: float = Field(ge=0, description="cost of each sequence decoding one token in the step")
    per_context_token_s: float = Field(ge=0, description="cost of each KV token held by scheduled sequences")
    per_prefill_attention_s: float = Field(
        default=0.0,
        ge=0,
        description="cost of each (prompt token computed, context token it attends to) pair: prefill's quadratic part",
    )
    weights_read_s: float = Field(
        default=0.0,
        ge=0,
        description="least time of a step's linear layers: reading the weights once (a small batch is memory-bound)",
    )


class _EngineLimits(Spec):
    max_num_seqs: int = Field(gt=0, description="most sequences in one batch (vLLM --max-num-seqs)")
    max_num_batched_tokens: int = Field(
        gt=0, description="token budget of one step (vLLM default 8192 on H100)"
    )
    max_model_len: int = Field(gt=0, le=MAX_TOKENS, description="longest prompt + output the server accepts")


class _Summary(Spec):
    prefill_tokens_per_gpu_s: float = Field(gt=0, description="prompt tokens per GPU-second at saturation")
    decode_tokens_per_gpu_s: float = Field(gt=0, description="output tokens per GPU-second at full batch")


class _ProfileFile(Spec):
    model: str
    gpu: str
    gpus_per_replica: int = Field(
        default=1, gt=0, le=MAX_GPUS_PER_REPLICA, description="GPUs one replica spans (tensor x pipeline)"
    )
    tensor_parallel: int = Field(default=1, gt=0, le=MAX_GPUS_PER_REPLICA)
    source: str = Field(default="", description="where the numbers come from")
    step_time: _StepTimeModel
    kv_capacity_tokens: int = Field(gt=0, description="KV-cache capacity of one replica, in tokens")
    kv_block_size: int = Field(
        default=16,
        gt=0,
        le=2**16,
        description="tokens per KV-cache block (vLLM: 16; hybrid models a few hundred)",
    )
    api_latency_s: float = Field(
        default=0.0,
        ge=0,
        le=MAX_SECONDS,
        description="seconds a request spends outside the engine (API server in and out): added to what a "
        "client sees of its TTFT and end-to-end latency, no engine time",
    )
    engine: _EngineLimits
    summary: _Summary
    fit: dict[str, object] = Field(default_factory=dict, description="fit quality reported by calibrate")
    warnings: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _holds_a_block(self) -> _ProfileFile:
        """A KV cache with no block for a sequence holds no request: every one would be answered 400."""
        if found := kv_cache_problem(self.kv_capacity_tokens, self.kv_block_size):
            raise ValueError(f"kv_capacity_tokens {found}")
        return self


def sequence_kv_blocks(kv_capacity_tokens: int, kv_block_size: int) -> int:
    """The KV blocks a replica hands to sequences: its whole blocks less the one vLLM's block pool keeps back
    as its null block (a placeholder never handed out), so a burst that fills the cache preempts a block
    sooner (17 preemptions measured, and simulated, in a burst where a cache one block larger had 16)."""
    return kv_capacity_tokens // kv_block_size - 1


def kv_cache_problem(kv_capacity_tokens: int, kv_block_size: int) -> str | None:
    """What is wrong with a KV cache of this size, said after its field's name: none when it holds a block
    for a sequence."""
    if sequence_kv_blocks(kv_capacity_tokens, kv_block_size) >= 1:
        return None
    return (
        f"{kv_capacity_tokens:,} tokens hold no KV block for a sequence (blocks of {kv_block_size} tokens, and "
        "vLLM keeps one back as its null block): the engine could hold no request"
    )


PROFILE_FIELDS = frozenset(_ProfileFile.model_fields)  # the top-level keys of a profile file


@dataclass(frozen=True, slots=True)
class StepTimeModel:
    """Cost of one engine iteration, in seconds: a fixed overhead, the linear layers (the tokens they carry,
    but never less than reading the weights once: `weights_read_s`), and attention.

    A prefill chunk of c tokens starting at offset o attends to c*o + c*(c+1)/2 (token, context) pairs
    (`prefill_attention_pairs`); that term is what makes a long prompt cost more than linearly.
    """

    overhead_s: float
    per_prefill_token_s: float
    per_decode_seq_s: float
    per_context_token_s: float
    per_prefill_attention_s: float = 0.0
    weights_read_s: float = 0.0

    def arithmetic_s(self, prefill_tokens: float, decode_seqs: float) -> float:
        """The arithmetic of the step's matrix products on the tokens it carries."""
        return self.per_prefill_token_s * prefill_tokens + self.per_decode_seq_s * decode_seqs

    def linear_layers_s(self, prefill_tokens: float, decode_seqs: float) -> float:
        """The step's matrix products: their arithmetic, or the weights' read if that takes longer."""
        return max(self.weights_read_s, self.arithmetic_s(prefill_tokens, decode_seqs))

    def step_time(
        self, prefill_tokens: float, decode_seqs: float, context_tokens: float, attention_pairs: float = 0.0
    ) -> float:
        """Duration of one step that computes these prefill tokens and decodes these sequences."""
        return (
            self.overhead_s
            + self.linear_layers_s(prefill_tokens, decode_seqs)
            + self.per_context_token_s * context_tokens
            + self.per_prefill_attention_s * attention_pairs
        )

    def fastest_s(self, prompt_tokens: float, output_tokens: float) -> float:
        """A lower bound on one request's service: its prompt in one step, then each further output token at
        the emptiest decode step, context and attention left out. Only what cannot make it even so is late."""
        return self.step_time(prompt_tokens, 0, 0) + max(0.0, output_tokens - 1) * self.step_time(0, 1, 0)


def prefill_attention_pairs(chunk: int, offset: int) -> float:
    """(token, context) pairs a prefill chunk of `chunk` tokens at `offset` computes attention over."""
    return chunk * offset + chunk * (chunk + 1) / 2


def prefill_chunks(prompt_tokens: int, token_budget: int) -> list[tuple[int, int]]:
    """(chunk, offset) of each step that prefills a lone prompt, as the engine chunks it at the token budget."""
    return [
        (min(token_budget, prompt_tokens - offset), offset)
        for offset in range(0, max(1, prompt_tokens), token_budget)
    ]


def solo_service_s(
    step: StepTimeModel, token_budget: int, prompt_tokens: int, output_tokens: int = 1
) -> float:
    """Seconds one request takes alone on an idle replica, as the engine simulates it: its prompt prefilled in
    chunks of at most `token_budget` tokens, each holding the context computed so far and attending to it
    (quadratic in a long prompt), the first token at the end of the last chunk (`output_tokens` 1: its TTFT);
    then output - 1 decode steps of one sequence holding its prompt and the tokens produced so far."""
    prefill = sum(
        step.step_time(chunk, 0, offset + chunk, prefill_attention_pairs(chunk, offset))
        for chunk, offset in prefill_chunks(prompt_tokens, token_budget)
    )
    decodes = max(0, output_tokens - 1)
    return (
        prefill
        + decodes * step.step_time(0, 1, prompt_tokens)
        + step.per_context_token_s * decodes * (decodes + 1) / 2
    )


@dataclass(frozen=True, slots=True)
class EngineLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


@dataclass(frozen=True, slots=True)
class Profile:
    """A calibrated cost model for one model on one GPU type and parallelism (see module docstring)."""

    model: str
    gpu: str
    step_time: StepTimeModel
    kv_capacity_tokens: int
    engine: EngineLimits
    prefill_tokens_per_gpu_s: float
    decode_tokens_per_gpu_s: float
    gpus_per_replica: int = 1
    tensor_parallel: int = 1
    kv_block_size: int = 16
    api_latency_s: float = 0.0
    source: str = ""
    fit: dict[str, object] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, object]:
        """The YAML layout of this profile (inverse of `load_profile`)."""
        d = asdict(self)
        return {
            "model": self.model,
            "gpu": self.gpu,
            "gpus_per_replica": self.gpus_per_replica,
            "tensor_parallel": self.tensor_parallel,
            "source": self.source,
            "step_time": d["step_time"],
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "kv_block_size": self.kv_block_size,
            "api_latency_s": self.api_latency_s,
            "engine": d["engine"],
            "summary": {
                "prefill_tokens_per_gpu_s": self.prefill_tokens_per_gpu_s,
                "decode_tokens_per_gpu_s": self.decode_tokens_per_gpu_s,
            },
            "fit": dict(self.fit),
            "warnings": list(self.warnings),
        }


def summary_figures(
    step: StepTimeModel, limits: EngineLimits, kv_capacity_tokens: int, gpus: int, ref_context: int = 1024
) -> tuple[float, float]:
    """Prefill and decode tokens per GPU-second implied by a step model.

    Prefill: one prompt that fills the token budget (or the context, if shorter), alone: one full step with
    its attention (`solo_service_s`). Decode: the largest batch that fits both `max_num_seqs` and the KV
    cache with `ref_context` tokens per sequence.
    """
    budget = limits.max_num_batched_tokens
    prompt = min(budget, limits.max_model_len - 1)
    batch = max(1, min(limits.max_num_seqs, kv_capacity_tokens // max(1, ref_context)))
    prefill_s = solo_service_s(step, budget, prompt)
    decode_s = step.step_time(0, batch, batch * ref_context)
    free = math.inf  # a step model that makes the step take no time: a profile refuses it (`gt=0`, finite)
    prefill = prompt / prefill_s / gpus if prefill_s > 0 else free
    decode = batch / decode_s / gpus if decode_s > 0 else free
    return prefill, decode


def profile_from_dict(data: object, source: str | Path | None = None) -> Profile:
    """Validate a parsed profile document; raise `InputError` naming the file and each bad field."""
    try:
        p = _ProfileFile.model_validate(data)
    except ValidationError as e:
        scenario = ScenarioSpec.model_fields
        kind = another_kind(source, data, PROFILE_FIELDS, "calibration profile", scenario, "a scenario")
        raise InputError(kind or pydantic_problems(source, e, document=data)) from None
    if p.engine.max_num_batched_tokens < p.engine.max_num_seqs:
        raise InputError(
            [
                problem(
                    source,
                    "engine.max_num_batched_tokens",
                    "must be at least engine.max_num_seqs (as in vLLM)",
                )
            ]
        )
    if p.gpus_per_replica % p.tensor_parallel:
        why = f"must divide gpus_per_replica ({p.gpus_per_replica}): a replica spans tensor x pipeline GPUs"
        raise InputError([problem(source, "tensor_parallel", why)])
    step = StepTimeModel(**p.step_time.model_dump())
    longest = _longest_request_s(step, p.engine)
    if longest <= 0:  # every coefficient 0: each request would be served at once, whatever the load
        why = (
            "every coefficient is 0: a step would take no time (they are seconds per step, token or sequence)"
        )
        raise InputError([problem(source, "step_time", why)])
    if not longest <= MAX_SECONDS:
        raise InputError(
            [
                problem(
                    source,
                    "step_time",
                    f"one request filling the context (engine.max_model_len, {p.engine.max_model_len} tokens) "
                    f"would take {longest:.3g} s alone on an idle replica: at most {MAX_SECONDS:g} s (a "
                    "coefficient is far too large: they are seconds per step, token or sequence)",
                )
            ]
        )
    return Profile(
        model=p.model,
        gpu=p.gpu,
        step_time=step,
        kv_capacity_tokens=p.kv_capacity_tokens,
        engine=EngineLimits(**p.engine.model_dump()),
        prefill_tokens_per_gpu_s=p.summary.prefill_tokens_per_gpu_s,
        decode_tokens_per_gpu_s=p.summary.decode_tokens_per_gpu_s,
        gpus_per_replica=p.gpus_per_replica,
        tensor_parallel=p.tensor_parallel,
        kv_block_size=p.kv_block_size,
        api_latency_s=p.api_latency_s,
        source=p.source,
        fit=dict(p.fit),
        warnings=tuple(p.warnings),
    )


def _longest_request_s(step: StepTimeModel, limits: _EngineLimits) -> float:
    """The longer of the two requests that fill the context alone: all prompt, or one token then all output."""
    budget, context = limits.max_num_batched_tokens, limits.max_model_len
    return max(solo_service_s(step, budget, context), solo_service_s(step, budget, 1, context - 1))


def load_profile(path: str | Path) -> Profile:
    """Read and validate a calibration profile YAML file."""
    path = Path(path)
    data = read_mapping(path, "calibration profile")
    return profile_from_dict(data, path)


def save_profile(profile: Profile, path: str | Path, header: str = "") -> None:
    """Write a profile as YAML, with an optional comment header (e.g. fit warnings)."""
    text = yaml.safe_dump(profile.to_dict(), sort_keys=False)
    lines = [f"# {line}" for line in header.splitlines()]
    lines += [f"# WARNING: {w}" for w in profile.warnings]
    Path(path).write_text(("\n".join(lines) + "\n" if lines else "") + text)
