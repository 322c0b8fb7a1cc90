"""What a gateway sees of one engine replica: the figures a vLLM metrics endpoint (and a proxy counting the
prompts it forwarded) publishes, and what the gateway itself sent there since it last polled.

An engine-aware policy predicts a request's time to first token from these: free batch slots, KV-cache use,
and the prompt tokens still to prefill ahead of it. Plain data, no simulator imports.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from simadmit.config.profile import Profile, StepTimeModel, prefill_attention_pairs


@dataclass(slots=True)
class ReplicaLoad:
    """One serving replica's load at its last poll, advanced by this gateway's own sends since."""

    running: int = 0  # sequences in the batch (prefilling or decoding): vllm:num_requests_running
    waiting: int = 0  # sent to it, not yet scheduled: vllm:num_requests_waiting
    prefill_tokens: int = 0  # prompt tokens sent to it whose first token has not come yet
    prefill_pairs: float = 0.0  # their prefill attention pairs, sum of p * (p + 1) / 2
    kv_used: int = 0  # KV-cache tokens held: vllm:kv_cache_usage_perc x capacity
    kv_capacity: int = 0
    max_seqs: int = 0  # batch slots (--max-num-seqs)
    work_gpu_s: float = 0.0  # GPU-seconds charged to it and unfinished: what least-work routing compares
    prompt_tokens_total: int = 0  # prompt tokens prefilled since it started: vllm:prompt_tokens_total
    prefill_rate_tps: float = 0.0  # the gateway's smoothed rate of that counter, tokens per second
    polled_at: float = 0.0  # when these metrics were read
    # under priority scheduling: priority -> (requests waiting, their prompt tokens, their prefill pairs)
    waiting_by_priority: dict[int, tuple[int, int, float]] = field(default_factory=dict)
    # decode steps each sequence in the batch still has to run, shortest first, when the gateway knows the
    # true output lengths (a study's oracle); empty when it does not (a real gateway: only their mean)
    remaining_steps: tuple[int, ...] = ()

    @property
    def kv_used_fraction(self) -> float:
        return self.kv_used / self.kv_capacity if self.kv_capacity else 0.0

    def add(self, prompt_tokens: int, estimate_gpu_s: float, priority: int | None = None) -> None:
        """This gateway sent a request of `prompt_tokens` here: count it until the next poll says otherwise
        (by its `priority` too, when the replica schedules by priority)."""
        pairs = prompt_attention_pairs(prompt_tokens)
        self.waiting += 1
        self.prefill_tokens += prompt_tokens
        self.prefill_pairs += pairs
        self.work_gpu_s += estimate_gpu_s
        if priority is not None:
            n, tokens, p = self.waiting_by_priority.get(priority, (0, 0, 0.0))
            self.waiting_by_priority[priority] = (n + 1, tokens + prompt_tokens, p + pairs)


def ahead_of(load: ReplicaLoad, priority: int) -> ReplicaLoad:
    """The load a request of `priority` waits behind under priority scheduling: all of it but the waiting
    requests of lower priority (a higher number), which it overtakes. Later arrivals of higher priority
    that will overtake it are unknown at decision time, so left out."""
    n = tokens = 0
    pairs = 0.0
    for level, (count, prompt, p) in load.waiting_by_priority.items():
        if level > priority:
            n += count
            tokens += prompt
            pairs += p
    if not n:
        return load
    return replace(
        load,
        waiting=max(0, load.waiting - n),
        prefill_tokens=max(0, load.prefill_tokens - tokens),
        prefill_pairs=max(0.0, load.prefill_pairs - pairs),
    )


def prompt_attention_pairs(prompt_tokens: int) -> float:
    """Attention pairs of a whole prompt's prefill, however it is chunked."""
    return prefill_attention_pairs(prompt_tokens, 0)


def least_work(replicas: list[ReplicaLoad]) -> int:
    """Index of the replica least-work routing picks (the first of equals)."""
    best = 0
    for i in range(1, len(replicas)):
        if replicas[i].work_gpu_s < replicas[best].work_gpu_s:
            best = i
    return best


@dataclass(frozen=True, slots=True)
class EngineModel:
    """What a gateway knows of a pool's engines: the profile's step-time model, the token budget and, when
    they schedule by priority, each tier's priority (`priorities`; None: FCFS).

    `ttft` simulates a replica forward in closed form: the prompt tokens ahead of a new request (FCFS) and
    its own are prefilled in chunks of what the decoding batch leaves of the token budget, each step lasting
    the step model's time; if no batch slot or not enough KV cache is free, it first waits for finishes,
    which a full batch of `d` sequences of mean output `m` produces at `d / m` per step (renewal rate), or,
    when the load carries the running sequences' remaining steps, after the k-th shortest of them; each step
    slowed by the prefill chunks it carries (`decode_step`).
    """

    step: StepTimeModel
    max_num_batched_tokens: int
    priorities: Mapping[str, int] | None = None
    api_latency_s: float = 0.0  # the profile's: part of every TTFT a client sees, no engine time

    @classmethod
    def of(
        cls, profile: Profile, max_num_batched_tokens: int, priorities: Mapping[str, int] | None
    ) -> EngineModel:
        """The model a gateway predicts a pool's engines with, from the profile it believes."""
        return cls(profile.step_time, max_num_batched_tokens, priorities, profile.api_latency_s)

    def priority(self, tier: str) -> int | None:
        """The priority a request of `tier` carries, or None when the engines serve FCFS."""
        return None if self.priorities is None else self.priorities.get(tier, 0)

    def decode_step(self, load: ReplicaLoad, prompt_tokens: int) -> float:
        """Predicted seconds per output token once a request of `prompt_tokens` joins the batch of `load`:
        the step time with every running and waiting sequence decoding (up to the batch slots), stretched
        by the share of each step that prefill chunks take at the replica's recent prefill rate (chunked
        prefill shares the steps with decodes: at saturation most of each step is prefill). The prompts
        queued now are ahead of the request (FCFS): they delay its first token, not its decode."""
        s = self.step
        batch = load.running + load.waiting + 1
        if load.max_seqs:
            batch = min(batch, load.max_seqs)
        context = load.kv_used + load.prefill_tokens + prompt_tokens
        if load.kv_capacity:
            context = min(context, load.kv_capacity)
        decode = s.step_time(0, batch, context)
        prefill_share = min(0.95, (s.per_prefill_token_s + s.per_context_token_s) * load.prefill_rate_tps)
        return decode / (1.0 - prefill_share)

    def ttft(
        self, load: ReplicaLoad, prompt_tokens: int, mean_output: float, tier: str | None = None
    ) -> float:
        """Predicted seconds from now to the first token of a request of `prompt_tokens` (of `tier`) sent to
        `load`, as its client sees it (the API server's latency included): under priority scheduling it
        waits only behind the work of its priority or higher."""
        level = None if tier is None else self.priority(tier)
        if level is not None:
            load = ahead_of(load, level)
        s = self.step
        decoding = load.running
        per_step = max(1, self.max_num_batched_tokens - decoding)
        decode_step = s.step_time(0, decoding, load.kv_used)
        # the step in progress carries the head of the prompt queue and is, on average, half done
        chunk = min(per_step, load.prefill_tokens)
        t = 0.0
        if decoding or load.waiting:
            t = (decode_step + (s.per_prefill_token_s + s.per_context_token_s) * chunk) / 2
        tokens = load.prefill_tokens - chunk + prompt_tokens
        steps = max(1, math.ceil(tokens / per_step))
        t += (
            steps * decode_step
            + s.per_prefill_token_s * tokens
            + s.per_context_token_s * tokens * (steps + 1) / 2  # the prompts' KV, held as it fills
            + s.per_prefill_attention_s * (load.prefill_pairs + prompt_attention_pairs(prompt_tokens))
        )
        t += self.api_latency_s
        tokens += chunk
        if not decoding:
            return t
        # steps until a slot frees: finishes come at decoding / mean_output per step (renewal rate), or,
        # when the running sequences' remaining lengths are known, with the k-th shortest of them (no later:
        # sequences joining meanwhile can only bring a finish forward)
        finishes = load.running + load.waiting + 1 - load.max_seqs if load.max_seqs else 0
        wait_steps = max(0.0, finishes * mean_output / decoding)
        known = load.remaining_steps
        if finishes > 0 and known:
            k = min(finishes, len(known))
            wait_steps = known[k - 1] + (finishes - k) * mean_output / decoding
        kv_short = load.kv_used + tokens - load.kv_capacity if load.kv_capacity else 0
        if kv_short > 0:  # KV frees at kv_used / mean_output per step, while decoders grow it by one each
            freed = load.kv_used / mean_output - decoding
            wait_steps = max(wait_steps, kv_short / freed if freed > 0 else math.inf)
        if wait_steps > 0:  # the steps until then also carry the prompts queued beyond the next step
            batch = min(load.running + load.waiting, load.max_seqs) if load.max_seqs else decoding
            chunk = min(max(0, self.max_num_batched_tokens - batch), max(0, load.prefill_tokens - per_step))
            step = decode_step + (s.per_prefill_token_s + s.per_context_token_s) * chunk
            t += wait_steps * max(step, self.decode_step(load, 0))
        return t
