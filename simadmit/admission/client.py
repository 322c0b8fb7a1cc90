"""Client behaviour on a 429: exponential backoff with jitter, honouring the server's Retry-After.

The jitter kinds follow the usual catalogue (AWS architecture blog, "Exponential Backoff And Jitter"):
none, full, equal and decorrelated. A retry budget, as in Finagle and gRPC, caps retries at a fraction of
first attempts so that a rejection storm cannot multiply the load.
"""

from __future__ import annotations

from simadmit.sim.world import ClientConfig


def backoff_delay(retry: int, retry_after_s: float, previous_wait_s: float, cfg: ClientConfig, u: float) -> float:
    """Seconds to wait before retry number `retry` (1-based), given a uniform draw `u` in [0, 1).

    The backoff part grows as `min(cap, base * 2**(retry-1))` and is jittered as configured (decorrelated
    jitter instead draws from [base, 3 x the previous backoff]); it is added on top of the Retry-After the
    gateway asked for when the client honours it.
    """
    span = min(cfg.backoff_cap_s, cfg.backoff_base_s * 2.0 ** (retry - 1))
    if cfg.jitter == "full":
        wait = span * u
    elif cfg.jitter == "equal":
        wait = span / 2 + span / 2 * u
    elif cfg.jitter == "decorrelated":
        low = cfg.backoff_base_s
        high = max(low, 3 * (previous_wait_s or low))
        wait = min(cfg.backoff_cap_s, low + (high - low) * u)
    else:
        wait = span
    return (retry_after_s if cfg.honor_retry_after else 0.0) + wait


class RetryBudget:
    """Token bucket: each first attempt deposits `ratio` tokens (up to `burst`); each retry spends one."""

    def __init__(self, ratio: float, burst: float) -> None:
        self.ratio = ratio
        self.burst = burst
        self.tokens = burst

    def deposit(self) -> None:
        self.tokens = min(self.burst, self.tokens + self.ratio)

    def withdraw(self) -> bool:
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False
