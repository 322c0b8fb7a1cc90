"""Backends: where a study's units run, and `run_sweep`, which runs a plan's missing units through one.

A backend maps a function over argument tuples and yields `(index, result)` as results arrive, in any
order; `process_map` uses local worker processes (or this process for one job), `ray_backend` in
`simadmit.study.ray_backend` a Ray cluster. Both run the same function on the same arguments, so results
are identical for the same seeds. `run_sweep` saves each finished unit at once, so interrupting it loses
nothing that finished, then assembles and writes the table.
"""

from __future__ import annotations

import functools
import multiprocessing
import multiprocessing.pool
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pandas as pd

from simadmit.study.grid import SweepPlan
from simadmit.study.runner import run_unit
from simadmit.study.store import PointStore
from simadmit.study.table import assemble, assemble_runs, write_table

OnProgress = Callable[[int, int], None]  # (units done, units total)
Backend = Callable[[Callable[..., dict], list[tuple], int], Iterator[tuple[int, dict]]]


def process_map(fn: Callable[..., dict], args: list[tuple], jobs: int) -> Iterator[tuple[int, dict]]:
    """Yield (index, fn(*args[index])) as results arrive; in this process when jobs == 1.

    Workers start with `forkserver`, so no thread of the parent (a progress bar) is copied into them, and
    ignore Ctrl-C: the terminal sends it to the whole process group, and only the parent decides. When the
    parent stops (Ctrl-C, an error, or the caller closing the iterator) the workers are terminated at
    once rather than left to finish their units.
    """
    with WorkerPool() as pool:
        yield from pool(fn, args, jobs)


class WorkerPool:
    """`process_map` whose workers outlive a call: a search runs many small batches, and starting workers
    for each would cost more than some batches. Close it (or use it as a context manager) when done."""

    def __init__(self) -> None:
        self.pool: multiprocessing.pool.Pool | None = None

    def __call__(self, fn: Callable[..., dict], args: list[tuple], jobs: int) -> Iterator[tuple[int, dict]]:
        if jobs <= 1 or len(args) <= 1:
            for i, a in enumerate(args):
                yield i, fn(*a)
            return
        if self.pool is None:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(
                ["simadmit.study.runner"]
            )  # workers fork with the simulator imported
            self.pool = context.Pool(jobs, initializer=_ignore_interrupts)
        try:
            yield from _between_waits(
                self.pool.imap_unordered(functools.partial(_indexed, fn), enumerate(args))
            )
        except BaseException:  # Ctrl-C, an error, or the caller gave up: stop the work in flight
            self.close()
            raise

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
            self.pool = None

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _between_waits(results: multiprocessing.pool.IMapIterator) -> Iterator[tuple[int, dict]]:
    """The pool's results, with Ctrl-C raised here, between two waits, rather than inside one.

    A KeyboardInterrupt that lands while the pool's condition variable releases its lock leaves the lock
    broken, and Python then raises "release unlocked lock" instead: a traceback, not an interrupt. So while
    results are awaited Ctrl-C only sets a flag, and the wait looks at it every tenth of a second.
    """
    stop = threading.Event()
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set()) if in_main else None
    try:
        while not stop.is_set():
            try:
                yield results.next(timeout=0.1)
            except multiprocessing.TimeoutError:
                continue
            except StopIteration:
                return
        raise KeyboardInterrupt
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _indexed(fn: Callable[..., dict], item: tuple[int, tuple]) -> tuple[int, dict]:
    return item[0], fn(*item[1])


def _ignore_interrupts() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def run_sweep(
    plan: SweepPlan,
    out: Path,
    jobs: int = 1,
    backend: Backend = process_map,
    progress: OnProgress | None = None,
) -> pd.DataFrame:
    """Run the units not yet saved in `out`, then write and return the table (sweep.parquet, sweep.csv)."""
    store = PointStore(out)
    units = plan.units()
    pending = [u for u in units if not store.has(u.key)]
    done = len(units) - len(pending)
    if progress is not None:
        progress(done, len(units))
    args = [(plan.document, str(plan.source), dict(u.overrides), u.seed) for u in pending]
    for i, record in backend(run_unit, args, jobs):
        store.save(pending[i].key, record)
        done += 1
        if progress is not None:
            progress(done, len(units))
    table = assemble(plan, store)
    write_table(plan, table, out, assemble_runs(plan, store))
    return table
