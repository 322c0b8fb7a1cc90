"""`simadmit calibrate` against a server that accepts requests and then hangs: the run ends at its budget.

The fake server (tests/fake_vllm.py) answers its first completions, then sends the headers of every later
one and nothing more, as a wedged engine does. Without a bound each hung request would hold its worker for
the whole request time-out; with `--budget` the run stops at the budget plus its grace (the server has
been silent far longer than 10 s by then), keeps every row it measured, says what was still waiting, and
exits 1.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from rich.console import Console

from simadmit.calibrate import deadline
from simadmit.calibrate.client import InFlight
from simadmit.calibrate.deadline import BudgetSpent, Stalls, grace_s, stall_after_s, within_budget
from simadmit.calibrate.measurements import measurements_path, read_measurements
from simadmit.calibrate.phases import Cell, RunnerSettings, RunStats, in_rounds
from simadmit.calibrate.run import CalibrationConfig, _run_with_progress, calibrate
from tests.console import ctrl_c_as_in_a_terminal
from tests.fake_vllm import FakeVllm

ROOT = Path(__file__).resolve().parent.parent
SIMADMIT = str(Path(sys.executable).parent / "simadmit")
TEARDOWN_S = 10.0  # cancelling the hung requests and exiting, on a busy shared machine


def test_a_hung_server_ends_the_run_at_its_budget_keeping_what_was_measured(tmp_path: Path) -> None:
    budget_s, ok_first = 16.0, 6  # long enough for a request to stall (10 s) well before the end
    out = tmp_path / "profile.yaml"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    with FakeVllm(then="hang", ok_first=ok_first) as server:
        result = subprocess.run(
            [SIMADMIT, "calibrate", "--endpoint", server.url, "--out", str(out), "--budget", f"{budget_s:g}s",
             "--request-timeout", "10m", "--max-concurrency", "2"],
            capture_output=True, text=True, timeout=120, env=env, check=False,
        )  # fmt: skip
        ended = time.monotonic()
        assert server.first_request_at is not None
        # Measured from the first request the server saw, so interpreter start-up is not counted.
        ran_s = ended - server.first_request_at
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output
    assert result.returncode == 1, output
    assert ran_s < budget_s + grace_s(budget_s) + TEARDOWN_S, (ran_s, output)
    # One line says why the run stopped and what still hung: 1 or 2 requests, as the hang caught the plan in
    # a cell of concurrency 1 or 2 (which depends on how fast the first requests went); one line sums up the
    # stalls the bar counted while it ran, and they are the same requests.
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    waiting = re.search(
        r"stopped at the time budget .*: (\d+) requests were still waiting on the server", lines[0]
    )
    assert waiting, lines[0]
    hung = int(waiting.group(1))
    assert 1 <= hung <= 2
    stalled = [line for line in result.stdout.splitlines() if line.startswith("stalled: ")]
    assert len(stalled) == 1, result.stdout
    assert f"stalled: {hung} of {hung} requests without a byte from the server" in stalled[0], result.stdout
    assert f"{ok_first} requests measured" in lines[0] and "--resume" in lines[0]
    rows = read_measurements(measurements_path(out))
    assert sum(r.ok for r in rows) == ok_first
    assert not out.exists()  # no profile from an unfinished plan


def test_ctrl_c_against_a_hung_server_is_one_line_and_exit_130(tmp_path: Path) -> None:
    """Ctrl-C while requests hang: the run's own tasks are cancelled before its client and CSV close, so the
    user sees one line (no asyncio traceback) and the rows measured stay for --resume."""
    out = tmp_path / "profile.yaml"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    with FakeVllm(then="hang", ok_first=4) as server:
        process = subprocess.Popen(
            [SIMADMIT, "calibrate", "--endpoint", server.url, "--out", str(out), "--budget", "10m",
             "--max-concurrency", "2"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
            preexec_fn=ctrl_c_as_in_a_terminal,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while server.completions < 6 and time.monotonic() < deadline:  # both workers are now hung
            time.sleep(0.2)
        time.sleep(0.5)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=60)
    assert "Traceback" not in stdout + stderr, stderr
    assert process.returncode == 130, stdout + stderr
    (line,) = stderr.strip().splitlines()
    assert line.startswith("interrupted: 4 requests measured (") and line.endswith(
        f"are kept in {measurements_path(out)}; rerun with --resume to continue"
    ), line
    assert sum(r.ok for r in read_measurements(measurements_path(out))) == 4


def test_the_progress_bar_counts_the_stalled_requests_and_one_line_sums_them_up(tmp_path: Path) -> None:
    """On a terminal, the bar's `calibration` row shows how many requests have gone silent past the
    threshold (a third of the request time-out here: 2 s), from the moment they do; the frames before that
    show none. When the run ends, one line (not one per frame or per request) says what stalled."""
    request_timeout_s = 6.0
    stall_s = stall_after_s(request_timeout_s)
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=200, color_system=None)
    with FakeVllm(then="hang", ok_first=3) as server:
        cfg = CalibrationConfig(
            endpoint=server.url, out=tmp_path / "p.yaml", budget_s=4.0, max_concurrency=2,
            runner=RunnerSettings(request_timeout_s=request_timeout_s),
        )  # fmt: skip
        with pytest.raises(BudgetSpent):
            asyncio.run(within_budget(calibrate(cfg, console), cfg.budget_s, stall_s))
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "\n", screen.getvalue())  # cursor moves between frames
    rows = [line for line in text.splitlines() if line.lstrip().startswith("calibration ")]
    counts = [int(m.group(1)) if (m := re.search(r"(\d+) stalled\s*$", r)) else 0 for r in rows]
    assert counts and counts[0] == 0, rows[:3]  # nothing stalled at the start
    assert max(counts) >= 1, rows[-3:]  # the hung requests are counted in the bar
    summary = [line for line in text.splitlines() if line.startswith("stalled: ")]
    assert len(summary) == 1, summary
    assert f"without a byte from the server for {stall_s:g} s or more" in summary[0]
    assert f"stalled: {max(counts)} of " in summary[0]  # the most at once, as the bar showed it


def test_a_slow_server_is_not_taken_for_a_hung_one(tmp_path: Path) -> None:
    """Every request is silent for 1.5 s before its first token (a long prefill on a slow CPU), longer than
    the 1 s after which a request counts as stalled, and the plan's minimum outlasts the 2 s budget. The
    server has answered after such silences before the budget ends, so the run goes on past the budget
    and its grace, measures both rounds and writes the profile, rather than stopping as if it hung."""
    with FakeVllm(prefill_s=1.5) as server:
        cfg = CalibrationConfig(endpoint=server.url, out=tmp_path / "p.yaml", budget_s=2.0, max_concurrency=1)
        started = time.monotonic()
        asyncio.run(within_budget(calibrate(cfg, Console(file=io.StringIO())), cfg.budget_s, stall_s=1.0))
        ran_s = time.monotonic() - started
    assert ran_s > 2 * (cfg.budget_s + grace_s(cfg.budget_s))
    assert {r.round for r in read_measurements(measurements_path(cfg.out))} == {0, 1, 2}
    assert cfg.out.exists()


def test_a_silence_no_longer_than_the_server_has_answered_after_is_not_shown_as_stalled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The progress bar's stall count uses the rule the hang check uses: a request silent for 0.3 s, past
    the 0.2 s floor, is not stalled on a server that has answered after 1 s of silence before (twice that
    is 2 s: room for a busy machine's pauses), and is stalled on one that has never kept a request waiting
    over 0.05 s (the floor applies)."""
    in_flight = InFlight()
    monkeypatch.setattr(deadline, "IN_FLIGHT", in_flight)
    in_flight.open()
    time.sleep(0.3)
    stalls = Stalls(after_s=0.2)
    in_flight.longest_answered_s = 1.0
    assert stalls.now() == 0 and stalls.summary() is None
    in_flight.longest_answered_s = 0.05
    assert stalls.now() == 1
    assert (stalls.summary() or "").startswith(
        "stalled: 1 of 1 requests without a byte from the server for 0.2 s"
    )


class _Runner:
    """A server whose every cell takes `cell_s` in the first round and `later_s` in the rounds after, as the
    calibration's runner reports it."""

    def __init__(self, cell_s: float, later_s: float | None = None) -> None:
        self.cell_s = cell_s
        self.later_s = cell_s if later_s is None else later_s
        self.stats = RunStats()
        self.ran: list[Cell] = []

    def remaining_s(self, cell: Cell) -> tuple[float, int]:
        return 1.0, 1

    async def run_cell(self, cell: Cell, tick: Callable[[], None]) -> None:
        took_s = self.cell_s if cell.round == 1 else self.later_s
        await asyncio.sleep(took_s)
        self.ran.append(cell)
        self.stats.wall_s[cell.label] += took_s
        tick()


def test_cells_of_a_later_round_that_would_end_past_the_cap_are_skipped() -> None:
    """Three cells in two rounds, each taking 0.5 s, against a cap 2.25 s away: the first round runs whole
    (every cell is owed once), the second runs while a cell, as long as it took before, ends before the cap,
    and the rest are skipped and counted on one line."""
    cells = in_rounds([Cell(phase, 1, (16,), 1, 1.0, 1) for phase in ("prefill", "decode", "mixed")])
    runner = _Runner(0.5)
    screen = io.StringIO()
    cap_at = time.perf_counter() + 2.25
    skipped = asyncio.run(
        _run_with_progress(
            cast(Any, runner), cells, cast(Any, SimpleNamespace()), Console(file=screen), 10.0, cap_at
        )
    )
    assert [(c.round, c.phase) for c in runner.ran] == [
        (1, "prefill"), (1, "decode"), (1, "mixed"), (2, "prefill")
    ]  # fmt: skip
    assert skipped == 2 and "2 cells of a later round skipped or cut short" in " ".join(
        screen.getvalue().split()
    )


def test_a_later_round_cell_still_running_at_the_cap_is_cut_short() -> None:
    """Two cells taking 0.5 s in the first round; the second round's first runs 5 s (the machine slowed
    down), past a cap 1.8 s away: it is cut short at the cap, well before it would end, the next one is
    skipped, and the run returns (to the fit) rather than running on into the hard cap."""
    cells = in_rounds([Cell(phase, 1, (16,), 1, 1.0, 1) for phase in ("prefill", "decode")])
    runner = _Runner(0.5, later_s=5.0)
    screen = io.StringIO()
    started = time.perf_counter()
    skipped = asyncio.run(
        _run_with_progress(
            cast(Any, runner), cells, cast(Any, SimpleNamespace()), Console(file=screen), 10.0, started + 1.8
        )
    )
    ran_s = time.perf_counter() - started
    assert [(c.round, c.phase) for c in runner.ran] == [(1, "prefill"), (1, "decode")]
    assert skipped == 2 and "2 cells of a later round skipped or cut short" in " ".join(
        screen.getvalue().split()
    )
    assert 1.8 <= ran_s < 4.0  # cut at the cap (plus one 0.5 s poll), not at the cell's 5 s
