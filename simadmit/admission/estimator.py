"""CostEstimator: predicted GPU-seconds of a request, from what the gateway sees before it runs.

The gateway knows the prompt length and the client's `max_tokens`, never the true output length, so the
plain estimate is an upper bound on decode work. It only needs to order requests correctly, but its absolute
size sets how much work a GPU-seconds budget lets in: clients that ask for 512 tokens and get 150 make the
pool look three times as busy as it is. `OutputLearner` lets a gateway charge what it has seen requests of a
tier really produce (it proxies the streamed tokens, so it knows), capped at max_tokens.
"""

from __future__ import annotations

import math
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

    def done(self, estimate_gpu_s: float, prompt_tokens: int, output_tokens: float) -> float:
        """GPU-seconds of a request's charge already worked off once its first token is out: its prefill
        and the `output_tokens` decoded so far, at these rates, never more than it was charged. What remains
        of in-flight work (`work: remaining`) is the charge less this, in the simulator and the live gateway."""
        return min(
            estimate_gpu_s,
            prompt_tokens / self.prefill_tokens_per_gpu_s + output_tokens / self.decode_tokens_per_gpu_s,
        )

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


class RatioEwma:
    """Online correction of a prediction, per key: exponentially weighted means of what was predicted and of
    what then happened, and their ratio as the factor to multiply the next prediction by.

    A ratio of means (not a mean of ratios) so that tiny predictions do not dominate. After a step change
    the factor moves a fraction `alpha` of the way per observation: after n observations the old regime
    weighs (1 - alpha)^n. Until `warmup` observations the factor is 1; it is clamped to [low, high] so one
    odd stretch cannot switch admission off or on entirely.

    With `forget_s`, evidence also ages: a factor `f` last observed or `renew`ed `t` > `forget_s` seconds ago
    is 1 + (f - 1) x exp(-(t - forget_s) / forget_s), and stays so once renewed. A correction that makes a
    policy refuse everything gets no new observations; without forgetting it would keep refusing for ever,
    whatever the pool does meanwhile.
    """

    def __init__(
        self,
        alpha: float = 0.05,
        warmup: int = 20,
        low: float = 0.25,
        high: float = 4.0,
        forget_s: float | None = None,
    ) -> None:
        self.alpha = alpha
        self.warmup = warmup
        self.low = low
        self.high = high
        self.forget_s = forget_s
        self.count: dict[str, int] = {}
        self.predicted: dict[str, float] = {}
        self.actual: dict[str, float] = {}
        self.last: dict[str, float] = {}  # when each key was last observed

    def observe(self, key: str, predicted: float, actual: float, now: float = 0.0) -> None:
        self._age(key, now)
        n = self.count.get(key, 0) + 1
        self.count[key] = n
        a = max(self.alpha, 1.0 / n)  # a plain mean until 1/n falls below alpha: no bias towards zero
        self.predicted[key] = self.predicted.get(key, 0.0) * (1 - a) + predicted * a
        self.actual[key] = self.actual.get(key, 0.0) * (1 - a) + actual * a

    def renew(self, key: str, now: float) -> None:
        """The factor of `key` is in use at `now` (it let something through): it ages no further from here."""
        self._age(key, now)

    def _age(self, key: str, now: float) -> None:
        """Fold the ageing since the last observation or renewal into the means, and restart its clock."""
        if self.forget_s is not None and key in self.last and self.predicted.get(key, 0.0) > 0:
            ratio = self.actual[key] / self.predicted[key]
            self.actual[key] = self.predicted[key] * (1.0 + (ratio - 1.0) * self._kept(key, now))
        self.last[key] = now

    def factor(self, key: str, now: float | None = None) -> float:
        if self.count.get(key, 0) < self.warmup or self.predicted[key] <= 0:
            return 1.0
        ratio = self.actual[key] / self.predicted[key]
        if self.forget_s is not None and now is not None:
            ratio = 1.0 + (ratio - 1.0) * self._kept(key, now)
        return min(self.high, max(self.low, ratio))

    def _kept(self, key: str, now: float) -> float:
        """The share of the evidence on `key` still kept at `now`: all of it for `forget_s` seconds."""
        assert self.forget_s is not None
        return math.exp(-max(0.0, now - self.last[key] - self.forget_s) / self.forget_s)


class CostCorrection:
    """Charges each request `estimate x factor(tier)`, the factor an EWMA of true over predicted cost.

    A proxying gateway counts the tokens it streams, so at completion it knows what the request really cost
    at the profile's rates; the correction follows a shift in output lengths within ~1/alpha completions.
    """

    def __init__(self, alpha: float = 0.05, warmup: int = 20) -> None:
        self.ratio = RatioEwma(alpha, warmup, low=0.0, high=1.0)  # never above the max_tokens bound

    def charge(self, tier: str, estimate_gpu_s: float) -> float:
        return estimate_gpu_s * self.ratio.factor(tier)

    def observe(self, tier: str, predicted_gpu_s: float, actual_gpu_s: float) -> None:
        self.ratio.observe(tier, predicted_gpu_s, actual_gpu_s)


class OutputQuantile:
    """The q-quantile of the last `window` outputs of each tier (capped at max_tokens): a cautious learned
    charge between the mean and max_tokens. `max_tokens` until `warmup` completions."""

    def __init__(self, q: float = 0.9, window: int = 512, warmup: int = 20) -> None:
        self.q = q
        self.window = window
        self.warmup = warmup
        self.seen: dict[str, list[int]] = {}
        self.next: dict[str, int] = {}

    def observe(self, tier: str, output_tokens: int) -> None:
        seen = self.seen.setdefault(tier, [])
        if len(seen) < self.window:
            seen.append(output_tokens)
        else:  # ring buffer: the oldest goes
            i = self.next.get(tier, 0)
            seen[i] = output_tokens
            self.next[tier] = (i + 1) % self.window

    def expected_output(self, tier: str, max_tokens: int) -> float:
        seen = self.seen.get(tier, [])
        if len(seen) < self.warmup:
            return float(max_tokens)
        return min(float(max_tokens), float(np.quantile(seen, self.q)))


def output_learning(mode: str) -> tuple[OutputLearner | OutputQuantile | None, CostCorrection | None]:
    """What one gateway learns from the answers it streams under `gateway.estimate_output`: the output
    lengths it charges (`learned`: their mean, `quantile`: their 90th percentile) or a correction of its
    charges (`ewma`); nothing for `max_tokens` and `oracle` (charged from the request itself)."""
    learner = {"learned": OutputLearner, "quantile": OutputQuantile}.get(mode)
    return (learner() if learner else None), (CostCorrection() if mode == "ewma" else None)
