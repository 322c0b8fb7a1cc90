"""The live gateway's overhead: the latency it adds, the CPU it spends per request, the rate it holds.

A fast fake vLLM backend (`tests/serve_fake.py`: answers at once, 16 output tokens) runs in its own process,
`simadmit gateway` in another (the command a user runs, a GPU-seconds policy that admits everything), the
load client in this one. Measured on loopback:
- the decision alone (`Gateway.decide`, estimator + policy + view), in microseconds;
- latency direct to the backend vs through the gateway, requests sent one at a time, interleaved, for a
  prompt given as token ids (no tokenization), as text (one `/tokenize` round trip), and streamed;
- closed-loop throughput through the gateway at a fixed concurrency, and the gateway process's CPU time
  per request (from /proc), which is what bounds one gateway process: 1 / CPU-seconds per request.

Run: `python benchmarks/gateway_overhead.py [--requests 400] [--concurrency 32] [--seconds 10]`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from simadmit.admission.estimator import CostEstimator  # noqa: E402
from simadmit.admission.gateway import Gateway, PoolSnapshot  # noqa: E402
from simadmit.admission.policies import GpuSeconds, Request  # noqa: E402
from tests.serve_helpers import PROFILE, PROMPT, SCENARIO  # noqa: E402

BACKEND = (
    "import uvicorn; from tests.serve_fake import FakeVllm; "
    "uvicorn.run(FakeVllm(output_tokens=16).app, host='127.0.0.1', port={port}, log_level='error')"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def decision_us(n: int = 200_000) -> float:
    """Microseconds per `Gateway.decide` on a view that admits (the common case; a rejection is cheaper)."""
    policy = GpuSeconds(budgets_s={"interactive": 1e9}, headroom=0.9, max_pool_gpu_s=1e18)
    gateway = Gateway(policy, [CostEstimator(1000.0, 100.0)], [1 << 30])
    gateway.refresh(0, PoolSnapshot(0.0, 0.0, {}, 0, 0, 64, 0.0, 8))
    requests = [Request(i, "interactive", 100 + i % 900, 256, 0.0) for i in range(n)]
    started = time.perf_counter()
    for r in requests:
        gateway.decide(r, 0, 0.0)
    return (time.perf_counter() - started) / n * 1e6


def start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(args, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"{url} exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} did not answer in {timeout_s} s")


CASES = {
    "token ids, not streamed": {"model": "fake", "prompt": list(range(100)), "max_tokens": 16},
    "text (/tokenize), not streamed": {"model": "fake", "prompt": PROMPT, "max_tokens": 16},
    "text (/tokenize), streamed": {"model": "fake", "prompt": PROMPT, "max_tokens": 16, "stream": True},
}


async def one(client: httpx.AsyncClient, url: str, body: dict[str, object]) -> float:
    started = time.perf_counter()
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        async for _ in r.aiter_raw():
            pass
        assert r.status_code == 200, r.status_code
    return time.perf_counter() - started


async def latencies(direct: str, gateway: str, n: int) -> list[tuple[str, float, float, float, float]]:
    """Per case: p50 and p99 of direct and gateway latencies (ms), requests interleaved one at a time."""
    rows = []
    async with httpx.AsyncClient(timeout=30) as client:
        for name, body in CASES.items():
            for url in (direct, gateway):  # warm the connections
                await one(client, url, body)
            d, g = [], []
            for _ in range(n):
                d.append(await one(client, direct, body))
                g.append(await one(client, gateway, body))
            dp, gp = np.percentile(d, [50, 99]) * 1e3, np.percentile(g, [50, 99]) * 1e3
            rows.append((name, dp[0], dp[1], gp[0], gp[1]))
    return rows


async def throughput(url: str, body: dict[str, object], concurrency: int, seconds: float) -> int:
    """Requests completed in `seconds` by `concurrency` clients sending back to back."""
    done = 0
    end = time.perf_counter() + seconds
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=None)) as client:

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < end:
                await one(client, url, body)
                done += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=400, help="sequential requests per case and path")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    print(f"Gateway.decide: {decision_us():.2f} us per decision")

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    tmp = Path(tempfile.mkdtemp())
    (tmp / "fake.yaml").write_text(yaml.safe_dump(PROFILE))
    admit_all = {"kind": "gpu_seconds", "budgets_s": {"interactive": 1e9}, "max_pool_gpu_seconds": 1e12}
    scenario = {**SCENARIO, "policies": [admit_all]}
    scenario["gateway"] = {"poll_interval_s": 0.2}
    (tmp / "scenario.yaml").write_text(yaml.safe_dump(scenario))
    bport, gport = free_port(), free_port()
    backend = start([sys.executable, "-c", BACKEND.format(port=bport)], env, tmp / "backend.log")
    gateway = start(
        [sys.executable, "-c", "from simadmit.cli import app; app()", "gateway", "--scenario",
         str(tmp / "scenario.yaml"), "--backend", f"http://127.0.0.1:{bport}", "--host", "127.0.0.1",
         "--port", str(gport)],
        env, tmp / "gateway.log",
    )  # fmt: skip
    direct, through = f"http://127.0.0.1:{bport}", f"http://127.0.0.1:{gport}"
    try:
        wait_healthy(f"{direct}/v1/models", backend, tmp / "backend.log")
        wait_healthy(f"{through}/health", gateway, tmp / "gateway.log")
        print(f"\nLatency, {args.requests} requests one at a time per case and path (ms):\n")
        print(
            "| request | direct p50 | direct p99 | via gateway p50 | via gateway p99 | added p50 | added p99 |"
        )
        print("|---|---|---|---|---|---|---|")
        for name, d50, d99, g50, g99 in asyncio.run(latencies(direct, through, args.requests)):
            print(
                f"| {name} | {d50:.2f} | {d99:.2f} | {g50:.2f} | {g99:.2f} | {g50 - d50:.2f} | {g99 - d99:.2f} |"
            )
        print(f"\nThroughput, {args.concurrency} clients back to back for {args.seconds:.0f} s:\n")
        print("| request | path | requests/s | gateway CPU ms per request | bound: requests/s per core |")
        print("|---|---|---|---|---|")
        for name in ("token ids, not streamed", "text (/tokenize), streamed"):
            body = CASES[name]
            for label, url in (("direct", direct), ("via gateway", through)):
                cpu0 = cpu_seconds(gateway.pid)
                n = asyncio.run(throughput(url, body, args.concurrency, args.seconds))
                cpu = cpu_seconds(gateway.pid) - cpu0
                per = f"{cpu / n * 1e3:.2f}" if label == "via gateway" else "-"
                bound = f"{n / cpu:.0f}" if label == "via gateway" and cpu else "-"
                print(f"| {name} | {label} | {n / args.seconds:.0f} | {per} | {bound} |")
    finally:
        for proc in (gateway, backend):
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
