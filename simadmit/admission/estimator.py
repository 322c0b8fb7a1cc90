"""CostEstimator: predicted GPU-seconds of a request, from what the gateway sees before it runs.

The gateway knows the prompt length and the client's `max_tokens`, never the true output length, so the
plain estimate is an upper bound on decode work. It only needs to order requests correctly, but its absolute
size sets how much work a GPU-seconds budget lets in: clients that ask for 512 tokens and get 150 make the
pool look three times as busy as it is. `OutputLearner` lets a gateway charge what it has seen requests of a
tier really produce (it proxies the streamed tokens, so it knows), capped at max_tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simadmit.config.profile import Profile


@dataclass(frozen=True, slots=True)
class CostEstimator:
    """GPU-seconds = prompt / prefill rate + max_tokens / decode rate (rates per GPU at saturation)."""

    prefill_tokens_per_gpu_s: float
    decode_tokens_per_gpu_s: float

    @classmethod
    def from_profile(cls, profile: Profile) -> CostEstimator:
        return cls(profile.prefill_tokens_per_gpu_s, profile.decode_tokens_per_gpu_s)

    def estimate(self, prompt_tokens: int, max_tokens: float) -> float:
        """Predicted GPU-seconds of one request (output charged at `max_tokens`, or a learned expectation)."""
        return prompt_tokens / self.prefill_tokens_per_gpu_s + max_tokens / self.decode_tokens_per_gpu_s

    def estimate_many(self, prompt_tokens: np.ndarray, max_tokens: np.ndarray) -> np.ndarray:
        """Vectorised `estimate`, for a whole workload at once."""
        return prompt_tokens / self.prefill_tokens_per_gpu_s + max_tokens / self.decode_tokens_per_gpu_s


class OutputLearner:
    """Running mean of the output tokens completed requests produced, per tier (shared with a live gateway).

    Until a tier has `warmup` completions it charges the full `max_tokens`, so a cold gateway is cautious.
    """

    def __init__(self, warmup: int = 20) -> None:
        self.warmup = warmup
        self.count: dict[str, int] = {}
        self.total: dict[str, float] = {}

    def observe(self, tier: str, output_tokens: int) -> None:
        self.count[tier] = self.count.get(tier, 0) + 1
        self.total[tier] = self.total.get(tier, 0.0) + output_tokens

    def expected_output(self, tier: str, max_tokens: int) -> float:
        n = self.count.get(tier, 0)
        if n < self.warmup:
            return float(max_tokens)
        return min(float(max_tokens), self.total[tier] / n)
