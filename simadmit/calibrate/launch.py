"""Start a vLLM OpenAI server on loopback for the length of a `with` block, and always stop it.

The server runs in its own process group (so its engine workers go with it): on exit, SIGTERM to the group,
then SIGKILL if it has not gone within a grace period, whatever happened inside the block, including a
SIGTERM sent to the launching process. vLLM can live in
another environment: pass that environment's Python (`--vllm-python`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx


class LaunchError(Exception):
    """The server could not be started (missing vLLM, bad arguments, start-up crash or time-out)."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _last_line(log_path: Path) -> str:
    try:
        lines = [ln.strip() for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def stop_process_group(process: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """SIGTERM the process's group, wait up to `grace_s`, then SIGKILL it."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass


def wait_healthy(url: str, process: subprocess.Popen[bytes], log_path: Path, timeout_s: float) -> None:
    """Poll `/health` until it answers 200; fail early if the server process exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise LaunchError(
                f"vLLM exited with code {process.returncode} during start-up: {_last_line(log_path)} (log: {log_path})"
            )
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise LaunchError(f"vLLM did not answer {url}/health within {timeout_s:.0f} s (log: {log_path})")


@contextmanager
def launched_server(
    model: str,
    vllm_args: Sequence[str],
    python: str,
    log_path: Path,
    timeout_s: float = 900.0,
    env: Mapping[str, str] | None = None,
) -> Iterator[str]:
    """Serve `model` with `python -m vllm.entrypoints.openai.api_server` on 127.0.0.1; yield its base URL."""
    port = free_port()
    command = [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model, "--host", "127.0.0.1", "--port", str(port), *vllm_args,
    ]  # fmt: skip
    full_env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", **(env or {})}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        try:
            process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
            )
        except OSError as e:
            raise LaunchError(f"--vllm-python: cannot start {python}: {e.strerror}") from None
    url = f"http://127.0.0.1:{port}"
    # A SIGTERM to this process must still stop the server (it runs in its own session, so it would
    # outlive us): turn it into an exception, which the `finally` below handles like any other.
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if in_main else None
    try:
        wait_healthy(url, process, log_path, timeout_s)
        yield url
    finally:
        stop_process_group(process)
        if in_main:
            signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
