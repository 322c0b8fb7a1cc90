"""Ray backend: a sweep's units as Ray tasks, on a cluster (`address`) or on a local Ray started on demand.

The same function runs on the same arguments as with the process backend, so the rows are identical for
the same seeds. Workers need simadmit installed and the scenario's profile files at the same paths (a
bundled profile name always works; for files, use a Ray `runtime_env` or shared storage). Ray is an
optional extra: `pip install simadmit[ray]`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from simadmit.config.errors import InputError
from simadmit.study.backends import Backend


def ray_backend(address: str | None = None) -> Backend:
    """A backend for `run_sweep`/`optimize` that connects to `address` (None: start a local Ray)."""

    def ray_map(fn: Callable[..., dict], args: list[tuple], jobs: int) -> Iterator[tuple[int, dict]]:
        try:
            import ray
        except ImportError:
            raise InputError(["--backend ray: Ray is not installed (pip install 'simadmit[ray]')"]) from None
        if not ray.is_initialized():
            if address is None:
                ray.init(num_cpus=max(jobs, 1), include_dashboard=False, log_to_driver=False)
            else:
                ray.init(address=address, log_to_driver=False)
        remote = ray.remote(_refusing)
        pending = {remote.remote(fn, *a): i for i, a in enumerate(args)}
        try:
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                for ref in done:
                    result = ray.get(ref)
                    if isinstance(result, Refused):
                        raise InputError(result.problems)
                    yield pending.pop(ref), result
        finally:
            for ref in pending:
                ray.cancel(ref)

    return ray_map


@dataclass(frozen=True)
class Refused:
    """A unit's bad input, returned as a value: raised inside a Ray task, it would come back wrapped in a
    `RayTaskError`, and Ray would also log every other task's copy with its remote traceback."""

    problems: list[str]


def _refusing(fn: Callable[..., dict], *args: object) -> dict | Refused:
    try:
        return fn(*args)
    except InputError as e:
        return Refused(e.problems)
