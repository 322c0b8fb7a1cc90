"""Calibration against a real vLLM server (SmolLM2-135M on the CPU build; see tests/vllm_server.py).

One calibration is run for the module, interrupted with Ctrl-C part-way and resumed, so the same run checks
that nothing measured is lost and that the fitted model matches the server. The CPU is noisy (20-40% between
runs of the same server on this kind of machine), so the checks are about agreement within the same server session and about trends.
"""

from __future__ import annotations

import asyncio
import csv
import io
import random
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from simadmit.calibrate.client import Attempt, discover, stream_completion, tokenize
from simadmit.calibrate.drift import DRIFT_WARNING, round_drift
from simadmit.calibrate.fit import FitThresholds, decode_step_s, observations
from simadmit.calibrate.measurements import Measurement, read_measurements
from simadmit.calibrate.phases import aggregate_throughput
from simadmit.calibrate.prompts import SAMPLE_TEXT, PromptMaker
from simadmit.config.profile import Profile, load_profile, solo_service_s
from tests.console import ctrl_c_as_in_a_terminal
from tests.vllm_server import MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, VllmServer, cpu_flags, served_dtype

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]  # the first run provisions vLLM in its setup

# Held-out points are predicted within these relative errors. Throughput varies 20-40% between server
# starts; within one session, runs of this test put held-out TTFTs within 16% of the fit and inter-token
# latencies within 14% (with another process competing for the CPU, too). The bounds leave room for the CPU's
# minute-to-minute drift and still fail a model that is wrong in kind: a prefill rate off by 2x, a missing step
# overhead, decode steps charged for prefill work they do not do, or prefills in the batch left out.
TTFT_TOLERANCE = 0.25
ITL_TOLERANCE = 0.35


def command(server: VllmServer, out: Path, budget: str, max_concurrency: int) -> list[str]:
    return [
        sys.executable, "-m", "simadmit.calibrate", "--endpoint", server.url, "--budget", budget,
        "--max-concurrency", str(max_concurrency), "--max-num-seqs", str(MAX_NUM_SEQS),
        "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS), "--gpu-name", "CPU", "--out", str(out),
    ]  # fmt: skip


def rows_in(csv_path: Path, phase: str) -> int:
    if not csv_path.exists():
        return 0
    return sum(1 for r in csv.DictReader(io.StringIO(csv_path.read_text())) if r["phase"] == phase)


@dataclass(frozen=True)
class Calibrated:
    profile: Profile
    profile_path: Path
    csv_path: Path
    before_interrupt: str  # the CSV as Ctrl-C left it
    interrupted: subprocess.CompletedProcess[str]
    resumed: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def calibrated(vllm_server: VllmServer, tmp_path_factory: pytest.TempPathFactory) -> Calibrated:
    """A 90 s calibration up to concurrency 8, interrupted during the prefill sweep, then resumed."""
    out = tmp_path_factory.mktemp("calibration") / "smollm2.yaml"
    csv_path = out.with_name("smollm2.measurements.csv")
    cmd = command(vllm_server, out, "90s", 8)
    process = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=ctrl_c_as_in_a_terminal
    )
    deadline = time.monotonic() + 120
    while rows_in(csv_path, "prefill") < 6 and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=60)
    interrupted = subprocess.CompletedProcess(cmd, process.returncode, stdout, stderr)
    before = csv_path.read_text()
    resumed = subprocess.run([*cmd, "--resume"], check=False, capture_output=True, text=True, timeout=420)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    return Calibrated(load_profile(out), out, csv_path, before, interrupted, resumed)


def test_interrupted_run_keeps_its_csv_and_resume_repeats_nothing(
    calibrated: Calibrated, tmp_path: Path
) -> None:
    """Ctrl-C exits 130 pointing at --resume; the CSV it left is kept verbatim as the head of the final one;
    no (phase, concurrency, seq, attempt) appears twice, so the warm-up and the prefill requests done before
    the interruption were not measured again, and the prefill sweep carried on from the next seq."""
    assert calibrated.interrupted.returncode == 130, calibrated.interrupted.stderr
    assert "--resume" in calibrated.interrupted.stderr
    assert calibrated.csv_path.read_text().startswith(calibrated.before_interrupt)
    snapshot = tmp_path / "before.csv"
    snapshot.write_text(calibrated.before_interrupt)
    before = read_measurements(snapshot)
    rows = read_measurements(calibrated.csv_path)
    assert 0 < len(before) < len(rows)
    assert max(Counter((r.phase, r.concurrency, r.seq, r.attempt) for r in rows).values()) == 1
    new = rows[len(before) :]
    assert not [r for r in new if r.phase == "warmup"]
    prefill_before = [r.seq for r in before if r.phase == "prefill"]
    prefill_new = [r.seq for r in new if r.phase == "prefill"]
    assert prefill_before and prefill_new
    assert min(prefill_new) == max(prefill_before) + 1


def test_kv_capacity_equals_cache_config_info(calibrated: Calibrated, vllm_server: VllmServer) -> None:
    """The profile's KV capacity is the server's num_gpu_blocks x block_size, read here independently."""
    text = httpx.get(f"{vllm_server.url}/metrics", timeout=10).text
    info = [
        s.labels
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "vllm:cache_config_info"
    ]
    assert len(info) == 1
    expected = int(info[0]["num_gpu_blocks"]) * int(info[0]["block_size"])
    # 2 GiB of KV in blocks of 128 tokens, each token holding a key and a value of SmolLM2's 30 layers x 3
    # KV heads x 64 dimensions in the server's dtype: 728 blocks in bfloat16, 364 in float32
    width = {"bfloat16": 2, "float32": 4}[served_dtype(cpu_flags())]
    assert calibrated.profile.kv_capacity_tokens == expected == 2**31 // (128 * 2 * 30 * 3 * 64 * width) * 128
    assert calibrated.profile.kv_block_size == int(info[0]["block_size"])


def test_continuous_batching_is_visible(calibrated: Calibrated) -> None:
    """Aggregate decode throughput at concurrency 8 is well above concurrency 1.

    A server that decoded one request at a time would give about 1x, and the CPU's 20-50% noise cannot carry
    that to 2x. How far above it a batch goes is the machine's: 3.9-5x on the 2-core VMs measured here, and
    3.0x on one where a lone request decoded at 16 tokens/s instead of 19-29."""
    rows = read_measurements(calibrated.csv_path)
    one, eight = (aggregate_throughput(rows, "decode", c) for c in (1, 8))
    assert eight > 2 * one, (one, eight)


def test_profile_reports_its_fit(calibrated: Calibrated) -> None:
    """The profile carries its fit's figures, and its R^2 is the step model's on the fitted points of the CSV,
    recomputed here, with the on-screen warning exactly when it is below the threshold.

    R^2 is not held to a bound near 1: over absolute seconds it is ruled by the longest points, so one slow
    stretch of a shared CPU moves it a lot (0.98 on a quiet 2-core machine; 0.78 once on another, whose run
    also warned of a phase predicted 25% off). How well the model predicts is what the held-out tests below
    check, against tolerances sized from the server's noise."""
    p = calibrated.profile
    assert p.engine.max_model_len == 2048 and p.engine.max_num_seqs == MAX_NUM_SEQS
    assert p.step_time.overhead_s > 0 and p.step_time.per_prefill_token_s > 0
    fit = p.fit
    assert {"points", "r2", "phases", "ttft_offset_s", "client_overhead", "faults_retried"} <= set(fit)
    assert {"prefill", "decode", "mixed", "saturation"} <= set(fit["phases"])  # type: ignore[arg-type]
    assert "prefill" in fit["held_out"]  # type: ignore[operator]  # every fifth request, reported by band
    obs, _ = observations(read_measurements(calibrated.csv_path), MAX_NUM_BATCHED_TOKENS)
    fitted = [o for o in obs if not o.held_out]
    assert len(fitted) == fit["points"]
    measured = np.array([o.seconds for o in fitted])
    predicted = np.array([o.predict(p.step_time, float(fit["ttft_offset_s"])) for o in fitted])  # type: ignore[arg-type]
    r2 = 1 - np.sum((measured - predicted) ** 2) / np.sum((measured - measured.mean()) ** 2)
    assert 0 < fit["r2"] <= 1 and abs(fit["r2"] - r2) < 2e-3, (fit["r2"], r2)  # type: ignore[operator]
    assert ("poor fit: R^2" in calibrated.resumed.stdout) == (r2 < FitThresholds().min_r2)
    assert "R^2" in calibrated.resumed.stdout and "client overhead" in calibrated.resumed.stdout
    # how far each phase moved between the rounds, as the CSV's rows say, warned of exactly above the limit
    drift = round_drift(read_measurements(calibrated.csv_path))
    assert "decode" in drift  # every decode block holds a full batch in each round
    assert fit["drift_between_rounds"] == {phase: d.report() for phase, d in drift.items()}
    unsteady = [phase for phase, d in drift.items() if abs(d.median) > DRIFT_WARNING]
    assert [w.split()[2] for w in p.warnings if w.startswith("unsteady machine")] == unsteady
    # the latency outside the engine, read off vLLM's own clocks (7-9 ms measured on a quiet 2-core VM)
    assert fit["ttft_offset_source"] == "measured" and 0 < p.api_latency_s < 0.1, p.api_latency_s


async def _measure(
    server: VllmServer, prompt: int, output: int, concurrency: int, each: int
) -> list[Attempt]:
    """`concurrency` closed-loop workers sending `each` requests apiece: the same method the calibration uses."""
    async with httpx.AsyncClient(timeout=120) as client:
        endpoint = await discover(client, server.url, server.model)
        prompts = PromptMaker(await tokenize(client, endpoint, SAMPLE_TEXT), random.Random(11))

        async def worker() -> list[Attempt]:
            return [
                await stream_completion(client, endpoint, prompts.make(prompt), output, 120)
                for _ in range(each)
            ]

        results = await asyncio.gather(*(worker() for _ in range(concurrency)))
    attempts = [a for batch in results for a in batch]
    assert all(a.status == "ok" for a in attempts), [a.status for a in attempts]
    return attempts


def as_rows(
    attempts: list[Attempt], phase: str, concurrency: int, prompt: int, output: int
) -> list[Measurement]:
    """Held-out attempts as measurement rows, to read them exactly as the fit reads the calibration's."""
    rows = []
    for seq, a in enumerate(attempts):
        measured = {k: v for k, v in asdict(a).items() if k != "client_busy_s"}
        rows.append(Measurement(phase=phase, concurrency=concurrency, seq=seq, attempt=1, model="held-out",
                                prompt_tokens_target=prompt, output_tokens_target=output, **measured))  # fmt: skip
    return rows


def test_fit_predicts_held_out_ttft_and_inter_token_latency(
    calibrated: Calibrated, vllm_server: VllmServer
) -> None:
    """At prompt lengths and concurrencies the calibration never used, the profile's step model (with the
    fitted TTFT offset) predicts the median TTFT at concurrency 1 and the median inter-token latency at
    concurrency 3 and 6 within the tolerances above. Inter-token latencies are predicted the way the fit reads them:
    decode steps of the batch plus the prefills of batch-mates that started during a request's decode."""
    p = calibrated.profile
    offset = float(p.fit["ttft_offset_s"])  # type: ignore[arg-type]
    report = []
    for prompt in (300, 1100):
        rows = as_rows(asyncio.run(_measure(vllm_server, prompt, 1, 1, 4)), "prefill", 1, prompt, 1)
        obs, _ = observations(rows, MAX_NUM_BATCHED_TOKENS)
        predicted = statistics.median(o.predict(p.step_time, offset) for o in obs)
        report.append(("ttft", prompt, 1, predicted, statistics.median(r.ttft_s for r in rows)))
    output = 48
    for concurrency in (3, 6):
        attempts = asyncio.run(_measure(vllm_server, 200, output, concurrency, 3))
        obs, _ = observations(as_rows(attempts, "decode", concurrency, 200, output), MAX_NUM_BATCHED_TOKENS)
        predicted = statistics.median(o.predict(p.step_time) / o.steps for o in obs)
        measured = statistics.median(o.seconds / o.steps for o in obs)
        report.append(("itl", 200, concurrency, predicted, measured))
        pure = decode_step_s(p.step_time, concurrency, 200, output)
        print(f"itl c={concurrency}: a steady batch without prefills would take {pure:.4f}s per token")
    errors = [(kind, prompt, c, pred, meas, pred / meas - 1) for kind, prompt, c, pred, meas in report]
    for kind, prompt, c, pred, meas, err in errors:
        print(f"{kind} prompt={prompt} c={c}: predicted {pred:.4f}s measured {meas:.4f}s error {err:+.1%}")
    assert all(abs(e[-1]) <= (TTFT_TOLERANCE if e[0] == "ttft" else ITL_TOLERANCE) for e in errors), errors


# A lone long prompt's TTFT at an idle server, predicted by the engine's own cost (chunked steps with their
# attention, no TTFT offset), against the median of five repeats. On a quiet machine repeats at one length
# spread by about 10%, and the attention model fitted to a whole calibration priced its 1,536-token prompts
# within 1% of their median (the linear model: 21% short) and its held-out ones within 6%. A machine shared with
# other CPU-bound work slows the server by up to 2.5x from minute to minute, and then this check can fail
# without the model being wrong: look at the spread it prints.
LONG_PROMPT_TOLERANCE = 0.15


def test_long_prompt_ttft_at_an_idle_server(calibrated: Calibrated, vllm_server: VllmServer) -> None:
    """An 1,800-token prompt (a length the calibration never sent) alone on the server: the profile's step
    model, charged as the simulated engine charges it, predicts its median TTFT over five repeats within 15%."""
    prompt = 1800
    attempts = asyncio.run(_measure(vllm_server, prompt, 1, 1, 5))
    measured = [a.ttft_s for a in attempts]
    predicted = solo_service_s(calibrated.profile.step_time, MAX_NUM_BATCHED_TOKENS, prompt)
    error = predicted / statistics.median(measured) - 1
    print(f"ttft prompt={prompt}: predicted {predicted:.3f}s measured {sorted(measured)} error {error:+.1%}")
    assert abs(error) <= LONG_PROMPT_TOLERANCE, (predicted, measured)


def test_poor_fit_is_written_with_a_warning(vllm_server: VllmServer, tmp_path: Path) -> None:
    """A 3-second budget at concurrency 1 gives too few points: the profile is written all the same, with
    the warning on screen, in its `warnings:` list and as a comment at the top of the file."""
    out = tmp_path / "tiny.yaml"
    result = subprocess.run(
        command(vllm_server, out, "3s", 1), check=False, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING: poor fit" in result.stdout
    profile = load_profile(out)
    assert any("points" in w for w in profile.warnings)
    assert out.read_text().startswith("# ") and "# WARNING: poor fit" in out.read_text()


def test_check_compares_the_simulator_with_the_endpoint(
    calibrated: Calibrated, vllm_server: VllmServer
) -> None:
    """`calibrate check` replays a mixed load on the server and on the simulator with the fitted profile and
    prints predicted vs measured TTFT and inter-token latency; the medians agree within a factor of two."""
    pytest.importorskip("simadmit.fleet.engine_replay")
    from simadmit.calibrate.check import CheckConfig, run_check

    table, failed = run_check(
        calibrated.profile, vllm_server.url, vllm_server.model, CheckConfig(requests=12, seed=3)
    )
    print(table.to_string())
    assert failed == 0
    p50 = table[table["stat"] == "p50"].set_index("metric")
    assert set(p50.index) == {"ttft_s", "itl_s"}
    assert (p50["error"].abs() < 1.0).all(), table
