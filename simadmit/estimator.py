"""CostEstimator: predicted GPU-seconds of a request, from what the gateway sees before it runs.

The gateway knows the prompt length and the client's `max_tokens`, never the true output length, so the
estimate is an upper bound on decode work. It only needs to order requests correctly; its error against the
true cost is reported as a metric of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simadmit.profile import Profile


@dataclass(frozen=True, slots=True)
class CostEstimator:
    """GPU-seconds = prompt / prefill rate + max_tokens / decode rate (rates per GPU at saturation)."""

    prefill_tokens_per_gpu_s: float
    decode_tokens_per_gpu_s: float

    @classmethod
    def from_profile(cls, profile: Profile) -> CostEstimator:
        return cls(profile.prefill_tokens_per_gpu_s, profile.decode_tokens_per_gpu_s)

    def estimate(self, prompt_tokens: int, max_tokens: int) -> float:
        """Predicted GPU-seconds of one request."""
        return prompt_tokens / self.prefill_tokens_per_gpu_s + max_tokens / self.decode_tokens_per_gpu_s

    def estimate_many(self, prompt_tokens: np.ndarray, max_tokens: np.ndarray) -> np.ndarray:
        """Vectorised `estimate`, for a whole workload at once."""
        return prompt_tokens / self.prefill_tokens_per_gpu_s + max_tokens / self.decode_tokens_per_gpu_s
