"""`simadmit calibrate` as a user meets it without a server: one-line errors and exit code 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from simadmit.calibrate.cli import parse_duration
from simadmit.calibrate.launch import free_port
from simadmit.config.errors import InputError
from tests.fake_vllm import FakeVllm


def calibrate(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "simadmit.calibrate", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for f in fragments:
        assert f in lines[0]


def test_connection_refused_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """Nothing listens on the port: the user hears it at once, and no measurements file is left behind."""
    port = free_port()
    result = calibrate("--endpoint", f"http://127.0.0.1:{port}", "--out", str(tmp_path / "p.yaml"))
    assert_one_line_error(result, "connection refused", str(port))
    assert not list(tmp_path.iterdir())


def test_unknown_host_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = calibrate("--endpoint", "http://no-such-host.invalid:8000", "--out", str(tmp_path / "p.yaml"))
    assert_one_line_error(result, "unknown host")


@pytest.mark.parametrize(
    "url", ["localhost:8000", "ftp://host/x", "http://", "http://:8000", "http://[::1", "http://host:99999"]
)
def test_bad_url_is_one_line_and_exit_2(tmp_path: Path, url: str) -> None:
    assert_one_line_error(calibrate("--endpoint", url, "--out", str(tmp_path / "p.yaml")), "--endpoint")


def test_missing_out_and_endpoint_are_both_reported(tmp_path: Path) -> None:
    result = calibrate()
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert all(line.startswith("error: ") for line in lines), result.stderr  # as every command prints them
    assert {"--out", "--endpoint"} <= {line.removeprefix("error: ").split(":")[0] for line in lines}


def test_launch_without_vllm_fails_fast_with_the_servers_last_words(tmp_path: Path) -> None:
    """`--launch` with an interpreter that has no vLLM: the server dies at start-up, and its log says why."""
    result = calibrate(
        "--launch", "some/model", "--vllm-python", sys.executable, "--out", str(tmp_path / "p.yaml"),
        "--", "--dtype", "bfloat16",
    )  # fmt: skip
    assert_one_line_error(result, "vLLM exited", "No module named 'vllm'")


def test_launch_with_an_interpreter_that_does_not_exist_names_the_option(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-python")
    result = calibrate("--launch", "some/model", "--vllm-python", missing, "--out", str(tmp_path / "p.yaml"))
    assert_one_line_error(result, f"--vllm-python: cannot start {missing}: No such file or directory")
    assert not list(tmp_path.iterdir())  # nothing measured, nothing written


def test_vllm_args_need_launch(tmp_path: Path) -> None:
    result = calibrate(
        "--endpoint", "http://127.0.0.1:1", "--out", str(tmp_path / "p.yaml"), "--", "--dtype", "x"
    )
    assert_one_line_error(result, "--launch")


def test_budget_durations() -> None:
    assert parse_duration("10m") == 600
    assert parse_duration("1h30m") == 5400
    assert parse_duration("90") == 90
    assert parse_duration("2.5s") == 2.5
    with pytest.raises(InputError, match="--budget"):
        parse_duration("ten minutes")


def test_check_with_missing_profile_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = calibrate("check", str(tmp_path / "nope.yaml"), "--endpoint", "http://127.0.0.1:1")
    assert_one_line_error(result, "nope.yaml", "not found")


def test_check_with_invalid_profile_names_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: m\ngpu: g\n")
    result = calibrate("check", str(bad), "--endpoint", "http://127.0.0.1:1")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "step_time" in result.stderr and "required field is missing" in result.stderr


def test_a_key_in_the_endpoint_url_is_neither_written_nor_printed(tmp_path: Path) -> None:
    """A calibration against `http://user:key@host` (a short one, against a fake vLLM) writes its profile and
    measurements, and neither they nor its output hold the key: profiles are shared, keys are not."""
    with FakeVllm() as server:
        url = server.url.replace("http://", "http://user:sk-secret-9@")
        out = tmp_path / "p.yaml"
        result = calibrate("--endpoint", url, "--out", str(out), "--budget", "30s", "--max-concurrency", "4",
                           timeout=180)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert server.url.removeprefix("http://") in out.read_text()  # the endpoint is named, without the key
    for path in tmp_path.iterdir():
        assert b"sk-secret-9" not in path.read_bytes(), path.name
    assert "sk-secret-9" not in result.stdout + result.stderr
