"""How much the load client itself costs, so a calibration can show the client was not the bottleneck.

Three figures: the client process's CPU time as a share of wall time, the time spent handling response bytes
per request, and the event loop's lag (how late a 20 ms timer fires): a loop that lags by more than a
fraction of an inter-token gap would blur the token timestamps it records.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from simadmit.calibrate.background import cancel


class OverheadMonitor:
    """Measures the client's CPU share and event-loop lag between `start` and `stop`."""

    def __init__(self, tick_s: float = 0.02) -> None:
        self._tick_s = tick_s
        self._lags: list[float] = []
        self._task: asyncio.Task[None] | None = None
        self._cpu0 = self._wall0 = 0.0
        self._cpu = self._wall = 0.0
        self.busy_s = 0.0
        self.requests = 0

    async def _watch(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(self._tick_s)
            self._lags.append(time.perf_counter() - before - self._tick_s)

    def start(self) -> None:
        self._cpu0, self._wall0 = time.process_time(), time.perf_counter()
        self._task = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        self._cpu, self._wall = time.process_time() - self._cpu0, time.perf_counter() - self._wall0
        await cancel(self._task)

    def record(self, busy_s: float) -> None:
        """Count one request and the time spent handling its response."""
        self.busy_s += busy_s
        self.requests += 1

    def report(self) -> dict[str, float]:
        lags = np.array(self._lags) if self._lags else np.zeros(1)
        return {
            "cpu_share_of_one_core": round(self._cpu / self._wall, 4) if self._wall > 0 else 0.0,
            "handling_ms_per_request": round(1e3 * self.busy_s / max(1, self.requests), 3),
            "loop_lag_p50_ms": round(1e3 * float(np.percentile(lags, 50)), 3),
            "loop_lag_p99_ms": round(1e3 * float(np.percentile(lags, 99)), 3),
        }
