"""Client behaviour on a 429: exponential backoff with jitter, honouring the server's Retry-After.

`Client` is the retry state machine of a population of clients, as plain Python that a simulator and a
load generator drive alike: after each rejection it says how long to wait before the next attempt, or that
the client gives up (retries exhausted, the answer would come after the deadline, or the retry budget is
spent). The jitter kinds follow the usual catalogue (AWS architecture blog, "Exponential Backoff And
Jitter"): none, full, equal and decorrelated. A retry budget, as in Finagle and gRPC, caps retries at a
fraction of first attempts so that a rejection storm cannot multiply the load.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ClientConfig:
    max_retries: int
    honor_retry_after: bool
    backoff_base_s: float
    backoff_cap_s: float
    jitter: str  # none | full | equal | decorrelated
    abandon_after_s: float | None  # give up without a first token this long after arriving
    retry_budget_ratio: float | None = None
    retry_budget_burst: float = 10.0


def backoff_delay(
    retry: int, retry_after_s: float, previous_wait_s: float, cfg: ClientConfig, u: float
) -> float:
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


class Client:
    """What clients do between attempts. `draw` gives the uniform jitter draws (a seeded stream).

    Call `attempt` before each attempt; after a 429 call `after_rejection`, which returns the delay before
    the next attempt or None when the client gives up; call `forget` once a request is over.
    """

    def __init__(self, cfg: ClientConfig, draw: Callable[[], float]) -> None:
        self.cfg = cfg
        self.draw = draw
        self.budget = (
            RetryBudget(cfg.retry_budget_ratio, cfg.retry_budget_burst) if cfg.retry_budget_ratio else None
        )
        self.backoff: dict[int, float] = {}  # backoff part of each retrying request's last wait

    def attempt(self, tries: int) -> None:
        """Attempt number `tries` (1-based) is being sent: a first attempt earns retry budget."""
        if tries == 1 and self.budget is not None:
            self.budget.deposit()

    def after_rejection(
        self, rid: int, tries: int, retry_after_s: float, now: float, deadline_s: float
    ) -> float | None:
        """Seconds until the next attempt of request `rid` after its `tries`-th attempt was rejected, or None
        when the client gives up: retries exhausted, the answer would come too late to matter (past the
        absolute `deadline_s`), or the retry budget is spent."""
        cfg = self.cfg
        if tries > cfg.max_retries:
            return None
        delay = backoff_delay(tries, retry_after_s, self.backoff.get(rid, 0.0), cfg, float(self.draw()))
        if now + delay > deadline_s or (self.budget is not None and not self.budget.withdraw()):
            return None
        self.backoff[rid] = delay - (retry_after_s if cfg.honor_retry_after else 0.0)
        return delay

    def abandons_at(self, arrival_s: float) -> float | None:
        """When a client that arrived at `arrival_s` gives up waiting for its first token (None: never)."""
        a = self.cfg.abandon_after_s
        return None if a is None else arrival_s + a

    def forget(self, rid: int) -> None:
        self.backoff.pop(rid, None)
