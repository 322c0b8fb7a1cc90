"""Fidelity of the admission layer: the same scenario through `simadmit simulate` and through two live
gateways in front of a real vLLM CPU server, side by side.

One tier (prompts lognormal around 128 tokens, sent as random token ids so nothing hits the prefix cache;
64 output tokens with `ignore_eos`, so the truth equals max_tokens and both sides charge the same work),
the calibrated SmolLM2 CPU profile, GPU-seconds admission, two gateway replicas polling every 200 ms,
clients that do not retry (so the rejection rate is the attempts refused). Load is relative to the
profile's capacity: the rate at which the estimated work equals one GPU-second per second. For each load
the simulator runs the scenario and an open-loop sender replays the very same arrival stream against the
two gateways (attempts alternate between them, as the simulator's do); both report the rejection rate,
TTFT and E2E of admitted requests, and the peak in-flight GPU-seconds against the pool budget (the
overshoot stale views cause).

Starts its own vLLM server (the tests' provisioned environment) unless given `--vllm-url`; run it under
`flock /tmp/vllm.lock` on a shared machine. Run: `python benchmarks/gateway_fidelity.py [--loads 0.6,1,1.5]
[--duration 60] [--repeats 1]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from simadmit.config.loading import scenario_from_dict  # noqa: E402
from simadmit.sim.ledger import COMPLETED, REJECTED  # noqa: E402
from simadmit.sim.simulation import Simulation  # noqa: E402
from simadmit.sim.world import build_policies, build_world  # noqa: E402
from simadmit.workload.build import Workload, generate  # noqa: E402

PROFILE = ROOT / "calibration" / "smollm2-135m-cpu.yaml"
OUTPUT = 64
BUDGET_S = 12.0
MAX_POOL = 12.0


def scenario(rate: float, duration: float) -> dict[str, object]:
    return {
        "name": "fidelity",
        "workload": {
            "seed": 11,
            "rate_rps": rate,
            "duration_s": duration,
            "warmup_s": 0,
            "tiers": [
                {"name": "chat", "prompt_tokens": {"kind": "lognormal", "median": 128, "sigma": 0.5, "min": 16, "max": 512},
                 "output_tokens": {"kind": "fixed", "value": OUTPUT}, "max_tokens": OUTPUT}
            ],
        },
        "pools": [{"name": "cpu", "profile": str(PROFILE), "replicas": 1,
                   "engine": {"max_num_seqs": 128, "max_num_batched_tokens": 2048}}],
        "gateway": {"replicas": 2, "poll_interval_s": 0.2, "routing": "least_work"},
        "clients": {"max_retries": 0},
        "policies": [{"kind": "gpu_seconds", "budgets_s": {"chat": BUDGET_S}, "headroom": 0.9,
                      "max_pool_gpu_seconds": MAX_POOL}],
    }  # fmt: skip


def capacity_rps() -> float:
    """Requests per second whose estimated work is one GPU-second per second (the profile's capacity)."""
    spec = scenario(1.0, 2000.0)
    w = generate(scenario_from_dict(spec, "fidelity").workload)
    est = build_world(scenario_from_dict(spec, "fidelity"), ROOT).pools[0].estimator
    return 1.0 / float(np.mean(est.estimate_many(w.prompt, w.max_tokens)))


def peak_in_flight(starts: np.ndarray, ends: np.ndarray, work: np.ndarray) -> float:
    """Largest sum of `work` over intervals [start, end) open at once."""
    events = sorted(
        [(s, w) for s, w in zip(starts, work, strict=True)]
        + [(e, -w) for e, w in zip(ends, work, strict=True)]
    )
    level = peak = 0.0
    for _, w in events:
        level += w
        peak = max(peak, level)
    return peak


def simulate(spec: dict[str, object]) -> dict[str, float]:
    s = scenario_from_dict(spec, "fidelity")
    world = build_world(s, ROOT)
    workload = generate(s.workload)
    (policy,) = build_policies(s).values()
    result = Simulation(world, workload, policy, s.workload.seed).run()
    led = result.ledger
    arrival = workload.arrival
    done = np.array([o == COMPLETED for o in led.outcome])
    ttft = np.array(led.first_token)[done] - arrival[done]
    e2e = np.array(led.finish)[done] - arrival[done]
    return summary(np.mean([o == REJECTED for o in led.outcome]), ttft, e2e, result.peak_in_flight_gpu_s[0])


def summary(rejected: float, ttft: np.ndarray, e2e: np.ndarray, peak: float) -> dict[str, float]:
    q = lambda a, p: float(np.percentile(a, p)) if len(a) else float("nan")  # noqa: E731
    return {
        "rejection": float(rejected), "ttft_p50": q(ttft, 50), "ttft_p99": q(ttft, 99),
        "e2e_p50": q(e2e, 50), "e2e_p99": q(e2e, 99), "peak_gpu_s": peak, "completed": float(len(ttft)),
    }  # fmt: skip


async def send_all(
    workload: Workload, gateways: list[str], model: str, seed: int
) -> list[tuple[int, float, float, float]]:
    """Open loop: each request at its arrival time, attempts alternating between the gateways; returns
    (status, sent, first token, finished) per request, times from the start."""
    rng = np.random.default_rng(seed)
    results: list[tuple[int, float, float, float]] = [(0, 0.0, float("nan"), float("nan"))] * len(workload)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as client:
        start = time.perf_counter()

        async def one(i: int) -> None:
            body = {
                "model": model, "prompt": rng.integers(100, 49000, int(workload.prompt[i])).tolist(),
                "max_tokens": int(workload.max_tokens[i]), "ignore_eos": True, "stream": True,
            }  # fmt: skip
            await asyncio.sleep(max(0.0, workload.arrival[i] - (time.perf_counter() - start)))
            sent = time.perf_counter() - start
            first = float("nan")
            async with client.stream("POST", f"{gateways[i % len(gateways)]}/v1/completions", json=body) as r:
                async for chunk in r.aiter_raw():
                    if first != first and b'"text"' in chunk:
                        first = time.perf_counter() - start
            results[i] = (r.status_code, sent, first, time.perf_counter() - start)

        await asyncio.gather(*(one(i) for i in range(len(workload))))
    return results


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def gateways(scenario_file: Path, backend: str, n: int) -> Iterator[list[str]]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    procs, urls = [], []
    for _ in range(n):
        port = free_port()
        procs.append(subprocess.Popen(
            [sys.executable, "-c", "from simadmit.cli import app; app()", "gateway", "--scenario", str(scenario_file),
             "--backend", backend, "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ))  # fmt: skip
        urls.append(f"http://127.0.0.1:{port}")
    try:
        for url in urls:
            for _ in range(600):
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                time.sleep(0.1)
        yield urls
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def real(spec: dict[str, object], backend: str, model: str, seed: int, tmp: Path) -> dict[str, float]:
    s = scenario_from_dict(spec, "fidelity")
    workload = generate(s.workload)
    est = build_world(s, ROOT).pools[0].estimator.estimate_many(workload.prompt, workload.max_tokens)
    path = tmp / "scenario.yaml"
    path.write_text(yaml.safe_dump(spec))
    with gateways(path, backend, 2) as urls:
        rows = asyncio.run(send_all(workload, urls, model, seed))
    status = np.array([r[0] for r in rows])
    sent, first, end = (np.array([r[k] for r in rows]) for k in (1, 2, 3))
    ok = status == 200
    peak = peak_in_flight(sent[ok], end[ok], est[ok])
    return summary(np.mean(status == 429), first[ok] - sent[ok], end[ok] - sent[ok], peak)


@contextlib.contextmanager
def vllm(url: str | None) -> Iterator[tuple[str, str]]:
    if url:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        yield url, model
        return
    from simadmit.calibrate.launch import launched_server
    from tests.vllm_server import SERVED_NAME, provision, server_args

    python, model_dir = provision()
    work = Path(tempfile.mkdtemp())
    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CACHE_ROOT": str(work / "cache")}
    with launched_server(
        str(model_dir), server_args(), str(python), work / "server.log", timeout_s=600, env=env
    ) as u:
        yield u, SERVED_NAME


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm-url", default=None)
    parser.add_argument("--loads", default="0.6,1.0,1.5")
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    cap = capacity_rps()
    print(
        f"capacity by the profile: {cap:.2f} requests/s (mean estimate {1 / cap:.3f} GPU-s); pool budget {MAX_POOL} x 0.9"
    )
    tmp = Path(tempfile.mkdtemp())
    header = "| load | side | rejected | TTFT p50 | TTFT p99 | E2E p50 | E2E p99 | peak in-flight GPU-s (budget 10.8) |"
    rows = []
    with vllm(args.vllm_url) as (url, model):
        for load in (float(x) for x in args.loads.split(",")):
            spec = scenario(cap * load, args.duration)
            sides = [("simulated", simulate(spec))]
            for r in range(args.repeats):
                sides.append((f"real #{r + 1}", real(spec, url, model, 1000 + r, tmp)))
            for side, m in sides:
                rows.append(
                    f"| {load:.0%} | {side} | {m['rejection']:.1%} | {m['ttft_p50']:.2f} s | {m['ttft_p99']:.2f} s | "
                    f"{m['e2e_p50']:.2f} s | {m['e2e_p99']:.2f} s | {m['peak_gpu_s']:.2f} |"
                )
                print(rows[-1], flush=True)
    print("\n" + header + "\n|---|---|---|---|---|---|---|---|\n" + "\n".join(rows))


if __name__ == "__main__":
    main()
