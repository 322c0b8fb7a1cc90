"""Ledger: what happened to every request and every attempt of one run, kept in flat Python lists.

Plain lists indexed by request id are the cheapest thing to write from the inner loop; `records.py` turns
them into DataFrames once the run is over.
"""

from __future__ import annotations

import math

PENDING, COMPLETED, REJECTED, ABANDONED, ABORTED, IN_FLIGHT, TOO_LONG = range(7)
OUTCOMES = ("pending", "completed", "rejected", "abandoned", "aborted", "in_flight", "too_long")


class Ledger:
    """Per-request times and outcome, plus one row per gateway decision (attempt)."""

    def __init__(self, n: int) -> None:
        nan = math.nan
        self.admit = [nan] * n
        self.scheduled = [nan] * n
        self.first_token = [nan] * n
        self.finish = [nan] * n
        self.outcome = [PENDING] * n
        self.attempts = [0] * n
        self.pool = [-1] * n
        self.replica = [-1] * n
        self.preemptions = [0] * n
        self.aborted_prompt_done = [0] * n  # tokens prefilled and decoded when it was aborted mid-service
        self.aborted_output_done = [0] * n
        # one entry per attempt
        self.att_rid: list[int] = []
        self.att_time: list[float] = []
        self.att_gateway: list[int] = []
        self.att_reason: list[str] = []
        self.att_retry_after: list[float] = []
        self.att_predicted_wait: list[float] = []  # the wait the decision was made on (X-Queue-Predict-Wait)
