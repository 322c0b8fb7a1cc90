"""`--launch`: the server is started on loopback, waited for, and always stopped, even on SIGTERM.

A stand-in "interpreter" answers `python -m vllm.entrypoints.openai.api_server ... --port P` with a tiny
HTTP server that says 200 to everything and records its pid, so the mechanics are tested in a second.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from simadmit.calibrate.launch import LaunchError, launched_server
from tests.vllm_server import cpu_flags, served_dtype

SERVER = """
import os, sys, http.server
port = int(sys.argv[sys.argv.index("--port") + 1])
open(os.environ["PID_FILE"], "w").write(str(os.getpid()))
class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Ok).serve_forever()
"""


@pytest.fixture
def fake_python(tmp_path: Path) -> Path:
    script = tmp_path / "fake-python"
    script.write_text(f"#!/bin/sh\nexec {sys.executable} -c '{SERVER}' \"$@\"\n")
    script.chmod(0o755)
    return script


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_server_is_up_inside_the_block_and_gone_after(fake_python: Path, tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    with launched_server("m", [], str(fake_python), tmp_path / "log", 30, {"PID_FILE": str(pid_file)}) as url:
        assert url.startswith("http://127.0.0.1:")
        assert httpx.get(f"{url}/health").status_code == 200
    assert gone(int(pid_file.read_text()))


def test_server_is_stopped_when_the_block_fails(fake_python: Path, tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    env = {"PID_FILE": str(pid_file)}
    with (
        pytest.raises(RuntimeError, match="boom"),
        launched_server("m", [], str(fake_python), tmp_path / "log", 30, env),
    ):
        raise RuntimeError("boom")
    assert gone(int(pid_file.read_text()))


def test_server_is_stopped_when_the_launcher_gets_sigterm(fake_python: Path, tmp_path: Path) -> None:
    """The server runs in its own session, so only the launcher can stop it: SIGTERM must not orphan it."""
    pid_file = tmp_path / "pid"
    launcher = subprocess.Popen(
        [sys.executable, "-c", (
            "import sys, time\nfrom pathlib import Path\nfrom simadmit.calibrate.launch import launched_server\n"
            f"with launched_server('m', [], {str(fake_python)!r}, Path({str(tmp_path / 'log')!r}), 30, "
            f"{{'PID_FILE': {str(pid_file)!r}}}) as url:\n    print(url, flush=True)\n    time.sleep(60)\n"
        )],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert launcher.stdout is not None
    url = launcher.stdout.readline().strip()
    assert httpx.get(f"{url}/health").status_code == 200
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=30) == 128 + signal.SIGTERM
    deadline = time.monotonic() + 10
    while not gone(int(pid_file.read_text())) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(int(pid_file.read_text()))


def test_a_server_that_dies_at_start_up_is_reported_with_its_last_words(tmp_path: Path) -> None:
    broken = tmp_path / "broken-python"
    broken.write_text("#!/bin/sh\necho 'ValueError: unknown argument --bogus' >&2\nexit 3\n")
    broken.chmod(0o755)
    with (
        pytest.raises(LaunchError, match="exited with code 3.*unknown argument --bogus"),
        launched_server("m", ["--bogus"], str(broken), tmp_path / "log", 30),
    ):
        pass


def test_the_tests_server_runs_bfloat16_only_where_the_cpu_has_avx512(tmp_path: Path) -> None:
    """vLLM's CPU kernels for bfloat16 need AVX-512; elsewhere the tests' server runs float32."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nflags\t\t: fpu sse avx avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu avx2\n"
    )
    assert cpu_flags(cpuinfo) == {"fpu", "sse", "avx", "avx2", "fma"}
    assert served_dtype(cpu_flags(cpuinfo)) == "float32"
    cpuinfo.write_text("flags\t\t: fpu avx2 avx512f avx512bw\n")
    assert served_dtype(cpu_flags(cpuinfo)) == "bfloat16"
    assert cpu_flags(tmp_path / "absent") == frozenset()
