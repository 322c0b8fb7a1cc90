"""Running the `simadmit` console command in a child process, as a user's shell does."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def command() -> list[str]:
    """The installed console script, importing this checkout's package."""
    script = shutil.which("simadmit", path=str(Path(sys.executable).parent))
    return [script] if script else [sys.executable, "-c", "from simadmit.cli import app; app()"]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "80", "NO_COLOR": "1"}


def run(*args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*command(), *args], capture_output=True, text=True, env=env(), timeout=300, check=False, **kwargs
    )  # type: ignore[call-overload]


def ctrl_c_as_in_a_terminal() -> None:
    """In a child before it starts (`preexec_fn`): Ctrl-C at its default, as a terminal's foreground command has
    it. A test run started in the background by a script inherits SIGINT ignored (shells ignore it in
    asynchronous jobs), and Python keeps an inherited ignore, so the command would run on through the Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
