"""Ray backend: a sweep's units as Ray tasks, on a cluster (`address`) or on a local Ray started on demand.

The same function runs on the same arguments as with the process backend, so the rows are identical for
the same seeds. Workers need simadmit installed and the scenario's profile files at the same paths (a
bundled profile name always works; for files, use a Ray `runtime_env` or shared storage). Ray is an
optional extra: `pip install simadmit[ray]`.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

from simadmit.config.errors import InputError, problem
from simadmit.study.backends import Backend

REACH_TIMEOUT_S = 10.0  # Ray itself retries an address it cannot reach without end
RAY_HEAD_PORT, RAY_CLIENT_PORT = 6379, 10001  # Ray's defaults when an address gives no port


def check_address(address: str) -> None:
    """`InputError` unless `address` (host:port or ray://host:port; `auto` and `local` are Ray's own
    words) names a port that answers: Ray would wait on an unreachable cluster forever."""
    if address in ("auto", "local"):
        return
    client = "://" in address  # ray://host[:port], a Ray client server; else a head's host[:port]
    try:
        parts = urlsplit(address if client else f"ray://{address}")
        host, port = parts.hostname, parts.port or (RAY_CLIENT_PORT if client else RAY_HEAD_PORT)
    except ValueError:
        host, port = None, 0
    if not host or parts.scheme != "ray" or parts.path not in ("", "/"):
        why = "expected host:port or ray://host:port (or auto), e.g. 10.0.0.5:6379"
        raise InputError([problem(None, "--address", f"{address}: {why}")])
    try:
        with socket.create_connection((host, port), timeout=REACH_TIMEOUT_S):
            pass
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise InputError(
            [problem(None, "--address", f"{address}: no Ray cluster answers there ({why})")]
        ) from None


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
                try:
                    ray.init(address=address, log_to_driver=False)
                except ConnectionError as e:  # something answers there, but no Ray; or `auto` finds none
                    why = str(e).splitlines()[0] if str(e) else type(e).__name__
                    raise InputError([problem(None, "--address", f"{address}: {why}")]) from None
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
