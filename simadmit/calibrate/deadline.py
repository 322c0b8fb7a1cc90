"""The time budget of a whole calibration, and a watch that says when the server has gone silent.

The plan spreads its cells over the budget, but a request that the server accepts and never answers holds
its worker until the request time-out. `within_budget` stops the run at the budget plus a short grace once
the server has gone silent (no headers or bytes for any request for `STALL_S`, or for twice the longest a
request has waited for a byte that then came: a slow server's long prefills are silent for longer, and are
not a hang), whatever it does: every attempt already measured is in the CSV, and `BudgetSpent` says what
was still waiting. A server still answering may finish the plan's minimum requests (they are owed whatever
the budget), up to a hard cap of twice the budget plus a minute (a later round's cells that would end past
it are skipped, and one still running near it is cut short: `run.py`). While it runs, the progress bar
counts the requests silent for a while (`Stalls`), so a stalled server is seen as stalled rather than as
slow progress.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from simadmit.calibrate.client import IN_FLIGHT

T = TypeVar("T")
STALL_S = 10.0  # a request (or the server) silent this long is stalled


def stall_after_s(request_timeout_s: float) -> float:
    """Silence after which a request counts as stalled: `STALL_S`, or a third of the request time-out
    when that is shorter, so a stall shows before the time-out ends it."""
    return min(STALL_S, request_timeout_s / 3)


class Stalls:
    """The requests in flight silent for longer than this server is while it works (`after_s` at least, the
    rule the budget's hang check uses): now (for the progress bar) and the most at once over the run (for the
    one line that sums them up at the end). A slow server's long prefills are not shown as stalls."""

    def __init__(self, after_s: float) -> None:
        self.after_s = after_s
        self.most = 0
        self.open_then = 0
        self.silent_then_s = after_s
        self.longest_s = 0.0

    def now(self) -> int:
        silent_s = IN_FLIGHT.silent_too_long_s(self.after_s)
        stalled, longest = IN_FLIGHT.stalled(silent_s)
        if stalled > self.most:
            self.most, self.open_then, self.silent_then_s = stalled, len(IN_FLIGHT), silent_s
        self.longest_s = max(self.longest_s, longest)
        return stalled

    def summary(self) -> str | None:
        if not self.most:
            return None
        return (
            f"stalled: {self.most} of {self.open_then} requests without a byte from the server for "
            f"{self.silent_then_s:.3g} s or more (the longest {self.longest_s:.0f} s)"
        )


def grace_s(budget_s: float) -> float:
    """Time after the budget for requests in flight to finish: 10% of it, between 2 s and 60 s."""
    return min(60.0, max(2.0, 0.1 * budget_s))


def hard_cap_s(budget_s: float) -> float:
    """The longest a run may take, even against a server that is slow but answering."""
    return 2 * budget_s + 60.0


WRAP_UP_S = 15.0  # after the last measurement: the fit, its report and the profile, before the hard cap


def later_rounds_end_s(budget_s: float) -> float:
    """When a later round's measuring ends, skipping or cutting short what is left, so the profile is
    written before the hard cap rather than the run failing at it."""
    return hard_cap_s(budget_s) - WRAP_UP_S


class BudgetSpent(Exception):
    """The run reached its time budget before it finished: what was still waiting then."""

    def __init__(self, ran_s: float, open_requests: int, stalled: int, longest_silence_s: float) -> None:
        self.ran_s = ran_s
        self.open_requests = open_requests
        self.stalled = stalled
        self.longest_silence_s = longest_silence_s
        super().__init__(self.describe())

    def describe(self) -> str:
        if not self.open_requests:
            return f"the run was still going at {self.ran_s:.0f} s"
        silent = (
            f", {self.stalled} of them without a byte from the server for {self.longest_silence_s:.0f} s"
            if self.stalled
            else ""
        )
        return f"{self.open_requests} requests were still waiting on the server at {self.ran_s:.0f} s{silent}"


async def within_budget(work: Coroutine[Any, Any, T], budget_s: float, stall_s: float = STALL_S) -> T:
    """Run `work` within its budget (see the module docstring), else cancel it and raise `BudgetSpent`."""
    task = asyncio.ensure_future(work)
    start = time.perf_counter()
    IN_FLIGHT.longest_answered_s = 0.0  # how silent this server can be while working: learnt afresh
    limit, cap = start + budget_s + grace_s(budget_s), start + hard_cap_s(budget_s)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=1.0)
            if done:
                return task.result()
            now = time.perf_counter()
            server_silent_s = now - max(IN_FLIGHT.last_heard, start)
            if (now >= limit and server_silent_s >= IN_FLIGHT.silent_too_long_s(stall_s)) or now >= cap:
                break
        stalled, longest = IN_FLIGHT.stalled(IN_FLIGHT.silent_too_long_s(stall_s))
        spent = BudgetSpent(now - start, len(IN_FLIGHT), stalled, longest)
    finally:
        if not task.done():
            await _stop(task)
    raise spent


async def _stop(run: asyncio.Future[Any]) -> None:
    """Cancel a run: first every task it started (while its client and files are still open), then itself.

    Stopping the run alone would close its HTTP client and its measurements file under tasks it started
    and still awaits, which then fail on a closed file as asyncio tears them down.
    """
    current = asyncio.current_task()
    started = [t for t in asyncio.all_tasks() if t is not current and t is not run]
    for t in started:
        t.cancel()
    await asyncio.gather(*started, return_exceptions=True)
    run.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):  # stopping: its outcome is moot
        await run
