"""Background asyncio tasks of a calibration run (the metrics sampler, the client's overhead watch)."""

from __future__ import annotations

import asyncio
import contextlib


async def cancel(task: asyncio.Task[None] | None) -> None:
    """Stop a background loop and wait until it has really stopped."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
