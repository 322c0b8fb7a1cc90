"""Client behaviour on a 429: exponential backoff with jitter, honouring the server's Retry-After."""

from __future__ import annotations

from simadmit.world import ClientConfig


def backoff_delay(retry: int, retry_after_s: float, cfg: ClientConfig, u: float) -> float:
    """Seconds to wait before retry number `retry` (1-based), given a uniform draw `u` in [0, 1).

    Exponential backoff `min(cap, base * 2**(retry-1))`, with full jitter (uniform over that span) or none,
    added on top of the Retry-After the gateway asked for, when the client honours it.
    """
    span = min(cfg.backoff_cap_s, cfg.backoff_base_s * 2.0 ** (retry - 1))
    wait = span * u if cfg.jitter == "full" else span
    return (retry_after_s if cfg.honor_retry_after else 0.0) + wait
